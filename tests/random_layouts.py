"""Random layouts against one process: a search for plans the planner may choose that no test fixes.

    .venv/bin/python tests/random_layouts.py [--seed 1] [--trials 40] [--checkpoints]

Each trial draws a world (2 or 4 ranks), a test model, a schedule, stages and micro-batches; plans with them
fixed; then gives every stage a random sharding level and recomputation (what the planner chooses per stage
from measurements, which differ between machines) and trains that plan against one process (support.cases:
fidelity, fp32 rtol 1e-5), with SGD or Adam, the loss computed by partita or by the caller, an evaluation
call half the time, now and then gradients accumulated over two calls or the model built on the meta device.
With --checkpoints, each trial saves a checkpoint under one random layout and loads it under another (state
bit-equal, the next losses the saving run's). Constraints that no layout meets are skipped. Prints one line
per trial and the failures; exits 1 if any.
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
# what support.checkpoint_cases trains (its batches: one global batch per step, whatever the world)
CHECKPOINT_MODELS = ["mlp", "gpt", "tied_embedding", "shared_linear", "hf_gpt2", "hf_llama", "hf_bert"]


def draw(rng: random.Random, name: str | None = None) -> tuple[int, str, dict, dict]:
    """A world, a model (`name`, else drawn), the constraints to plan with, and the arguments of the run
    against one process."""
    world, name, schedule = rng.choice([2, 4]), name or rng.choice(MODELS), rng.choice(SCHEDULES)
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
    # HF models initialize themselves (test_materialize); the GPT's __init__ draws its children's weights again,
    # which a model built on the meta device does not replay (it would need that code as init_fn)
    if rng.random() < 0.3 and not name.startswith("hf_") and name != "gpt":
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


class NoSuchLayout(Exception):
    pass


def random_plan(pools: Pools, rng: random.Random, world: int, name: str, constraints: dict, path: Path) -> str:
    """A plan for `constraints`, each stage's level and recomputation then drawn, written to `path`; what it
    says of the stages."""
    try:
        planned = pools.run(world, "support.cases:fidelity", name, steps=1, **constraints)
    except AssertionError as e:
        if "PlanError" not in str(e):
            raise
        raise NoSuchLayout from e
    plan = per_stage(json.loads(planned[0]["plan_json"]), rng, name)
    path.write_text(json.dumps(plan))
    return f"{world} ranks, {constraints}, stages {[(s['sharding'], s['recompute']) for s in plan['stages']]}"


def fidelity_trial(pools: Pools, rng: random.Random, folder: Path) -> str:
    """One random layout trained against one process; what it was (AssertionError if it differs)."""
    from test_fidelity import check
    world, name, constraints, run = draw(rng)
    said = f"{name}, {random_plan(pools, rng, world, name, constraints, folder / 'plan.json')}, {run}"
    try:
        check(pools.run(world, "support.cases:fidelity", name, plan=str(folder / "plan.json"), **run))
    except AssertionError as e:
        raise AssertionError(f"{said}\n     {str(e)[-2000:]}") from None
    return said


def checkpoint_trial(pools: Pools, rng: random.Random, folder: Path) -> str:
    """A checkpoint saved under one random layout, loaded under another: state bit-equal, next losses the
    saving run's (AssertionError if not)."""
    from test_checkpoint import check_resumed
    name = rng.choice(CHECKPOINT_MODELS)
    (saving, _, saving_constraints, _), (loading, _, loading_constraints, _) = draw(rng, name), draw(rng, name)
    said = (f"{name} saved by {random_plan(pools, rng, saving, name, saving_constraints, folder / 'saving.json')}, "
            f"loaded by {random_plan(pools, rng, loading, name, loading_constraints, folder / 'loading.json')}")
    try:
        saved = pools.run(saving, "support.checkpoint_cases:train_and_save", name, str(folder / "checkpoint"),
                          {"plan": str(folder / "saving.json")})
        check_resumed(pools.run(loading, "support.checkpoint_cases:load_and_continue", name,
                                str(folder / "checkpoint"), {"plan": str(folder / "loading.json")}), saved)
    except AssertionError as e:
        raise AssertionError(f"{said}\n     {str(e)[-2000:]}") from None
    return said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--checkpoints", action="store_true",
                        help="save under one random layout and load under another instead")
    args = parser.parse_args()
    trial_of = checkpoint_trial if args.checkpoints else fidelity_trial
    rng = random.Random(args.seed)
    pools, failed = Pools(), []
    root = Path(tempfile.mkdtemp(prefix="partita-random-layouts-"))
    try:
        for trial in range(args.trials):
            folder = root / str(trial)
            folder.mkdir()
            try:
                print(f"ok   {trial}: {trial_of(pools, rng, folder)}", flush=True)
            except NoSuchLayout:
                print(f"skip {trial}: no such layout", flush=True)
            except AssertionError as e:
                print(f"FAIL {trial}: {e}", flush=True)
                failed.append(f"{trial}: {str(e).splitlines()[0]}")
    finally:
        pools.close()
        if failed:  # kept to replay a failing plan
            print(f"the plans are in {root}")
        else:
            shutil.rmtree(root)
    print(f"{len(failed)} of {args.trials} failed" + "".join(f"\n  {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
