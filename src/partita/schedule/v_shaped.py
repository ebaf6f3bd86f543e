"""V-shaped schedules: ZBVZeroBubble and DualPipeV, two stages per rank.

Rank r holds stage r (going down the V) and stage 2P-1-r (coming back up), so the last stage sits on rank 0
next to the first. Restated from torch 2.13's `ScheduleZBVZeroBubble._calculate_single_rank_operations`
(Qi et al., arXiv 2401.10241, section 6) and `ScheduleDualPipeV._calculate_single_rank_operations`
(DeepSeek-V3, arXiv 2412.19437). DualPipeV's overlapped forward+backward pairs run one after the other
(torch runs the sub-actions in order), so here they are two actions.
"""

from __future__ import annotations

from collections import Counter

from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action

F, B, I, W = FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT


def zbv_zero_bubble(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    """The order of ScheduleZBVZeroBubble on `rank`.

    >>> " ".join(map(str, zbv_zero_bubble(0, 2, 1, 2)))
    '0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1'
    """
    P, down, up = pipeline_size, rank, num_stages - 1 - rank
    # torch plans at least a full V (2P - 1 micro-batches) and then drops the actions of the extra ones
    num_planned = max(2 * P - 1, micro_batches)
    order: list[Action] = []
    count: Counter[tuple[int, str]] = Counter()

    def run(*steps: tuple[int, str]) -> None:
        for stage, op in steps:
            order.append(Action(stage, op, count[stage, op]))
            count[stage, op] += 1

    for _ in range(2 * (P - rank) - 1):
        run((down, F))
    for _ in range(rank):
        run((up, F), (down, F))
    for _ in range(P - rank):
        run((up, F), (up, I), (up, W))
    while count[up, F] < count[down, F] or count[down, F] < num_planned:
        if count[down, F] < num_planned:
            run((down, F))
        run((down, I), (down, W), (up, F), (up, I), (up, W))
    for _ in range(rank):
        run((down, I), (up, I))
    for _ in range(P - rank):
        run((down, I), (down, W))
    while count[up, W] < count[up, I]:
        run((up, W))
    while count[down, W] < count[down, I]:
        run((down, W))
    return [a for a in order if a.micro_batch < micro_batches]


def dual_pipe_v(rank: int, num_stages: int, pipeline_size: int, micro_batches: int) -> list[Action]:
    """The order of ScheduleDualPipeV on `rank`; B and I share one count of backwards per stage.

    >>> " ".join(map(str, dual_pipe_v(0, 2, 1, 2)))
    '0F0 1F0 0F1 1B0 1F1 0B0 1B1 0I1 0W1'
    """
    P, down, up = pipeline_size, rank, num_stages - 1 - rank
    order: list[Action] = []
    count: Counter[tuple[int, str]] = Counter()  # forwards and backwards (B or I) run per stage
    pending_weights: list[Action] = []  # W of each I, run later in the order the I's ran

    def run(stage: int, op: str) -> None:
        counted = F if op == F else B
        action = Action(stage, op, count[stage, counted])
        count[stage, counted] += 1
        order.append(action)
        if op == I:
            pending_weights.append(action._replace(op=W))

    def run_pending_weight() -> None:
        if pending_weights:
            order.append(pending_weights.pop(0))

    for _ in range(2 * (P - rank - 1)):
        run(down, F)
    for _ in range(rank + 1):
        run(down, F)
        run(up, F)
    for _ in range(P - rank - 1):
        run(up, I)
        run_pending_weight()
        run(up, F)
    for _ in range(micro_batches - 2 * P + rank + 1):
        run(down, F)
        run(up, B)
        run(up, F)
        run(down, B)
    for _ in range(P - rank - 1):
        run(up, B)
        run(up, F)
        run(down, B)
    # the last backwards: zero bubble (I now, W later) from the middle one on; odd ranks switch one stage earlier
    split = False
    num_last = rank + 1
    for i in range(num_last):
        split = split or (i == num_last // 2 and rank % 2 == 1)
        run(up, I if split else B)
        split = split or (i == num_last // 2 and rank % 2 == 0)
        run(down, I if split else B)
    for _ in range(P - rank - 1):
        run_pending_weight()
        run(down, I if split else B)
    for _ in range(rank + 1):
        run_pending_weight()
    return order
