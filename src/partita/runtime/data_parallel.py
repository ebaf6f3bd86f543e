"""A one-stage, one-micro-batch plan: the user's module under torch's DistributedDataParallel.

The loss is that of the global batch (`batch.global_loss`): each rank's mean weighed by its rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.nn.parallel import DistributedDataParallel

from partita.capture.export import CapturedGraph
from partita.plan.plan import Plan
from partita.runtime import agreement
from partita.runtime.groups import MadeGroups
from partita.runtime.batch import Call, Loss, checked_loss, global_loss, rows_combination
from partita.runtime.ownership import Ownership
from partita.runtime.precision import as_captured, autocast
from partita.runtime.run import Runtime, as_trained


class DataParallel(Runtime):
    same_shapes = False
    split_gradients = False

    def __init__(self, module: nn.Module, cap: CapturedGraph, plan: Plan, ownership: Ownership, *, loss: Loss | None,
                 rank: int, world_size: int, device: torch.device, made: MadeGroups):
        super().__init__(module, plan, ownership, rank, device, made)
        self.loss = loss
        self.world_size = world_size
        self.cap = cap
        self.ddp = module if world_size == 1 else _ddp(module, cap)
        self._params = list(module.parameters())  # listed once: walking the modules per call costs more
        self._trained = _trained(self._params)  # DDP sums the gradients of the parameters that required grad then
        # the ranks agree on a call during its forward, and wait for it before any collective after it (the loss's,
        # the backward's), unless DDP's forward has a collective of its own: a rank whose call differs would join
        # another collective first
        self.agrees_before_forward = isinstance(self.ddp, DistributedDataParallel) and self.ddp.broadcast_buffers \
            and any(True for _ in module.buffers())
        # outputs leave in the captured graph's dtypes, as a pipeline's do (precision.py); in fp32 they are
        self.out_dtypes = None if plan.precision == "fp32" else \
            [o.meta["val"].dtype if isinstance(o, fx.Node) else None for o in cap.outputs]

    def __call__(self, call: Call):
        if self.world_size > 1 and _trained(self._params) != self._trained:
            # a parameter was unfrozen (or frozen) since: a new DDP sums the gradients of those trained now; the
            # old one's hooks go with it. Every rank changes requires_grad at the same call, and DDP's making is
            # collective
            unused = self.ddp.find_unused_parameters
            self._trained, self.ddp = _trained(self._params), None
            self.ddp = _ddp(self.module, self.cap, unused=unused)
        if self.agrees_before_forward:
            call.rows  # noqa: B018 - waits for the agreement of the call: DDP's forward broadcasts buffers
        args, kwargs = call.args, call.kwargs
        if self.loss is not None and self.world_size > 1:
            # the loss gives this rank's value DDP's world size times its weight (global_loss), which DDP's
            # average takes back from the parameters' gradients but not from the inputs'
            args, kwargs = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda t: _GradientTimes.apply(t, 1.0 / self.world_size) if t.requires_grad else t,
                (args, kwargs))
        try:
            with autocast(self.plan.precision, self.device):
                out = self.ddp(*args, **kwargs)
                # under autocast too, as a one-process loop computes it (precision.py)
                value = self.loss.fn(out, call.target) if self.loss is not None else None
                check = self.loss is not None and not self.loss.checked and self.world_size > 1
                found = rows_combination(self.loss.fn, out, call.target, value) if check else None
        except Exception as e:
            agreement.failed_alone(e)
            raise
        rows = call.rows
        if check:
            self.loss = checked_loss(self.loss, found, self.device)
        if self.loss is None:
            result = torch.utils._pytree.tree_map(
                lambda t: global_loss(t, "mean", rows) if isinstance(t, torch.Tensor) and t.dim() == 0 else t,
                as_captured(out, self.out_dtypes))
        else:
            result = global_loss(value, self.loss.reduction, rows)
        return self.loss_scale.scaling(result) if self.loss_scale is not None else result

    def settle_buckets(self, call: Call) -> None:
        """One throwaway forward and backward through DDP, whose effects are undone (gradients, buffers, random
        streams). torch's DDP sums its first backward in one bucket in parameter order, then re-buckets in the
        order the gradients became ready. Settled here, every step of every process sums in the same buckets,
        the first step after a restart from a checkpoint included: resumed training then computes bit for bit
        what uninterrupted training would have."""
        if not isinstance(self.ddp, DistributedDataParallel):
            return
        if not self.ddp.find_unused_parameters and self._unreached_anywhere(call):
            self.ddp = _ddp(self.module, self.cap, unused=True)
        if self.ddp.find_unused_parameters:
            return  # no re-bucketing then
        with self._undone():
            out = self.ddp(*call.args, **call.kwargs)
            leaves = _requiring_grad(out)
            if leaves:
                (sum(t.sum() for t in leaves) * 0.0).backward()

    def _unreached_anywhere(self, call: Call) -> bool:
        """Whether, on any rank, a trained parameter has no path to the outputs in this call's autograd graph: a
        value that reaches them only detached, or through an argmax. The captured graph reads it, but DDP, waiting
        for its gradient, would never finish the backward's reduction (the previous step's gradients left unsummed,
        then torch's advice of an option partita sets). The loss is not computed: the user's loss_fn runs once per
        call, as in one process."""
        try:
            with self._undone(), autocast(self.plan.precision, self.device):
                reached = _reached_parameters(_requiring_grad(self.module(*call.args, **call.kwargs)))
            found = any(p.requires_grad and id(p) not in reached for p in self._params)
        except Exception:  # noqa: BLE001 - the call itself raises it where it fails; here it tells nothing
            found = False
        unreached = torch.tensor([float(found)], device=self.device)
        dist.all_reduce(unreached, op=dist.ReduceOp.MAX)
        return bool(unreached.item())

    @contextlib.contextmanager
    def _undone(self):
        """A throwaway run of the model: its gradients, buffers and random streams as they were after it."""
        grads = [(p, p.grad) for p in self.module.parameters()]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), as_trained(self.module), torch.enable_grad():
            yield
        with torch.no_grad():
            for p, grad in grads:
                p.grad = grad
            for b, value in buffers:
                b.copy_(value)


def _requiring_grad(out) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _reached_parameters(roots: list[torch.Tensor]) -> set[int]:
    """ids of the tensors whose gradients a backward from `roots` accumulates."""
    reached, seen = set(), set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's gradient
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _trained(params: list[nn.Parameter]) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in params)


class _GradientTimes(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, factor: float):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _ddp(module: nn.Module, cap: CapturedGraph, unused: bool = False) -> DistributedDataParallel:
    """torch's DDP over `module`, finding the parameters without a gradient at each backward where some may have
    none (`unused`: some had none in the first call's autograd graph, `DataParallel._unreached_anywhere`)."""
    used = {cap.fqn_of[n] for n in cap.parameters}
    # routing by value (a mixture of experts): eager code may skip an expert no row of this rank reaches
    unused = unused or cap.routes_by_value() or any(p.requires_grad and n not in used
                                                    for n, p in module.named_parameters())
    return DistributedDataParallel(module, find_unused_parameters=unused)
