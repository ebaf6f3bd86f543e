"""One compute action of a pipeline schedule, with a short text form ("2F3") that converts both ways.

The text form is torch's (`torch.distributed.pipelining.schedules._Action`): stage index, op letter,
micro-batch index. Only compute ops are modelled; sends and receives follow from the orders and the placement.
"""

from __future__ import annotations

import re
from typing import NamedTuple

FORWARD = "F"
FULL_BACKWARD = "B"
BACKWARD_INPUT = "I"  # zero-bubble schedules split B into I (input gradients) ...
BACKWARD_WEIGHT = "W"  # ... and W (weight gradients), run later to fill bubbles
OPS = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

_TEXT = re.compile(r"(\d+)([FBIW])(\d+)")


class Action(NamedTuple):
    """Run `op` of stage `stage` on micro-batch `micro_batch`.

    >>> a = Action(2, "F", 3)
    >>> str(a), Action.parse("2F3") == a
    ('2F3', True)
    """

    stage: int
    op: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.micro_batch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}, {self.op!r}, {self.micro_batch})"

    @staticmethod
    def parse(text: str) -> Action:
        """The action written as `str(action)`, e.g. "0B12"; ValueError for anything else."""
        match = _TEXT.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an action: write stage, op ({'/'.join(OPS)}), micro-batch, "
                             f"e.g. '2F3'")
        return Action(int(match[1]), match[2], int(match[3]))
