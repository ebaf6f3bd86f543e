"""What every launcher test shares: the training script, its environment, and the check of its losses."""

import json
import os
import sys
from pathlib import Path

import pytest

from launch.reference import reference_losses
from launch.train_script import STEPS
from support.session import cache_dir

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
PYTHON = sys.executable
SCRIPT = str(HERE / "train_script.py")


def env(**extra) -> dict:
    """The test's environment for a launched job: short timeouts, one thread per rank, partita importable, no
    writes to the user's cache."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PARTITA_TIMEOUT_S="60", PARTITA_CACHE_DIR=cache_dir(),
             RAY_AUTH_MODE="disabled")
    e.update(extra)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), e.get("PYTHONPATH", "")])
    return e


def losses(run_dir: Path) -> list[dict]:
    """The lines rank 0 wrote, one per step it finished, in order (over every attempt)."""
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


def by_step(rows: list[dict]) -> dict[int, float]:
    """The loss of each step. A step computed again after a restart gave the same loss: bit for bit in the
    same world, within fp32 rounding (rtol 1e-5) in another (other plan, other order of summation)."""
    out: dict[int, float] = {}
    world: dict[int, int] = {}
    for r in rows:
        step, loss = r["step"], r["loss"]
        if step in out:
            same = loss == out[step] if world[step] == r["world"] else loss == pytest.approx(out[step], rel=1e-5)
            assert same, f"step {step} computed twice, differently: {out[step]} then {loss}"
        out[step], world[step] = loss, r["world"]
    return out


def check(run_dir: Path, world: int, steps: int = STEPS, stages: int | None = 2) -> None:
    """The job trained `stages` stages (None: as many as it planned) on `world` ranks, every step once or repeated
    exactly, and its losses are one process's on the same global batches."""
    plan = json.loads((run_dir / f"plan-{world}.json").read_text())
    assert plan["world_size"] == world
    assert stages is None or len(plan["stages"]) == stages, plan["reasons"]
    got = by_step(losses(run_dir))
    assert sorted(got) == list(range(steps))
    assert [got[s] for s in range(steps)] == pytest.approx(reference_losses(steps), rel=1e-5)


def rank0_logs(log_dir: Path) -> str:
    """What rank 0 wrote to stderr under `partita run --log-dir log_dir`, over every run and attempt."""
    return "".join(p.read_text() for p in sorted(log_dir.glob("*/attempt_*/0/stderr.log")))


def output(proc) -> str:
    """A finished process's output, for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
