"""Join the job's process group from whatever launched this process.

`init()` finds the launcher from its environment variables (Ray Train, torchrun / `partita run` /
torch.distributed.launch, Open MPI's mpirun, Slurm's srun; one module each beside this one), picks the backends
(gloo on CPU; on CUDA nccl for GPU tensors, with the device from the local rank, and gloo for CPU ones) and
creates the default process group with a bounded timeout, so that a dead peer ends the job instead of hanging it.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from partita import settings
from partita.errors import LaunchError
from partita.launch import gpus, mpi, peers, ray_worker, rendezvous, slurm, threads, torchrun, watchdog
from partita.launch.detected import Join, Placement

log = logging.getLogger("partita")

# First match wins. Ray Train sets torchrun's variables in its workers, and torchrun or mpirun may run inside
# a Slurm allocation, whose variables their ranks inherit: the innermost launcher comes first.
LAUNCHERS = (ray_worker, torchrun, mpi, slurm)


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    device: torch.device
    num_nodes: int = 1


_world: World | None = None


def timeout() -> timedelta:
    """Process-group timeout: PARTITA_TIMEOUT_S seconds (default 300)."""
    return timedelta(seconds=settings.timeout_s())


def detect(environ: dict) -> Placement:
    """This process's place as its launcher describes it; a single process when no launcher did.

    >>> detect({}).launcher
    'single'
    """
    for launcher in LAUNCHERS:
        placement = launcher.detect(environ)
        if placement is not None:
            return placement
    return Placement("single", 0, 1)


def _set_cpu_threads(local_world_size: int) -> None:
    """This rank's share of the node's cores as torch's threads, unless the user chose them (threads.py)."""
    count = threads.threads_per_rank(threads.usable_cores(), local_world_size, os.environ,
                                     threads.launcher_environ(os.environ))
    if count is not None:
        torch.set_num_threads(count)


