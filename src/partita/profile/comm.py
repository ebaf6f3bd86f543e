"""Measure the real backend between the real ranks: point-to-point and all-reduce, as latency + bytes/bandwidth.

Point-to-point: a ping-pong between ranks 0 and 1 (every other rank waits at a barrier); all-reduce: over
all ranks. Each is timed at a few sizes and fitted by least squares (the alpha-beta model).
"""

from __future__ import annotations

import statistics
import time

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
    """Time of an all-reduce over all ranks, by size; None with one rank."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    points = []
    for nbytes in SIZES_BYTES:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(REPEATS + 1):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            _sync(device)
            times.append(time.perf_counter() - start)
        points.append((nbytes, statistics.median(times[1:])))
    return _fit(points)
