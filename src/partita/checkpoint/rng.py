"""The random number generators a training step draws from, as plain data (tensors, tuples, lists).

Saved per rank: ranks draw different numbers (dropout masks of different rows), and a resumed run must
continue each rank's streams where they stopped. numpy's state is kept only if the program imported numpy.
"""

from __future__ import annotations

import random
import sys

import torch


def capture() -> dict:
    state: dict = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, key, pos, has_gauss, gauss = numpy.random.get_state()
        # a plain list, not an ndarray: loading admits plain data only (weights_only)
        state["numpy"] = (kind, [int(k) for k in key], int(pos), int(has_gauss), float(gauss))
    return state


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in state:
        kind, key, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, numpy.array(key, dtype=numpy.uint32), pos, has_gauss, gauss))
