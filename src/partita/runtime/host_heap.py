"""How a CPU rank's C heap (glibc's malloc) serves the big tensors a step allocates and frees, set for the plan.

glibc serves a block above its mmap threshold by mapping memory for it alone, unmapped when freed; below the
threshold, from heaps that keep freed blocks for the next allocations. Neither suits every plan:

- Under FSDP's levels every micro-batch gathers each unit's parameters and frees them, and reduce-scatters
  from buffers freed after: kept in per-thread heaps, these freed blocks made a rank's resident memory 20-32 %
  more than the plan's (bench/memory_accuracy.py, 2 x 2 ZeRO-2 and ZeRO-3). Blocks of 1 MiB and more are mapped
  on their own, and go back to the system when freed.
- Otherwise, a mapped block is faulted in page by page every time it is allocated: with blocks of 1 MiB and
  more mapped, a step of bench/plan_quality.py's imbalanced model took 1.5 x as long per row at 8 to 16 rows,
  and the blocks timed alone at those rows paid it too, which bent their lines (see Fit.timed). Blocks up to
  32 MiB (the highest glibc's own moving threshold goes) come from the heap, which keeps up to twice that free
  at its top rather than returning and faulting it in again.

A user's MALLOC_MMAP_THRESHOLD_ is left alone. Other C libraries have their own rules and are left alone too.
"""

from __future__ import annotations

import ctypes
import os

import torch

from partita.plan.plan import FSDP_LEVELS, Plan

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
GLIBC_TRIM_BYTES = 128 * 2**10  # glibc's default
SHARDED_MAP_BYTES = 2**20
HEAP_MAP_BYTES = 32 * 2**20


def thresholds(plan: Plan) -> tuple[int, int]:
    """(mmap threshold, trim threshold) in bytes for a rank running `plan`."""
    if any(s.sharding in FSDP_LEVELS for s in plan.stages):
        return SHARDED_MAP_BYTES, GLIBC_TRIM_BYTES
    return HEAP_MAP_BYTES, 2 * HEAP_MAP_BYTES


def set_for(plan: Plan, device: torch.device) -> None:
    """Set this process's heap for `plan` where it computes on the CPU (a GPU's memory has its own allocator)."""
    if device.type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mapped, trimmed = thresholds(plan)
        libc.mallopt(_M_MMAP_THRESHOLD, mapped)
        libc.mallopt(_M_TRIM_THRESHOLD, trimmed)
    except (OSError, AttributeError):  # not glibc
        pass
