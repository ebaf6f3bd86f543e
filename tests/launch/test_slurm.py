"""Slurm: `srun -n 4` and `partita slurm` (sbatch) train like one process; what Slurm cannot run is refused."""

import re
import subprocess
import time

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
    proc = subprocess.Popen([str(BIN / "partita"), "slurm", "--nodes", "1", "--ranks-per-node", "4", "--time", "5",
                             "--launcher", launcher, "--wait", SCRIPT, str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**slurm.env),
                            cwd=tmp_path)
    first = proc.stdout.readline()
    job_id = re.search(r"submitted job (\d+)", first).group(1)
    # what Slurm does before the time limit (--signal=B:USR1), once training runs: the script notes it and
    # training goes on
    job_log = tmp_path / "partita-logs" / f"partita-{job_id}.out"
    wait_for(lambda: job_log.exists() and "partita: launched by" in job_log.read_text(), f"job {job_id} to train")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, env=env(**slurm.env))
    stdout, stderr = proc.communicate(timeout=240)
    job_output = job_log.read_text()
    assert proc.returncode == 0, output(subprocess.CompletedProcess(proc.args, proc.returncode, first + stdout,
                                                                    stderr)) + job_output
    assert (tmp_path / "partita-logs" / f"partita-{job_id}.stop").exists()
    assert "partita: the time limit is near" in job_output
    check(out, 4)


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.2)


def test_partita_slurm_refuses_more_nodes_than_the_cluster_has(slurm, tmp_path):
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "3", "--ranks-per-node", "1", SCRIPT],
                          capture_output=True, text=True, env=env(**slurm.env), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "Slurm cannot run this job: allocation failure: Requested node configuration is not available" in proc.stderr
    assert "debug*: 1 node(s), 8 CPUs per node" in proc.stderr  # what the cluster has
    queue = subprocess.run(["squeue", "--noheader"], capture_output=True, text=True, env=env(**slurm.env))
    assert queue.stdout.strip() == ""  # nothing was left pending
