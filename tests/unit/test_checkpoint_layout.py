"""Which unfinished saves a save removes: only those surely abandoned (another job may share the directory)."""

from __future__ import annotations

import os
import socket
import time

from partita.checkpoint import layout


def _unfinished(root, name: str, host: str | None = None, age_s: float = 0.0):
    entry = root / name
    entry.mkdir()
    (entry / "__0_0.distcp").write_bytes(b"\0" * 10)
    if host is not None:
        (entry / layout.SAVING).write_text(host + "\n")
    for path in (*entry.iterdir(), entry):
        os.utime(path, (time.time() - age_s,) * 2)
    return entry


def test_only_surely_abandoned_unfinished_saves_are_removed(tmp_path):
    here, old = socket.gethostname(), layout.STALE_S + 60
    dead = _unfinished(tmp_path, "step-000001.tmp-dead", host=here)  # its saving process is gone
    live = tmp_path / "step-000002.tmp-live"
    live.mkdir()
    lock = layout.SaveLock()
    lock.take(live)
    elsewhere = _unfinished(tmp_path, "step-000003.tmp-elsewhere", host="another-host")  # cannot tell: by age
    stale_elsewhere = _unfinished(tmp_path, "step-000004.tmp-stale", host="another-host", age_s=old)
    unlocked = _unfinished(tmp_path, "step-000005.tmp-fresh")  # not locked yet, or a filesystem without locks
    stale = _unfinished(tmp_path, "step-000006.tmp-old", age_s=old)
    old_latest = tmp_path / "latest.tmp-1234"
    old_latest.write_text("step-000001\n")
    os.utime(old_latest, (time.time() - old,) * 2)
    try:
        removed = layout.remove_unfinished(tmp_path)
    finally:
        lock.release()
    assert sorted(removed) == sorted([dead, stale_elsewhere, stale, old_latest])
    assert live.is_dir() and elsewhere.is_dir() and unlocked.is_dir()
    assert layout.remove_unfinished(tmp_path) == [live]  # once its process released the lock


def test_a_finished_save_leaves_no_lock_file_in_its_checkpoint(tmp_path):
    tmp = layout.temporary_dir(tmp_path, 7)
    tmp.mkdir()
    lock = layout.SaveLock()
    lock.take(tmp)
    lock.drop_file()
    assert layout.remove_unfinished(tmp_path) == []  # still held, and just changed
    lock.release()
    assert list(tmp.iterdir()) == []
