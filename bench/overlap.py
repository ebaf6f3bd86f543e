"""What overlapping the gradient all-reduce with the last backward gains: a 2 stages x 2 replicas plan trained
with PARTITA_OVERLAP=on (each stage's buckets start their sums while its last backward runs) and off (after
the pipeline), measured in one run, blocks of steps alternating between the two.

    python bench/overlap.py [--steps 5] [--blocks 6] [--hidden 2048]

Both arms train the same model on the same data on the same 4 ranks under the same plan; the plan's estimate
assumes the overlap. Printed: each arm's step time, their ratio, the plan's estimated step and the share of
the step that the all-reduce takes by the plan.
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


def worker(out: str, steps: int, blocks: int, hidden: int) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import partita
    from models import TutorialMLP

    w = partita.init()
    layers, local_batch = 8, 32
    torch.manual_seed(0)
    arms = {}
    x, y = torch.randn(local_batch, hidden), torch.randn(local_batch, hidden)
    for overlap in ("on", "off"):
        net = TutorialMLP(hidden, layers)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        os.environ["PARTITA_OVERLAP"] = overlap
        model = partita.parallelize(net, opt, loss_fn=torch.nn.MSELoss(), stages=2, micro_batches=4,
                                    schedule="1F1B")

        def step(model=model, opt=opt):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()

        step()  # the first call builds the runtime, which reads the setting
        arms[overlap] = (model, step)
    seconds = timed_blocks({name: step for name, (_, step) in arms.items()}, blocks, steps)
    if w.rank == 0:
        plan = arms["on"][0].plan
        Path(out).write_text(json.dumps({
            "step_s": {k: v / (blocks * steps) for k, v in seconds.items()},
            "estimate_s": plan.estimate.step_s,
            "allreduce_s": max(s.allreduce_s for s in plan.stages),
            "plan": plan.explain().splitlines()[0],
        }))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="steps per block")
    ap.add_argument("--blocks", type=int, default=6, help="alternating blocks per arm")
    ap.add_argument("--hidden", type=int, default=2048, help="width of the MLP's 8 layers")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.blocks, args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", "4", "--quiet",
               "--log-dir", os.path.join(tmp, "logs"), __file__, "--worker", out, "--steps", str(args.steps),
               "--blocks", str(args.blocks), "--hidden", str(args.hidden)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(Path(out).read_text())
    on, off = r["step_s"]["on"], r["step_s"]["off"]
    print(f"overlap: {r['plan']}")
    print(f"overlap: MLP 8x{args.hidden}, 4 ranks, local batch 32, step s: overlap on {on:.4f}, off {off:.4f}, "
          f"on/off {on / off:.3f}")
    print(f"overlap: the plan's estimated step {r['estimate_s']:.4f} s (estimate/measured with overlap "
          f"{r['estimate_s'] / on:.3f}); all-reduce per stage by the plan {r['allreduce_s']:.4f} s")


if __name__ == "__main__":
    main()
