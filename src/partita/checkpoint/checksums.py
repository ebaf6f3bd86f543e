"""The checksum of every file of a checkpoint: recorded in its manifest at save, compared before anything is read.

A file's length shows a truncated file, not a value changed in place (a flipped bit, one float overwritten):
that loaded as if nothing were wrong. Each rank checksums the data files it wrote, rank 0 also `.metadata`; on
load the ranks share the files to check, so that checking costs one more read of the checkpoint in all, not one
per rank. The checksum is xxHash's XXH3-64: the standard library's zlib.crc32 (1.5-4 GB/s here) took 9-14% of a
save of 4 ranks on 2 cores, XXH3 4-8 times less time, 2-5% (bench/checkpoint_time.py prints its share). Where
xxhash is not installed (machines that cannot install packages) partita writes crc32 instead: each recorded
checksum names its algorithm. A checkpoint without checksums (saved before partita recorded them) is refused unless
PARTITA_UNVERIFIED_CHECKPOINTS=on.
"""

from __future__ import annotations

import logging
import os
import stat
import zlib
from pathlib import Path

try:
    import xxhash
except ImportError:  # a machine that cannot install it: slower checksums, as good at finding damage
    xxhash = None

from partita.checkpoint.layout import previous_checkpoint
from partita.checkpoint.manifest import MANIFEST, Manifest
from partita.checkpoint.unpickling import METADATA
from partita import settings
from partita.errors import CheckpointError

_BLOCK = 4 << 20  # bytes read at a time: few system calls, and the block stays in the CPU's cache

log = logging.getLogger("partita")
_said_unverified = False  # the note about checkpoints without checksums is given once per process
ALGORITHM = "xxh3_64" if xxhash is not None else "crc32"  # what this process records


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def file_checksum(path: Path, algorithm: str | None = None) -> str:
    """"<algorithm>:<hex digest>" of the file's bytes (by default this process's ALGORITHM)."""
    algorithm = algorithm or ALGORITHM
    if algorithm == "xxh3_64" and xxhash is None:
        raise CheckpointError(f"{path.parent} records xxh3_64 checksums, and this Python has no xxhash package to "
                              "compute them: pip install xxhash, or load it where xxhash is installed")
    digest = xxhash.xxh3_64() if algorithm == "xxh3_64" else _Crc32()
    block = bytearray(_BLOCK)
    view = memoryview(block)
    # without blocking: a FIFO named in a crafted manifest would wait for a writer; a device such as /dev/zero
    # (through a link) would never end
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"{path.parent} is damaged or was tampered with: its {path.name} is not a regular "
                                  f"file, and a checkpoint holds only those. {_previous(path.parent)}")
        while n := f.readinto(block):
            digest.update(view[:n])
    return f"{algorithm}:{digest.hexdigest()}"


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
        recorded = manifest.checksums[name]
        try:
            found = file_checksum(directory / name, recorded.partition(":")[0])
        except OSError as e:
            raise CheckpointError(f"{directory} is damaged: its file {name} cannot be read ({e}). "
                                  f"{_previous(directory)}") from None
        if found != recorded:
            raise CheckpointError(
                f"{directory} is damaged: its file {name} changed after it was saved (checksum {found}, the manifest "
                f"recorded {recorded}), so its values cannot be trusted. {_previous(directory)}")


def check(directory: Path, manifest: Manifest, data_files, *, rank: int = 0, world_size: int = 1) -> None:
    """Verify this rank's share of the checkpoint's files (every file in one process) against the checksums in
    its manifest, and that each of `data_files` (the files DCP's metadata names) has one and the manifest names no
    other. A checkpoint without checksums (saved before partita recorded them, or with them removed) is refused,
    unless PARTITA_UNVERIFIED_CHECKPOINTS=on: then it loads unverified, which rank 0 says once per process."""
    global _said_unverified
    if not manifest.checksums:
        if not settings.unverified_checkpoints_allowed():
            raise CheckpointError(
                f"{directory} has no checksums in its {MANIFEST}, so nothing shows that its files are the ones "
                "saved: partita.save records them in every checkpoint, and a manifest without them was written by a "
                "partita before they were recorded, or edited since. Load another checkpoint, or, if you trust this "
                "one, load it unverified with PARTITA_UNVERIFIED_CHECKPOINTS=on")
        if rank == 0 and not _said_unverified:
            _said_unverified = True
            log.warning("%s has no checksums: its files are loaded unverified (PARTITA_UNVERIFIED_CHECKPOINTS=on)",
                        directory)
        return
    # .metadata first, on every rank (it is small): the files it names are those whose checksums count
    verify(directory, manifest, [METADATA] if METADATA in manifest.checksums else [])
    others = sorted(set(manifest.checksums) - set(data_files) - {METADATA})
    if others:  # read none of them: a crafted name may be a FIFO, whose reading would wait forever
        raise CheckpointError(f"{directory} was tampered with: its {MANIFEST} records a checksum of {others[0]}, "
                              f"which is not one of its files (those {METADATA} names, and {METADATA}). "
                              f"{_previous(directory)}")
    verify(directory, manifest, share(set(manifest.checksums) - {METADATA}, rank, world_size))
    unrecorded = sorted(set(data_files) - set(manifest.checksums))
    if unrecorded:
        raise CheckpointError(f"{directory} is damaged or was tampered with: its data file {unrecorded[0]} has no "
                              f"checksum in {MANIFEST}. {_previous(directory)}")


def _previous(directory: Path) -> str:
    previous = previous_checkpoint(directory)
    if previous is None:
        return f"There is no earlier checkpoint under {directory.parent}."
    return f"Load the previous checkpoint instead: {previous}"
