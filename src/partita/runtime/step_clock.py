"""How long a training step takes on this rank, measured from a call of the parallelized model to the end of
its step: the end of the backward that reaches partita, or of the optimizer's step where partita has the
optimizer, whichever comes last before the next call. What the caller does before a call (loading the next
batch), which no plan knows, is not counted.

The first calls are left out (they capture, plan, build and warm caches), and only training calls of the
planned size count: an evaluation call, or a last short batch, is no step.

On a GPU the host returns long before the kernels it queued have run, so the host's clock alone times their
launch (the H200 measured 91 ms for a GPT-2 step of 160 ms): there a mark is also a CUDA event on the current
stream, and a step lasts the longer of the host's span and the GPU's. The events are read once, when the
last measured step ended (one wait for the GPU, once per job).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

WARM_UP_CALLS = 3  # the first training calls, not counted
MEASURED_STEPS = 5  # steps whose median is compared with the plan's estimate


Mark = float | tuple[float, torch.cuda.Event]  # the host's clock, with an event on a GPU


def mark(device: torch.device) -> Mark:
    """Now, on `device`: the host's clock, and on a GPU an event recorded on the current stream."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return time.perf_counter(), event


def seconds_between(start: Mark, end: Mark) -> float:
    """Seconds from `start` to `end`: the host's span, or on a GPU the longer of it and the GPU's (waits for
    the GPU to reach `end`)."""
    if isinstance(start, float):
        return end - start
    end[1].synchronize()
    return max(end[0] - start[0], start[1].elapsed_time(end[1]) / 1e3)


@dataclass
class StepClock:
    """Times the training steps of the planned size; says their median once, after `MEASURED_STEPS`."""

    rows: tuple[int, ...]  # every rank's rows in the calls the plan was made for
    between: Callable[[Mark, Mark], float] = seconds_between
    seen: int = 0
    start: Mark | None = None  # the call that began the step under way
    end: Mark | None = None  # the last end of its backward or optimizer step
    steps: list[tuple[Mark, Mark]] = field(default_factory=list)
    done: bool = False

    def called(self, rows: tuple[int, ...], training: bool, now: Mark) -> float | None:
        """A call at `now`: it ends the step before it. The median step, in seconds, at the call that completes
        the measurement (once); None otherwise."""
        if self.done:
            return None
        if self.start is not None and self.end is not None and self.seen > WARM_UP_CALLS:
            self.steps.append((self.start, self.end))
        counted = training and rows == self.rows
        self.seen += counted
        self.start, self.end = (now if counted else None), None
        if len(self.steps) < MEASURED_STEPS:
            return None
        self.done = True
        return statistics.median(self.between(a, b) for a, b in self.steps)

    def ended(self, now: Mark) -> None:
        """The backward of the step under way reached partita's part, or the optimizer stepped."""
        if self.start is not None:
            self.end = now
