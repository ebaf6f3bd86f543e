"""Move batch rows between the ranks of one pipeline replica.

Each rank loads its own local batch, as with DDP. A replica computes on the rows of all of its ranks, so
the first stage gathers their inputs (in rank order), the last stage gathers their targets, and outputs
(and, in backward, gradients) go back to the rank whose rows they are. Tensors of any dtype travel
together as one byte buffer: one collective per exchange, not one per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def padded_nbytes(self) -> int:
        """Bytes in a packed buffer: rounded up so that the next tensor starts aligned."""
        return -(-self.nbytes // _ALIGN) * _ALIGN

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype)


_ALIGN = 8


def pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    specs = [TensorSpec.of(t) for t in tensors]
    # host tensors bound for a GPU (a CPU model's weights) are packed in pinned memory and cross in one
    # asynchronous copy, not one synchronous copy each (runtime/host_copies.py says why)
    staged = device.type == "cuda" and all(t.device.type == "cpu" for t in tensors)
    buffer = torch.empty(sum(s.padded_nbytes for s in specs), dtype=torch.uint8, device="cpu" if staged else device,
                         pin_memory=staged)
    for t, view in zip(tensors, unpack(buffer, specs)):
        view.copy_(t.detach())
    return buffer.to(device, non_blocking=True) if staged else buffer


def buckets(items: list[T], limit_bytes: int, tensor_of: Callable[[T], torch.Tensor] = lambda t: t) -> list[list[T]]:
    """`items` in order, cut into runs of one dtype whose tensors take at most `limit_bytes` together (a tensor
    bigger than that alone): one collective each, with bounded memory."""
    out: list[list[T]] = []
    current: list[T] = []
    size, dtype = 0, None
    for item in items:
        t = tensor_of(item)
        nbytes = t.numel() * t.element_size()
        if current and (size + nbytes > limit_bytes or t.dtype != dtype):
            out.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
        dtype = t.dtype
    if current:
        out.append(current)
    return out


def unpack(buffer: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """Views into `buffer`, one per spec, in packing order."""
    out, offset = [], 0
    for spec in specs:
        out.append(buffer[offset:offset + spec.nbytes].view(spec.dtype).reshape(spec.shape))
        offset += spec.padded_nbytes
    return out


def _with_rows(spec: TensorSpec, rows: int) -> TensorSpec:
    return TensorSpec((rows, *spec.shape[1:]), spec.dtype)


@dataclass(frozen=True)
class Replica:
    """The ranks whose rows one pipeline replica computes, and the group that connects them."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    rank: int
    device: torch.device

    @property
    def size(self) -> int:
        return len(self.ranks)

    def gather_rows(self, tensors: list[torch.Tensor], dst: int) -> list[torch.Tensor] | None:
        """On `dst`: each tensor concatenated along dim 0 over the replica's ranks, in rank order."""
        if self.size == 1:
            return list(tensors)
        if not tensors:
            return [] if self.rank == dst else None
        specs = [TensorSpec.of(t) for t in tensors]
        mine = pack(tensors, self.device)
        bufs = [torch.empty_like(mine) for _ in self.ranks] if self.rank == dst else None
        dist.gather(mine, bufs, dst=dst, group=self.group)
        if self.rank != dst:
            return None
        parts = [unpack(b, specs) for b in bufs]
        return [torch.cat([p[i] for p in parts]) for i in range(len(specs))]

    def scatter_rows(self, tensors: list[torch.Tensor] | None, local_specs: list[TensorSpec], src: int,
                     ) -> list[torch.Tensor]:
        """From `src`: rank i of the replica gets the i-th equal slice (dim 0) of each tensor."""
        if self.size == 1:
            return list(tensors or [])
        if not local_specs:
            return []
        mine = torch.empty(sum(s.padded_nbytes for s in local_specs), dtype=torch.uint8, device=self.device)
        chunks = None
        if self.rank == src:
            split = [t.chunk(self.size) if t.dim() else [t] * self.size for t in tensors]
            chunks = [pack([s[i] for s in split], self.device) for i in range(self.size)]
        dist.scatter(mine, chunks, src=src, group=self.group)
        return [t.clone() for t in unpack(mine, local_specs)]  # own storage: these go to the user


def replica_specs(local: list[TensorSpec], replica_size: int) -> list[TensorSpec]:
    """Specs of the replica-wide tensors made of `replica_size` local batches."""
    return [_with_rows(s, s.shape[0] * replica_size) if s.shape else s for s in local]
