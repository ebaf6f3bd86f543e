"""Which schedules exist, and where each puts a stage within one pipeline (pure)."""

from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
# every rank runs all its forwards before its first backward: these can run when the user's own code computes
# the loss between the forward and the backward (tests/unit/test_schedule.py checks this against the orders)
FORWARDS_FIRST_SCHEDULES = ("GPipe", "LoopedBFS")
# zero-bubble schedules split each backward into the input gradients and, later, the weight gradients
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str) -> int:
    """How many stages each rank of a pipeline runs (partita uses two for looped schedules)."""
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def stage_to_pipeline_rank(schedule: str, stage: int, pipeline_size: int) -> int:
    """Position, within one pipeline replica, of the rank that runs `stage` under `schedule`.

    >>> [stage_to_pipeline_rank("ZBVZeroBubble", s, 2) for s in range(4)]
    [0, 1, 1, 0]
    """
    if schedule in V_SCHEDULES:
        return stage if stage < pipeline_size else 2 * pipeline_size - 1 - stage
    return stage % pipeline_size
