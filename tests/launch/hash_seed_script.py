"""A model whose capture follows the process's hash seed, trained on 2 pipeline stages: the job must train one
process's losses or refuse on every rank.

    <launcher> hash_seed_script.py RUN_DIR [kinds | gemma3 | by_rank]

As Hugging Face's Gemma 3 builds its rotary tables in `for layer_type in set(self.config.layer_types)`, `Kinds`
builds one table per kind of layer in the order of a set of strings, which follows PYTHONHASHSEED (seeds 0 and 1
order {"local", "global"} differently), and its layers read the tables of their kind. Each rank writes what its
interpreter hashes with and the set's order to RUN_DIR/seed-<rank>.json; rank 0 writes the losses to
RUN_DIR/losses.json; a rank that raises a PartitaError writes its text to RUN_DIR/error-<rank>.txt and exits 3.
`gemma3` trains a tiny Hugging Face Gemma 3 instead, the model that showed it; `by_rank` a model that computes
another operation on rank 1.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import partita

KINDS = ("local", "global", "local", "global")  # of each layer
WIDTH, ROWS, STEPS = 8, 8, 3


class Kinds(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frequency_local = nn.Parameter(torch.rand(WIDTH))
        self.frequency_global = nn.Parameter(torch.rand(WIDTH) * 3)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in KINDS)

    def forward(self, x):
        tables = {}
        for kind in set(KINDS):  # the order of a set of strings: the process's hash seed's
            tables[kind] = torch.cos(x * getattr(self, f"frequency_{kind}"))
        for layer, kind in zip(self.layers, KINDS):
            x = torch.tanh(layer(x)) * tables[kind]
        return x


class ByRank(Kinds):
    """Computes another operation on rank 1: a graph no reordering makes rank 0's."""

    def forward(self, x):
        x = super().forward(x)
        return torch.sin(x) if os.environ.get("RANK") == "1" else torch.cos(x)


VOCAB, SEQUENCE = 64, 8


def gemma3() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=4, max_position_embeddings=64, use_cache=False,
        layer_types=["sliding_attention", "full_attention"] * 2))


def lm_loss(out, y):
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())


MODELS = {"kinds": (Kinds, nn.functional.mse_loss), "gemma3": (gemma3, lm_loss),
          "by_rank": (ByRank, nn.functional.mse_loss)}


def batch(step: int, name: str = "kinds") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if name == "gemma3":
        return (torch.randint(0, VOCAB, (ROWS, SEQUENCE), generator=g),
                torch.randint(0, VOCAB, (ROWS, SEQUENCE), generator=g))
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def one_process_losses(name: str = "kinds") -> list[float]:
    make, loss_fn = MODELS[name]
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = batch(step, name)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def main() -> None:
    run = Path(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "kinds"
    make, loss_fn = MODELS[name]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (run / f"seed-{rank}.json").write_text(json.dumps({"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
                                                       "order": list(set(KINDS))}))
    model = make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parallel = partita.parallelize(model, optimizer, loss_fn=loss_fn, stages=2, micro_batches=2)
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step, name)
            share = ROWS // world
            loss = parallel(x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    except partita.PartitaError as e:
        (run / f"error-{rank}.txt").write_text(str(e))
        partita.shutdown()
        sys.exit(3)
    if rank == 0:
        (run / "losses.json").write_text(json.dumps(losses))
    partita.shutdown()


if __name__ == "__main__":
    main()
