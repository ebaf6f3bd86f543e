"""Split a sequence of block costs into contiguous stages with the smallest largest stage."""

from __future__ import annotations

from partita.errors import PlanError


def _stages_needed(costs: list[float], limit: float) -> int:
    count, load = 1, 0.0
    for c in costs:
        if load + c > limit and load > 0:
            count, load = count + 1, c
        else:
            load += c
    return count


def balance(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges, one per stage, minimising the largest sum (exact).

    >>> balance([1, 1, 1, 1, 4], 2)
    [(0, 4), (4, 5)]
    """
    n = len(costs)
    if num_stages > n:
        raise PlanError(f"{num_stages} stages need at least {num_stages} blocks, the model has {n}; "
                        f"use at most {n} stages")
    lo, hi = max(costs, default=0.0), sum(costs)
    for _ in range(100):  # bisection on the bottleneck; 100 halvings reach float resolution
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
        mid = (lo + hi) / 2
        if _stages_needed(costs, mid) <= num_stages:
            hi = mid
        else:
            lo = mid
    return _cut(costs, num_stages, hi)


def _cut(costs: list[float], num_stages: int, limit: float) -> list[tuple[int, int]]:
    """Greedy cut under `limit`, leaving at least one block for each remaining stage."""
    ranges, start, load = [], 0, 0.0
    n = len(costs)
    for i, c in enumerate(costs):
        to_open = num_stages - len(ranges) - 1  # stages still to start after the current one
        if i > start and to_open > 0 and (load + c > limit * (1 + 1e-9) or n - i == to_open):
            ranges.append((start, i))
            start, load = i, 0.0
        load += c
    ranges.append((start, n))
    return ranges
