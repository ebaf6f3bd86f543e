"""Each launcher's variables -> this process's place; which launcher wins when several set variables. No processes."""

import json
import subprocess
import sys

import pytest

from launch.harness import BIN, PYTHON, SCRIPT, env, output
from partita.errors import LaunchError
from partita.launch import mpi
from partita.launch.env import detect
from partita.launch.detected import Address, Join
from partita.launch.slurm import first_host, tasks_per_node

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "n1",
            "MASTER_PORT": "29500"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_orte_num_nodes": "2", "OMPI_MCA_ess_base_jobid": "1475739649"}
SRUN = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "4(x2)"}
# the batch script of `sbatch -n 8`: Slurm's variables, but no job step
BATCH = {"SLURM_JOB_ID": "12", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "8",
         "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_torchrun_agent_store():
    p = detect(TORCHRUN)
    assert (p.launcher, p.rank, p.world_size, p.local_rank, p.num_nodes, p.join) == ("torchrun", 5, 8, 1, 2, Join.AGENT)


def test_variables_set_by_hand_need_the_master_address():
    by_hand = {"RANK": "1", "WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="MASTER_ADDR is not set"):
        detect(by_hand)
    p = detect({**by_hand, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (p.launcher, p.join, p.address) == ("env", Join.STORE, Address("10.0.0.1", 29500))


def test_mpirun_leaves_the_address_to_agree_unless_given():
    p = detect(OMPI)
    assert (p.launcher, p.rank, p.local_rank, p.layout(), p.address) == (
        "mpirun", 5, 1, "8 ranks = 2 nodes x 4 ranks per node", None)
    assert detect({**OMPI, "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}).address == Address("n1", 29500)


def test_mpirun_on_several_nodes_without_mpi4py_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if mpi4py were not installed
    with pytest.raises(LaunchError, match=r"pip install mpi4py.*mpirun -x MASTER_ADDR"):
        mpi.agree_address(detect(OMPI), OMPI)
    one_node = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_MCA_orte_num_nodes": "1"}
    assert mpi.agree_address(detect(one_node), one_node).address.host == "127.0.0.1"


def srun_address_in_another_process(environ: dict, hash_seed: int) -> str:
    """The rendezvous address that a separate Python process, with its own salt for str hashes, derives."""
    code = "import json, sys; from partita.launch.slurm import detect; print(detect(json.loads(sys.argv[1])).address)"
    proc = subprocess.run([PYTHON, "-c", code, json.dumps(environ)], capture_output=True, text=True,
                          env=env(PYTHONHASHSEED=str(hash_seed)), timeout=60)
    assert proc.returncode == 0, output(proc)
    return proc.stdout.strip()


def test_srun_task():
    p = detect(SRUN)
    assert (p.launcher, p.rank, p.world_size, p.local_rank, p.local_world_size, p.num_nodes) == ("srun", 5, 8, 1, 4, 2)
    # every rank is a process of its own and derives the same port: two hash seeds, as ranks would have
    assert p.address.host == "gpu07"
    assert srun_address_in_another_process(SRUN, 1) == srun_address_in_another_process(SRUN, 2) == str(p.address)
    assert detect({**SRUN, "SLURM_STEP_ID": "1"}).address.port != p.address.port  # two steps may run at once


def test_a_batch_script_without_srun_is_a_single_process():
    assert detect(BATCH).launcher == "single"


def test_the_innermost_launcher_wins():
    assert detect({**SRUN, **TORCHRUN}).launcher == "torchrun"  # srun ... torchrun
    assert detect({**SRUN, **OMPI}).launcher == "mpirun"  # salloc ... mpirun


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(LaunchError, match="rank 8 of a world of 8"):
        detect({**OMPI, "OMPI_COMM_WORLD_RANK": "8"})


@pytest.mark.parametrize("nodelist, first", [("vm", "vm"), ("gpu[07-09,12],cpu3", "gpu07"),
                                             ("rack[2-3]-n[01-04]", "rack2-n01"), ("a1,b[1-2]", "a1")])
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_per_node():
    assert tasks_per_node("4(x2),3") == [4, 4, 3] and tasks_per_node("2") == [2]


def dry_run(*options: str) -> str:
    """The batch script that `partita slurm --nodes 2 --ranks-per-node 4 OPTIONS --dry-run` prints."""
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "2", "--ranks-per-node", "4", *options,
                           "--dry-run", SCRIPT, "--steps", "10"], capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 0, output(proc)
    return proc.stdout


def uncommented(script: str) -> list[str]:
    """The first line of each group of consecutive commands or #SBATCH lines that no comment directly precedes."""
    def comment(line: str) -> bool:
        return line.startswith("#") and not line.startswith("#SBATCH")

    lines = script.splitlines()[1:]  # after #!/bin/bash
    return [line for before, line in zip(["", *lines], lines)
            if line.strip() and not comment(line) and not comment(before) and not before.strip()]


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
@pytest.mark.parametrize("requeue", [[], ["--no-requeue"]])
def test_partita_slurm_dry_run_prints_a_valid_commented_script(launcher, requeue):
    script = dry_run("--gpus-per-node", "4", "--partition", "gpu", "--launcher", launcher, *requeue)
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=4" in script
    assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --signal=B:USR1@120" in script and f"{SCRIPT} --steps 10" in script
    assert uncommented(script) == [], script
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_partita_slurm_leaves_the_partition_to_slurm_unless_given():
    assert "--partition" not in dry_run()  # the cluster's default partition


def test_partita_slurm_without_slurm_says_so(tmp_path):
    proc = subprocess.run([str(BIN / "partita"), "slurm", "--nodes", "1", "--ranks-per-node", "2", SCRIPT],
                          capture_output=True, text=True, env=env(PATH=str(BIN)), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "sbatch is not installed here (not on PATH)" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "partita-logs").exists()  # nothing written for a job that was not submitted
