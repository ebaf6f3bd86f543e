"""Every causal language model transformers ships, tiny, trained under data parallelism and a 2 x 2 pipeline
against one process: a search for the next model that trains silently wrong (Gemma 3's hash-ordered rotary
tables were one).

    PYTHONHASHSEED=0 .venv/bin/python tests/hf_architectures.py [--only llama,gemma3_text] [--start K] [--limit N]

Each architecture (support.hf_architectures: built from its config class with tiny sizes, random token ids,
the next-token loss) is first built, called and differentiated in one process; then trained two steps with
SGD and momentum on 2 ranks (data parallel) and on 4 ranks (2 stages x 2 replicas, 2 micro-batches, 1F1B) against one
process (support.cases:fidelity, fp32 rtol 1e-5, atol 1e-6). One line per architecture: whether it builds
and captures (else why not), the largest relative error per layout (|got - want| / (|want| + atol / rtol):
within tolerance up to 1e-5), PASS or FAIL. Exits 1 if any FAILs.
Not part of the suite (an hour for them all); tests/distributed/test_hf_architectures.py trains a fixed few.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "distributed"), str(HERE.parent / "src"), str(HERE.parent / "examples")]
# the pools' workers import partita from the environment's path (as tests/conftest.py sets it)
os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ.setdefault("PARTITA_SWITCH_LAYOUT", "off")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from support.pool import Pools  # noqa: E402

LAYOUTS = {  # name -> world, plan arguments
    "data-parallel": (2, {"stages": 1, "micro_batches": 1}),
    "2x2": (4, {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}),
}
STEPS = 2
# SGD with momentum: Adam divides each gradient entry by its own magnitude, so on entries near zero it turns fp32
# rounding noise (the ranks sum rows in another order than one process) into whole steps (CTRL: parameters
# 2e-4 apart after one Adam step, 2e-7 with SGD); a wrong gradient still shows under SGD
OPTIMIZER = "sgd"


def train(pools: Pools, model_type: str, layout: str) -> tuple[bool, str]:
    """(passed, what to print) for one layout."""
    from test_fidelity import check

    world, plan = LAYOUTS[layout]
    try:
        results = pools.run(world, "support.hf_architectures:fidelity", model_type, steps=STEPS, optimizer=OPTIMIZER,
                            **plan)
    except AssertionError as e:  # the case raised on some rank
        return False, f"{layout}: {_cause(str(e))}"
    relative = max((v["relative"] for r in results for v in r["diffs"].values()), default=float("nan"))
    try:
        check(results)
    except AssertionError as e:
        return False, f"{layout}: rel {relative:.2g} FAIL ({str(e).splitlines()[0][:200]})"
    return True, f"{layout}: rel {relative:.2g}"


def _cause(text: str) -> str:
    """The first exception line with a message in a pool's failure (the root of a chain comes first), leaving
    out the timeouts that other ranks then meet."""
    lines = [line.strip() for line in text.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Failed): \S", line)
              and "Timed out" not in line and "failed on ranks" not in line]
    return (errors[0] if errors else lines[-1])[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types (default: all causal LMs)")
    parser.add_argument("--start", type=int, default=0, help="skip the first K architectures")
    parser.add_argument("--limit", type=int, default=None, help="at most N architectures")
    args = parser.parse_args()
    from support.hf_architectures import causal_lm_types

    types = args.only.split(",") if args.only else list(causal_lm_types())
    types = types[args.start:][:args.limit]
    pools, failed, counts = Pools(), [], {"PASS": 0, "FAIL": 0, "not built": 0}
    try:
        for model_type in types:
            built = pools.run(1, "support.hf_architectures:one_process", model_type)[0]
            if built["error"] is not None:
                counts["not built"] += 1
                print(f"{model_type:28s} not built in one process: {built['error']}", flush=True)
                continue
            said, passed = [], True
            for layout in LAYOUTS:
                ok, line = train(pools, model_type, layout)
                passed &= ok
                said.append(line)
            verdict = "PASS" if passed else "FAIL"
            counts[verdict] += 1
            if not passed:
                failed.append(model_type)
            print(f"{model_type:28s} {verdict}  " + " | ".join(said), flush=True)
    finally:
        pools.close()
    print(f"{counts}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
