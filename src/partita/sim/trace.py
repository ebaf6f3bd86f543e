"""The result of one simulated step: when each action ran, and the totals the planner compares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from partita.schedule.action import BACKWARD_INPUT, FORWARD, FULL_BACKWARD, Action

SEND_ACTIVATIONS = "SEND_F"  # torch's names for the two transfers
SEND_GRADIENTS = "SEND_B"
TAIL = "TAIL"  # a rank's work after the pipeline drains: gradient all-reduce and optimizer step


class Event(NamedTuple):
    """One interval of a rank's time line.

    `op` is a compute op (F, B, I, W), a transfer sent by `rank` (SEND_F: stage `stage`'s output to the next
    stage; SEND_B: its input gradients to the previous one), or TAIL (stage and micro-batch are -1 then).
    """

    rank: int
    stage: int
    op: str
    micro_batch: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Trace:
    """One simulated training step of one pipeline replica (every replica runs the same).

    The simulator stores only start and end times next to the orders, which keeps it fast inside the
    planner's search; `events` builds the full list from them on each access.

    >>> from partita.schedule import orders
    >>> from partita.sim import StageCosts, simulate
    >>> trace = simulate(orders("GPipe", 2, 2, 2), StageCosts.uniform(2, 1.0, 2.0), tail_s=(0.5, 0.5))
    >>> trace.makespan_s, trace.step_s, trace.busy_s, round(trace.bubble_fraction, 3)
    (9.0, 9.5, (6.0, 6.0), 0.333)
    >>> trace.events[0]
    Event(rank=0, stage=0, op='F', micro_batch=0, start_s=0.0, end_s=1.0)
    """

    step_s: float  # makespan_s + the longest tail: no rank starts its tail before the pipeline drains
    makespan_s: float  # from the start of the step to the end of the last action
    busy_s: tuple[float, ...]  # compute seconds per rank
    bubble_fraction: float  # 1 - sum(busy_s) / (ranks x makespan_s)
    orders: tuple[tuple[Action, ...], ...]  # what each rank ran, in order
    starts_s: tuple[tuple[float, ...], ...]  # when each action of `orders` started
    ends_s: tuple[tuple[float, ...], ...]  # and ended
    send_activations_s: tuple[float, ...]  # per stage, as simulated: zero towards a stage on the same rank
    send_gradients_s: tuple[float, ...]
    tail_s: tuple[float, ...]  # per rank

    @property
    def num_ranks(self) -> int:
        return len(self.orders)

    @property
    def events(self) -> tuple[Event, ...]:
        """Compute events rank by rank in order, then the transfers that take time, then the tails."""
        computes, transfers = [], []
        for rank, (order, starts, ends) in enumerate(zip(self.orders, self.starts_s, self.ends_s)):
            for (stage, op, micro_batch), start, end in zip(order, starts, ends):
                computes.append(Event(rank, stage, op, micro_batch, start, end))
                if op == FORWARD:
                    send, kind = self.send_activations_s[stage], SEND_ACTIVATIONS
                elif op in (FULL_BACKWARD, BACKWARD_INPUT):
                    send, kind = self.send_gradients_s[stage], SEND_GRADIENTS
                else:
                    continue
                if send:
                    transfers.append(Event(rank, stage, kind, micro_batch, end, end + send))
        tails = [Event(rank, -1, TAIL, -1, self.makespan_s, self.makespan_s + t)
                 for rank, t in enumerate(self.tail_s) if t]
        return tuple(computes + transfers + tails)

    def to_chrome_trace(self) -> str:
        """JSON for chrome://tracing or ui.perfetto.dev: a process per rank; compute, sends, tail as threads.

        >>> from partita.schedule import orders
        >>> from partita.sim import StageCosts, simulate
        >>> trace = simulate(orders("1F1B", 2, 2, 2), StageCosts.uniform(2, 1.0, 2.0))
        >>> json.loads(trace.to_chrome_trace())["traceEvents"][0]["name"]
        '0F0'
        """
        lanes = {SEND_ACTIVATIONS: 1, SEND_GRADIENTS: 1, TAIL: 2}  # thread ids; compute is 0
        events = [{"name": _label(e), "ph": "X", "pid": e.rank, "tid": lanes.get(e.op, 0),
                   "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6} for e in self.events]
        names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
                 for r in range(self.num_ranks)]
        names += [{"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}}
                  for r in range(self.num_ranks) for tid, name in enumerate(("compute", "sends", "after pipeline"))]
        return json.dumps({"traceEvents": events + names, "displayTimeUnit": "ms"})


def _label(event: Event) -> str:
    if event.op == TAIL:
        return "all-reduce + optimizer step"
    return f"{event.stage}{event.op}{event.micro_batch}"
