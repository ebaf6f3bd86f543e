"""Whole-model views on every rank: parameters, buffers and optimizer state, gathered from their owners.

A rank holds only the tensors of the stages it runs (the others are meta on it); the owner of a tensor is
the lowest rank that runs a stage reading it (every holder has the same value after a step). A tensor this
rank does not hold arrives in host memory. Where FSDP shards a stage (`fully_sharded.py`), its replicas hold
DTensors: each view gathers them whole first (`full_value`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from partita.runtime.route import TensorSpec, pack, unpack


def broadcast_from_owners(named: list[tuple[str, torch.Tensor]], owner: dict[str, int],
                          device: torch.device) -> "OrderedDict[str, torch.Tensor]":
    """A copy of every tensor, taken from its owner: one broadcast per owner rank."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict((n, t.detach().clone()) for n, t in named)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return out
    by_owner: dict[int, list[str]] = {}
    for name, _ in named:
        by_owner.setdefault(owner.get(name, 0), []).append(name)
    for src in sorted(by_owner):
        names = by_owner[src]
        for n, t in zip(names, broadcast_packed([out[n] for n in names], src, device)):
            out[n] = t.to(landing(out[n])).clone()
    return out


def landing(t: torch.Tensor) -> torch.device:
    """Where a copy of `t` taken from another rank goes: next to this rank's own copy, or to host memory."""
    return torch.device("cpu") if t.is_meta else t.device


def broadcast_packed(tensors: list[torch.Tensor], src: int, device: torch.device,
                     group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Rank `src`'s values of `tensors` on every rank of `group`, in one broadcast: views into one byte buffer
    on `device`. The other ranks' `tensors` give only shapes and dtypes (they may be meta)."""
    specs = [TensorSpec.of(t) for t in tensors]
    if dist.get_rank() == src:
        buffer = pack(tensors, device)
    else:
        buffer = torch.empty(sum(s.padded_nbytes for s in specs), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=group)
    return unpack(buffer, specs)


def broadcast_tensors(tensors: list[torch.Tensor], device: torch.device, src: int = 0,
                      group: dist.ProcessGroup | None = None) -> None:
    """Overwrite `tensors` on every rank of `group` with rank `src`'s values, in one broadcast."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not tensors:
        return
    values = broadcast_packed(tensors, src, device, group)
    if dist.get_rank() != src:
        with torch.no_grad():
            for t, value in zip(tensors, values):
                t.copy_(value)


def gather_optimizer_state(state_dict: dict, owner_of_index: dict[int, int], rank: int) -> dict:
    """The optimizer's state_dict with every parameter's state, taken from the rank that owns it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return state_dict
    # every replica of a sharded stage takes part in gathering its state, in the same order
    whole = {i: {k: full_value(v) for k, v in s.items()} for i, s in sorted(state_dict["state"].items())}
    mine = {i: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
            for i, s in whole.items() if owner_of_index.get(i, 0) == rank}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {}
    for part in every:
        merged.update(part)
    return {"state": dict(sorted(merged.items())), "param_groups": state_dict["param_groups"]}


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A whole optimizer state tensor of `param` as `param` is held: this replica's shard where `param` is
    sharded (every replica cuts its own: no communication), else moved to its device."""
    if isinstance(param, DTensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        return distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                 src_data_rank=None)
    return value.to(param.device)


def full_value(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` whole: a sharded tensor gathered from its replicas (collective over them), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: its shard of a sharded tensor, else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t
