"""`partita run` and plain `torchrun` start real processes that train like one process."""

import subprocess

import pytest

from launch.harness import BIN, SCRIPT, check, env, output


@pytest.mark.slow
def test_partita_run(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "4", "--log-dir", str(tmp_path / "logs"), SCRIPT,
                           str(out)], capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, output(proc)
    assert "rank 3: " in proc.stdout and str(tmp_path / "logs") in proc.stdout  # where each rank's log goes
    assert "launched by torchrun: 4 ranks = 1 node x 4 ranks per node" in proc.stdout + proc.stderr  # rank 0 says
    check(out, 4)


@pytest.mark.slow
def test_torchrun(tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", SCRIPT, str(out)],
                          capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, output(proc)
    check(out, 4)


@pytest.mark.slow
def test_partita_run_returns_the_failing_exit_status(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import partita, sys\npartita.init()\nsys.exit(7 if partita.get_rank() == 1 else 0)\n")
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path), str(bad)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 7
    assert "rank 1 failed with exit code 7" in proc.stderr
