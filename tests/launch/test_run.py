"""`partita run` and plain `torchrun` start real processes that train like one process; a rank that dies ends
the job within seconds, and the job names it."""

import json
import subprocess
import time

import pytest

from launch.daemons import end, free_port
from launch.harness import BIN, PYTHON, SCRIPT, check, env, output, rank0_logs

pytestmark = pytest.mark.slow

# rank 1 SIGKILLs itself in its fourth step and writes the time of the kill to the file named by its argument
DIES = """
import os, signal, sys, time
import torch, torch.distributed as dist
import partita
partita.init()
for step in range(1000):
    if partita.get_rank() == 1 and step == 3:
        open(sys.argv[1], "w").write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
"""


def test_partita_run(reference_run):
    run, proc = reference_run["dir"], reference_run["proc"]
    assert "rank 3: " in proc.stdout and str(run / "logs") in proc.stdout  # where each rank's log goes
    assert "launched by torchrun: 4 ranks = 1 node x 4 ranks per node" in rank0_logs(run / "logs")
    check(run, 4)


def test_torchrun(tmp_path):
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, output(proc)
    check(tmp_path, 4)


def test_partita_run_returns_the_failing_exit_status(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import partita, sys\npartita.init()\nsys.exit(7 if partita.get_rank() == 1 else 0)\n")
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path), str(bad)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 7
    assert "rank 1 failed with exit code 7" in proc.stderr


def test_a_killed_rank_without_restarts_ends_the_job_and_is_named(tmp_path):
    script, killed = tmp_path / "dies.py", tmp_path / "killed"
    script.write_text(DIES)
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path / "logs"),
                           str(script), str(killed)], capture_output=True, text=True, env=env(), timeout=120)
    seconds = time.time() - float(killed.read_text())
    assert proc.returncode == 128 + 9, output(proc)
    assert "partita run: rank 1 was killed by SIGKILL" in proc.stderr, output(proc)
    assert seconds < 15, output(proc)


def test_ranks_started_by_hand_name_the_rank_that_died(tmp_path):
    script, killed = tmp_path / "dies.py", tmp_path / "killed"
    script.write_text(DIES)
    address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([PYTHON, str(script), str(killed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(RANK=str(rank), WORLD_SIZE="2", **address)) for rank in range(2)]
    try:
        ranks = [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]
        seconds = time.time() - float(killed.read_text())
    finally:
        end([p.pid for p in procs if p.poll() is None])
    assert ranks[1].returncode == -9
    assert ranks[0].returncode == 1
    assert f"LaunchError: rank 1 (process {procs[1].pid}) ended, so a collective of rank 0 failed" in ranks[0].stderr, \
        output(ranks[0])
    assert seconds < 15


# the script's own group has no backend for CPU tensors, as a group of NCCL alone (Ray Train's on GPUs, or a
# script's init_process_group("nccl")) has none: gloo serving only CUDA tensors stands for it on this machine
ADOPTED_WITHOUT_CPU = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group("cuda:gloo")
import partita
from partita.errors import BatchError
from partita.runtime import agreement
partita.init()
out = {"rows": agreement.agree("the same", "the test", rows=3)}
try:
    agreement.agree(f"rank {partita.get_rank()}", "their inputs")
except BatchError as e:
    out["differ"] = str(e)
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as e:
    out["default_group"] = str(e)
open(os.path.join(sys.argv[1], f"{partita.get_rank()}.json"), "w").write(json.dumps(out))
os._exit(0)  # partita.shutdown's barrier would run on the CPU here, where NCCL's runs on the GPU
"""


def test_ranks_agree_over_an_adopted_group_without_a_cpu_backend(tmp_path):
    """partita's own agreement sums CPU tensors; where the group it adopts has no backend for them, it makes a
    gloo group beside it (agreement.cpu_group): ranks still agree, and still all raise the same error when they
    do not, instead of "No backend type associated with device type cpu" at a job's first call."""
    script = tmp_path / "adopted.py"
    script.write_text(ADOPTED_WITHOUT_CPU)
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path / "logs"),
                           str(script), str(tmp_path)], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, output(proc)
    said = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for out in said:
        assert "No backend type associated with device type cpu" in out["default_group"]  # the premise holds
        assert out["rows"] == [3, 3]
        assert "ranks disagree on their inputs: ranks [0]: rank 0; ranks [1]: rank 1" in out["differ"]
