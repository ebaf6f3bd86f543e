"""Steps that every rank takes together, so that a problem found on one rank stops all of them at once.

A rank that raised alone would leave the others waiting in the next collective until the process-group
timeout; here each step's outcome is exchanged, and every rank raises the same CheckpointError. The exchange is
a statement of the runtime's agreement (`agreement.state_step`), the same kind of collective as a model call's:
a rank that meets another in a model call, or in another step, raises the same PartitaError at once.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from partita.errors import CheckpointError, PartitaError, RankError
from partita.runtime import agreement

T = TypeVar("T")


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _raise_for(problems: list[RankError | None], what: str, cause: BaseException | None) -> None:
    """One CheckpointError naming each failing rank's cause (ranks that failed alike together)."""
    failed = sorted((p for p in problems if p is not None), key=lambda p: p.rank)
    if not failed:
        return
    if not _distributed():
        raise CheckpointError(f"{what}: {failed[0].message}") from cause
    by_text: dict[str, list[int]] = {}
    for p in failed:
        by_text.setdefault(p.message, []).append(p.rank)
    detail = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {t}" for t, r in by_text.items())
    raise CheckpointError(f"{what}: {detail}") from cause


def _attempt(step: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return step(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by the caller
        return None, e


def _all_gather(value) -> list:
    if not _distributed():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def together(step: Callable[[], T], what: str) -> T:
    """Run `step` on every rank; if it failed anywhere, raise the same CheckpointError everywhere."""
    result, problem = _attempt(step)
    _raise_for(agreement.state_step(what, problem), what, problem)
    return result


def stop_asked_anywhere(asked: bool) -> bool:
    """Whether any rank was asked to stop (signals may reach only some ranks), at partita.elastic's check between
    two steps, which every rank takes: a rank elsewhere (it left the loop) is an error on every rank at once."""
    return agreement.any_rank_says(agreement.STOP_CHECK, asked)


def every_rank(step: Callable[[], T], what: str) -> list[T]:
    """Run `step` on every rank; every rank gets every rank's result (picklable, in rank order), or the same
    CheckpointError if it failed anywhere."""
    return _all_gather(together(step, what))


def from_rank0(step: Callable[[], T], what: str) -> T:
    """Run `step` on rank 0 only; every rank gets its result, or raises its error."""
    result, problem = _attempt(step) if not _distributed() or dist.get_rank() == 0 else (None, None)
    _raise_for(agreement.state_step(what, problem), what, problem)
    message = [result]
    if _distributed():
        dist.broadcast_object_list(message, src=0)
    return message[0]


def dcp_step(step: Callable[[], T], what: str, hint: str) -> T:
    """Run a torch.distributed.checkpoint call; its failures (which DCP already reports to every rank) become
    one CheckpointError naming each rank's cause, with `hint` (what to do) after causes partita did not name."""
    try:
        with warnings.catch_warnings():
            # DCP warns whenever it runs without a process group; partita asks for that on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return step()
    except CheckpointException as e:
        _raise_for([_dcp_cause(rank, exc, hint) for rank, (exc, _) in e.failures.items()], what, None)
        raise


def _dcp_cause(rank: int, exc: BaseException, hint: str) -> RankError:
    """A rank's cause of a DCP failure, with `hint` after a cause partita did not name."""
    cause = RankError.of(rank, exc)
    return cause if isinstance(exc, PartitaError) else dataclasses.replace(cause, message=f"{cause.message}. {hint}")
