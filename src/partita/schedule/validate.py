"""The rules every schedule's orders obey, checked without running anything."""

from __future__ import annotations

from collections.abc import Sequence

from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD, OPS, Action


def validate_orders(orders: Sequence[Sequence[Action]], num_stages: int, micro_batches: int) -> None:
    """Raise ValueError, naming rank, position and rule, unless `orders` is a complete, well-ordered schedule.

    The rules (torch's `_validate_schedule`, plus "exactly once"): each stage runs on one rank; each (stage,
    micro-batch) runs exactly one F and either one B or one I and one W; on its rank F comes before B or I,
    and I before W.

    >>> validate_orders([[Action(0, "F", 0), Action(0, "B", 0)]], num_stages=1, micro_batches=1)
    >>> validate_orders([[Action(0, "B", 0), Action(0, "F", 0)]], num_stages=1, micro_batches=1)
    Traceback (most recent call last):
    ...
    ValueError: rank 0, position 0: 0B0 runs before its forward 0F0
    """
    rank_of_stage: dict[int, int] = {}
    seen: set[Action] = set()
    for rank, order in enumerate(orders):
        for position, action in enumerate(order):
            where = f"rank {rank}, position {position}: {action}"
            stage, op, micro_batch = action
            if op not in OPS or not 0 <= stage < num_stages or not 0 <= micro_batch < micro_batches:
                raise ValueError(f"{where} is outside the schedule: stages 0..{num_stages - 1}, micro-batches "
                                 f"0..{micro_batches - 1}, ops {'/'.join(OPS)}")
            if rank_of_stage.setdefault(stage, rank) != rank:
                raise ValueError(f"{where}: stage {stage} also runs on rank {rank_of_stage[stage]}; a stage "
                                 f"lives on one rank")
            if action in seen:
                raise ValueError(f"{where} runs twice")
            needed = _needs(action)
            if needed is not None and needed not in seen:
                raise ValueError(f"{where} runs before its {_NEEDED_NAME[op]} {needed}")
            seen.add(action)
    for stage in range(num_stages):
        for micro_batch in range(micro_batches):
            ran = {op for op in OPS if Action(stage, op, micro_batch) in seen}
            if ran not in ({FORWARD, FULL_BACKWARD}, {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}):
                raise ValueError(f"stage {stage}, micro-batch {micro_batch} runs {''.join(sorted(ran)) or 'nothing'}; "
                                 f"it needs F and B, or F, I and W")


_NEEDED_NAME = {FULL_BACKWARD: "forward", BACKWARD_INPUT: "forward", BACKWARD_WEIGHT: "input-gradient backward"}


def _needs(action: Action) -> Action | None:
    """The action of the same stage and micro-batch that must have run earlier on the same rank."""
    if action.op in (FULL_BACKWARD, BACKWARD_INPUT):
        return action._replace(op=FORWARD)
    if action.op == BACKWARD_WEIGHT:
        return action._replace(op=BACKWARD_INPUT)
    return None
