"""`partita run` and plain `torchrun` start real processes that train like one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.reference import reference_losses

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
SCRIPT = str(HERE / "train_script.py")


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PARTITA_TIMEOUT_S="60")
    e["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1] / "src"), e.get("PYTHONPATH", "")])
    return e


def check(out: Path, world: int):
    result = json.loads(out.read_text())
    assert result["world"] == world and len(result["plan"]["stages"]) == 2
    assert result["losses"] == pytest.approx(reference_losses(world, 3), rel=1e-5)


@pytest.mark.slow
def test_partita_run(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "4", "--log-dir", str(tmp_path / "logs"), SCRIPT,
                           str(out)], capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 3: " in proc.stdout and str(tmp_path / "logs") in proc.stdout  # where each rank's log goes
    check(out, 4)


@pytest.mark.slow
def test_torchrun(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", SCRIPT, str(out)],
                          capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check(out, 4)


@pytest.mark.slow
def test_partita_run_returns_the_failing_exit_status(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import partita, sys\npartita.init()\nsys.exit(7 if partita.get_rank() == 1 else 0)\n")
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path), str(bad)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 7
    assert "rank 1 failed with exit code 7" in proc.stderr
