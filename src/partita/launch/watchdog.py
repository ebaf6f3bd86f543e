"""Find a rank that stopped answering (SIGSTOP, a machine that froze) within seconds, whatever the timeouts.

A collective waits for every rank until the process group's timeout (PARTITA_TIMEOUT_S, 300 s by default): a rank
that stopped would hold the job that long, and a long timeout is what long steps need. So each rank runs a thread
that counts a heartbeat in the job's store every BEAT_S and reads the counts of its two neighbours in the ring of
ranks (rank - 1 and rank + 1: the store's load grows with the ranks, not their square). A live process beats
from its thread whatever its main thread does: a long step (torch's kernels release the GIL, and Python code
lets the thread run every 5 ms), a wait in a collective. A neighbour whose count has not moved for SILENT_S is
stopped or frozen: the thread names it on stderr, kills it with SIGKILL when it is a stopped process of this
machine (such a process acts on no other signal, so its launcher would wait for it in vain; a silent neighbour of
this machine that is not stopped by a signal lives, held in C code or a debugger, and is left to the timeouts), and ends this rank
with exit status 1, so that the launcher (`partita run`, torchrun) ends the job, or restarts it. A rank that
leaves (`partita.shutdown()`, or the end of its process) says so first, and is not waited for.

The same thread ends a rank held by a failure elsewhere: a rank whose stage raised tells every rank through
partita's statements at the end of the run (runtime.agreement), but a rank held in a collective the failing rank
never joins (FSDP's, inside a stage's compute) never gets there. The failing rank also publishes its failure in
the store (`tell`); a rank that has not heard of it otherwise GRACE_S later prints it and ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from partita.launch import peers

BEAT_S = 1.0
SILENT_S = 20.0  # with torchrun's 30 s for the ranks it stops, a job with a stopped rank ends within 60 s
_BEATS = "watchdog/beats/"
_LEFT = "watchdog/left/"
_FAILED = "watchdog/failed"
GRACE_S = 10.0  # for ranks to hear a failure in partita's own statements before they are ended
_SAY_S = 2.0  # a rank that has not heard of a failure so long after it was published names it
_STORE_TIMEOUT = timedelta(seconds=5)

_running: dict = {}  # store, rank, stop (an Event) of this process's watch


def start(store: dist.Store, rank: int, world_size: int, server: int | None) -> None:
    """Beat and watch from now on (once per process). `server`: the rank whose process serves the store, if one
    does: a store that stops answering is then that rank's silence."""
    if world_size < 2 or _running:
        return
    own = store.clone()  # the main thread's waits on the store must not delay the beats
    own.set_timeout(_STORE_TIMEOUT)
    stop = threading.Event()
    _running.update(store=own, rank=rank, stop=stop)
    threading.Thread(target=_watch, args=(own, rank, world_size, server, stop), name="partita-watchdog",
                     daemon=True).start()
    atexit.register(leave)


def tell(message: str, raised: bool) -> None:
    """A rank failed in a step (`message` says which, where, and its error): this one, or this one `raised` it.
    The first such message is published: a rank that has not raised it through partita's statements within
    GRACE_S (the failing rank too) is held in a collective some rank never joins, and ends with that message."""
    if not _running:
        return
    _running["heard"] = _running.get("heard", False) or raised
    try:
        _running["store"].compare_set(_FAILED, "", message)  # the first failure stands
    except Exception:  # noqa: BLE001 - a store that is gone: the launcher ends the job
        pass


def leave() -> None:
    """This rank stops beating and says so: its neighbours do not wait for its beats any more."""
    if not _running:
        return
    _running["stop"].set()
    try:
        _running["store"].set(f"{_LEFT}{_running['rank']}", "")
    except Exception:  # noqa: BLE001 - a store that is gone has no one to tell
        pass
    _running.clear()


def _watch(store: dist.Store, rank: int, world_size: int, server: int | None, stop: threading.Event) -> None:
    watched = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
    now = time.monotonic()
    heard = {r: (-1, now) for r in watched}  # each neighbour's last count, and when it last changed
    reached = now  # when the store last answered
    failure_seen = None  # when a published failure was first seen
    said = False  # whether this rank printed it
    while not stop.wait(BEAT_S):
        now = time.monotonic()
        try:
            store.add(f"{_BEATS}{rank}", 1)
            if not _running.get("heard") and store.check([_FAILED]):
                failure_seen = failure_seen or now
                if failure_seen < now - _SAY_S and not said:
                    # every rank names it: the launcher may end a rank before its own grace ends
                    said = True
                    print(f"partita: {store.get(_FAILED).decode()}. Rank {rank} has not heard of it in partita's "
                          f"statements yet: it ends within {GRACE_S:.0f} s unless it does", file=sys.stderr,
                          flush=True)
                if now - failure_seen > GRACE_S and not stop.is_set():
                    _end_after_failure(rank, store.get(_FAILED).decode())
            for r in list(watched):
                if store.check([f"{_LEFT}{r}"]):
                    watched.remove(r)
                    continue
                count = store.add(f"{_BEATS}{r}", 0)
                if count != heard[r][0]:
                    heard[r] = (count, now)
            reached = now
        except Exception:  # noqa: BLE001 - DistStoreError, a reset connection: the store is silent itself
            if server is not None and server != rank and now - reached > SILENT_S and not stop.is_set():
                _end(rank, [server], now - reached, "serves the job's store, which")
            continue
        # a neighbour on this machine that is not stopped lives (a C call holding the GIL, a debugger): its
        # collectives time out by themselves if it never comes back
        silent = [r for r in watched if now - heard[r][1] > SILENT_S and _stopped_or_elsewhere(r)]
        if silent and not stop.is_set():
            _end(rank, silent, max(now - heard[r][1] for r in silent), "")


def _stopped_or_elsewhere(rank: int) -> bool:
    pid = peers.pid_of(rank)
    return pid is None or peers.stopped_by_signal(pid)


def _end_after_failure(rank: int, message: str) -> None:
    print(f"partita: {message}. Rank {rank} waits for that rank in a collective it never joins: ending rank {rank} "
          "so that the launcher ends the job (or restarts it from the last checkpoint: partita run --max-restarts N).",
          file=sys.stderr, flush=True)
    leave()
    os._exit(1)


def _end(rank: int, silent: list[int], seconds: float, serving: str) -> None:
    """Name the silent ranks, kill those stopped on this machine, end this rank."""
    named = []
    for r in silent:
        pid = peers.pid_of(r)
        if pid is not None and peers.stopped_by_signal(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                named.append(f"rank {r} (process {pid} on this machine, stopped: killed it with SIGKILL)")
            except ProcessLookupError:  # it ended since
                named.append(f"rank {r} (process {pid}, ended)")
        else:
            named.append(f"rank {r}" + (f" (process {pid} on this machine)" if pid is not None else ""))
    print(f"partita: {' and '.join(named)} {serving}has not answered for {seconds:.0f} s: it is stopped (SIGSTOP) "
          f"or frozen, and every rank would wait for it in its next collective until PARTITA_TIMEOUT_S. Ending rank "
          f"{rank} so that the launcher ends the job (or restarts it from the last checkpoint: partita run "
          "--max-restarts N).", file=sys.stderr, flush=True)
    leave()
    os._exit(1)
