"""How fast the job's own optimizer steps, in bytes of parameters per second: one step of its class with its
hyper-parameters, timed over probe parameters on the device.

A model of the step from the bytes it must move (read weights, gradients and state; write weights and state)
misses how torch runs it, a kernel (foreach, or one per tensor) per term: Adam's step took as long as about 22
passes over memory the size of the parameters on an H200 (foreach; 10 GB in 50 ms) and 14 on this project's
CPU machine (one tensor at a time), SGD with momentum 6, where the bytes it must move are 7 and 5. Timing the step itself holds for every optimizer and
implementation (foreach, fused, one tensor at a time). An optimizer whose class cannot be made again from
its defaults (a constructor taking other arguments) is not measured: the planner then models its step.

The probe has the model's parameter bytes (within PROBE_BYTES_RANGE) in tensors of the model's mean size, so
that what the step costs per tensor counts as in the model; on a CPU each step starts out of cache, as in
training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from partita.profile.block_times import cold_median_seconds, median_seconds

PROBE_BYTES_RANGE = (64 * 2**10, 64 * 2**20)
STEPS = 5  # timed steps on a CPU, after one that creates the optimizer's state; the median is kept


@dataclass(frozen=True)
class OptimizerKind:
    """The job's optimizer as measuring needs it: how to make another of its kind, and what names that kind."""

    description: str  # its class and hyper-parameters: what a measured rate is cached under
    new: Callable[[list[torch.Tensor]], torch.optim.Optimizer]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer | None) -> OptimizerKind | None:
        """The kind of `optimizer`: its class, made with those of its defaults that its constructor takes (one
        group's hyper-parameters; another group's differ little in cost per byte; AdamW's defaults hold a
        `decoupled_weight_decay` that its constructor sets itself). None without one."""
        if optimizer is None:
            return None
        kind = type(optimizer)
        takes = inspect.signature(kind).parameters
        defaults = {k: v for k, v in optimizer.defaults.items()
                    if k in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())}
        return cls(f"{kind.__module__}.{kind.__qualname__} {sorted(defaults.items())}",
                   lambda params: kind(params, **defaults))


def optimizer_rate(kind: OptimizerKind, param_bytes: int, param_tensors: int, device: torch.device) -> float:
    """Bytes of float32 parameters per second that an optimizer of `kind` steps, over a probe like the model's
    `param_bytes` in `param_tensors` tensors; 0.0 where none of its kind can be made from its defaults."""
    low, high = PROBE_BYTES_RANGE
    probe_bytes = min(max(int(param_bytes), low), high)
    tensors = max(1, min(param_tensors, round(param_tensors * probe_bytes / max(param_bytes, 1))))
    numel = max(1, probe_bytes // 4 // tensors)
    generator = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, device=device, generator=generator)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, device=device, generator=generator) * 1e-3
    try:
        optimizer = kind.new(params)
    except TypeError:
        return 0.0
    with torch.no_grad():
        optimizer.step()  # the first step creates the state (Adam's moments)
        step_s = (median_seconds(optimizer.step, device) if device.type != "cpu"
                  else cold_median_seconds(optimizer.step, device, STEPS))
    return 4 * numel * tensors / step_s
