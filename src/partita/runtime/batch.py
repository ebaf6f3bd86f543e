"""The global batch of a call: each rank's rows, and a loss over all of them.

Each rank passes its own local batch; the global batch is the ranks' local batches concatenated in rank order.
Under data parallelism the local batches may differ in size (a last short batch): each rank's mean is then
weighed by its rows, so that the loss and the gradients are those of the global batch, not a mean of means.
"""

from __future__ import annotations

import dataclasses
import logging
import math
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


def check_first_rows(rows: tuple[int, ...]) -> None:
    """The model's first call, which partita captures and plans from, has rows (`rows`: each rank's)."""
    if not sum(rows):
        raise BatchError(f"the model's first call has 0 rows on every rank ({len(rows)}): partita plans the layout for "
                         "the first call's global batch, and an empty one has nothing to split into micro-batches "
                         "or weigh. Make the first call with a batch of rows; a later call may pass 0 rows on some "
                         "ranks under a data-parallel plan (a last short batch)")


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
    if rows[rank] == 0 and reduction == "mean":
        # a mean over no rows is NaN, and NaN x 0 stays NaN: this rank adds nothing to the global batch's loss
        value = value.nan_to_num(0.0)
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
    declared: bool = True  # loss_fn's own `reduction` says it (a plain function does not: taken as a mean)
    checked: bool = False  # the first call that combines showed whether its values combine rows so (`checked_loss`)


def loss_of(loss_fn: Callable | None) -> Loss | None:
    """`loss_fn` as partita uses it (None: the user computes the loss from the outputs)."""
    if loss_fn is None:
        return None
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is None:
        return Loss(loss_fn, "mean", declared=False)
    if reduction not in ("mean", "sum"):
        raise PlanError(f"loss_fn has reduction={reduction!r}; partita needs 'mean' or 'sum' to combine "
                        "micro-batch losses into the batch loss")
    return Loss(loss_fn, reduction)


COMBINATIONS = ("mean", "sum", "neither")  # what `rows_combination` may find, in the order `checked_loss` sends them
ROWS_RTOL = 1e-4  # relative: float32 sums of the same rows in another order differ by about 1e-6


def rows_combination(loss_fn: Callable, out, target: torch.Tensor, whole: torch.Tensor) -> str | None:
    """How `loss_fn` combines the rows of this batch, from its value on the batch (`whole`, as the call computed
    it) and on each half, computed likewise (the caller's autocast; without gradients, on views of the outputs,
    with the random streams as they were): "mean", "sum", "neither" (e.g. a mean over the tokens that
    ignore_index keeps, or class weights), or None where this batch cannot tell (one row, a loss of 0, outputs
    whose dim 0 is not the rows, a loss_fn that refuses half the rows)."""
    rows = target.shape[0] if isinstance(target, torch.Tensor) and target.dim() else 0
    leaves = [t for t in torch.utils._pytree.tree_leaves((out, target)) if isinstance(t, torch.Tensor)]
    if rows < 2 or any(t.dim() == 0 or t.shape[0] != rows for t in leaves):
        return None
    half = rows // 2
    values = [whole]
    try:
        devices = [target.device.index or 0] if target.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for start, stop in ((0, half), (half, rows)):
                args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach()[start:stop],
                                                         (out, target))
                values.append(loss_fn(*args))
    except Exception:  # noqa: BLE001 - a loss that cannot take half the rows tells nothing; the call itself goes on
        return None
    if any(not isinstance(v, torch.Tensor) or v.numel() != 1 or not v.is_floating_point() for v in values):
        return None
    # outputs or a loss in bfloat16 or float16 round what the three values are made of
    floats = [t.dtype for t in leaves + values if t.is_floating_point()]
    rtol = max(ROWS_RTOL, *(4 * torch.finfo(dtype).eps for dtype in floats))
    whole_s, first, second = (float(v.detach()) for v in values)
    scale = max(abs(whole_s), abs(first), abs(second))
    if not math.isfinite(scale) or scale == 0.0:
        return None
    as_mean = abs(whole_s - (half * first + (rows - half) * second) / rows) <= rtol * scale
    as_sum = abs(whole_s - (first + second)) <= rtol * scale
    if as_mean and as_sum:
        return None
    return "mean" if as_mean else "sum" if as_sum else "neither"


def checked_loss(loss: Loss, found: str | None, device: torch.device) -> Loss:
    """`loss` once every rank showed how it combines rows on the first call that combines (`found`: this rank's
    `rows_combination`, None where it computed none or could not tell). partita combines the losses of
    micro-batches and ranks by rows: a plain function takes what its values show; a loss that says one reduction
    and shows the other would be off by the micro-batches times the replicas, an error on every rank; one that
    is neither a mean nor a sum over rows differs from one process's loss, which the log says."""
    flags = torch.tensor([float(found == kind) for kind in COMBINATIONS], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    seen = {kind for kind, flag in zip(COMBINATIONS, flags.tolist()) if flag}
    name = getattr(loss.fn, "__name__", type(loss.fn).__name__)
    speaks = not dist.is_initialized() or dist.get_rank() == 0
    if "neither" in seen or len(seen) > 1:
        if speaks:
            log.warning("partita: loss_fn %s is not a %s over the batch's rows (its value on a batch differs from "
                        "the %s of its values on the two halves%s): partita computes it per micro-batch and per "
                        "rank and combines those by rows, so the loss and the gradients differ from one process's "
                        "on the whole batch (as DDP's do). For one process's: reduction='sum', divided by a count "
                        "that does not depend on how the batch is split (e.g. the global batch's tokens)", name,
                        loss.reduction, loss.reduction, ", on some ranks" if len(seen) > 1 else "")
        return dataclasses.replace(loss, checked=True)
    if not seen:
        if not loss.declared and speaks:
            log.warning("partita: loss_fn %s has no `reduction`, and its values on the first batch could not tell: "
                        "partita takes it as a mean over rows. If it sums, set loss_fn.reduction = 'sum' before "
                        "parallelize() (a function is an object: the attribute sticks)", name)
        return dataclasses.replace(loss, checked=True)
    (shown,) = seen
    if loss.declared and shown != loss.reduction:
        raise PlanError(f"loss_fn {name} has reduction={loss.reduction!r}, but its values are a {shown} over the "
                        f"batch's rows (its value on a batch is the {shown} of its values on the two halves): "
                        f"partita would combine the micro-batches' and ranks' losses as a {loss.reduction}, off by "
                        f"their number. Set loss_fn.reduction = {shown!r} before parallelize()")
    if not loss.declared and speaks:
        log.info("partita: loss_fn %s has no `reduction`; its values on the first batch are a %s over rows, and "
                 "partita combines micro-batches and ranks so", name, shown)
    return dataclasses.replace(loss, reduction=shown, checked=True)


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
