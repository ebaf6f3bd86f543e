"""Join the job's process group from whatever launched this process.

`init()` reads the launcher's environment (torchrun / torch.distributed.launch today), picks the backend
(gloo on CPU, nccl on CUDA with the device from LOCAL_RANK) and creates the default process group with a
bounded timeout, so that a dead peer ends the job instead of hanging it.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from partita.errors import LaunchError

log = logging.getLogger("partita")

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class World:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    device: torch.device


_world: World | None = None


def timeout() -> timedelta:
    """Process-group timeout: PARTITA_TIMEOUT_S seconds (default 300)."""
    return timedelta(seconds=float(os.environ.get("PARTITA_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def _detect() -> tuple[int, int, int, int, str]:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return rank, world, local_rank, local_world, launcher
    return 0, 1, 0, 1, "single"


def _set_cpu_threads(local_world_size: int) -> None:
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


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
    rank, world_size, local_rank, local_world, launcher = _detect()
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
        _set_cpu_threads(local_world)
    if world_size == 1 and not dist.is_initialized():
        # a one-rank group, so that pipelines and collectives need no special case for one process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout())
    if world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
                raise LaunchError(
                    f"{var} is not set, but RANK/WORLD_SIZE say this is rank {rank} of {world_size}. "
                    "Launch with `partita run -n N script.py` or `torchrun --nproc-per-node N script.py`, "
                    "which set it for you."
                )
        try:
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=timeout(),
                device_id=device if backend == "nccl" else None,
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the cause attached
            raise LaunchError(
                f"rank {rank} of {world_size} could not join the process group at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({e}). "
                "Check that every rank was started with the same WORLD_SIZE and MASTER_ADDR/PORT."
            ) from e
    _world = World(rank, world_size, local_rank, local_world, launcher, device)
    if rank == 0 and world_size > 1:
        log.info("partita: %s launch, %d ranks, backend %s", launcher, world_size, backend)
    return _world


def world() -> World:
    return init()


def get_rank() -> int:
    """This process's rank in the job (0 when not distributed)."""
    return world().rank


def get_world_size() -> int:
    """Number of processes in the job (1 when not distributed)."""
    return world().world_size


def barrier() -> None:
    """Wait until every rank reaches this point."""
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group cleanly.

    Barrier, then collect garbage before `destroy_process_group`: gloo worker threads that still hold work
    objects at interpreter exit abort about one run in ten otherwise.
    """
    global _world
    if dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
    _world = None
