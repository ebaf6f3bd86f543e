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


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, which only waits to be reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def in_session(sid: int) -> list[int]:
    """The running processes of session `sid`: what a process started with start_new_session=True left running."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
            members.append(int(stat.parent.name))
    return members


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
