"""The global batch of a call: each rank's rows, and a loss over all of them.

Each rank passes its own local batch; the global batch is the ranks' local batches concatenated in rank order.
Under data parallelism the local batches may differ in size (a last short batch): each rank's mean is then
weighed by its rows, so that the loss and the gradients are those of the global batch, not a mean of means.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita.capture.export import CallSignature, Modes
from partita.errors import BatchError, PlanError
from partita.runtime.agreement import Agreement

log = logging.getLogger("partita")


def local_rows(tensors: list[torch.Tensor]) -> int:
    """The rows of this rank's batch: every tensor input's size in dim 0, which must be the same."""
    rows = {t.shape[0] for t in tensors}
    if len(rows) > 1:
        raise BatchError(f"the tensor inputs have different sizes in dim 0 ({sorted(rows)}); partita splits "
                         "every tensor input along dim 0 as the batch, so they must all have the same size")
    return rows.pop() if rows else 0


def global_loss(value: torch.Tensor, reduction: str, rows: tuple[int, ...]) -> torch.Tensor:
    """The global batch's loss from each rank's `value` (a mean over its `rows[rank]` rows, or a sum), the same
    on every rank, with a gradient such that DDP's average of the ranks' gradients is the global batch's.

    A mean weighs rank r by rows[r] / sum(rows); DDP divides every gradient by the world size W, so rank r's
    own value gets the gradient W * rows[r] / sum(rows) (1 when all ranks pass the same rows). A sum adds the
    ranks' values and each gets the gradient W."""
    world = len(rows)
    if world == 1:
        return value
    rank = dist.get_rank()
    uneven = len(set(rows)) > 1
    total = value.detach().clone()
    if reduction == "mean" and uneven:
        total = total * rows[rank]
    dist.all_reduce(total)
    if reduction == "sum":
        weight = float(world)
    elif uneven:
        total, weight = total / sum(rows), world * rows[rank] / sum(rows)
    else:
        total, weight = total / world, 1.0
    mine = value * weight if weight != 1.0 else value
    return mine + (total - mine).detach()


@dataclass(frozen=True)
class Loss:
    """The user's loss function, with how it combines rows: partita computes the loss itself with it."""

    fn: Callable
    reduction: str  # "mean" or "sum"


def loss_of(loss_fn: Callable | None) -> Loss | None:
    """`loss_fn` as partita uses it (None: the user computes the loss from the outputs)."""
    if loss_fn is None:
        return None
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None:
        # a plain function says nothing of how it combines rows; a sum taken for a mean would be silently off by
        # the micro-batches times the replicas
        reduction = "mean"
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("partita: loss_fn %s has no `reduction`: partita takes it as a mean over rows. If it "
                        "sums, set loss_fn.reduction = 'sum' (a function is an object: the attribute sticks)",
                        getattr(loss_fn, "__name__", type(loss_fn).__name__))
    if reduction not in ("mean", "sum"):
        raise PlanError(f"loss_fn has reduction={reduction!r}; partita needs 'mean' or 'sum' to combine "
                        "micro-batch losses into the batch loss")
    return Loss(loss_fn, reduction)


@dataclass(frozen=True)
class Call:
    """One call of the parallelized model, as every rank agreed on it."""

    args: tuple  # the model's inputs (the target split off)
    kwargs: dict
    tensors: list[torch.Tensor]  # the tensors among them, flattened
    signature: CallSignature
    target: torch.Tensor | None  # with a loss function: what the loss compares the outputs to
    modes: Modes  # the model's modules' train/eval modes at this call
    agreement: Agreement  # with every rank on this call, under way

    @property
    def rows(self) -> tuple[int, ...]:
        """Every rank's local rows, once every rank agreed on the call: until the first read, a rank may compute
        but must join no other collective (`agreement.Agreement`)."""
        return self.agreement.rows()


def sizes_beyond_batch(call: Call) -> tuple[tuple[int, ...], ...]:
    """Each tensor input's, and the target's, sizes beyond the batch dimension: data parallelism lets them differ
    between ranks and calls (each rank pads its own sequences), partita's pipelined runtime does not."""
    return tuple(tuple(t.shape[1:]) for t in call.tensors + ([call.target] if call.target is not None else []))


def split_target(args: tuple, kwargs: dict, *, with_loss: bool) -> tuple[tuple, torch.Tensor | None,
                                                                          BatchError | None]:
    """(inputs, target, problem): with a loss function, the last positional argument is the target."""
    if not with_loss:
        return args, None, None
    if not args or len(args) + len(kwargs) < 2:
        return args, None, BatchError(
            "this model was parallelized with loss_fn, so every call is model(*inputs, target) and returns the "
            "loss; to get outputs, parallelize without loss_fn")
    *inputs, target = args
    if not isinstance(target, torch.Tensor):
        return tuple(inputs), None, BatchError(
            f"the target (last positional argument) must be a tensor, got {type(target).__name__}")
    return tuple(inputs), target, None
