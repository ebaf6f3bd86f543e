"""Slurm: `srun -n 4` and `partita slurm` (sbatch) train like one process; what Slurm cannot run is refused."""

import re
import subprocess

import pytest

from launch.harness import BIN, PYTHON, SCRIPT, check, env, output

pytestmark = pytest.mark.slow


def test_srun(slurm, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(["srun", "--nodes=1", "--ntasks=4", PYTHON, SCRIPT, str(out)], capture_output=True,
                          text=True, env=env(**slurm.env), timeout=240)
    assert proc.returncode == 0, output(proc)
    assert re.search(r"launched by srun \(Slurm job \d+ step 0\): 4 ranks = 1 node x 4 ranks per node", proc.stderr)
    check(out, 4)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_partita_slurm(slurm, tmp_path, launcher):
    out = tmp_path / "out.json"
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "1", "--ranks-per-node", "4", "--time", "5",
                           "--launcher", launcher, "--wait", SCRIPT, str(out)],
                          capture_output=True, text=True, env=env(**slurm.env), cwd=tmp_path, timeout=240)
    job_output = next(tmp_path.glob("partita-logs/partita-*.out"), None)
    assert proc.returncode == 0, output(proc) + (job_output.read_text() if job_output else "")
    assert re.search(r"submitted job \d+", proc.stdout)
    check(out, 4)


def test_partita_slurm_refuses_more_nodes_than_the_cluster_has(slurm, tmp_path):
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "3", "--ranks-per-node", "1", SCRIPT],
                          capture_output=True, text=True, env=env(**slurm.env), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "Slurm cannot run this job: allocation failure: Requested node configuration is not available" in proc.stderr
    assert "debug*: 1 node(s), 8 CPUs per node" in proc.stderr  # what the cluster has
    queue = subprocess.run(["squeue", "--noheader"], capture_output=True, text=True, env=env(**slurm.env))
    assert queue.stdout.strip() == ""  # nothing was left pending
