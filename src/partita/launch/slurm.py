"""Processes started by Slurm's `srun`: each task is a rank, and the first node of the step hosts the rendezvous.

Only srun's tasks are ranks. The batch script itself also sees SLURM_PROCID=0 and SLURM_NTASKS, but it is no
task of a step (no SLURM_STEP_ID), so a plain `python train.py` in a batch script trains alone rather than
waiting for ranks that nobody started.

>>> p = detect({"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "12", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
...             "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
...             "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "node[01-02]"})
>>> (p.rank, p.local_rank, p.layout(), p.address.host)
(5, 1, '8 ranks = 2 nodes x 4 ranks per node', 'node01')
"""

from __future__ import annotations

import re

from partita.launch.detected import Address, Join, Placement, integer, job_port


def detect(environ: dict) -> Placement | None:
    """srun's SLURM_* variables of a job step, or None."""
    if "SLURM_STEP_ID" not in environ or "SLURM_PROCID" not in environ:
        return None
    world_size = integer(environ, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS")
    per_node = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ["SLURM_TASKS_PER_NODE"])
    job = f"{environ.get('SLURM_JOB_ID', '0')}.{environ['SLURM_STEP_ID']}"
    # MASTER_ADDR/MASTER_PORT, when set, win: sbatch passes the submitting shell's variables on to every task
    host = environ.get("MASTER_ADDR") or first_host(environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"])
    # a requeued job keeps its id and starts again at step 0: its restart count keeps it off the port its
    # previous run may still hold
    restart = environ.get("SLURM_RESTART_COUNT", "0")
    port = integer(environ, "MASTER_PORT") if "MASTER_PORT" in environ else job_port(f"{job}.{restart}")
    return Placement("srun", integer(environ, "SLURM_PROCID"), world_size, integer(environ, "SLURM_LOCALID"),
                     per_node[integer(environ, "SLURM_NODEID")], len(per_node), Join.STORE, Address(host, port),
                     detail=f"Slurm job {job.replace('.', ' step ')}")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (what `scontrol show hostnames LIST | head -n 1` prints).

    >>> first_host("gpu[07-09,12],cpu3"), first_host("rack[2-3]-n[01-04]"), first_host("vm")
    ('gpu07', 'rack2-n01', 'vm')
    """
    first = re.split(r",(?![^\[]*\])", nodelist)[0]  # the first entry: a comma outside brackets ends it
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed task counts, one per node: '4(x2),3' -> [4, 4, 3].

    >>> tasks_per_node("4(x2),3")
    [4, 4, 3]
    """
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", text):
        counts += [int(count)] * int(repeat or 1)
    return counts
