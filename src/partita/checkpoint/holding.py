"""Which of a model's tensors this rank writes into a checkpoint, and which it reads back.

A rank's copy of a tensor is current only where the rank trains it:

- a partita model with a plan: the parameters of this rank's stages (every replica of a stage, and every
  stage that reads a tied weight, holds the same value after a step, since gradients are summed over
  exactly those ranks); buffers only on their owner (replicas take the first replica's BatchNorm
  statistics before each call, so the others are a step behind at save time);
- a partita model before its first call, or a plain module in a multi-process job: rank 0's copy (the first
  call starts every rank from rank 0's weights);
- torch's DistributedDataParallel: the same parameters on every rank, and rank 0's buffers (DDP broadcasts
  them from rank 0 before each forward). A one-stage partita plan follows the first rule, which amounts to
  the same.

Each rank offers every tensor it holds current and DCP picks one writer per tensor among them, balancing
bytes over ranks (`dedup_save_plans`): replicas share the writing instead of the first replica writing
alone. Loading reads the tensors the rank holds (`reads`): after the first call, those of its stages; before
it, the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from partita.plan.plan import Plan
from partita.runtime.run import Held, first_names


@dataclass(frozen=True)
class Holding:
    module: nn.Module  # the user's own module
    rank: int
    world_size: int
    plan: Plan | None
    writes: frozenset[str]  # state_dict names this rank's copy is current for
    reads: frozenset[str]  # state_dict names this rank loads
    trains: frozenset[str] | None  # parameters (canonical names) whose optimizer state lives here; None: all


@runtime_checkable
class Partitioned(Protocol):
    """A model whose ranks each hold part of it current: a partita model (`partita.parallelize`)."""

    module: nn.Module

    @property
    def plan(self) -> Plan | None: ...

    def held(self) -> Held | None: ...

    def loss_scale_state(self) -> dict | None:
        """float16's dynamic loss scale as a checkpoint keeps it (`LossScale.state_dict`); None where there is
        none to keep."""
        ...

    def load_loss_scale_state(self, state: dict | None) -> None:
        """Go on from a loss scale a checkpoint kept; None (it kept none) starts the scale over."""
        ...

    def resume_from(self, checkpoint: Path) -> None:
        """Take the weights from this checkpoint (a step-* directory) as the first call materializes them, and
        the optimizer state once they exist (a model built on the meta device, loaded before its first call)."""
        ...


def holding_of(model: nn.Module) -> Holding:
    """This rank's part in a checkpoint of `model` (a partita model, a DDP module or a plain module)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    held = model.held() if isinstance(model, Partitioned) else None
    if isinstance(model, (Partitioned, DistributedDataParallel)):
        module, plan = model.module, getattr(model, "plan", None)
    else:
        module, plan = model, None
    every = frozenset(module.state_dict(keep_vars=True))
    reads = every
    if held is not None:
        writes, trains, reads = held.writes, held.trains, held.reads
    elif isinstance(model, DistributedDataParallel):
        names = first_names(module)
        writes = frozenset(n for n, t in module.state_dict(keep_vars=True).items() if id(t) in names or rank == 0)
        trains = None
    else:
        writes = every if rank == 0 else frozenset()
        trains = None
    return Holding(module, rank, world, plan, writes, reads, trains)
