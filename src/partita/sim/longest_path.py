"""The makespan alone, for a planner that asks for it thousands of times per layout.

What `simulate` computes is the longest path through a graph that the orders fix: an action starts at the later
of its rank's previous action's end and its input's arrival. The graph does not depend on the durations, so
`step_graph` lays it out once, in an order that puts every action after those it waits for, and
`StepGraph.makespan_s` then walks it in one flat loop per call: no event queue, no per-action lookups, no trace.
Same model, same numbers as `simulate` (tests/unit/test_sim.py holds them together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partita.schedule.action import BACKWARD_INPUT, FORWARD, FULL_BACKWARD, OPS, Action
from partita.sim.costs import StageCosts
from partita.sim.simulate import simulate


@dataclass(frozen=True)
class StepGraph:
    """Every action of a step as (its rank's previous action, the action whose output it waits for, the
    transfer between them, its duration), each an index: actions count from 1 in the graph's order (0: none,
    which ended at 0); transfers index the sends of `makespan_s`, activations then gradients, then a zero
    (for no transfer, or one between stages on the same rank); durations index the costs of each kind of
    action in the order of `OPS` (forwards, full backwards, input and weight halves), stage by stage."""

    steps: tuple[tuple[int, int, int, int], ...]
    lasts: tuple[int, ...]  # each rank's last action
    num_stages: int

    def makespan_s(self, forward_s: Sequence[float], backward_s: Sequence[float],
                   send_activations_s: Sequence[float], send_gradients_s: Sequence[float],
                   backward_input_s: Sequence[float] = (), backward_weight_s: Sequence[float] = ()) -> float:
        """The step's makespan under these costs (as `StageCosts`; empty halves: half of each backward)."""
        halves = [b / 2 for b in backward_s] if not (backward_input_s and backward_weight_s) else ()
        durations = [*forward_s, *backward_s, *(backward_input_s or halves), *(backward_weight_s or halves)]
        sends = [*send_activations_s, *send_gradients_s, 0.0]
        ends = [0.0]
        end = ends.append
        for previous, waits_for, send, duration in self.steps:
            start = ends[previous]
            arrived = ends[waits_for] + sends[send]
            end((arrived if arrived > start else start) + durations[duration])
        return max((ends[last] for last in self.lasts if last), default=0.0)


def step_graph(orders: Sequence[Sequence[Action]], num_stages: int) -> StepGraph:
    """The graph of `orders` (see `partita.schedule.orders`). Raises ValueError where `simulate` does (orders
    that deadlock, a stage on two ranks)."""
    # with every duration positive, an action starts after every action it waits for has started: start times
    # order the graph
    trace = simulate(orders, StageCosts.uniform(num_stages, 1.0, 1.0))
    actions = sorted(((start, rank, position) for rank, starts in enumerate(trace.starts_s)
                      for position, start in enumerate(starts)))
    index = {orders[rank][position]: i + 1 for i, (_, rank, position) in enumerate(actions)}
    rank_of = {stage: rank for rank, order in enumerate(orders) for stage, _, _ in order}
    zero = 2 * num_stages
    steps = []
    for _, rank, position in actions:
        stage, op, micro_batch = orders[rank][position]
        previous = index[orders[rank][position - 1]] if position else 0
        waits_for, send = 0, zero
        if op == FORWARD and stage:
            waits_for = index[(stage - 1, FORWARD, micro_batch)]
            send = stage - 1 if rank_of[stage - 1] != rank else zero
        elif op in (FULL_BACKWARD, BACKWARD_INPUT):
            if stage == num_stages - 1:
                waits_for = index[(stage, FORWARD, micro_batch)]
            else:
                waits_for = index.get((stage + 1, FULL_BACKWARD, micro_batch)) or index[
                    (stage + 1, BACKWARD_INPUT, micro_batch)]
                send = num_stages + stage + 1 if rank_of[stage + 1] != rank else zero
        steps.append((previous, waits_for, send, OPS.index(op) * num_stages + stage))
    lasts = tuple(index[order[-1]] if order else 0 for order in orders)
    return StepGraph(tuple(steps), lasts, num_stages)
