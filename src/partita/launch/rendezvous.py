"""partita's own rendezvous: rank 0 serves a TCP store, every rank joins it and checks the world it declares.

Launchers without an agent (mpirun, srun, variables set by hand) only tell each process its own rank and
world size. If two processes were started with different world sizes, torch's rendezvous waits for ranks that
will never come until the process-group timeout, then fails with a gloo error that does not say why. Here each
rank states its world size in the store first: the first statement stands, and a rank that states another one
stops at once with a message naming both, which every rank then reports.

Under torchrun's elastic agent (`partita run`), the agent serves the store and keeps it for the whole job: `join_agent`
gives each start of the workers its own part of it, so that a restart after a dead rank never reads the dead
workers' keys.
"""

from __future__ import annotations

import socket
import time
import uuid
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import DistStoreError

from partita.errors import LaunchError
from partita.launch.detected import Address, Placement

_KEY = "partita/rendezvous/"
_SESSION = "partita/session/"
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
            _stop(store, me, f"only {arrived} of {me.world_size} ranks reached the rendezvous at {address} within "
                             f"{timeout.total_seconds():.0f} s (PARTITA_TIMEOUT_S); missing ranks: {_listed(missing)}. "
                             f"Check that {me.world_size} processes were started, all with the same world size, and "
                             f"that they reach {address}.")
        time.sleep(_POLL_S)


def _listed(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:10])) + (" ..." if len(ranks) > 10 else "")


def _stop(store: dist.Store, me: Placement, problem: str) -> None:
    """Stop the rendezvous on every rank with the first problem any rank found."""
    message = store.compare_set(_KEY + "stop", "", problem).decode() if problem else store.get(_KEY + "stop").decode()
    if me.rank == 0:
        # rank 0 serves the store: stay long enough for the others to read the message before the store goes
        time.sleep(20 * _POLL_S)
    raise LaunchError(message)


def join_agent(me: Placement, timeout: timedelta) -> dist.Store:
    """Join the store of torchrun's agent at `me.address`; return the part of it that is new to this start of the job.

    The agent makes its store in its first rendezvous round only and starts the workers of every restart on it
    (torch 2.13: torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, `next_rendezvous`), while
    `init_process_group` under the agent adds no prefix per attempt (torch/distributed/rendezvous.py,
    `_create_c10d_store`). Gloo of the restarted workers then reads the dead workers' addresses and fails or hangs.
    TORCHELASTIC_RESTART_COUNT cannot tell the starts apart: each agent counts its own restarts, so nodes disagree.
    """
    try:
        store = dist.TCPStore(me.address.host, me.address.port, is_master=False, timeout=timeout)
    except RuntimeError as e:
        raise LaunchError(f"rank {me.rank} of {me.world_size} could not reach the store of torchrun's agent at "
                          f"{me.address} ({e}). Check that the agent still runs; its output says why.") from e
    try:
        name = _serve_session(store, me, timeout) if me.rank == 0 else _ask_session(store, me, timeout)
    except DistStoreError as e:
        raise LaunchError(f"rank {me.rank} lost the store of torchrun's agent at {me.address} ({e}): the agent "
                          "probably stopped; its output says why.") from e
    return dist.PrefixStore(f"partita/{name}", store)


def _ask_session(store: dist.Store, me: Placement, timeout: timedelta) -> str:
    """Ask rank 0 for the name of this start under a nonce of our own: an answer to it cannot be an old one."""
    nonce = uuid.uuid4().hex
    store.append(_SESSION + "asks", nonce + ",")
    answer = _SESSION + "answer/" + nonce
    try:
        store.wait([answer], timeout)
    except DistStoreError as e:
        raise LaunchError(f"rank {me.rank} got no answer from rank 0 within {timeout.total_seconds():.0f} s "
                          f"(PARTITA_TIMEOUT_S) at the store of torchrun's agent at {me.address}: rank 0 probably "
                          "stopped; its output says why.") from e
    name = store.get(answer).decode()
    store.set(f"{_SESSION}{name}/rank/{me.rank}", "")
    store.add(f"{_SESSION}{name}/joined", 1)
    return name


def _serve_session(store: dist.Store, me: Placement, timeout: timedelta) -> str:
    """Draw a new name and answer every rank's ask until all ranks confirmed it. Asks left by the workers of an
    earlier start get the answer too, which nobody reads: rank 0 cannot tell them from the new ones."""
    name, answered = uuid.uuid4().hex, set()
    deadline = time.monotonic() + timeout.total_seconds()
    while (joined := store.add(f"{_SESSION}{name}/joined", 0)) < me.world_size - 1:
        asks = set(store.get(_SESSION + "asks").decode().split(",")[:-1]) if store.check([_SESSION + "asks"]) else set()
        if new := sorted(asks - answered):
            store.multi_set([_SESSION + "answer/" + nonce for nonce in new], [name] * len(new))
            answered.update(new)
        if time.monotonic() > deadline:
            missing = [r for r in range(1, me.world_size) if not store.check([f"{_SESSION}{name}/rank/{r}"])]
            raise LaunchError(f"only {joined + 1} of {me.world_size} ranks of this torchrun job reached rank 0 within "
                              f"{timeout.total_seconds():.0f} s (PARTITA_TIMEOUT_S); missing ranks: "
                              f"{_listed(missing)}. Their output says why.")
        time.sleep(_POLL_S)
    return name
