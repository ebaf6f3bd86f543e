"""CPU threads per rank: the ranks on a node share its cores, rather than each starting a thread per core.

A rank gets its share, cores // local ranks (at least 1), of the cores this process may run on: its CPU affinity
(taskset, Slurm's --cpus-per-task, a container's cpuset), not the machine's count. An OMP_NUM_THREADS that the
user set wins, and torch follows it already. One that torchrun set does not: for more than one rank per node
and no OMP_NUM_THREADS of the user's, torchrun sets it to 1 (torch/distributed/run.py, with a warning), which
leaves all but one core per rank idle when the node has more cores than ranks.

The rank's own environment cannot tell torchrun's 1 from a user's: torchrun's agent copies its OMP_NUM_THREADS
into every rank's (torch/distributed/elastic/agent/server/local_elastic_agent.py). The environment that the
agent, the rank's parent, started with can: Linux's /proc/PID/environ shows that one, and a process's later
changes to its own environment never reach it. No torch here: `partita run` computes the share too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_per_rank(cores: int, ranks: int) -> int:
    """Each of `ranks` ranks' share of `cores`, at least 1.

    >>> cores_per_rank(8, 3), cores_per_rank(2, 4)
    (2, 1)
    """
    return max(1, cores // max(1, ranks))


def threads_per_rank(cores: int, local_world_size: int, environ: Mapping[str, str],
                     launcher_environ: Mapping[str, str] | None = None) -> int | None:
    """The intra-op threads of one of `local_world_size` CPU ranks on `cores` cores; None when the user chose them
    with OMP_NUM_THREADS. `launcher_environ`: what torchrun's agent started with (`launcher_environ()`).

    >>> threads_per_rank(8, 4, {})
    2
    >>> threads_per_rank(8, 4, {"OMP_NUM_THREADS": "3"}) is None          # the user's choice
    True
    >>> torchrun = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "job"}
    >>> threads_per_rank(8, 4, torchrun, launcher_environ={"PATH": "/bin"})  # torchrun's 1: the share wins
    2
    """
    if "OMP_NUM_THREADS" in environ and not _set_by_torchrun(environ, launcher_environ):
        return None
    return cores_per_rank(cores, local_world_size)


def _set_by_torchrun(environ: Mapping[str, str], launcher_environ: Mapping[str, str] | None) -> bool:
    """Whether torchrun's agent (or `partita run`, which is one) set OMP_NUM_THREADS after it started. Unknown
    (the agent's environment unreadable) counts as the user's: their choice must not be overridden."""
    return ("TORCHELASTIC_RUN_ID" in environ and launcher_environ is not None
            and "OMP_NUM_THREADS" not in launcher_environ)


def launcher_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment that torchrun's agent, this process's parent, started with; None when torchrun did not
    start this process or that environment cannot be read (no /proc: not Linux)."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}
