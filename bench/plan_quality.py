"""How good the automatic plan is, measured in one run on this machine's CPU ranks.

    python bench/plan_quality.py [--ranks 4]

1. The automatic plan's throughput / the best of a grid of hand configurations (stages x micro-batches x
   schedule, boundaries balanced by FLOPs) on a small GPT. Goal: at least 0.95.
2. On a deliberately imbalanced model (a big embedding and a big classification head that compute little,
   a parameter-light middle that computes a lot), partita's plan / the same layout split so that stages hold
   equal parameter counts (DeepSpeed's default, partition_method="parameters"). Goal: at least 1.2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from turns import WARM_CALLS, seconds_per_step, warmed_step  # noqa: E402

ROUNDS = 3  # turns of every configuration, interleaved
GRID = [(1, 1, "GPipe"), (2, 2, "GPipe"), (2, 4, "GPipe"), (2, 4, "1F1B"), (2, 8, "1F1B"), (4, 4, "GPipe"),
        (4, 4, "1F1B"), (4, 8, "1F1B")]  # stages, micro-batches, schedule


def _gpt():
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    from models import SmallGPT, lm_loss

    torch.manual_seed(0)
    model = SmallGPT(vocab=256, dim=128, heads=4, layers=4, context=64)
    return model, lm_loss, lambda b: (torch.randint(0, 256, (b, 64)), torch.randint(0, 256, (b, 64))), 16


def _imbalanced():
    import torch
    from torch import nn

    class Imbalanced(nn.Module):
        """Tokens -> embedding (2.1 M parameters, no FLOPs) -> 16 per-token MLPs (33 K parameters each, most of
        the FLOPs) -> mean over tokens -> classification head (2.1 M parameters, one row per sample)."""

        def __init__(self, vocab=16384, dim=128, classes=16384, depth=16):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.mixers = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
                                         for _ in range(depth)])
            self.head = nn.Linear(dim, classes)

        def forward(self, tokens):
            x = self.embed(tokens)
            for mixer in self.mixers:
                x = x + mixer(x)
            return self.head(x.mean(dim=1))

    torch.manual_seed(0)
    return (Imbalanced(), nn.CrossEntropyLoss(),
            lambda b: (torch.randint(0, 16384, (b, 512)), torch.randint(0, 16384, (b,))), 8)


def _parameter_balanced(plan, graph):
    """The same layout, with stage boundaries that give each stage the same parameter bytes."""
    from partita.plan.partition import balance

    ranges = balance([float(graph.param_bytes_of(i, i + 1)) for i in range(graph.num_blocks)], plan.num_stages)
    stages = tuple(replace(s, blocks=r, first_node=graph.blocks[r[0]].first_node,
                           last_node=graph.blocks[r[1] - 1].last_node) for s, r in zip(plan.stages, ranges))
    return replace(plan, stages=stages, estimate=None,
                   reasons=("boundaries balance parameter counts (DeepSpeed's default)",))


def worker(out: str, steps: int) -> None:
    import torch

    import partita

    w = partita.init()

    def build(make, **plan_args):
        model, loss_fn, batch, local_batch = make()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        pm = partita.parallelize(model, opt, loss_fn=loss_fn, **plan_args)
        return pm, warmed_step(pm, opt, *batch(local_batch), WARM_CALLS), local_batch * w.world_size

    grid = [(st, m, sc) for st, m, sc in GRID if w.world_size % st == 0]
    gpt = [build(_gpt)] + [build(_gpt, stages=st, micro_batches=m, schedule=sc) for st, m, sc in grid]
    rates = [gpt[0][2] / s for s in seconds_per_step([step for _, step, _ in gpt], ROUNDS, steps)]
    ours, ours_step, rows = build(_imbalanced, stages=w.world_size, schedule="1F1B")
    theirs, theirs_step, _ = build(_imbalanced, plan=_parameter_balanced(ours.plan, ours._graph))
    imbalanced = [rows / s for s in seconds_per_step([ours_step, theirs_step], ROUNDS, steps)]
    if w.rank == 0:
        results = {
            "auto": {"samples_per_s": rates[0], "plan": gpt[0][0].plan.explain().splitlines()[0],
                     "reasons": list(gpt[0][0].plan.reasons)},
            "grid": [{"config": list(cfg), "samples_per_s": r, "plan": pm.plan.explain().splitlines()[0]}
                     for cfg, (pm, _, _), r in zip(grid, gpt[1:], rates[1:])],
            "imbalanced": {"partita": imbalanced[0], "parameters": imbalanced[1], "partita_plan": ours.plan.explain(),
                           "parameter_ranges": [s.blocks for s in theirs.plan.stages]},
        }
        Path(out).write_text(json.dumps(results))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="consecutive steps per timed turn")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, PARTITA_CACHE_DIR=os.path.join(tmp, "cache"), PARTITA_LOG="off")
        cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", str(args.ranks), "--quiet", "--log-dir",
               os.path.join(tmp, "logs"), __file__, "--worker", out, "--steps", str(args.steps)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        r = json.loads(Path(out).read_text())
    best = max(r["grid"], key=lambda g: g["samples_per_s"])
    for g in r["grid"]:
        print(f"plan_quality: hand {g['config']}: {g['samples_per_s']:.0f} samples/s ({g['plan']})")
    print(f"plan_quality: automatic: {r['auto']['samples_per_s']:.0f} samples/s ({r['auto']['plan']})")
    for reason in r["auto"]["reasons"]:
        print(f"plan_quality:     {reason}")
    print(f"plan_quality: automatic / best hand configuration {best['config']}: "
          f"{r['auto']['samples_per_s'] / best['samples_per_s']:.3f} (goal >= 0.95)")
    imb = r["imbalanced"]
    print(f"plan_quality: imbalanced model, {args.ranks} stages 1F1B: partita {imb['partita']:.0f} samples/s, "
          f"parameter-balanced split {imb['parameters']:.0f} samples/s, ratio "
          f"{imb['partita'] / imb['parameters']:.2f} (goal >= 1.2)")
    print("plan_quality: partita's split:\n" + imb["partita_plan"])
    print(f"plan_quality: parameter-balanced split, blocks per stage: {imb['parameter_ranges']}")


if __name__ == "__main__":
    main()
