"""The 2-D example of Ray users (seed 004): 4 linear layers as 2 pipeline stages, on 4 Ray Train workers.

By hand it takes tensor- and pipeline-parallel groups (`new_group`), broadcasts between them and an if/else per
rank for each layer. With partita it is a plain model, `parallelize` and `partita.ray.run`; the 2 stages run as
2 replicas each. Usage: python ray_2d.py OUT_DIR: on a local Ray cluster of its own; rank 0 writes its losses,
plan and the cluster's address to OUT_DIR/out.json, and Ray keeps the run's results in OUT_DIR/ray-results.
"""

import json
import os
import sys

import torch

import partita
import partita.ray

BATCH, HIDDEN, OUT = 32, 50, 4


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3)], torch.nn.Linear(HIDDEN, OUT))


def batch(rank: int):
    """Rank `rank`'s own inputs and targets, the same in every step."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, OUT, generator=g)


def train(config):
    partita.init()  # rank, world and process group come from Ray
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), stages=2)
    x, y = batch(partita.get_rank())
    losses = []
    for _ in range(config["steps"]):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if partita.get_rank() == 0:
        import ray  # here, in a Ray worker: the tests import this module where Ray may be missing

        with open(config["out"], "w") as f:
            json.dump({"losses": losses, "plan": model.plan.to_dict(),
                       "cluster": ray.get_runtime_context().gcs_address}, f)
    partita.shutdown()


if __name__ == "__main__":
    out_dir = sys.argv[1]
    partita.ray.run(train, workers=4, config={"steps": 5, "out": os.path.join(out_dir, "out.json")},
                    storage_path=os.path.join(out_dir, "ray-results"))
