"""Where checkpoints live on disk, and how a new one appears all at once or not at all.

    ROOT/
      step-000120/             a complete checkpoint: DCP's files and manifest.json
      step-000130/
      latest                   "step-000130": the checkpoint saved last
      step-000140.tmp-3f9a1c/  being written, or left by a save that died: never read; removed by a later save
                               once surely abandoned (`remove_unfinished`)
      step-000110.skipped-9c2e41/  a checkpoint partita.elastic could not resume from: kept for inspection, never
                               read, counted or removed by partita

A save writes into a temporary directory next to its target and renames it into place once every rank
has finished (a rename within one directory is atomic), then replaces `latest` (a temporary file,
fsync, os.replace). A save interrupted at any point leaves the previous checkpoint and `latest` as they
were. While a save writes, its temporary directory holds `.partita-saving`, naming the host of the rank 0
that holds an flock on it: another job saving into the same root keeps a save whose lock is held. Plain
Python: no torch.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path

from partita.checkpoint.manifest import MANIFEST, Manifest, read_manifest
from partita.errors import CheckpointError

LATEST = "latest"
TMP_MARK = ".tmp-"
SKIPPED_MARK = ".skipped-"
SAVING = ".partita-saving"
# A live save writes its files, or waits at most PARTITA_TIMEOUT_S (300 s by default) for another rank, so a
# temporary entry that nothing wrote into for this long is abandoned even where its lock tells nothing.
STALE_S = 3600.0
_STEP_DIR = re.compile(r"step-(\d+)")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def temporary_dir(root: Path, step: int) -> Path:
    # secrets, not random: saving must leave the user's random streams where they were
    return root / f"{step_name(step)}{TMP_MARK}{secrets.token_hex(4)}"


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (a directory's own fsync; a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_unfinished(root: Path, now: float | None = None) -> list[Path]:
    """Delete what interrupted saves left behind (names with `.tmp-`) once surely abandoned; return what was removed.

    Another job may be saving into the same root. An entry is abandoned when its `.partita-saving` lock was
    taken on this host and no process holds it any more (the kernel drops an flock with its process: a save
    killed or failed); or, where the lock tells nothing (taken on another host, whose locks a network
    filesystem may not share; a filesystem without locks; not taken yet; older entries), when nothing in it was
    written for STALE_S. Anything else is a save in progress and stays.
    """
    now = time.time() if now is None else now
    removed = []
    for entry in sorted(root.glob(f"*{TMP_MARK}*")):
        try:
            held = _lock_held(entry / SAVING) if entry.is_dir() else None
            if held or (held is None and now - _last_write(entry) <= STALE_S):
                continue
        except FileNotFoundError:
            continue  # its save finished or another cleaner removed it meanwhile
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _lock_held(lock: Path) -> bool | None:
    """Whether a process holds the save lock `lock`; None where that cannot be told from here."""
    try:
        # opened for writing: NFS emulates flock with POSIX locks, whose exclusive kind needs it
        with open(lock, "r+") as f:
            if f.read().strip() != socket.gethostname():
                return None
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False  # closing the file releases the lock just taken
    except OSError:  # no lock file (yet, or any more), another user's, or a filesystem without locks
        return None


def _last_write(entry: Path) -> float:
    """When anything in `entry` (a file, or a directory and its files: DCP writes them flat) last changed."""
    times = [entry.lstat().st_mtime]
    if entry.is_dir() and not entry.is_symlink():
        for child in entry.iterdir():
            try:
                times.append(child.lstat().st_mtime)
            except FileNotFoundError:
                continue
    return max(times)


class SaveLock:
    """Rank 0's claim on the temporary directory of its save: while it is held, `remove_unfinished` in any
    process on this host leaves the directory alone."""

    def __init__(self):
        self._file = None
        self._lock: Path | None = None

    def take(self, tmp: Path) -> None:
        # locked under another name, then renamed into place: a cleaner never finds the lock file unheld
        part = tmp / f"{SAVING}.part"
        self._file = open(part, "w")
        self._file.write(socket.gethostname() + "\n")
        self._file.flush()
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # a filesystem without locks: the directory's age alone tells others whether it is abandoned
        os.rename(part, tmp / SAVING)
        self._lock = tmp / SAVING

    def drop_file(self) -> None:
        """Remove the lock file before the directory becomes a checkpoint; the lock stays held until `release`
        (in between, the directory's fresh change keeps cleaners away)."""
        if self._lock is not None:
            self._lock.unlink(missing_ok=True)
            self._lock = None

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def is_checkpoint(directory: Path) -> bool:
    return _STEP_DIR.fullmatch(directory.name) is not None and (directory / MANIFEST).is_file()


def complete_checkpoints(root: Path) -> list[tuple[Path, Manifest]]:
    """Every complete checkpoint under `root`, oldest save first (by the manifest's time, then step).

    Save time, not step number, decides: a run restarted from step 100 that saves step 110 must not see a
    step 200 left by the abandoned run as its newest.
    """
    found = []
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.is_dir() and is_checkpoint(entry):
            try:
                found.append((entry, read_manifest(entry)))
            except CheckpointError:
                continue  # a damaged checkpoint is never the one to resume from
    return sorted(found, key=lambda pm: (pm[1].saved_at, pm[1].step))


def latest_checkpoint(path: str | os.PathLike) -> str | None:
    """The checkpoint to resume from under `path` (a root given to `partita.save`), or None if there is none.

    The complete checkpoint saved last: the `latest` pointer's, unless another was saved after it (a save
    stopped between renaming its checkpoint into place and pointing `latest` at it), its manifest does not read,
    or it names none. Directories of unfinished saves (`.tmp-`) are never returned.

    >>> import tempfile
    >>> latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    root = Path(path)
    if not root.is_dir():
        return None
    try:
        named = root / (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = None
    complete = complete_checkpoints(root)  # oldest save first
    newest = complete[-1][0] if complete else None
    if named is not None and named.parent == root and is_checkpoint(named) and newest in (None, named):
        return str(named)
    return None if newest is None else str(newest)


def previous_checkpoint(directory: Path) -> str | None:
    """The complete checkpoint saved last before `directory`, in the same root; None if there is none."""
    directory = Path(directory)
    saved = [p for p, _ in complete_checkpoints(directory.parent)]
    earlier = saved[:saved.index(directory)] if directory in saved else saved
    return str(earlier[-1]) if earlier else None


def newest_first(path: str | os.PathLike) -> list[str]:
    """Every complete checkpoint under `path`, saved last first."""
    return [str(p) for p, _ in reversed(complete_checkpoints(Path(path)))]


def set_aside(directory: Path) -> Path:
    """Rename a checkpoint that could not be resumed from out of the way (`step-N.skipped-<hex>`): saves of the
    same step no longer replace it, keep-K pruning neither counts nor deletes it, and it stays for inspection."""
    aside = directory.with_name(f"{directory.name}{SKIPPED_MARK}{secrets.token_hex(3)}")
    os.rename(directory, aside)
    fsync_dir(directory.parent)
    return aside


def write_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}{TMP_MARK}{secrets.token_hex(4)}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def commit(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory into place and point `latest` at it.

    Saving a step again replaces its checkpoint: the old one is first renamed to a `.tmp-` name (so that an
    interruption between the two renames leaves it to be cleaned up, never half-visible).
    """
    root = final.parent
    if final.exists():
        displaced = root / f"{final.name}{TMP_MARK}{secrets.token_hex(4)}"
        os.rename(final, displaced)
        os.rename(tmp, final)
        shutil.rmtree(displaced, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, final.name)


def prune(root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete all but the `keep` checkpoints saved last (never `newest`); return the deleted ones."""
    others = [p for p, _ in complete_checkpoints(root) if p != newest]
    doomed = others[:max(0, len(others) - (keep - 1))]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory meant by `path`: a step-* directory itself, or the latest one under a root."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"no checkpoint at {p}: the path does not exist. Check the path, or save one first "
                              "with partita.save(model, optimizer, path, step=...).")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file, not a checkpoint: pass the directory given to partita.save, or one "
                              "of its step-* directories (partita export turns a checkpoint into a single file).")
    if TMP_MARK in p.name:
        raise CheckpointError(f"{p} is an unfinished checkpoint (a save that was interrupted); it is never "
                              f"loaded. Load {p.parent} for the latest complete one.")
    if (p / MANIFEST).exists():
        return p
    found = latest_checkpoint(p)
    if found is None:
        if (p / ".metadata").exists():
            raise CheckpointError(f"{p} is a torch.distributed.checkpoint directory but not a partita checkpoint "
                                  f"(no {MANIFEST}). Load it with torch.distributed.checkpoint directly, or save "
                                  "with partita.save.")
        raise CheckpointError(f"no complete checkpoint in {p}: it holds no step-* directory with a {MANIFEST}. "
                              "Pass the directory given to partita.save, or check partita.latest_checkpoint(path) "
                              "before loading.")
    return Path(found)
