"""The seed's 2.5 B-parameter MLP trained on 4 CPU ranks of one 24 GiB machine: a model no rank could hold.

    python bench/seed_2p5b.py [--ranks 4] [--steps 3]

RaNNC's tutorial model, `nn.Sequential` of 100 x `nn.Linear(5000, 5000)` (2.5 B parameters, 10 GB in float32),
built on the meta device, SGD without momentum, local batch 16, run by `partita run -n 4`. Keeping the whole
model on every rank would take 40 GB of weights alone; each rank here materializes and keeps only its stages.
Prints the plan, each rank's peak resident memory (and above what it had before building the model), the
time of each step and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, LOCAL_BATCH = 5000, 100, 16


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(out: str, steps: int) -> None:
    import torch
    from torch import nn

    import partita

    w = partita.init()
    before = _resident_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    pm = partita.parallelize(model, opt, loss_fn=nn.MSELoss())
    g = torch.Generator().manual_seed(1 + w.rank)
    x, y = torch.randn(LOCAL_BATCH, HIDDEN, generator=g), torch.randn(LOCAL_BATCH, HIDDEN, generator=g)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = pm(x, y)
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    held = sum(t.numel() * t.element_size() for t in model.parameters() if not t.is_meta)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = [None] * w.world_size
    torch.distributed.all_gather_object(report, {"rank": w.rank, "before": before, "peak": peak, "held": held})
    if w.rank == 0:
        Path(out).write_text(json.dumps({"ranks": report, "losses": losses, "seconds": seconds,
                                         "plan": pm.plan.explain()}))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    gib = 2**30
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", str(args.ranks), "--quiet",
               "--log-dir", os.path.join(tmp, "logs"), __file__, "--worker", out, "--steps", str(args.steps)]
        started = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(Path(out).read_text())
    print(f"seed_2p5b: {LAYERS} x Linear({HIDDEN}, {HIDDEN}) = {LAYERS * (HIDDEN * HIDDEN + HIDDEN) / 1e9:.2f} B "
          f"parameters ({LAYERS * (HIDDEN * HIDDEN + HIDDEN) * 4 / gib:.1f} GiB float32), built on the meta device, "
          f"SGD, local batch {LOCAL_BATCH}, {args.ranks} ranks; whole job {time.perf_counter() - started:.0f} s")
    print(r["plan"])
    for rank in r["ranks"]:
        print(f"seed_2p5b: rank {rank['rank']}: holds {rank['held'] / gib:.2f} GiB of weights, peak resident "
              f"{rank['peak'] / gib:.2f} GiB ({(rank['peak'] - rank['before']) / gib:.2f} GiB above its "
              f"{rank['before'] / gib:.2f} GiB before building the model)")
    print(f"seed_2p5b: step seconds {', '.join(f'{s:.2f}' for s in r['seconds'])} (the first captures, measures "
          f"and plans); losses {', '.join(f'{v:.6g}' for v in r['losses'])}")


if __name__ == "__main__":
    main()
