"""The model as the planner sees it: blocks in execution order, with numbers as functions of the batch rows.

A block is a run of consecutive graph operations that belong to one module (a transformer layer, an
embedding, a head), chosen coarse enough to plan quickly and fine enough to balance stages. Stages are
contiguous ranges of blocks. Blocks with the same signature have the same structure and shapes (the N
layers of a transformer), so one measurement serves all of them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from partita.errors import InternalError


@dataclass(frozen=True)
class Fit:
    """A quantity as a function of the rows of a micro-batch: the largest of a few lines `fixed + per_row * rows`.

    One line for a measured or counted quantity; two (compute and memory traffic) for a roofline time.

    >>> Fit.line(2.0, 0.5).at(4)
    4.0
    >>> Fit(((1.0, 0.0), (0.0, 1.0))).at(3)
    3.0
    """

    lines: tuple[tuple[float, float], ...] = ((0.0, 0.0),)

    @classmethod
    def line(cls, fixed: float, per_row: float) -> "Fit":
        return cls(((float(fixed), float(per_row)),))

    @classmethod
    def through(cls, rows_a: float, value_a: float, rows_b: float, value_b: float) -> "Fit":
        """The line through two measurements."""
        per_row = (value_b - value_a) / (rows_b - rows_a)
        return cls.line(value_a - per_row * rows_a, per_row)

    @classmethod
    def timed(cls, rows_a: float, seconds_a: float, rows_b: float, seconds_b: float) -> "Fit":
        """Seconds timed at `rows_a` < `rows_b` rows: the line through both, and below `rows_a` never less per
        row than there. A block timed alone at few rows runs in a cache that holds all it reads (on a CPU), so
        its line can fall towards zero rows faster than in proportion (a negative fixed cost); extended below
        the measurements it priced a micro-batch of one row at a third of what it takes in a training step, and
        the planner split batches into micro-batches of one row that ran twice as long as estimated."""
        line = cls.through(rows_a, seconds_a, rows_b, seconds_b)
        (fixed, _), = line.lines
        return line if fixed >= 0 else cls((*line.lines, (0.0, seconds_a / rows_a)))

    def at(self, rows: float) -> float:
        return max(0.0, max(f + p * rows for f, p in self.lines))

    def __add__(self, other: "Fit") -> "Fit":
        if len(self.lines) == 1 and len(other.lines) == 1:
            (f1, p1), (f2, p2) = self.lines[0], other.lines[0]
            return Fit.line(f1 + f2, p1 + p2)
        raise InternalError(f"only single lines add, got fits of {len(self.lines)} and {len(other.lines)} lines; "
                            "evaluate roofline fits with .at(rows) first")

    def scaled(self, k: float) -> "Fit":
        return Fit(tuple((f * k, p * k) for f, p in self.lines))


@dataclass(frozen=True)
class Block:
    index: int
    name: str  # the module it belongs to, e.g. "layers.17" ("" for the root module)
    units: tuple[int, int]  # [start, stop) of the splitter's units (capture.split.units)
    first_node: str
    last_node: str
    signature: str  # equal for blocks of equal structure and shapes
    num_ops: int
    fwd_flops: Fit  # forward FLOPs
    fwd_bytes: Fit  # bytes its forward ops read and write (memory traffic)
    activation_bytes: Fit  # bytes of the tensors its forward produces (an upper bound of what backward keeps)
    params: tuple[str, ...]  # FQNs of the parameters it reads (tied parameters under one name)
    writes_buffers: bool = False  # updates buffers in place (BatchNorm statistics): never recomputed


@dataclass(frozen=True)
class ModelGraph:
    """What the planner needs to know about a model, as plain numbers."""

    blocks: tuple[Block, ...]
    param_bytes: dict[str, int]  # FQN -> bytes, every parameter some block reads
    boundary_bytes: tuple[Fit, ...]  # bytes live across the cut after block i (i < num_blocks - 1)
    input_bytes: Fit  # bytes of the tensor inputs of one call
    # of the blocks' structure (their first and last operations and their parameters): what a saved plan is
    # matched against, so that it serves the same model at other input sizes
    fingerprint: str = field(default="")
    output_bytes: Fit = Fit.line(0.0, 0.0)  # bytes of the tensor outputs of one call
    # of the whole captured graph (every operation, in order, its arguments and shapes: capture.listing), which
    # every rank of a job must have captured alike
    digest: str = ""
    # param_bytes_of by (start, stop): the planner asks for the same ranges under every candidate layout
    _param_bytes_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.fingerprint:
            text = json.dumps([[b.first_node, b.last_node, b.params] for b in self.blocks])
            object.__setattr__(self, "fingerprint", hashlib.sha256(text.encode()).hexdigest()[:16])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_units(self) -> int:
        return self.blocks[-1].units[1] if self.blocks else 0

    def params_of(self, start: int, stop: int) -> set[str]:
        return {p for b in self.blocks[start:stop] for p in b.params}

    def param_bytes_of(self, start: int, stop: int) -> int:
        key = (start, stop)
        if key not in self._param_bytes_cache:
            self._param_bytes_cache[key] = sum(self.param_bytes[p] for p in self.params_of(start, stop))
        return self._param_bytes_cache[key]

    def stage_of_unit(self, stage_of_block: list[int]) -> list[int]:
        """Expand a per-block stage assignment to the splitter's units."""
        return [stage for block, stage in zip(self.blocks, stage_of_block) for _ in range(*block.units)]
