"""The compute order of each rank of a pipeline, exactly as torch 2.13's schedule classes run it.

`orders(schedule, num_stages, pipeline_size, micro_batches)[rank]` is the list of actions that pipeline
position `rank` computes, in order. Each generator restates the loop of its torch class
(`torch.distributed.pipelining.schedules`): `Schedule1F1B._step_microbatches`,
`ScheduleGPipe._step_microbatches`, and `_calculate_single_rank_operations` of the multi-stage classes, whose
bubbles (`None`) are dropped because the runtime skips them. `tests/torch/test_schedule_orders.py` runs torch's
classes on stand-in stages and checks that every order here is the one torch executes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from partita.schedule.catalog import LOOPED_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from partita.schedule.action import FORWARD, FULL_BACKWARD, Action
from partita.schedule.interleaved import interleaved_1f1b, interleaved_zero_bubble, micro_batches_per_round
from partita.schedule.v_shaped import dual_pipe_v, zbv_zero_bubble


@lru_cache(maxsize=1024)
def orders(schedule: str, num_stages: int, pipeline_size: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """The actions each pipeline position runs, in the order torch's schedule `schedule` runs them.

    Immutable and memoized: the planner asks for the same orders for every candidate layout of one shape.

    >>> [" ".join(map(str, order)) for order in orders("1F1B", 2, 2, 3)]
    ['0F0 0F1 0B0 0F2 0B1 0B2', '1F0 1B0 1F1 1B1 1F2 1B2']
    """
    check_sizes(schedule, num_stages, pipeline_size, micro_batches)
    generate = _GENERATORS[schedule]
    return tuple(tuple(generate(rank, num_stages, pipeline_size, micro_batches)) for rank in range(pipeline_size))


def check_sizes(schedule: str, num_stages: int, pipeline_size: int, micro_batches: int) -> None:
    """Raise ValueError, with the rule and a valid value, unless torch runs `schedule` at these sizes.

    >>> check_sizes("1F1B", 4, 4, 2)
    Traceback (most recent call last):
    ...
    ValueError: 1F1B needs at least as many micro-batches as stages: 2 < 4. Use micro_batches=4 or more, or GPipe.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    for name, value in (("num_stages", num_stages), ("pipeline_size", pipeline_size),
                        ("micro_batches", micro_batches)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if schedule in SINGLE_STAGE_SCHEDULES and num_stages != pipeline_size:
        raise ValueError(f"{schedule} runs one stage per rank: num_stages ({num_stages}) must equal pipeline_size "
                         f"({pipeline_size}). Use pipeline_size={num_stages}, or a looped schedule "
                         f"({', '.join(LOOPED_SCHEDULES)}).")
    if schedule in LOOPED_SCHEDULES and num_stages % pipeline_size:
        raise ValueError(f"{schedule} puts the same number of stages on each rank: num_stages ({num_stages}) must "
                         f"be a multiple of pipeline_size ({pipeline_size}), e.g. {2 * pipeline_size}.")
    if schedule in V_SCHEDULES and num_stages != 2 * pipeline_size:
        raise ValueError(f"{schedule} puts exactly two stages on each rank: num_stages ({num_stages}) must be "
                         f"2 x pipeline_size ({pipeline_size}); use num_stages={2 * pipeline_size}.")
    if schedule in ("1F1B", "DualPipeV") and micro_batches < num_stages:
        raise ValueError(f"{schedule} needs at least as many micro-batches as stages: {micro_batches} < "
                         f"{num_stages}. Use micro_batches={num_stages} or more, or GPipe.")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, micro_batches // pipeline_size)
        if micro_batches % rounds:
            valid = rounds * micro_batches_per_round(micro_batches, pipeline_size)
            raise ValueError(f"{schedule} runs the micro-batches in max(1, micro_batches // pipeline_size) = "
                             f"{rounds} equal rounds, so micro_batches ({micro_batches}) must be a multiple "
                             f"of {rounds}; use micro_batches={valid}.")


def _gpipe(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    # every forward, then every backward, both in micro-batch order
    forwards = [Action(rank, FORWARD, m) for m in range(micro_batches)]
    return forwards + [Action(rank, FULL_BACKWARD, m) for m in range(micro_batches)]


def _one_f_one_b(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    # stage s runs num_stages - s forwards before its first backward, then alternates backward, forward
    num_warmup = min(micro_batches, num_stages - rank)
    order = [Action(rank, FORWARD, m) for m in range(num_warmup)]
    for m in range(micro_batches):
        order.append(Action(rank, FULL_BACKWARD, m))
        if num_warmup + m < micro_batches:
            order.append(Action(rank, FORWARD, num_warmup + m))
    return order


def _looped_bfs(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    # breadth first: all forwards of each local stage in turn, then the backwards in exact reverse order
    stages = range(rank, num_stages, pipeline_size)
    micro_batches = range(micro_batches)
    order = [Action(s, FORWARD, m) for s in stages for m in micro_batches]
    return order + [Action(s, FULL_BACKWARD, m) for s in reversed(stages) for m in reversed(micro_batches)]


_GENERATORS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "GPipe": _gpipe,
    "1F1B": _one_f_one_b,
    "LoopedBFS": _looped_bfs,
    "Interleaved1F1B": interleaved_1f1b,
    "InterleavedZeroBubble": interleaved_zero_bubble,
    "ZBVZeroBubble": zbv_zero_bubble,
    "DualPipeV": dual_pipe_v,
}
