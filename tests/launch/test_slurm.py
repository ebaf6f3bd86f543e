"""Slurm: `srun -n 4` and `partita slurm` (sbatch) train like one process; a job warned of its time limit saves,
requeues itself and resumes; what Slurm cannot run is refused."""

import re
import subprocess
import time

import pytest

from launch.daemons import end
from launch.harness import BIN, PYTHON, SCRIPT, check, env, losses, output
from launch import slurm_cluster
from launch.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.slow


def test_srun(slurm, tmp_path):
    proc = subprocess.run(["srun", "--nodes=1", "--ntasks=4", PYTHON, SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, env=env(**slurm.env), timeout=240)
    assert proc.returncode == 0, output(proc)
    assert re.search(r"launched by srun \(Slurm job \d+ step 0\): 4 ranks = 1 node x 4 ranks per node", proc.stderr)
    check(tmp_path, 4)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_partita_slurm_requeues_a_job_warned_of_its_time_limit(slurm, tmp_path, launcher):
    """What Slurm does before the time limit (--signal=B:USR1): the batch script notes it in the stop file,
    training saves at the next step boundary and stops, the script requeues the job, and the requeued run (same
    job id, SLURM_RESTART_COUNT 1) resumes; `partita slurm --wait` waits through it all."""
    steps = 40
    proc = subprocess.Popen([str(BIN / "partita"), "slurm", "--nodes", "1", "--ranks-per-node", "4", "--time", "5",
                             "--partition", "debug", "--launcher", launcher, "--wait", SCRIPT, str(tmp_path),
                             "--steps", str(steps), "--step-sleep", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**slurm.env),
                            cwd=tmp_path)
    first = proc.stdout.readline()
    job_id = re.search(r"submitted job (\d+)", first).group(1)
    wait_for(lambda: (tmp_path / "losses.jsonl").exists() and len(losses(tmp_path)) >= 2, f"job {job_id} to train")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, env=env(**slurm.env))
    # Slurm makes a requeued job eligible two minutes after the requeue; an operator may let it start sooner, but
    # not within the second of the requeue: slurmd refuses a credential no newer than the revoked one
    wait_for(lambda: re.search(r"JobState=PENDING .*Restarts=1", job_fields(job_id, slurm)), f"job {job_id} requeued")
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, env=env(**slurm.env))
    stdout, stderr = proc.communicate(timeout=240)
    job_output = (tmp_path / "partita-logs" / f"partita-{job_id}.out").read_text()
    ctld = (slurm.root / "log" / "slurmctld.log").read_text()[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode}\n{first}{stdout}\n{stderr}\n{job_output}\n{ctld}"
    assert "partita: the time limit is near" in job_output and "requeueing job" in job_output, job_output
    rows = losses(tmp_path)
    assert {r["requeue"] for r in rows} == {0, 1} and rows[-1]["requeue"] == 1
    check(tmp_path, 4, steps)


def job_fields(job_id: str, slurm) -> str:
    return subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                          env=env(**slurm.env)).stdout


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


def test_partita_slurm_refuses_a_partition_the_cluster_lacks(slurm, tmp_path):
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "1", "--ranks-per-node", "1", "--partition", "gpu",
                           SCRIPT], capture_output=True, text=True, env=env(**slurm.env), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "Slurm cannot run this job: sbatch: error: invalid partition specified: gpu" in proc.stderr, output(proc)
    assert "debug*: 1 node(s)" in proc.stderr and "or another --partition" in proc.stderr  # what the cluster has


def test_stopping_the_test_cluster_ends_the_jobs_that_a_failed_test_left():
    """slurmstepd and a job's processes outlive the daemons: stop() must cancel the job and wait for them."""
    if why := slurm_cluster.missing():
        pytest.skip(why)
    cluster = SlurmCluster()  # a cluster of this test's own: the session's one serves the other tests
    try:
        cluster.start()
        submitted = cluster.run("sbatch", "--parsable", f"--chdir={cluster.root}", "--wrap", "srun sleep 300")
        assert submitted.returncode == 0, submitted.stderr
        # scontrol listpids: PID JOBID STEPID ...; a line of step 0 once srun's task runs
        wait_for(lambda: re.search(r"^\d+\s+\d+\s+0\s", cluster.run("scontrol", "listpids").stdout, re.M),
                 "the job's step to run")
    finally:
        cluster.stop()
    left = cluster.processes()
    end(left)  # what a broken stop() left, so that this test leaves nothing either way
    assert left == []
