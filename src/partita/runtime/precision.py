"""Mixed precision (the plan's `precision`): stages compute in bfloat16 or float16 under torch.autocast, with the
float32 weights and optimizer state the model has as the master copy. float16 scales the loss dynamically
(`LossScale`), as torch.amp.GradScaler does, with one decision for all ranks.

Why autocast rather than low-precision copies of the parameters (FSDP2's MixedPrecisionPolicy): it keeps no
second copy of the weights between steps, works alike for DDP, pipelines and sharding, and computes what the
user's own one-process loop under `torch.autocast` computes, the reference partita's fidelity is held to.

Values crossing between stages keep the dtypes of the captured graph (float32): each stage's outputs are cast
back at its end, so receive buffers and the gradients sent back are those of the captured model (bfloat16 ->
float32 -> bfloat16 loses nothing). The loss partita computes (`loss_fn`) runs under autocast on the last
stage's outputs as they are, as a one-process loop under `torch.autocast` computes it: cross entropy then reads
bfloat16 logits and computes in float32 (reading them cast to float32 first made GPT-2's bf16 step on an H200
2 ms of 41 slower: the log-softmax's passes over 8 x 1024 x 50257 values in float32). Outputs returned to the
user leave in the captured graph's dtypes. The backward runs outside autocast, as torch advises; autograd
replays the forward's casts.
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from partita.errors import PlanError
from partita.plan.plan import PRECISION_DTYPES
from partita.runtime.state import local_part

# the dtypes autocast computes in (float32 needs none)
DTYPES = {p: getattr(torch, name) for p, name in PRECISION_DTYPES.items() if p != "fp32"}
SCALED = ("fp16",)  # float16's range is too narrow for gradients: its loss is scaled
# torch.amp.GradScaler's defaults: start high, halve on an overflow, double after this many clean steps
INITIAL_LOSS_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000

log = logging.getLogger("partita")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a stage's forward runs in."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def check_precision(precision: str, device: torch.device) -> None:
    """A precision this device computes in, or a PlanError saying why not."""
    if precision == "fp32":
        return
    if precision not in DTYPES:
        raise PlanError(f"unknown precision {precision!r}; choose one of fp32, {', '.join(DTYPES)}")
    try:
        with autocast(precision, device):
            torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
    except RuntimeError as e:
        raise PlanError(f"precision={precision!r}: this {device.type} device cannot compute in "
                        f"{DTYPES[precision]} under torch.autocast ({e}). Use precision='fp32'"
                        f"{'' if precision == 'bf16' else ' or bf16'}.") from None


def as_captured(values, dtypes: list[torch.dtype | None] | None):
    """A stage's outputs (a tensor or a tuple of them) cast back to the dtypes the captured graph gives them;
    as they are where `dtypes` is None (a loss follows under autocast)."""
    if dtypes is None:
        return values
    leaves, spec = pytree.tree_flatten(values)
    cast = [v.to(d) if isinstance(v, torch.Tensor) and d is not None and v.is_floating_point() and v.dtype != d
            else v for v, d in zip(leaves, dtypes + [None] * (len(leaves) - len(dtypes)))]
    return pytree.tree_unflatten(cast, spec)


class LowPrecision(nn.Module):
    """A stage computed under autocast whose outputs leave it in the captured graph's dtypes."""

    def __init__(self, stage: nn.Module, precision: str, device: torch.device,
                 out_dtypes: list[torch.dtype] | None):
        super().__init__()
        self.stage, self.precision, self.device, self.out_dtypes = stage, precision, device, out_dtypes

    def forward(self, *args):
        with autocast(self.precision, self.device):
            out = self.stage(*args)
        return as_captured(out, self.out_dtypes)


class LossScale:
    """float16's dynamic loss scale, the same on every rank. The backward runs on the loss times `scale`, so
    that small gradients survive in float16. Parameter gradients stay scaled until the optimizer's step divides
    them, once per step as torch.amp.GradScaler unscales: what partita reads of them before (its gradient norm,
    get_param_grad) is divided as it is read (`unscaled`), so that a backward accumulating after a read adds
    onto gradients that carry the same scale as its own. When any rank's gradients overflowed, every rank
    skips that optimizer step, the scale halves and the log says so; after GROWTH_INTERVAL clean steps it
    doubles. Gradients of the inputs stay scaled, as with torch.amp.GradScaler."""

    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.params, self.device = params, device
        self.scale = INITIAL_LOSS_SCALE
        self.clean_steps = 0
        self._taken_from: tuple[torch.optim.Optimizer, object] | None = None  # `take_over_step`'s
        self.scaled = False  # .grad holds gradients of the scaled loss

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it: the scale and the clean steps counted toward its next doubling."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict | None) -> None:
        """Go on from a `state_dict()`; None (a checkpoint that has none) starts over, as a new job does."""
        self.scale, self.clean_steps = ((state["scale"], state["clean_steps"]) if state is not None
                                        else (INITIAL_LOSS_SCALE, 0))

    def scaling(self, value):
        """`value` (any structure of tensors), whose gradients are multiplied by the scale on their way back."""
        return pytree.tree_map_only(torch.Tensor, lambda t: _Scaled.apply(t, self) if t.requires_grad else t,
                                    value)

    def unscaled(self, value: torch.Tensor) -> torch.Tensor:
        """`value`, read off the gradients held now, as the loss itself gives it (a new tensor when they are
        scaled; the scale is a power of two, so dividing is exact, as the step's own division is)."""
        return value / self.scale if self.scaled else value

    def unscale(self) -> None:
        if not self.scaled:
            return
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.scale)
        self.scaled = False

    def take_over_step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step() unscales first, and is skipped on every rank when any rank's gradients overflowed
        (until `give_back_step`)."""
        own_step = optimizer.step
        # the instance's own step (someone patched it before), or none: the class's
        self._taken_from = (optimizer, own_step if "step" in vars(optimizer) else None)

        def step(opt, *args, **kwargs):
            self.unscale()
            if self._overflowed():
                log.warning("partita: float16 gradients overflowed at loss scale %g: every rank skips this "
                            "optimizer step; the scale is now %g", self.scale, self.scale / 2)
                self.scale /= 2
                self.clean_steps = 0
                return None
            self.clean_steps += 1
            if self.clean_steps == GROWTH_INTERVAL:
                self.scale *= 2
                self.clean_steps = 0
            return own_step(*args, **kwargs)

        optimizer.step = types.MethodType(step, optimizer)

    def give_back_step(self) -> None:
        """The optimizer's step as it was before `take_over_step`: a runtime that hands the model to another (a
        layout switch) leaves no scale of its own in the chain of the next one's step."""
        if self._taken_from is None:
            return
        optimizer, own_step = self._taken_from
        if own_step is None:
            del optimizer.step
        else:
            optimizer.step = own_step
        self._taken_from = None

    def _overflowed(self) -> bool:
        # checked on the device, read once: a read per parameter would wait for the device as many times
        finite = [torch.isfinite(local_part(p.grad)).all() for p in self.params if p.grad is not None]
        flag = (~torch.stack(finite)).any().float().reshape(1) if finite else torch.zeros(1)
        flag = flag.to(self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class _Scaled(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by the loss scale (and notes that it did)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, loss_scale: LossScale):
        ctx.loss_scale = loss_scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.loss_scale.scaled = True
        return grad * ctx.loss_scale.scale, None
