"""What the tests' own daemons (Slurm, Ray) need: free ports, and ending them by process id, never by name."""

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    """A port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, ppid, pgrp, session, ...); None once it ended."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, which only waits to be reaped, does not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def session(pid: int) -> int | None:
    """The session of the process, None once it ended."""
    fields = _stat(pid)
    return int(fields[3]) if fields else None


def _running() -> list[int]:
    return [int(p.name) for p in Path("/proc").glob("[0-9]*") if alive(int(p.name))]


def in_session(sid: int) -> list[int]:
    """The running processes of session `sid`: what a process started with start_new_session=True left running."""
    return [pid for pid in _running() if session(pid) == sid]


def started_with(name: str, value: str) -> list[int]:
    """The running processes whose environment had name=value when they started (/proc/PID/environ), and so what
    they started in turn, unless it was given another environment: e.g. everything that talks to one Slurm cluster
    (its SLURM_CONF)."""
    entry = f"{name}={value}".encode()
    found = []
    for pid in _running():
        try:
            if entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def end(pids: list[int], grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to each process, then SIGKILL to those still running after `grace_s`."""
    for s, wait_s in ((sig, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, s)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return
