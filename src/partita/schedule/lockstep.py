"""Time steps in which every rank of a pipeline exchanges its messages, so that no two ranks wait on each other.

partita's own driver (calls whose loss the user's code computes: the forwards now, the backwards later) runs
the schedule's orders itself. Under NCCL a send of a large message waits until its receiver posts the matching
receive, and both directions between two ranks share one stream: a rank that sends to its peer while the peer
sends to it waits forever (LoopedBFS on two ranks does that in each phase: rank 1 passes stage 1's outputs
back to rank 0 while rank 0 still sends stage 0's). torch's multi-stage schedules avoid it by running every
rank in the same time steps and exchanging each step's messages in one group; the driver does the same with
the steps given here.

A rank computes at most one action per step, the earliest step after its previous action and after the step
in which the action's input arrived. Every message travels in the step in which its sender computed it:
the sender's send and the receiver's receive are in the same step's group on both ranks, so every group
finds all its peers and no rank waits on one that waits for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action


class Exchange(NamedTuple):
    """One step of one rank: the action it computes (or None), then the messages it sends and receives.

    `sends_to`: the pipeline position that receives `action`'s output (None: no message; it stays on the rank
    or ends the pipeline). `receives`: this rank's later actions whose input arrives in this step, from
    `received_from` (the same order)."""

    step: int
    action: Action | None
    sends_to: int | None
    receives: tuple[Action, ...]
    received_from: tuple[int, ...]


def _receiver(action: Action, num_stages: int) -> tuple[str, int, int] | None:
    """The stage that takes `action`'s output as its input, as (direction, stage, micro-batch): the next stage's
    forward, the previous stage's backward (of either kind); None at the pipeline's ends and for weight halves."""
    if action.op == FORWARD:
        return (FORWARD, action.stage + 1, action.micro_batch) if action.stage + 1 < num_stages else None
    if action.op in (FULL_BACKWARD, BACKWARD_INPUT) and action.stage > 0:
        return (FULL_BACKWARD, action.stage - 1, action.micro_batch)
    return None


def _input(action: Action) -> tuple[str, int, int] | None:
    if action.op == BACKWARD_WEIGHT:
        return None  # its input-gradient half ran on this rank
    return (FORWARD if action.op == FORWARD else FULL_BACKWARD, action.stage, action.micro_batch)


def lockstep(phase: Sequence[Sequence[Action]], num_stages: int) -> tuple[tuple[Exchange, ...], ...]:
    """Per pipeline position, the steps of `phase` (each position's actions, in its order) in which it computes
    or exchanges something; steps with neither are left out.

    `phase` holds only forwards or only backwards (with weight halves), as the driver runs them.

    >>> for rank in lockstep([[Action(0, "F", 0), Action(2, "F", 0)], [Action(1, "F", 0)]], num_stages=3):
    ...     print([(e.step, str(e.action), e.sends_to, [str(a) for a in e.receives]) for e in rank])
    [(0, '0F0', 1, []), (1, 'None', None, ['2F0']), (2, '2F0', None, [])]
    [(0, 'None', None, ['1F0']), (1, '1F0', 0, [])]
    """
    where = {a.stage: rank for rank, order in enumerate(phase) for a in order}
    producer = {}
    for order in phase:
        for a in order:
            receiver = _receiver(a, num_stages)
            if receiver is not None and receiver[1] in where:
                producer[receiver] = a
    ran_at: dict[Action, int] = {}
    steps: list[dict[int, Action]] = [{} for _ in phase]
    nexts = [0] * len(phase)
    step = 0
    while any(nexts[r] < len(order) for r, order in enumerate(phase)):
        moved = False
        for rank, order in enumerate(phase):
            if nexts[rank] == len(order):
                continue
            action = order[nexts[rank]]
            source = producer.get(_input(action))
            # its producer ran in an earlier step: from another rank, its message came at that step's end
            if source is not None and ran_at.get(source, step) >= step:
                continue
            steps[rank][step] = action
            ran_at[action] = step
            nexts[rank] += 1
            moved = True
        if not moved:
            stuck = {r: str(order[nexts[r]]) for r, order in enumerate(phase) if nexts[r] < len(order)}
            raise ValueError(f"the orders wait on each other: no rank's next action can run: {stuck}")
        step += 1
    return tuple(_exchanges(rank, steps[rank], ran_at, where, producer, num_stages) for rank in range(len(phase)))


def _exchanges(rank: int, steps: dict[int, Action], ran_at: dict[Action, int], where: dict[int, int],
               producer: dict, num_stages: int) -> tuple[Exchange, ...]:
    arriving: dict[int, list[tuple[Action, int]]] = {}
    for action in steps.values():
        source = producer.get(_input(action))
        if source is not None and where[source.stage] != rank:
            arriving.setdefault(ran_at[source], []).append((action, where[source.stage]))
    out = []
    for step in sorted(set(steps) | set(arriving)):
        action = steps.get(step)
        receiver = _receiver(action, num_stages) if action is not None else None
        sends_to = where.get(receiver[1]) if receiver is not None else None
        received = arriving.get(step, [])
        out.append(Exchange(step, action, None if sends_to == rank else sends_to,
                            tuple(a for a, _ in received), tuple(r for _, r in received)))
    return tuple(out)
