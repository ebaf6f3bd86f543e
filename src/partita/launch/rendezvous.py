"""partita's own rendezvous: rank 0 serves a TCP store, every rank joins it and checks the world it declares.

Launchers without an agent (mpirun, srun, variables set by hand) only tell each process its own rank and
world size. If two processes were started with different world sizes, torch's rendezvous waits for ranks that
will never come until the process-group timeout, then fails with a gloo error that does not say why. Here each
rank states its world size in the store first: the first statement stands, and a rank that states another one
stops at once with a message naming both, which every rank then reports.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist

from partita.errors import LaunchError
from partita.launch.placement import Address, Placement

_KEY = "partita/rendezvous/"
_POLL_S = 0.05


def join(me: Placement, timeout: timedelta) -> dist.Store:
    """Serve (rank 0) or join the store at `me.address`; return it once all ranks declared the same world."""
    address, serve = me.address, me.rank == 0
    try:
        store = dist.TCPStore(address.host, address.port, me.world_size, is_master=serve, timeout=timeout,
                              wait_for_workers=False)
    except RuntimeError as e:
        what = "serve the rendezvous on port" if serve else "reach the rendezvous at"
        hint = ("Another job may use that port: choose another MASTER_PORT." if serve else
                "Check that rank 0 runs and that this host can reach it (MASTER_ADDR/MASTER_PORT).")
        raise LaunchError(f"rank {me.rank} of {me.world_size} ({me.launcher}) could not {what} {address} ({e}). "
                          f"{hint}") from e
    try:
        _agree(store, me, address, timeout)
    except LaunchError:
        raise
    except (RuntimeError, OSError) as e:
        raise LaunchError(f"rank {me.rank} lost the rendezvous at {address} ({e}): rank 0, which serves it, "
                          "probably stopped; its output says why.") from e
    return store


def _agree(store: dist.Store, me: Placement, address: Address, timeout: timedelta) -> None:
    claim = f"{me.world_size} {me.rank} {socket.gethostname()}"
    first = store.compare_set(_KEY + "world_size", "", claim).decode()  # the first claim stands
    world_size, rank, host = first.split(" ", 2)
    fix = (f"({me.launcher}, rendezvous at {address}). Start every process of the job with the same world size "
           "(WORLD_SIZE, mpirun -np, srun -n) and its own rank.")
    if int(world_size) != me.world_size:
        _stop(store, me, f"ranks disagree on the world size: rank {rank} on {host} was started with a world of "
                         f"{world_size}, rank {me.rank} on {socket.gethostname()} with {me.world_size} {fix}")
    if store.add(_KEY + f"rank/{me.rank}", 1) > 1:
        _stop(store, me, f"two processes were started as rank {me.rank} (one on {socket.gethostname()}) {fix}")
    store.add(_KEY + "arrived", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while (arrived := store.add(_KEY + "arrived", 0)) < me.world_size:
        if store.check([_KEY + "stop"]):
            _stop(store, me, "")
        if time.monotonic() > deadline:
            missing = [r for r in range(me.world_size) if not store.check([_KEY + f"rank/{r}"])]
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            _stop(store, me, f"only {arrived} of {me.world_size} ranks reached the rendezvous at {address} within "
                             f"{timeout.total_seconds():.0f} s (PARTITA_TIMEOUT_S); missing ranks: {shown}. Check that "
                             f"{me.world_size} processes were started, all with the same world size, and that they "
                             f"reach {address}.")
        time.sleep(_POLL_S)


def _stop(store: dist.Store, me: Placement, problem: str) -> None:
    """Stop the rendezvous on every rank with the first problem any rank found."""
    message = store.compare_set(_KEY + "stop", "", problem).decode() if problem else store.get(_KEY + "stop").decode()
    if me.rank == 0:
        # rank 0 serves the store: stay long enough for the others to read the message before the store goes
        time.sleep(20 * _POLL_S)
    raise LaunchError(message)
