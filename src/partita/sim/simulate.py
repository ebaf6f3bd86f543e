"""A discrete-event simulation of one training step of one pipeline replica.

Model (what `simulate` assumes):
- Each rank runs its actions in the given order, one at a time; an action starts when the rank is free and
  its input has arrived.
- F(s, m) needs stage s-1's output for micro-batch m: the end of F(s-1, m) plus `send_activations_s[s-1]`.
  Stage 0 needs nothing.
- B(s, m) and I(s, m) need the input gradient from stage s+1: the end of B(s+1, m) or I(s+1, m) plus
  `send_gradients_s[s+1]`. The last stage needs only its own F(s, m), which ran earlier on the same rank.
  W(s, m) needs only I(s, m), earlier on the same rank.
- A transfer does not occupy the sender's compute (the runtime posts sends with batch_isend_irecv and moves on).
  It is a plain delay: no bandwidth shared between concurrent transfers, no link contention. Between two
  stages on the same rank (V-shaped schedules) it takes no time, whatever the costs say.
- After the last action of the pipeline every rank runs its tail: the part of its gradients' all-reduce that
  its stages' last backwards did not hide (the runtime starts each bucket's sum as that backward finishes
  its gradients; the cost model says how much shows: `CostModel.exposed_allreduce_s`), putting them into
  .grad, and the optimizer step. partita's runtime sums the loss over all ranks right after the schedule,
  so no tail starts before the whole pipeline has drained: step_s = makespan_s + max(tail_s).

The loop is a ready list of ranks: a rank runs its next actions until one waits for an input that has not
been produced; it is parked on that input and put back on the list when the input is produced. Every action
is visited once, so a step costs O(number of actions).
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, Action
from partita.sim.costs import StageCosts
from partita.sim.trace import Trace


def simulate(orders: Sequence[Sequence[Action]], costs: StageCosts, tail_s: Sequence[float] = ()) -> Trace:
    """Run `orders` (one list of actions per rank, see `partita.schedule.orders`) under `costs`.

    `tail_s[r]` is rank r's work after the pipeline drains (empty: none). Raises ValueError if the orders
    deadlock (a rank waits for an input that no rank will produce).

    >>> from partita.schedule import orders
    >>> trace = simulate(orders("1F1B", 4, 4, 8), StageCosts.uniform(4, 1.0, 2.0))
    >>> trace.makespan_s == (8 + 4 - 1) * (1.0 + 2.0)
    True
    """
    num_ranks, num_stages = len(orders), costs.num_stages
    tail_s = tuple(tail_s) or (0.0,) * num_ranks
    if len(tail_s) != num_ranks:
        raise ValueError(f"tail_s has {len(tail_s)} entries; it needs one per rank ({num_ranks})")
    rank_of = _placement(orders, num_stages)
    send_activations_s, send_gradients_s = _transfer_times(costs, rank_of)
    starts_s, ends_s, busy_s = _run(orders, costs, send_activations_s, send_gradients_s)
    _raise_if_stuck(orders, starts_s)
    makespan_s = max((ends[-1] for ends in ends_s if ends), default=0.0)
    capacity_s = num_ranks * makespan_s
    return Trace(
        step_s=makespan_s + max(tail_s),
        makespan_s=makespan_s,
        busy_s=tuple(busy_s),
        bubble_fraction=1.0 - sum(busy_s) / capacity_s if capacity_s else 0.0,
        orders=tuple(map(tuple, orders)),
        starts_s=tuple(map(tuple, starts_s)),
        ends_s=tuple(map(tuple, ends_s)),
        send_activations_s=tuple(send_activations_s),
        send_gradients_s=tuple(send_gradients_s),
        tail_s=tail_s,
    )


def _run(orders: Sequence[Sequence[Action]], costs: StageCosts, send_activations_s: list[float],
         send_gradients_s: list[float]) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """The event loop: when each action of `orders` starts and ends, and each rank's busy time. One flat loop
    on purpose: the planner simulates thousands of layouts, and a call per action would cost more than the
    action's own bookkeeping."""
    num_ranks, num_stages = len(orders), costs.num_stages
    duration_s = {FORWARD: costs.forward_s, FULL_BACKWARD: costs.backward_s,
                  BACKWARD_INPUT: costs.backward_input_s, BACKWARD_WEIGHT: costs.backward_weight_s}
    last_stage = num_stages - 1

    # Per kind of input, keyed by micro_batch * num_stages + stage of the stage that consumes it: when the
    # input reaches that stage's rank, and which rank is parked waiting for it.
    on_activations: tuple[dict[int, float], dict[int, int]] = ({}, {})
    on_gradients: tuple[dict[int, float], dict[int, int]] = ({}, {})
    waits_on = {FORWARD: on_activations, FULL_BACKWARD: on_gradients, BACKWARD_INPUT: on_gradients,
                BACKWARD_WEIGHT: (None, None)}
    starts_s: list[list[float]] = [[] for _ in orders]
    ends_s: list[list[float]] = [[] for _ in orders]
    busy_s = [0.0] * num_ranks
    ready_ranks = list(range(num_ranks))
    while ready_ranks:
        rank = ready_ranks.pop()
        order, starts, ends = orders[rank], starts_s[rank], ends_s[rank]
        clock = ends[-1] if ends else 0.0
        busy = busy_s[rank]
        for position in range(len(starts), len(order)):
            stage, op, micro_batch = order[position]
            key = micro_batch * num_stages + stage
            # wait for the input: W needs none, nor does stage 0's F
            inputs_at_s, parked = waits_on[op]
            if inputs_at_s is not None and (stage or op != FORWARD):
                arrived = inputs_at_s.get(key)
                if arrived is None:
                    parked[key] = rank
                    break
                if arrived > clock:
                    clock = arrived
            starts.append(clock)
            took = duration_s[op][stage]
            clock += took
            busy += took
            ends.append(clock)
            # hand the output on: F's to the next stage (the last stage's to its own backward), the input
            # gradient of B or I to the previous stage
            if op == FORWARD:
                if stage == last_stage:
                    arrived, (outputs_at_s, parked) = clock, on_gradients
                else:
                    key, arrived = key + 1, clock + send_activations_s[stage]
                    outputs_at_s, parked = on_activations
            elif op == BACKWARD_WEIGHT or not stage:
                continue
            else:
                key, arrived = key - 1, clock + send_gradients_s[stage]
                outputs_at_s, parked = on_gradients
            outputs_at_s[key] = arrived
            waiting = parked.pop(key, None)
            if waiting is not None:
                ready_ranks.append(waiting)
        busy_s[rank] = busy
    return starts_s, ends_s, busy_s