def backend_for(device: torch.device) -> str:
    """The process group's backends for ranks computing on `device`. On a GPU, NCCL sums and sends the GPU's
    tensors, and gloo the CPU tensors of partita's own small collectives (the ranks' agreement on each call,
    how a model was brought, object exchanges): a group of NCCL alone has no backend for CPU tensors."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _join(me: Placement, backend: str, device: torch.device) -> None:
    """Create the default process group the way `me.join` says."""
    if me.join is Join.ALONE:
        # a one-rank group, so that pipelines and collectives need no special case for one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout())
        _end_without_finalizing_after_errors()
        return
    if me.join is Join.ADOPT:
        raise LaunchError(f"{me.launcher} should have created the process group before the training function "
                          "started, but there is none; call partita.init() inside the function that it runs.")
    if me.join is Join.STORE:
        store = dist.PrefixStore("partita", rendezvous.join(me, timeout()))
    else:
        store = rendezvous.join_agent(me, timeout())
    peers.register(store, me.rank)
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("group", store), rank=me.rank,
                                world_size=me.world_size, timeout=timeout(),
                                device_id=device if device.type == "cuda" else None)
    except Exception as e:  # noqa: BLE001 - re-raised with the cause attached
        raise LaunchError(
            f"rank {me.rank} of {me.world_size} could not join the process group of its {me.launcher} job ({e}). "
            "Check that every rank was started with the same world size and can reach the others."
        ) from e
    server = 0 if me.join is Join.STORE else None  # else torchrun's agent serves it
    peers.watch(store, me.rank, server=server)
    watchdog.start(store, me.rank, me.world_size, server)
    _end_without_finalizing_after_errors()


def _end_without_finalizing_after_errors() -> None:
    """When an error ends the main thread while the process group lives, print it, run the exit handlers and end
    the process with status 1 at once. Finalizing the interpreter instead destroys gloo's threads while they are
    still joinable: `terminate called without an active exception` and SIGABRT (exit 134) in about one failing
    job in four on a loaded machine, so the launcher reported a crash instead of the error. A clean end goes
    through `shutdown`, which can wait for every rank; a failing rank cannot."""
    if getattr(sys.excepthook, "ends_process", False):
        return
    previous = sys.excepthook

    def report_and_end(kind, error, tb) -> None:
        previous(kind, error, tb)
        if not dist.is_initialized() or issubclass(kind, KeyboardInterrupt):  # Python ends those by SIGINT itself
            return
        atexit._run_exitfuncs()  # noqa: SLF001 - what finalizing would run first, and the only way to run it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    report_and_end.ends_process = True
    sys.excepthook = report_and_end


def log_to_stderr() -> None:
    """partita's INFO lines go to stderr as `partita: ...`, unless the application configured logging for the
    "partita" logger or PARTITA_LOG=off. Python drops INFO lines of a logger without a handler."""
    if log.handlers or not settings.log_enabled():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("partita: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _announce(me: Placement, backend: str) -> None:
    """One line on rank 0: what launched the job and its layout."""
    log_to_stderr()
    where = f" ({me.detail})" if me.detail else ""
    meet = f", rendezvous {me.address}" if me.address else ""
    log.info("launched by %s%s: %s, backend %s%s", me.launcher, where, me.layout(), backend, meet)


def _warn(ignored: list[str]) -> None:
    """On stderr even with PARTITA_LOG=off: Python prints a warning of a logger without a handler by itself."""
    log_to_stderr()
    for warning in ignored:
        log.warning("%s", warning)


def init() -> World:
    """Join the process group of this job (idempotent) and return this process's place in it.

    >>> import partita
    >>> w = partita.init()          # a single process when nothing launched us
    >>> (w.rank, w.world_size) == (partita.get_rank(), partita.get_world_size())
    True
    """
    global _world
    if _world is not None and dist.is_initialized():
        return _world
    ignored = settings.check()  # a bad value stops every rank here, before any collective
    me = detect(os.environ)
    if dist.is_initialized() and (me.world_size, me.rank) != (dist.get_world_size(), dist.get_rank()):
        # the script created the group itself: its ranks are the truth
        me = Placement("existing group", dist.get_rank(), dist.get_world_size(), 0, 1, join=Join.ADOPT)
    if torch.cuda.is_available():
        if me.join is Join.ADOPT:
            # no launcher says where this rank is on its node: the script that made the group chose its GPU
            # (torch.cuda.set_device before init_process_group, as NCCL needs); keep that one
            index = torch.cuda.current_device()
        else:
            index = gpus.gpu_of(me.local_rank, me.local_world_size, torch.cuda.device_count(),
                                os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("SLURM_GPUS_PER_TASK"))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _set_cpu_threads(me.local_world_size)
    backend = backend_for(device)
    if not dist.is_initialized():
        if me.join is Join.STORE and me.address is None:
            me = mpi.agree_address(me, os.environ)  # only mpirun leaves the address to be agreed
        _join(me, backend, device)
    _world = World(me.rank, me.world_size, me.local_rank, me.local_world_size, me.launcher, device, me.num_nodes)
    if me.rank == 0 and ignored:
        _warn(ignored)
    if me.rank == 0 and me.world_size > 1:
        _announce(me, dist.get_backend())  # an adopted group's own
    return _world


def world() -> World:
    return init()


def get_rank() -> int:
    """This process's rank in the job (0 when not distributed)."""
    return world().rank


def get_world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    return world().world_size


_before_barrier: list[Callable[[], None]] = []


def before_barrier(hook: Callable[[], None]) -> None:
    """Run `hook` in `barrier`, before it waits: once a model is parallelized, the call agreement, so that a rank
    in a barrier while another calls the model (`if rank == 0: partita.barrier()`) is an error on both at once."""
    if hook not in _before_barrier:
        _before_barrier.append(hook)


def barrier() -> None:
    """Wait until every rank reaches this point (once a model is parallelized: a PartitaError on every rank at
    once where another rank is in another collective call, such as a call of the model)."""
    if dist.is_initialized():
        for hook in _before_barrier:
            hook()
        dist.barrier()


_before_leaving: list[Callable[[], bool]] = []


def before_leaving(hook: Callable[[], bool]) -> None:
    """Run `hook` in `shutdown`, before its barrier. A hook returns False when ranks are not all leaving
    together (it told the others, which raise): then no rank would come to the barrier."""
    if hook not in _before_leaving:
        _before_leaving.append(hook)


def shutdown() -> None:
    """Leave the process group cleanly.

    Barrier, then collect garbage before `destroy_process_group`: gloo worker threads that still hold work
    objects at interpreter exit abort about one run in ten otherwise.
    """
    global _world
    watchdog.leave()
    if dist.is_initialized():
        if all([hook() for hook in _before_leaving]):
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
    _world = None
