"""Predicted vs measured step time on this machine, for fixed layouts of two models on CPU ranks.

    python bench/simulator_accuracy.py [--steps 12]

For each configuration (stages x replicas x micro-batches x schedule), partita plans with that layout fixed
(measured block costs and links), and the plan's estimated step time is compared with the median of
measured steps. Prints one line per configuration and the median absolute error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from turns import seconds_per_step, warmed_step  # noqa: E402

ROUNDS = 5  # turns of every configuration, interleaved

# (model, ranks, stages, micro-batches, schedule, local batch, optimizer)
CONFIGS = [
    ("mlp", 2, 1, 1, "GPipe", 32, "sgd"),
    ("mlp", 2, 2, 4, "GPipe", 32, "sgd"),
    ("mlp", 2, 2, 4, "1F1B", 32, "sgd"),
    ("mlp", 2, 2, 8, "1F1B", 32, "sgd"),
    ("mlp", 4, 2, 4, "1F1B", 32, "sgd"),
    ("mlp", 4, 4, 8, "1F1B", 32, "sgd"),
    ("mlp", 2, 4, 4, "Interleaved1F1B", 32, "sgd"),
    ("gpt", 2, 1, 1, "GPipe", 8, "sgd"),
    ("gpt", 2, 2, 4, "1F1B", 8, "sgd"),
    ("gpt", 2, 2, 8, "GPipe", 8, "sgd"),
    ("gpt", 4, 2, 4, "1F1B", 8, "sgd"),
    ("gpt", 4, 4, 4, "1F1B", 8, "sgd"),
    # Adam's step takes torch several times the passes over memory that SGD's does: priced at its measured rate
    ("mlp", 2, 1, 1, "GPipe", 32, "adam"),
    ("mlp", 4, 2, 4, "1F1B", 32, "adam"),
    ("gpt", 2, 2, 4, "1F1B", 8, "adam"),
]


def _model(name: str):
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    from models import SmallGPT, TutorialMLP, lm_loss

    torch.manual_seed(0)
    if name == "mlp":
        return TutorialMLP(512, 8), torch.nn.MSELoss(), lambda b: (torch.randn(b, 512), torch.randn(b, 512))
    model = SmallGPT(vocab=256, dim=128, heads=4, layers=4, context=64)
    return model, lm_loss, lambda b: (torch.randint(0, 256, (b, 64)), torch.randint(0, 256, (b, 64)))


def _build(name: str, stages: int, mbs: int, schedule: str, local_batch: int, optimizer: str):
    import torch

    import partita

    model, loss_fn, batch = _model(name)
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    pm = partita.parallelize(model, opt, loss_fn=loss_fn, stages=stages, micro_batches=mbs, schedule=schedule)
    return pm, warmed_step(pm, opt, *batch(local_batch))


def worker(out: str, steps: int, configs: list) -> None:
    import partita

    w = partita.init()
    built = [_build(name, stages, mbs, schedule, batch, optimizer)
             for name, _, stages, mbs, schedule, batch, optimizer in configs]
    measured = seconds_per_step([step for _, step in built], ROUNDS, steps)
    if w.rank == 0:
        results = []
        for config, (pm, _), seconds in zip(configs, built, measured):
            profile, cluster = pm.planned.profile, pm.planned.cluster
            results.append({"config": config, "predicted": pm.plan.estimate.step_s,
                            "measured": seconds, "plan": pm.plan.explain().splitlines()[0],
                            "overheads": asdict(cluster.overheads), "stream_bps": profile.param_stream_bps,
                            "stages": [(s.fwd_s, s.bwd_s) for s in pm.plan.stages]})
        Path(out).write_text(json.dumps(results))
    partita.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="consecutive steps per timed turn")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--configs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, json.loads(args.configs))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PARTITA_CACHE_DIR=os.path.join(tmp, "cache"), PARTITA_LOG="off",
                   PARTITA_SWITCH_LAYOUT="off")  # each plan's estimate against its own steps
        for ranks in sorted({c[1] for c in CONFIGS}):
            configs = [c for c in CONFIGS if c[1] == ranks]
            out = os.path.join(tmp, f"r{ranks}.json")
            cmd = [str(Path(sys.executable).parent / "partita"), "run", "-n", str(ranks), "--quiet", "--log-dir",
                   os.path.join(tmp, "logs"), __file__, "--worker", out, "--steps", str(args.steps),
                   "--configs", json.dumps(configs)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
            rows += json.loads(Path(out).read_text())
    errors = []
    print(f"{'model':5} {'optim':5} {'ranks':>5} {'stages':>6} {'mbs':>4} {'schedule':16} {'predicted':>10} "
          f"{'measured':>10} {'error':>7}")
    for r in rows:
        name, ranks, stages, mbs, schedule, _, optimizer = r["config"]
        err = (r["predicted"] - r["measured"]) / r["measured"]
        errors.append(abs(err))
        per_stage = " ".join(f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in r["stages"])
        print(f"{name:5} {optimizer:5} {ranks:5d} {stages:6d} {mbs:4d} {schedule:16} {r['predicted'] * 1e3:8.1f}ms "
              f"{r['measured'] * 1e3:8.1f}ms {100 * err:+6.1f}%   fwd/bwd per micro-batch (ms): {per_stage}")
    for ranks in sorted({r["config"][1] for r in rows}):
        o = next(r["overheads"] for r in rows if r["config"][1] == ranks)
        print(f"simulator_accuracy: measured runtime overheads at {ranks} ranks: data-parallel step "
              f"{o['data_parallel_step_s'] * 1e3:.2f} ms, pipeline step {o['pipeline_step_s'] * 1e3:.2f} ms, per "
              f"action {o['action_s'] * 1e3:.3f} ms, per message {o['message_s'] * 1e3:.3f} ms, DDP all-reduce x "
              f"{1 + o['allreduce_interference']:.2f}; parameter stream "
              + ", ".join(f"{r['config'][0]} {r['stream_bps'] / 1e9:.1f} GB/s" for r in rows
                          if r["config"][1] == ranks and r["config"][2:4] == [1, 1]))
    print(f"simulator_accuracy: {len(errors)} configurations, median |error| {100 * statistics.median(errors):.1f}%, "
          f"max {100 * max(errors):.1f}%")


if __name__ == "__main__":
    main()
