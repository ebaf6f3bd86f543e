"""What every launcher test shares: the training script, its environment, and the check of its losses."""

import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from launch.reference import reference_losses

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
PYTHON = sys.executable
SCRIPT = str(HERE / "train_script.py")
STEPS = 3
CACHE_DIR = tempfile.mkdtemp(prefix="partita-launch-cache-")  # block costs measured by the session's first job
atexit.register(shutil.rmtree, CACHE_DIR, True)


def env(**extra) -> dict:
    """The test's environment for a launched job: short timeouts, one thread per rank, partita importable, no
    writes to the user's cache."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PARTITA_TIMEOUT_S="60", PARTITA_CACHE_DIR=CACHE_DIR,
             RAY_AUTH_MODE="disabled")
    e.update(extra)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), e.get("PYTHONPATH", "")])
    return e


def check(out: Path, world: int) -> None:
    """The job trained 2 stages x 2 replicas and its losses are one process's on the same global batches."""
    result = json.loads(out.read_text())
    assert result["world"] == world and len(result["plan"]["stages"]) == 2
    assert result["losses"] == pytest.approx(reference_losses(world, STEPS), rel=1e-5)


def output(proc) -> str:
    """A finished process's output, for assertion messages."""
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
