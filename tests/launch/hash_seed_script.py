"""A model whose capture follows the process's hash seed, trained on 2 pipeline stages: the job must train one
process's losses or refuse on every rank.

    <launcher> hash_seed_script.py RUN_DIR

As Hugging Face's Gemma 3 builds its rotary tables in `for layer_type in set(self.config.layer_types)`, `Kinds`
builds one table per kind of layer in the order of a set of strings, which follows PYTHONHASHSEED (seeds 0 and 1
order {"local", "global"} differently), and its layers read the tables of their kind. Each rank writes what its
interpreter hashes with and the set's order to RUN_DIR/seed-<rank>.json; rank 0 writes the losses to
RUN_DIR/losses.json; a rank that raises a PartitaError writes its text to RUN_DIR/error-<rank>.txt and exits 3.
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


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def one_process_losses() -> list[float]:
    model = Kinds()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def main() -> None:
    run = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (run / f"seed-{rank}.json").write_text(json.dumps({"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED"),
                                                       "order": list(set(KINDS))}))
    model = Kinds()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    parallel = partita.parallelize(model, optimizer, loss_fn=nn.functional.mse_loss, stages=2, micro_batches=2)
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step)
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
