"""Sum each parameter's gradient over the ranks that hold it.

A parameter lives on every replica of its stage, and a parameter read by several stages (a tied embedding
and LM head) lives on every replica of each of them. Its gradient is the sum over all of those ranks, so
every copy takes the same optimizer step and the copies stay identical. torch's DDP and FSDP assume one
group per module; here a rank may need several groups (its stage's replicas, plus the union of stages for
each tied parameter), so partita reduces gradients itself, in buckets, one all-reduce per bucket.

The sums overlap the backward, as DDP's do: during the last backward of a step of each stage (the schedule
says which one is last), a parameter's gradient is final once autograd has accumulated it; a bucket whose
parameters are all final starts its all-reduce at once, while the backward goes on. Buckets hold parameters
in reverse module order, the order the backward finishes them, and start in a fixed order on every rank of
their group (gloo and NCCL match collectives by order); a bucket ready early waits for those before it. What
is not final when the pipeline ends (a parameter that got no gradient) starts then. The sums are waited for
when the user's backward reaches the loss.

Only the gradient produced since `stash()` is reduced: gradients accumulated by earlier calls were reduced
when they were produced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from partita import settings
from partita.runtime.route import buckets

BUCKET_BYTES = 32 * 2**20

log = logging.getLogger("partita")


@dataclass
class ParamGroup:
    """Parameters whose gradients are summed over the same ranks."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None  # None when this rank is the only member
    params: list[nn.Parameter]


@dataclass(frozen=True)
class _Bucket:
    """Parameters reduced by one all-reduce."""

    group: dist.ProcessGroup
    params: list[nn.Parameter]

    def start(self) -> _Sum:
        """Start the all-reduce of the parameters' current gradients, flattened, then one presence flag per
        parameter (whether any rank produced its gradient). Each .grad becomes its view into the flat buffer,
        so that the gradient is held once while the sum runs, as DDP's bucket views do."""
        grads = [p.grad for p in self.params]
        present = [g is not None for g in grads]
        like = self.params[0]
        # made on the device where every gradient is present (the common case): a tensor from host values would
        # stop the backward on a GPU for its copy
        flags = torch.ones(len(grads), dtype=like.dtype, device=like.device) if all(present) else \
            torch.tensor(present, dtype=like.dtype).to(like.device)
        flat = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for p, g in zip(self.params, grads)] + [flags])
        offset = 0
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return _Sum(self.params, flat, dist.all_reduce(flat, group=self.group, async_op=True))


@dataclass(frozen=True)
class _Sum:
    """A bucket's all-reduce under way."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    work: dist.Work

    def finish(self, fresh: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """Wait for the sum; put each parameter's summed gradient in `fresh`; return the presence flags (what
        `_mark_absent` reads)."""
        self.work.wait()
        offset = 0
        for p in self.params:
            fresh[id(p)] = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return self.flat[offset:]


def _mark_absent(sums: list[_Sum], flags: list[torch.Tensor], fresh: dict[int, torch.Tensor | None]) -> None:
    """A parameter whose gradient no rank produced stays None, as in one process. The flags of every bucket
    are read at once: each read waits for the device."""
    if not sums:
        return
    present = torch.cat(flags).tolist()
    for p, here in zip((p for s in sums for p in s.params), present):
        if here == 0:
            fresh[id(p)] = None


@dataclass
class _Step:
    """One step's reduction: which gradients are final, and the next bucket to start."""

    final_backwards_left: dict[int, int]  # id(param) -> last backwards of its stages still to run
    next_bucket: int = 0
    final_stage: int | None = None  # the stage whose last backward runs now
    counted: set[int] = field(default_factory=set)  # the parameters that backward has finished
    started: list[_Sum] = field(default_factory=list)


@dataclass
class Gradients:
    """The gradients a pipeline produced on this rank, their sums under way."""

    fresh: dict[int, torch.Tensor | None]
    started: list[_Sum]


