"""Mixed precision (the plan's `precision`): stages compute in bfloat16 or float16 under torch.autocast, with the
float32 weights and optimizer state the model has as the master copy.

Why autocast rather than low-precision copies of the parameters (FSDP2's MixedPrecisionPolicy): it keeps no
second copy of the weights between steps, works alike for DDP, pipelines and sharding, and computes what the
user's own one-process loop under `torch.autocast` computes, the reference partita's fidelity is held to.

Values crossing between stages keep the dtypes of the captured graph (float32): each stage's outputs are cast
back at its end, so receive buffers, the gradients sent back and the loss are those of the captured model
(bfloat16 -> float32 -> bfloat16 loses nothing). The backward runs outside autocast, as torch advises; autograd
replays the forward's casts.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch import nn

from partita.errors import PlanError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# precisions refused until partita scales the loss: float16's range is too narrow for gradients unscaled
UNSCALED = ("fp16",)


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
    if precision in UNSCALED:
        raise PlanError(f"precision={precision!r} needs dynamic loss scaling, which this partita version does not "
                        "have yet (float16 gradients would underflow silently): use precision='bf16', which needs "
                        "none, or 'fp32'.")
    try:
        with autocast(precision, device):
            torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
    except RuntimeError as e:
        raise PlanError(f"precision={precision!r}: this {device.type} device cannot compute in "
                        f"{DTYPES[precision]} under torch.autocast ({e}). Use precision='fp32'"
                        f"{'' if precision == 'bf16' else ' or bf16'}.") from None


def as_captured(values, dtypes: list[torch.dtype | None]):
    """A stage's outputs (a tensor or a tuple of them) cast back to the dtypes the captured graph gives them."""
    leaves, spec = pytree.tree_flatten(values)
    cast = [v.to(d) if isinstance(v, torch.Tensor) and d is not None and v.is_floating_point() and v.dtype != d
            else v for v, d in zip(leaves, dtypes + [None] * (len(leaves) - len(dtypes)))]
    return pytree.tree_unflatten(cast, spec)


class LowPrecision(nn.Module):
    """A stage computed under autocast whose outputs leave it in the captured graph's dtypes."""

    def __init__(self, stage: nn.Module, precision: str, device: torch.device, out_dtypes: list[torch.dtype]):
        super().__init__()
        self.stage, self.precision, self.device, self.out_dtypes = stage, precision, device, out_dtypes

    def forward(self, *args):
        with autocast(self.precision, self.device):
            out = self.stage(*args)
        return as_captured(out, self.out_dtypes)
