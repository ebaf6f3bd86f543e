"""Name the rank that stopped when a collective fails: gloo names only an address ("Connection closed by peer
[127.0.0.1]:23775") or a timeout, and the ranks that fail after it are no hint which rank was first.

Each rank records its process id in the job's store when it joins, under the machine it runs on. When a
collective's error reaches the top of the main thread, the rank marks itself in the store as one that failed after
another (so that the ranks failing after it do not blame it) and looks at the other ranks of its machine: one whose
process ended or is stopped, and that did not mark itself, is named in a LaunchError raised from the collective's
error. Ranks on other machines cannot be looked at from here: the error then stays as torch raised it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from partita.errors import LaunchError

_PROCESSES = "processes/"
_FOLLOWED = "followed/"
_STORE_TIMEOUT = timedelta(seconds=2)  # the store's server may be the rank that stopped
_LOOK_S = 1.0  # a killed process closes its sockets a moment before /proc shows it ended

_neighbours: dict[int, int] = {}  # rank -> process id, for the other ranks on this machine
_watched: dict = {}  # store, rank, server (see `watch`): set once the excepthook is installed


def register(store: dist.Store, rank: int) -> None:
    """Record this rank's process id (before the process group forms: once it has formed, every rank did)."""
    store.append(_PROCESSES + _machine(), f"{rank}:{os.getpid()},")


def watch(store: dist.Store, rank: int, server: int | None) -> None:
    """From now on, an error of a collective that reaches the top of the main thread names a rank of this machine
    that stopped. `server` is the rank whose process serves the store, if a rank does. Only Linux shows other
    processes' states (in /proc)."""
    if not Path("/proc/self/stat").exists():
        return
    entries = (item.split(":") for item in store.get(_PROCESSES + _machine()).decode().split(",")[:-1])
    _neighbours.clear()
    _neighbours.update({int(r): int(pid) for r, pid in entries if int(r) != rank})
    if not _watched:
        previous = sys.excepthook
        sys.excepthook = lambda kind, error, tb: previous(*_explained(kind, error, tb))
    _watched.update(store=store, rank=rank, server=server)


def _explained(kind, error, tb) -> tuple:
    try:
        named = explain(error)
    except Exception:  # noqa: BLE001 - the diagnosis must never hide the collective's own error
        named = None
    return (kind, error, tb) if named is None else (LaunchError, named, None)


def explain(error: BaseException) -> LaunchError | None:
    """A LaunchError from `error` that names the ranks of this machine that stopped, if `error` is a collective's."""
    if not _watched or not _from_collective(error):
        return None
    rank, server = _watched["rank"], _watched["server"]
    # asking a store whose server ended only adds torch's warnings about the lost connection
    store = None if server in _neighbours and _state(_neighbours[server]) else _watched["store"]
    followed = _mark_followed(store, rank)
    deadline = time.monotonic() + _LOOK_S
    while not (gone := {r: s for r, pid in _neighbours.items() if r not in followed and (s := _state(pid))}):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
        followed = _followed(store)
    described = ", ".join(f"rank {r} (process {_neighbours[r]}) {state}" for r, state in sorted(gone.items()))
    named = LaunchError(f"{described}, so a collective of rank {rank} failed (above). {_what_next()}")
    named.__cause__ = error
    return named


def _what_next() -> str:
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < restarts:
        return "torchrun's agent now restarts every rank, which resume from the last checkpoint."
    return ("Every rank must take part in every step: start the job again, with `partita run --max-restarts N` to "
            "restart it by itself from its last checkpoint when a rank dies.")


def _mark_followed(store: dist.Store | None, rank: int) -> set[int]:
    """Mark this rank as failing after another; return the ranks marked so. Nothing when the store is gone."""
    if store is None:
        return set()
    try:
        store.set_timeout(_STORE_TIMEOUT)
        store.set(f"{_FOLLOWED}{rank}", "")
    except RuntimeError:  # DistError, or a reset connection
        return set()
    return _followed(store)


def _followed(store: dist.Store | None) -> set[int]:
    if store is None:
        return set()
    try:
        return {r for r in _neighbours if store.check([f"{_FOLLOWED}{r}"])}
    except RuntimeError:
        return set()


def _from_collective(error: BaseException | None) -> bool:
    """Whether the error, or one it came from, is a collective's (gloo and NCCL raise RuntimeErrors naming them)."""
    seen = set()
    while error is not None and id(error) not in seen:
        text = str(error).lower()
        if isinstance(error, dist.DistError) or isinstance(error, RuntimeError) and ("gloo" in text or "nccl" in text):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def pid_of(rank: int) -> int | None:
    """The process id of `rank` when it runs on this machine (and is not this process); None otherwise."""
    return _neighbours.get(rank)


def stopped_by_signal(pid: int) -> bool:
    """Whether process `pid` is stopped by SIGSTOP (or SIGTSTP, SIGTTIN, SIGTTOU), not by a debugger (state t)."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "T"


def _state(pid: int) -> str | None:
    """How a process that cannot answer is ('ended', 'is stopped'); None while it runs."""
    fields = _stat(pid)
    return {"Z": "ended", "X": "ended", "T": "is stopped", "t": "is stopped"}.get(fields[0]) if fields else None


def stopped_child(pid: int) -> bool:
    """Whether `pid` is a child of this process stopped by SIGSTOP (or SIGTSTP, SIGTTIN, SIGTTOU): such a process
    acts on no signal but SIGKILL and SIGCONT. A process stopped by its debugger (state t) is not. The parent is
    checked because the number of a child that ended and was reaped may already be another process's."""
    fields = _stat(pid)
    return fields is not None and fields[0] == "T" and int(fields[1]) == os.getpid()


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, parent's id, ...); ['X'] (dead) once the
    process is gone; None when they cannot be read."""
    try:
        # the command name in parentheses may itself hold spaces and parentheses: the fields follow the last ")"
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return ["X"]
    except (OSError, IndexError):
        return None
    return fields or None


def _machine() -> str:
    """Where process ids mean the same: this kernel's boot and pid namespace (host names repeat in containers)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() + os.readlink("/proc/self/ns/pid")
    except OSError:
        return socket.gethostname()
