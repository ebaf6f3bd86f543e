"""From an unmodified nn.Module to a graph partita can split: torch.export, our splitter, FLOP counts."""
