"""Time several ways of training side by side on every rank of a job: blocks of steps alternate between them,
so that the noise of a shared machine hits all alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist
from turns import WARM_CALLS


def timed_blocks(arms: dict[str, Callable[[], None]], blocks: int, steps: int,
                 warm_up: int = WARM_CALLS) -> dict[str, float]:
    """Seconds each arm took for `blocks` x `steps` of its steps, after `warm_up` steps of each (past the calls at
    which a partita model plans, reviews its steps and may switch layouts: turns.WARM_CALLS). Every rank must
    call it with the same arms."""
    for step in arms.values():
        for _ in range(warm_up):
            step()
    seconds = dict.fromkeys(arms, 0.0)
    for _ in range(blocks):
        for name, step in arms.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            seconds[name] += time.perf_counter() - start
    return seconds
