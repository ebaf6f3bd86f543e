"""Every rank starts from the same software, plan, stage boundaries and initial weights: checked once per layout,
as each rank has built its part (`build.build_runtime`).

Each is a digest. The plan comes from rank 0 and the boundaries follow from it and from the graph (which
`planning.agree_on_graph` compared), and partita gives every rank the same initial values (rank 0's, or those
`init_fn` or `weights=` make): a difference is a fault of partita or of the ranks' environments, which would
otherwise train silently wrong. A tensor is compared among the ranks that hold it whole (a pipeline rank holds its
stages' tensors, the others are meta there; FSDP's shards differ by design and are left out).

The check costs one all-reduce of two int64s per tensor (the largest and the negated smallest digest of its
holders, equal only where every holder's is the same) and one pass over the rank's weights on its device; only
where something differs, an all-gather of every rank's digests names the ranks.
"""

from __future__ import annotations

import hashlib
import platform

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from partita.errors import PartitaError
from partita.runtime import agreement

_NOTHING = -(2 ** 63)  # what a rank says for a tensor it does not hold whole
_CHUNK = 1 << 22  # words of a tensor summed at once: bounds the temporary memory of a digest
_ODD = 0x9E3779B97F4A7C15 - 2 ** 64  # a word's weight steps by this: the digest sees where each word is


def _text_digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def value_digest(t: torch.Tensor) -> int:
    """A digest of a tensor's bits: on the CPU, SHA-1 of its bytes (0.7 GB/s on one core, where `word_sum` in torch
    ran at 0.06); on an accelerator, `word_sum` on the device.

    >>> a = torch.tensor([1.0, 2.0]); value_digest(a) == value_digest(a.clone())
    True
    >>> value_digest(a) == value_digest(a.flip(0))
    False
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        return int.from_bytes(hashlib.sha1(raw.numpy(), usedforsecurity=False).digest()[:8], "little")
    return word_sum(raw)


def word_sum(raw: torch.Tensor) -> int:
    """The sum of a byte tensor's 32-bit words (bytes where it has no whole words), each weighted by its position,
    modulo 2**64: exact whatever order the sum runs in, so on any device.

    >>> b = torch.tensor([1.0, 2.0, 3.0]).view(torch.uint8)
    >>> word_sum(b) == word_sum(b.clone()), word_sum(b) == word_sum(b.view(torch.float32).flip(0).view(torch.uint8))
    (True, False)
    >>> word_sum(b[:3]) != word_sum(b[1:4])
    True
    """
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0 else raw
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=raw.device) * _ODD + 1
        total += (part * weight).sum()
    return int(total)


def _held_whole(t: torch.Tensor) -> bool:
    return not isinstance(t, DTensor) and t.device.type != "meta"


def _statements(module: nn.Module, plan_text: str, boundaries: str) -> tuple[list[str], list[int]]:
    """What this rank starts from: names, and their digests (_NOTHING where it holds no whole copy)."""
    import partita

    software = f"python {platform.python_version()}, torch {torch.__version__}, partita {partita.__version__}"
    names = ["software (Python, torch, partita)", "plan", "stage boundaries"]
    digests = [_text_digest(software), _text_digest(plan_text), _text_digest(boundaries)]
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, t in tensors:
        names.append(f"the initial values of {name!r}")
        held = _held_whole(t)
        digests.append(_text_digest(f"{tuple(t.shape)} {t.dtype} {value_digest(t)}") if held else _NOTHING)
    return names, digests


def check_same_start(module: nn.Module, plan_text: str, boundaries: str) -> None:
    """Collective: every rank raises the same PartitaError where two ranks start from different software, plan,
    stage boundaries or initial values of a tensor both hold whole."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    names, digests = _statements(module, plan_text, boundaries)
    mine = torch.tensor(digests, dtype=torch.int64)
    held = mine != _NOTHING
    extremes = torch.cat([mine, torch.where(held, -mine, torch.full_like(mine, _NOTHING))])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=agreement.cpu_group())
    n = len(digests)
    differ = (extremes[:n] != _NOTHING) & (extremes[:n] != -extremes[n:])
    if not bool(differ.any()):
        return
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=agreement.cpu_group())
    raise PartitaError(different_starts(names, [d.tolist() for d in every]))


def different_starts(names: list[str], every: list[list[int]]) -> str:
    """What differs between the ranks' starts, given every rank's digests (see `_statements`); the same text on
    every rank."""
    found = []
    for i, name in enumerate(names):
        groups: dict[int, list[int]] = {}
        for rank, digests in enumerate(every):
            if digests[i] != _NOTHING:
                groups.setdefault(digests[i], []).append(rank)
        if len(groups) > 1:
            found.append(f"{name}: " + " / ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                                                   for rs in groups.values()))
    shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"the ranks would start training from different states, and train silently wrong: {shown} differ "
            "(ranks separated by / hold different ones). partita gives every rank rank 0's plan and the same initial "
            "values (rank 0's, or those init_fn or weights= make), so this is a fault of the ranks' environments or "
            "of partita: install the same versions of Python, torch and partita on every node, build the same model "
            "on every rank, and report it to partita's authors with this message if it persists.")