class GradSync:
    def __init__(self, groups: list[ParamGroup], params_of_stage: dict[int, set[int]] | None = None):
        """`params_of_stage`: for each of this rank's stages, the ids of the parameters it reads (a gradient
        is final after the last backward of each of them)."""
        self.groups = groups  # every parameter, trained now or not
        self.params_of_stage = params_of_stage or {}
        self.warned = False  # about gradient accumulation, once
        # the last step's buckets, in order: the stage whose last backward ran when each sum started (None:
        # after the pipeline), so that tests hold the runtime to the overlap the cost model assumes
        self.started_during: list[int | None] = []
        self._step: _Step | None = None
        self._overlap = settings.overlap_enabled()
        self._hooked: set[int] = set()
        self._trained: tuple[bool, ...] | None = None
        self.params: list[nn.Parameter] = []
        self.buckets: list[_Bucket] = []
        self.follow_trained()

    def follow_trained(self) -> None:
        """Sum the gradients of the parameters that require grad now: those frozen when the runtime was built
        and unfrozen since (a fine-tuning that unfreezes layers) too, in buckets made again. Every rank changes
        requires_grad at the same call, so the buckets stay alike on every rank."""
        trained = tuple(p.requires_grad for g in self.groups for p in g.params)
        if trained == self._trained:
            return
        self._trained = trained
        self.params = [p for g in self.groups for p in g.params if p.requires_grad]
        self.buckets = [_Bucket(g.group, bucket) for g in self.groups if g.group is not None
                        for bucket in buckets([p for p in g.params[::-1] if p.requires_grad], BUCKET_BYTES)]
        summed = {id(p) for b in self.buckets for p in b.params}
        for p in self.params:
            if self._overlap and id(p) in summed and id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(self._accumulated)
                self._hooked.add(id(p))

    def stash(self) -> list[torch.Tensor | None]:
        """Set every gradient aside, so that the next backward produces only its own contribution; from now
        on, buckets whose gradients are final start their sums."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        left = {id(p): 0 for b in self.buckets for p in b.params}
        for ids in self.params_of_stage.values():
            for i in ids & left.keys():
                left[i] += 1
        self._step = _Step(left)
        self.started_during = []
        return saved

    @contextlib.contextmanager
    def final_backward(self, stage: int) -> Iterator[None]:
        """Around the last backward of `stage` in a step (or the weight half of it): the gradients it
        accumulates are final, and once it ends so are those of every parameter it reads (torch's weight
        half sets .grad itself, without autograd's hooks; a parameter may get no gradient)."""
        step = self._step
        if step is None or not self._overlap:
            yield
            return
        step.final_stage, step.counted = stage, set()
        try:
            yield
            for i in self.params_of_stage.get(stage, set()) - step.counted:
                self._finished(step, i)
            self._start_ready(step)
        finally:
            step.final_stage = None

    def _accumulated(self, p: nn.Parameter) -> None:
        step = self._step
        if step is not None and step.final_stage is not None and \
                id(p) in self.params_of_stage.get(step.final_stage, ()) and id(p) not in step.counted:
            self._finished(step, id(p))
            self._start_ready(step)

    @staticmethod
    def _finished(step: _Step, param_id: int) -> None:
        step.counted.add(param_id)
        if param_id in step.final_backwards_left:
            step.final_backwards_left[param_id] -= 1

    def _start_ready(self, step: _Step) -> None:
        while step.next_bucket < len(self.buckets) and \
                all(step.final_backwards_left[id(p)] <= 0 for p in self.buckets[step.next_bucket].params):
            self._start(step)

    def _start(self, step: _Step) -> None:
        step.started.append(self.buckets[step.next_bucket].start())
        self.started_during.append(step.final_stage)
        step.next_bucket += 1

    def take(self, saved: list[torch.Tensor | None]) -> Gradients:
        """The gradients produced since `stash`, their sums started (the rest start now); the stashed ones go
        back in place."""
        step, self._step = self._step, None
        while step.next_bucket < len(self.buckets):
            self._start(step)
        fresh = {id(p): p.grad for p in self.params}
        for p, old in zip(self.params, saved):
            p.grad = old
        return Gradients(fresh, step.started)

    def apply(self, gradients: Gradients, scale: float | torch.Tensor = 1.0) -> None:
        """Wait for the sums of `gradients`, multiply by `scale`, add into .grad."""
        fresh = dict(gradients.fresh)
        _mark_absent(gradients.started, [started.finish(fresh) for started in gradients.started], fresh)
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
