"""How a CPU rank's C heap (glibc's malloc) serves the big tensors a step allocates and frees, set for the plan.

glibc serves a block above its mmap threshold by mapping memory for it alone, unmapped when freed; below the
threshold, from heaps that keep freed blocks for the next allocations. Each costs something the other does not:

- A mapped block is faulted in page by page every time it is allocated. With every block of 1 MiB and more
  mapped, a step of bench/plan_quality.py's imbalanced model took 1.5 x as long per row at 8 to 16 rows (its
  GPT 8 % longer), and the blocks timed alone at those rows paid it too, which bent their lines (Fit.timed).
- Heaps keep what a step freed in pieces that the next allocations do not always fit: a rank's resident memory
  then runs above the live tensors that the plan counts, by up to 42 % (a 4-stage GPT with recomputation; 13 %
  with big blocks mapped), and under FSDP's levels, which gather and free every unit's parameters for every
  micro-batch, it grows with every step (2.9 x the plan after three steps of data parallelism under ZeRO-3;
  1 % mapped) (bench/memory_accuracy.py).

So a rank that runs none of FSDP's levels and whose plan leaves room for what the heap keeps uses the heap for
blocks up to 32 MiB (the highest glibc's own moving threshold goes), keeping up to twice that free at its top
rather than returning it and faulting it in again. Any other rank maps blocks of 1 MiB and more, which go back
to the system when freed, so that its resident memory stays what the plan says.

A user's MALLOC_MMAP_THRESHOLD_ is left alone. Other C libraries have their own rules and are left alone too.
"""

from __future__ import annotations

import ctypes
import os

import torch

from partita.plan.plan import FSDP_LEVELS, Plan

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
GLIBC_TRIM_BYTES = 128 * 2**10  # glibc's default
MAPPED_BYTES = 2**20
HEAP_BYTES = 32 * 2**20
HEAP_ROOM = 3 / 2  # the heap is used where the plan's peak memory per rank, this many times over, fits the rank


def uses_heap(plan: Plan) -> bool:
    """Whether a rank running `plan` uses the heap: none of FSDP's levels, and room for what the heap keeps (a
    plan without memory estimates, made by hand, is taken to leave it)."""
    if any(s.sharding in FSDP_LEVELS for s in plan.stages):
        return False
    peak = max(s.memory_bytes for s in plan.stages)
    return not plan.device_memory_bytes or peak * HEAP_ROOM <= plan.device_memory_bytes


def thresholds(plan: Plan) -> tuple[int, int]:
    """(mmap threshold, trim threshold) in bytes for a rank running `plan`."""
    return (HEAP_BYTES, 2 * HEAP_BYTES) if uses_heap(plan) else (MAPPED_BYTES, GLIBC_TRIM_BYTES)


def set_by_user() -> bool:
    """Whether the user set glibc's mmap threshold (MALLOC_MMAP_THRESHOLD_), which `set_for` leaves alone."""
    return "MALLOC_MMAP_THRESHOLD_" in os.environ


def set_for(plan: Plan, device: torch.device) -> None:
    """Set this process's heap for `plan` where it computes on the CPU (a GPU's memory has its own allocator)."""
    if device.type != "cpu" or set_by_user():
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mapped, trimmed = thresholds(plan)
        libc.mallopt(_M_MMAP_THRESHOLD, mapped)
        libc.mallopt(_M_TRIM_THRESHOLD, trimmed)
    except (OSError, AttributeError):  # not glibc
        pass
