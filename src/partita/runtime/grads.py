"""Sum each parameter's gradient over the ranks that hold it.

A parameter lives on every replica of its stage, and a parameter read by several stages (a tied embedding
and LM head) lives on every replica of each of them. Its gradient is the sum over all of those ranks, so
every copy takes the same optimizer step and the copies stay identical. torch's DDP and FSDP assume one
group per module; here a rank may need several groups (its stage's replicas, plus the union of stages for
each tied parameter), so partita reduces gradients itself, in buckets, one all-reduce per bucket.

Only the gradient produced since `stash()` is reduced: gradients accumulated by earlier calls were reduced
when they were produced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.route import buckets

BUCKET_BYTES = 32 * 2**20

log = logging.getLogger("partita")


@dataclass
class ParamGroup:
    """Parameters whose gradients are summed over the same ranks."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None when this rank is the only member
    params: list[nn.Parameter]


class GradSync:
    def __init__(self, groups: list[ParamGroup]):
        self.groups = groups
        self.params = [p for g in groups for p in g.params]
        self.warned = False  # about gradient accumulation, once

    def stash(self) -> list[torch.Tensor | None]:
        """Set every gradient aside, so that the next backward produces only its own contribution."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return saved

    def take(self, saved: list[torch.Tensor | None]) -> dict[int, torch.Tensor | None]:
        """The gradients produced since `stash`, keyed by id(param); the stashed ones go back in place."""
        fresh = {id(p): p.grad for p in self.params}
        for p, old in zip(self.params, saved):
            p.grad = old
        return fresh

    def apply(self, fresh: dict[int, torch.Tensor | None], scale: float | torch.Tensor = 1.0) -> None:
        """Sum `fresh` over each parameter's ranks, multiply by `scale`, add into .grad."""
        fresh = dict(fresh)
        for group in self.groups:
            for bucket in buckets(group.params, BUCKET_BYTES):
                self._reduce_bucket(group, bucket, fresh)
        accumulated = 0
        for p in self.params:
            g = fresh.pop(id(p))
            if g is None:
                continue
            if not (isinstance(scale, float) and scale == 1.0):
                g.mul_(scale)  # the fresh gradient is partita's own: scaled in place, no second copy
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
                accumulated += g.numel() * g.element_size()
        if accumulated and not self.warned:
            self.warned = True
            log.warning("partita: gradients accumulate over calls (.grad was set when the pipeline produced "
                        "new ones): this rank held a second copy of %.1f MiB of gradients, which the plan's "
                        "memory does not count", accumulated / 2**20)

    @staticmethod
    def _reduce_bucket(group: ParamGroup, bucket: list[nn.Parameter], fresh: dict) -> None:
        if group.group is None:
            return
        grads = [fresh[id(p)] for p in bucket]
        flat = torch.cat([
            (g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(bucket, grads)
        ] + [torch.tensor([float(g is not None) for g in grads], dtype=bucket[0].dtype, device=bucket[0].device)])
        dist.all_reduce(flat, group=group.group)
        offset = 0
        for p in bucket:
            n = p.numel()
            fresh[id(p)] = flat[offset:offset + n].view_as(p)
            offset += n
        for p, present in zip(bucket, flat[offset:].tolist()):
            if present == 0:
                fresh[id(p)] = None  # no rank produced a gradient: stay None, as in one process
