"""The checksum of every file of a checkpoint: recorded in its manifest at save, compared before anything is read.

A file's length shows a truncated file, not a value changed in place (a flipped bit, one float overwritten):
that loaded as if nothing were wrong. Each rank checksums the data files it wrote, rank 0 also `.metadata`; on
load the ranks share the files to check, so that checking costs one more read of the checkpoint in all, not one
per rank. The checksum is xxHash's XXH3-64: the standard library's zlib.crc32 (1.5-4 GB/s here) took 9-14% of a
save of 4 ranks on 2 cores, XXH3 4-8 times less time, 2-5% (bench/checkpoint_time.py prints its share).
Checkpoints saved before partita recorded checksums load unverified.
"""

from __future__ import annotations

import logging
from pathlib import Path

import xxhash

from partita.checkpoint.layout import previous_checkpoint
from partita.checkpoint.manifest import MANIFEST, Manifest
from partita.errors import CheckpointError

_BLOCK = 4 << 20  # bytes read at a time: few system calls, and the block stays in the CPU's cache

log = logging.getLogger("partita")
_said_unverified = False  # the note about checkpoints without checksums is given once per process


def file_checksum(path: Path) -> str:
    """XXH3-64 of the file's bytes, as 16 hex digits."""
    digest = xxhash.xxh3_64()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def checksums_of(directory: Path, names) -> dict[str, str]:
    """The checksum of each named file of `directory`."""
    return {name: file_checksum(directory / name) for name in sorted(names)}


def share(names, rank: int, world_size: int) -> list[str]:
    """The files that `rank` checks when every rank loads the same checkpoint: every world_size-th one."""
    return sorted(names)[rank::world_size]


def verify(directory: Path, manifest: Manifest, names) -> None:
    """Raise unless each named file of `directory` has the checksum its manifest recorded; the error names the
    first file that differs and the checkpoint saved before this one."""
    for name in sorted(names):
        try:
            found = file_checksum(directory / name)
        except OSError as e:
            raise CheckpointError(f"{directory} is damaged: its file {name} cannot be read ({e}). "
                                  f"{_previous(directory)}") from None
        if found != manifest.xxh3_64[name]:
            raise CheckpointError(
                f"{directory} is damaged: its file {name} changed after it was saved (checksum {found}, the manifest "
                f"recorded {manifest.xxh3_64[name]}), so its values cannot be trusted. {_previous(directory)}")


def check(directory: Path, manifest: Manifest, data_files, *, rank: int = 0, world_size: int = 1) -> None:
    """Verify this rank's share of the checkpoint's files (every file in one process) against the checksums in
    its manifest, and that each of `data_files` (the files DCP's metadata names) has one. A checkpoint saved
    before partita recorded checksums loads unverified: rank 0 says so, once per process."""
    global _said_unverified
    if not manifest.xxh3_64:
        if rank == 0 and not _said_unverified:
            _said_unverified = True
            log.warning("%s has no checksums (saved by an earlier partita): its files are loaded unverified; "
                        "checkpoints saved from now on are checked", directory)
        return
    verify(directory, manifest, share(manifest.xxh3_64, rank, world_size))
    unrecorded = sorted(set(data_files) - set(manifest.xxh3_64))
    if unrecorded:
        raise CheckpointError(f"{directory} is damaged or was tampered with: its data file {unrecorded[0]} has no "
                              f"checksum in {MANIFEST}. {_previous(directory)}")


def _previous(directory: Path) -> str:
    previous = previous_checkpoint(directory)
    if previous is None:
        return f"There is no earlier checkpoint under {directory.parent}."
    return f"Load the previous checkpoint instead: {previous}"
