"""Timing shared by the benchmarks: training steps of several configurations, timed in interleaved turns."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


# A partita job's first call captures, measures and plans; it times its steps from the fourth call and may switch
# to a faster layout at the eighth (and switch back at the 16th): to time what it runs from then on, warm it
# this many calls
WARM_CALLS = 20


def warmed_step(pm, opt, x, y, calls: int = 2) -> Callable[[], None]:
    """One training step of `pm` on (x, y), after `calls` calls (WARM_CALLS for a job that may switch)."""
    def step():
        opt.zero_grad()
        pm(x, y).backward()
        opt.step()

    for _ in range(calls):
        step()
    return step


def seconds_per_step(steps: list[Callable[[], None]], rounds: int, count: int) -> list[float]:
    """Seconds per step of each step function. They take turns, `rounds` times, each running `count`
    consecutive steps between barriers: a slow spell of the shared machine then spoils one turn of each
    rather than every turn of one, and the median of each one's turns drops it."""
    import torch.distributed as dist

    seconds: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for times, step in zip(seconds, steps):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                step()
            dist.barrier()
            times.append((time.perf_counter() - start) / count)
    return [statistics.median(t) for t in seconds]
