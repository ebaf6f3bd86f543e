"""Blocks: the units a plan assigns to stages, in the captured graph's execution order.

A block is one operation of the captured graph together with the operations that must stay with it
(the element reads of a multi-output op). Stages are contiguous ranges of blocks. Every number is per
sample of the local batch, so the same graph serves any batch size.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Block:
    index: int
    nodes: tuple[str, ...]  # graph node names, in order
    module: str  # FQN of the innermost module that ran it ("" for the root)
    fwd_flops_per_sample: float
    fwd_flops_fixed: float  # the part that does not grow with the batch
    params: tuple[str, ...]  # FQNs of the parameters it reads (first name of tied ones)
    activation_bytes_per_sample: float  # bytes of the tensors it produces

    @property
    def name(self) -> str:
        return self.nodes[0]


@dataclass(frozen=True)
class ModelGraph:
    """What partition and plan need to know about a model, as plain numbers."""

    blocks: tuple[Block, ...]
    param_bytes: dict[str, int]  # FQN -> bytes, every parameter read by some block
    boundary_bytes_per_sample: tuple[float, ...]  # bytes live across the cut after block i
    input_bytes_per_sample: float
    fingerprint: str = field(default="")

    def __post_init__(self):
        if not self.fingerprint:
            text = json.dumps([[b.nodes, b.params] for b in self.blocks])
            object.__setattr__(self, "fingerprint", hashlib.sha256(text.encode()).hexdigest()[:16])

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def params_of(self, start: int, stop: int) -> set[str]:
        return {p for b in self.blocks[start:stop] for p in b.params}

    def param_bytes_of(self, start: int, stop: int) -> int:
        return sum(self.param_bytes[p] for p in self.params_of(start, stop))

    def to_dict(self) -> dict:
        return asdict(self)
