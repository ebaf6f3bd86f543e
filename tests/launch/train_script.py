"""A training script as a user would write it: 2 stages, data from each rank's own slice, losses to a file.

Usage: <launcher> train_script.py OUT.json [STEPS]. The test compares the losses with one process's.
"""

import json
import sys

import torch

import partita

LOCAL_BATCH, HIDDEN, LAYERS = 8, 32, 6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
                                 for _ in range(LAYERS)])


def global_batch(step: int, world: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(world * LOCAL_BATCH, HIDDEN, generator=g), torch.randn(world * LOCAL_BATCH, HIDDEN, generator=g)


def main(out: str, steps: int) -> None:
    partita.init()
    rank, world = partita.get_rank(), partita.get_world_size()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), stages=2 if world > 1 else 1)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, world)
        rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        loss = model(x[rows], y[rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "world": world, "plan": model.plan.to_dict()}, f)
    partita.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
