"""How long a training step takes on this rank, measured from a call of the parallelized model to the end of
its step: the end of the backward that reaches partita, or of the optimizer's step where partita has the
optimizer, whichever comes last before the next call. What the caller does before a call (loading the next
batch), which no plan knows, is not counted.

The first calls are left out (they capture, plan, build and warm caches), and only training calls of the
planned size count: an evaluation call, or a last short batch, is no step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

WARM_UP_CALLS = 3  # the first training calls, not counted
MEASURED_STEPS = 5  # steps whose median is compared with the plan's estimate


@dataclass
class StepClock:
    """Times the training steps of the planned size; says their median once, after `MEASURED_STEPS`."""

    rows: tuple[int, ...]  # every rank's rows in the calls the plan was made for
    seen: int = 0
    start_s: float | None = None  # the call that began the step under way
    end_s: float | None = None  # the last end of its backward or optimizer step
    steps_s: list[float] = field(default_factory=list)
    done: bool = False

    def called(self, rows: tuple[int, ...], training: bool, now_s: float) -> float | None:
        """A call at `now_s`: it ends the step before it. The median step at the call that completes the
        measurement (once); None otherwise."""
        if self.done:
            return None
        if self.start_s is not None and self.end_s is not None and self.seen > WARM_UP_CALLS:
            self.steps_s.append(self.end_s - self.start_s)
        counted = training and rows == self.rows
        self.seen += counted
        self.start_s, self.end_s = (now_s if counted else None), None
        if len(self.steps_s) < MEASURED_STEPS:
            return None
        self.done = True
        return statistics.median(self.steps_s)

    def ended(self, now_s: float) -> None:
        """The backward of the step under way reached partita's part, or the optimizer stepped."""
        if self.start_s is not None:
            self.end_s = now_s