def _placement(orders: Sequence[Sequence[Action]], num_stages: int) -> list[int]:
    """The rank of each stage, read from the orders."""
    rank_of = [-1] * num_stages
    for rank, order in enumerate(orders):
        for stage in {action[0] for action in order}:
            if not 0 <= stage < num_stages:
                raise ValueError(f"rank {rank} runs stage {stage}, but the costs have stages 0..{num_stages - 1}")
            if rank_of[stage] != -1:
                raise ValueError(f"stage {stage} runs on ranks {rank_of[stage]} and {rank}; a stage lives on one rank")
            rank_of[stage] = rank
    return rank_of


def _transfer_times(costs: StageCosts, rank_of: list[int]) -> tuple[list[float], list[float]]:
    """The send times of `costs`, zero where the neighbour stage is on the same rank."""
    last = costs.num_stages - 1
    activations = [t if s < last and rank_of[s] != rank_of[s + 1] else 0.0
                   for s, t in enumerate(costs.send_activations_s)]
    gradients = [t if s > 0 and rank_of[s] != rank_of[s - 1] else 0.0 for s, t in enumerate(costs.send_gradients_s)]
    return activations, gradients


def _raise_if_stuck(orders: Sequence[Sequence[Action]], starts_s: list[list[float]]) -> None:
    stuck = [f"rank {rank} at {orders[rank][len(starts)]} (position {len(starts)})"
             for rank, starts in enumerate(starts_s) if len(starts) < len(orders[rank])]
    if stuck:
        raise ValueError("the orders deadlock: each of these waits for an input no rank will produce: "
                         + "; ".join(stuck))
