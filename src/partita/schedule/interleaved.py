"""Interleaved (looped, depth-first) schedules: Interleaved1F1B and InterleavedZeroBubble.

Rank r holds stages r, r + P, r + 2P, ... (P ranks per pipeline). Micro-batches go in rounds of
`micro_batches_per_round`; each rank runs a round of forwards on one local stage before moving to the next,
and its backwards through the local stages in the reverse direction. Restated from torch 2.13's
`_get_1f1b_rank_ops` and `_get_warmup_ops` (Narayanan et al., arXiv 2104.04473; zero bubble: Qi et al.,
arXiv 2401.10241, the ZB1P schedule).
"""

from __future__ import annotations

from collections import Counter

from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action


def micro_batches_per_round(micro_batches: int, pipeline_size: int) -> int:
    """How many micro-batches one round holds: torch splits them into max(1, M // P) equal rounds.

    >>> micro_batches_per_round(10, 4), micro_batches_per_round(3, 4)
    (5, 3)
    """
    return micro_batches // max(1, micro_batches // pipeline_size)


def interleaved_1f1b(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    """The order of ScheduleInterleaved1F1B on `rank`.

    >>> " ".join(map(str, interleaved_1f1b(1, 4, 2, 2)))
    '1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1'
    """
    return _interleaved(rank, num_stages, pipeline_size, micro_batches, zero_bubble=False)


def interleaved_zero_bubble(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    """The order of ScheduleInterleavedZeroBubble on `rank`: backwards split into I, with W lagging `rank` behind.

    >>> " ".join(map(str, interleaved_zero_bubble(1, 4, 2, 2)))
    '1F0 1F1 3F0 3I0 3F1 3I1 3W0 1I0 3W1 1I1 1W0 1W1'
    """
    return _interleaved(rank, num_stages, pipeline_size, micro_batches, zero_bubble=True)


def _interleaved(rank: int, num_stages: int, pipeline_size: int, micro_batches: int,
                 zero_bubble: bool) -> list[Action]:
    num_local_stages = num_stages // pipeline_size
    per_round = micro_batches_per_round(micro_batches, pipeline_size)
    num_ops = num_local_stages * micro_batches  # forwards on this rank, and as many backwards
    # The last rank warms up with all but one local stage's first round; each hop towards rank 0 adds 2
    # forwards (1 for zero bubble, whose W ops fill the gaps instead).
    forwards_per_hop = 1 if zero_bubble else 2
    num_warmup = min((num_local_stages - 1) * per_round + forwards_per_hop * (pipeline_size - 1 - rank), num_ops)

    def stage_of(k: int, backward: bool) -> int:
        local_index = (k // per_round) % num_local_stages
        return (num_local_stages - 1 - local_index if backward else local_index) * pipeline_size + rank

    forwards = _numbered([stage_of(k, False) for k in range(num_ops)], FORWARD)
    backwards = _numbered([stage_of(k, True) for k in range(num_ops)], BACKWARD_INPUT if zero_bubble else FULL_BACKWARD)
    order = forwards[:num_warmup]
    for k, backward in enumerate(backwards):
        if num_warmup + k < num_ops:
            order.append(forwards[num_warmup + k])
        order.append(backward)
        # zero bubble: rank r runs the W of a backward r backwards later; the last r come at the end
        if zero_bubble and k >= rank:
            order.append(_weight_of(backwards[k - rank]))
    if zero_bubble:
        order += [_weight_of(b) for b in backwards[max(0, num_ops - rank):]]
    return order


def _numbered(stages: list[int], op: str) -> list[Action]:
    """`op` on each stage in turn; each stage's micro-batches counted from 0 in order of appearance."""
    seen: Counter[int] = Counter()
    actions = []
    for stage in stages:
        actions.append(Action(stage, op, seen[stage]))
        seen[stage] += 1
    return actions


def _weight_of(backward: Action) -> Action:
    return Action(backward.stage, BACKWARD_WEIGHT, backward.micro_batch)
