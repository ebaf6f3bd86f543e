"""Measure the real backend between the real ranks: point-to-point and the collectives partita runs, as
latency + bytes/bandwidth.

Point-to-point: a ping-pong between ranks 0 and 1 (every other rank waits at a barrier); all-reduce,
reduce-scatter and all-gather: over all ranks. Each is timed at a few sizes and fitted by least squares (the
alpha-beta model).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from partita.cluster import Link

SIZES_BYTES = (4 * 2**10, 256 * 2**10, 2 * 2**20, 8 * 2**20)
REPEATS = 5


def _fit(points: list[tuple[float, float]]) -> Link:
    """Least-squares latency and bandwidth from (bytes, seconds) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)  # a measured bandwidth is finite
    latency = max(my - slope * mx, 0.0)
    return Link(latency_s=latency, bandwidth_bps=1.0 / slope)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_p2p(device: torch.device) -> Link | None:
    """One-way time of a message between ranks 0 and 1; None with fewer than two ranks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    rank = dist.get_rank()
    points = []
    for nbytes in SIZES_BYTES:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(REPEATS + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            _sync(device)
            times.append((time.perf_counter() - start) / 2)
        points.append((nbytes, statistics.median(times[1:])))
    return _fit(points) if rank == 0 else None


def measure_allreduce(device: torch.device) -> Link | None:
    """Time of an all-reduce of a tensor over all ranks, by its size; None with one rank."""
    return _measure_collective(device, lambda whole, _: dist.all_reduce(whole))


def measure_reduce_scatter(device: torch.device) -> Link | None:
    """Time of a reduce-scatter of a tensor over all ranks (each keeps its share of the sum), by the whole
    tensor's size; None with one rank. FSDP's backward runs one per unit; gloo's costs more than half an
    all-reduce (measured 1.5 times an all-reduce on 4 CPU ranks)."""
    return _measure_collective(device, lambda whole, share: _REDUCE_SCATTER(share, whole))


def measure_allgather(device: torch.device) -> Link | None:
    """Time of an all-gather of every rank's share into the whole tensor, by the whole tensor's size; None with
    one rank. FSDP gathers each unit's parameters so."""
    return _measure_collective(device, lambda whole, share: _ALL_GATHER(whole, share))


# torch 2.13 renamed the tensor forms of these two (the old names warn on every call, in the user's log); 2.11 has
# only the old ones
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _measure_collective(device: torch.device, run: Callable[[torch.Tensor, torch.Tensor], object]) -> Link | None:
    """`run(whole, share)` over all ranks, timed at each size of the whole tensor and fitted."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world = dist.get_world_size()
    points = []
    for nbytes in SIZES_BYTES:
        share = torch.zeros(max(1, nbytes // 4 // world), dtype=torch.float32, device=device)
        whole = torch.zeros(share.numel() * world, dtype=torch.float32, device=device)
        times = []
        for _ in range(REPEATS + 1):
            dist.barrier()
            start = time.perf_counter()
            run(whole, share)
            _sync(device)
            times.append(time.perf_counter() - start)
        points.append((whole.numel() * 4, statistics.median(times[1:])))
    return _fit(points)
