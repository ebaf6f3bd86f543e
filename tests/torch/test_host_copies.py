"""Host tensors reach a rank's device as `Tensor.to` would put them there (through pinned memory on a GPU:
tests/gpu/test_cuda.py); on the CPU a copy is an ordinary one."""

import torch

from partita.runtime.host_copies import HostCopies


def test_on_the_cpu_a_copy_is_an_ordinary_one():
    copies = HostCopies(torch.device("cpu"))
    t = torch.arange(6, dtype=torch.float32)
    assert not copies.pinned(t)
    assert copies.to(t) is t  # already there: no copy, as Tensor.to
    copied = copies.to(t, copy=True)
    assert copied is not t and copied.data_ptr() != t.data_ptr() and torch.equal(copied, t)
    halved = copies.to(t, torch.float16)
    assert halved.dtype == torch.float16 and torch.equal(halved.float(), t)
    copies.finish()
    assert copies.in_flight_bytes == 0


def test_a_meta_tensor_is_never_staged_in_pinned_memory():
    """Pinning needs real memory: only CPU tensors bound for a GPU are staged."""
    assert not HostCopies(torch.device("cuda")).pinned(torch.empty(2, device="meta"))
    assert HostCopies(torch.device("cuda")).pinned(torch.empty(2))
