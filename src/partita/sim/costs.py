"""What one pipeline step costs, stage by stage: the simulator's input besides the orders."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Seconds per micro-batch of each stage; every field is a tuple indexed by stage.

    `send_activations_s[s]` is the time to send stage s's output to stage s+1, `send_gradients_s[s]` the time
    to send stage s's input gradients back to stage s-1 (the last and the first entry are unused). The
    simulator ignores them between stages on the same rank. An empty tuple means zeros for the sends, and for
    `backward_input_s` / `backward_weight_s` (the I and W halves of a split backward) half of `backward_s`
    each. Lists are accepted and stored as tuples.

    >>> costs = StageCosts(forward_s=(1.0, 1.0), backward_s=(2.0, 2.0))
    >>> costs.num_stages, costs.send_activations_s, costs.backward_input_s
    (2, (0.0, 0.0), (1.0, 1.0))
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    send_activations_s: tuple[float, ...] = ()
    send_gradients_s: tuple[float, ...] = ()
    backward_input_s: tuple[float, ...] = ()
    backward_weight_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        num_stages = len(self.forward_s)
        halves = tuple(b / 2 for b in self.backward_s)
        defaults = {"send_activations_s": (0.0,) * num_stages, "send_gradients_s": (0.0,) * num_stages,
                    "backward_input_s": halves, "backward_weight_s": halves}
        for name in ("forward_s", "backward_s", *defaults):
            values = tuple(float(v) for v in getattr(self, name)) or defaults.get(name, ())
            if len(values) != num_stages:
                raise ValueError(f"StageCosts.{name} has {len(values)} entries; it needs one per stage "
                                 f"({num_stages}, as forward_s)")
            if any(v < 0 for v in values):
                raise ValueError(f"StageCosts.{name} has a negative time: {values}")
            object.__setattr__(self, name, values)
        if num_stages == 0:
            raise ValueError("StageCosts needs at least one stage")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(cls, num_stages: int, forward_s: float, backward_s: float, send_s: float = 0.0) -> StageCosts:
        """Every stage the same; both sends of every stage take `send_s`.

        >>> StageCosts.uniform(3, 1.0, 2.0).backward_s
        (2.0, 2.0, 2.0)
        """
        return cls(forward_s=(forward_s,) * num_stages, backward_s=(backward_s,) * num_stages,
                   send_activations_s=(send_s,) * num_stages, send_gradients_s=(send_s,) * num_stages)
