"""Random layouts against one process: a search for plans the planner may choose that no test fixes.

    .venv/bin/python tests/random_layouts.py [--seed 1] [--trials 40]

Each trial draws a world (2 or 4 ranks), a test model, a schedule, stages and micro-batches; plans with them
fixed; then gives every stage a random sharding level and recomputation (what the planner chooses per stage
from measurements, which differ between machines) and trains that plan against one process (support.cases:
fidelity, fp32 rtol 1e-5), with SGD or Adam, the loss computed by partita or by the caller, an evaluation
call half the time, now and then gradients accumulated over two calls or the model built on the meta device.
Constraints that no layout meets are skipped. Prints one line per trial and the failures; exits 1 if any.
Not part of the suite (minutes per run): the layouts it found broken are tests of their own (mixed sharding
levels, zero-bubble schedules on HF models, ZeRO-1 with tied weights).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "distributed"), str(HERE.parent / "src")]
# the pools' workers import partita from the environment's path (as tests/conftest.py sets it)
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("PARTITA_SWITCH_LAYOUT", "off")

from support.pool import Pools  # noqa: E402

MODELS = ["mlp", "gpt", "tied_embedding", "hf_gpt2", "hf_llama", "hf_bert", "shared_linear", "shared_input",
          "forkjoin", "lenet", "embedding", "keywords", "batchnorm"]
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # FSDP's levels do not run under these
CALLER_LOSS = ("GPipe", "LoopedBFS")  # schedules that run when the caller computes the loss
LEVELS = ["none", "optimizer", "gradients", "parameters"]


def draw(rng: random.Random) -> tuple[int, str, dict, dict]:
    """A world, a model, the constraints to plan with, and the arguments of the run against one process."""
    world, name, schedule = rng.choice([2, 4]), rng.choice(MODELS), rng.choice(SCHEDULES)
    depth = rng.choice([d for d in (1, 2, 4) if d <= world])
    stages = depth * (1 if schedule in ("GPipe", "1F1B") else 2)
    # BatchNorm equals one process only with one micro-batch per replica (each replica's statistics, as DDP)
    micro_batches = 1 if name == "batchnorm" or stages == 1 else rng.choice([1, 2, 4])
    constraints = {"stages": stages, "micro_batches": micro_batches}
    if stages > 1:
        constraints["schedule"] = schedule
    run = {"optimizer": rng.choice(["adam", "sgd"]),
           "style": rng.choice(["loss_fn", "outputs"]) if schedule in CALLER_LOSS or stages == 1 else "loss_fn"}
    if rng.random() < 0.5:
        run["eval_batch"] = 4
    if rng.random() < 0.2:
        run["accumulate"] = 2  # two calls' backwards before one optimizer step
    if rng.random() < 0.3 and not name.startswith("hf_"):  # HF models initialize themselves (test_materialize)
        run["build"] = "meta"
    if name == "batchnorm":
        run["statistics_replicas"] = world // depth
    return world, name, constraints, run


def per_stage(plan: dict, rng: random.Random, name: str) -> dict:
    """`plan` (JSON form) with each stage's sharding level and recomputation drawn at random."""
    split = plan["schedule"] in SPLIT_BACKWARD
    for stage in plan["stages"]:
        stage["sharding"] = rng.choice(["none", "optimizer"] if split else LEVELS)
        stage["recompute"] = name != "batchnorm" and rng.random() < 0.4  # BatchNorm would update its statistics twice
    return plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    from test_fidelity import check

    rng = random.Random(args.seed)
    pools, failed = Pools(), []
    folder = Path(tempfile.mkdtemp(prefix="partita-random-layouts-"))
    try:
        for trial in range(args.trials):
            world, name, constraints, run = draw(rng)
            said = f"{trial}: {world} ranks, {name}, {constraints}, {run}"
            try:
                planned = pools.run(world, "support.cases:fidelity", name, steps=1, **constraints)
            except AssertionError as e:
                if "PlanError" not in str(e):
                    raise
                print(f"skip {said}: no such layout", flush=True)
                continue
            plan = per_stage(json.loads(planned[0]["plan_json"]), rng, name)
            said += f", stages {[(s['sharding'], s['recompute']) for s in plan['stages']]}"
            path = folder / f"plan-{trial}.json"
            path.write_text(json.dumps(plan))
            try:
                check(pools.run(world, "support.cases:fidelity", name, plan=str(path), **run))
                print(f"ok   {said}", flush=True)
            except AssertionError as e:
                print(f"FAIL {said}\n     {str(e)[-2000:]}", flush=True)
                failed.append(said)
    finally:
        pools.close()
        if failed:  # kept to replay a failing plan
            print(f"the plans are in {folder}")
        else:
            shutil.rmtree(folder)
    print(f"{len(failed)} of {args.trials} failed" + "".join(f"\n  {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
