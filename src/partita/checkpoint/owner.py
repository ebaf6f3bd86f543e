"""One job at a time per checkpoint directory.

Two jobs saving into one root would replace each other's checkpoints, and a job started against the root of a live
job would resume that job's run (its step, its learning rate) as if it were its own. So rank 0 of a job that saves
into a root, or resumes from it (`partita.elastic`), holds an flock on `ROOT/.partita-job` until the job leaves
(`partita.shutdown()`) or its process ends; the file names the holder (host, pid, job). Another job is refused with
an error that names the directory, the holder and the fix.

The kernel drops an flock with its process, so a job that died (a crash, kill -9, a node lost) blocks nothing: the
job run again, or the next attempt of an elastic job, takes the directory over. A new attempt of the same job (the
same TORCHELASTIC_RUN_ID, which `partita run` and torchrun keep over restarts, or SLURM_JOB_ID, which a requeued
job keeps) takes it over even while the old attempt's process is still ending. Where the filesystem has no locks,
nothing can tell a live holder from a dead one, and nothing is refused. Plain Python: no torch.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from partita.errors import CheckpointError

JOB_LOCK = ".partita-job"
_UNNAMED = {"", "none"}  # torchrun's run id when none was given: the same for every job

_held: dict[Path, IO] = {}  # root -> its lock file, open (and so locked) until `release_all`
_resumed: set[Path] = set()  # roots partita.elastic holds


def job_id(environ: dict | None = None) -> str | None:
    """This job's identity, the same on every attempt of it: its launcher's run id, or None where none is known.

    >>> job_id({"TORCHELASTIC_RUN_ID": "3f9a", "SLURM_JOB_ID": "12"})
    'torchrun 3f9a'
    >>> job_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "12"})
    'slurm 12'
    >>> job_id({}) is None
    True
    """
    environ = os.environ if environ is None else environ
    for name, launcher in (("TORCHELASTIC_RUN_ID", "torchrun"), ("SLURM_JOB_ID", "slurm")):
        value = environ.get(name, "").strip()
        if value.lower() not in _UNNAMED:
            return f"{launcher} {value}"
    return None


def claim(root: Path) -> None:
    """Hold `root` for this job (rank 0, before it saves there or resumes from there), or raise CheckpointError
    naming the live job that holds it."""
    key = root.resolve()
    if key in _held:
        return
    root.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}
    lock = open(root / JOB_LOCK, "a+")  # "a+": the holder's name stays readable until the lock is ours
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(lock)
        lock.close()
        if me["job"] is not None and holder.get("job") == me["job"]:
            return  # an earlier attempt of this job, still ending; the next save takes the lock over
        raise CheckpointError(
            f"{root} is in use by another job: {_describe(holder)} holds it and saves its checkpoints there. A "
            "checkpoint directory belongs to one job at a time: this job would replace that job's checkpoints, and "
            "resume its run (its step, its learning rate) as if it were its own. Give this job a directory of its "
            "own, or stop that job first (a job that ended, or died, holds nothing)") from None
    except OSError:
        lock.close()  # a filesystem without locks: a live holder cannot be told from a dead one
        return
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps(me) + "\n")
    lock.flush()
    if not _held:
        atexit.register(release_all)  # a job without partita.shutdown() closes its lock files too
    _held[key] = lock


def release_after_save(root: Path) -> None:
    """A process outside any job (no process group: a script or notebook saving a model) holds `root` only while it
    saves, unless it holds it for `partita.elastic`: it would otherwise keep every job it starts from using it."""
    if root.resolve() in _held and root.resolve() not in _resumed:
        _held.pop(root.resolve()).close()


def held_for_resuming(root: Path) -> None:
    """`root` is this process's for its whole run (partita.elastic): saves do not let go of it."""
    _resumed.add(root.resolve())


def release_all() -> bool:
    """Let go of every directory this process holds (the job leaves). True: `launch.env.before_leaving`'s
    protocol, this never keeps ranks from leaving together."""
    while _held:
        _held.popitem()[1].close()
    _resumed.clear()
    return True


def _holder(lock: IO) -> dict:
    try:
        lock.seek(0)
        holder = json.loads(lock.read() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    """'process 4242 on node7 (job torchrun 3f9a, since 2026-11-29 00:12:03)'."""
    if not holder.get("pid"):
        return "a process (it has not written its name yet)"
    since = holder.get("since")
    when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" \
        if isinstance(since, (int, float)) else ""
    return f"process {holder['pid']} on {holder.get('host', '?')} (job {holder.get('job') or 'without a run id'}{when})"
