"""What the ranks of tests/gpu's jobs run: `python -m partita.cli.main run -n N tests/gpu/ranks.py MODE`.

- init: join the job, nothing else (more ranks than GPUs stops every rank here);
- bigger: a model whose training state (weights, gradients, Adam's two moments) is 1.2 x one GPU's memory,
  built on the meta device, trained two steps on every GPU of the node; rank 0 prints the plan's stages and
  every rank the peak memory it allocated, as `RESULT {json}` lines.
"""

import json
import math
import sys

import torch
from torch import nn

import partita

WIDTH = 8192  # a layer: 256 MiB of float32 weights, 1 GiB with its gradient and Adam's moments


def init() -> None:
    partita.init()
    partita.shutdown()


def bigger() -> None:
    world = partita.init()
    total = torch.cuda.get_device_properties(world.device).total_memory
    per_layer = 16 * WIDTH * WIDTH  # bytes of weights, gradients and Adam's two moments
    layers = math.ceil(1.2 * total / per_layer)
    with torch.device("meta"):
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    model = partita.parallelize(net, opt, loss_fn=nn.MSELoss())
    x = torch.randn(8, WIDTH, device=world.device)
    for _ in range(2):
        opt.zero_grad()
        loss = model(x, x)
        loss.backward()
        opt.step()
    if world.rank == 0:
        print("RESULT", json.dumps({"stages": model.plan.num_stages, "layers": layers, "loss": loss.item(),
                                    "total_bytes": total}), flush=True)
    print("RESULT", json.dumps({"rank": world.rank, "peak_bytes": torch.cuda.max_memory_allocated(world.device)}),
          flush=True)
    partita.shutdown()


if __name__ == "__main__":
    {"init": init, "bigger": bigger}[sys.argv[1]]()
