"""A one-stage plan performs like DDP: throughput of partita vs torch DDP, measured in one run; and what the
automatic plan makes of the same model on the same ranks.

    python bench/ddp_parity.py [--ranks 4] [--steps 40]

All arms train the same model on the same data on the same ranks; blocks of steps alternate between them so
that machine noise hits all alike. partita returns the global batch's loss on every rank, which costs one
scalar all-reduce per step; the third arm is DDP doing the same, to show what partita adds beyond that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from interleaved import timed_blocks

ROOT = Path(__file__).resolve().parents[1]


def worker(out: str, steps: int, blocks: int) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import partita
    from models import TutorialMLP

    w = partita.init()
    hidden, layers, local_batch = 512, 10, 64
    torch.manual_seed(0)
    ours_net, auto_net, ddp_net = (TutorialMLP(hidden, layers) for _ in range(3))
    ours_opt, auto_opt, ddp_opt = (torch.optim.SGD(n.parameters(), lr=0.01) for n in (ours_net, auto_net, ddp_net))
    ours = partita.parallelize(ours_net, ours_opt, loss_fn=torch.nn.MSELoss(), stages=1, micro_batches=1)
    auto = partita.parallelize(auto_net, auto_opt, loss_fn=torch.nn.MSELoss())
    ddp = DistributedDataParallel(ddp_net)
    mse = torch.nn.MSELoss()
    x, y = torch.randn(local_batch, hidden), torch.randn(local_batch, hidden)

    def ours_step():
        ours_opt.zero_grad()
        ours(x, y).backward()
        ours_opt.step()

    def auto_step():
        auto_opt.zero_grad()
        auto(x, y).backward()
        auto_opt.step()

    def ddp_step():
        ddp_opt.zero_grad()
        mse(ddp(x), y).backward()
        ddp_opt.step()

    def ddp_global_loss_step():
        # what a DDP script does to print the loss of the global batch: one scalar all-reduce
        ddp_opt.zero_grad()
        loss = mse(ddp(x), y)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        loss.backward()
        ddp_opt.step()

    seconds = timed_blocks({"partita": ours_step, "ddp": ddp_step, "ddp_global_loss": ddp_global_loss_step,
                            "automatic": auto_step}, blocks, steps)
    if w.rank == 0:
        samples = blocks * steps * local_batch * w.world_size
        Path(out).write_text(json.dumps({k: samples / v for k, v in seconds.items()} |
                                        {"plan": auto.plan.explain().splitlines()[0]}))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--blocks", type=int, default=8, help="alternating blocks per side")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.blocks)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", str(args.ranks), "--quiet",
               "--log-dir", os.path.join(tmp, "logs"), __file__, "--worker", out, "--steps", str(args.steps),
               "--blocks", str(args.blocks)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(Path(out).read_text())
    print(f"ddp_parity: {args.ranks} ranks, MLP 10x512, local batch 64, samples/s: DDP {r['ddp']:.0f}, "
          f"DDP + global loss all-reduce {r['ddp_global_loss']:.0f}, partita one stage {r['partita']:.0f}")
    print(f"ddp_parity: ratio partita one stage/DDP {r['partita'] / r['ddp']:.3f}, "
          f"partita one stage/(DDP + global loss) {r['partita'] / r['ddp_global_loss']:.3f}")
    print(f"ddp_parity: automatic {r['plan']}: {r['automatic']:.0f} samples/s, "
          f"{r['automatic'] / r['ddp']:.3f} x DDP")


if __name__ == "__main__":
    main()
