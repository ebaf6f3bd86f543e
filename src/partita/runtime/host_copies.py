"""Copies of host tensors onto a rank's device, through pinned (page-locked) host memory on a GPU.

partita copies host memory to the GPU where a rank takes its part of the model: a model built on the CPU
(each rank moves the tensors it keeps) and weights read from disk (`weights=`, partita checkpoints). From
ordinary (pageable) memory CUDA copies synchronously, through a staging buffer of its own, so reading the next
tensor from disk waits for each copy. Staged in pinned memory, a copy runs asynchronously on the device's
stream while the host reads or converts the next tensor. torch's caching host allocator keeps a pinned block
from being reused until the copy out of it has finished, so a copy's source may be dropped at once; waiting
for the copies every IN_FLIGHT_BYTES bounds the pinned memory they hold (it is cached and reused, not grown
with the model). Work on the device that uses a copy runs on the same stream, after it.

On any other device, or for a tensor already on the device, this is a plain synchronous copy.
"""

from __future__ import annotations

import torch

IN_FLIGHT_BYTES = 256 * 2**20


class HostCopies:
    """Copies onto `device`, asynchronous where that helps (see the module's docstring); `finish()` waits for
    the ones under way."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.in_flight_bytes = 0

    def pinned(self, t: torch.Tensor) -> bool:
        """Whether copying `t` goes through pinned memory."""
        return self.device.type == "cuda" and t.device.type == "cpu" and not t.is_meta

    def to(self, t: torch.Tensor, dtype: torch.dtype | None = None, *, copy: bool = False) -> torch.Tensor:
        """`t` on the device (in `dtype`, if given), as `Tensor.to` returns it: `t` itself if it is there
        already, unless `copy`."""
        dtype = t.dtype if dtype is None else dtype
        if not self.pinned(t):
            return t.to(device=self.device, dtype=dtype, copy=copy)
        if self.in_flight_bytes >= IN_FLIGHT_BYTES:
            self.finish()
        staged = t if t.is_pinned() else t.pin_memory()
        self.in_flight_bytes += staged.numel() * staged.element_size()
        return staged.to(device=self.device, non_blocking=True).to(dtype)

    def finish(self) -> None:
        """Wait until every copy under way has landed."""
        if self.in_flight_bytes:
            torch.cuda.current_stream(self.device).synchronize()
            self.in_flight_bytes = 0
