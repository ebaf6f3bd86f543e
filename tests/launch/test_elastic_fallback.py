"""`partita.elastic` under `partita run` when its checkpoints are damaged (bytes overwritten inside a data file, its
length unchanged): it resumes from the newest checkpoint that verifies and says which one it skipped and why, keeps
the skipped one, and when none verifies, every rank stops with partita's CheckpointError instead of an abort."""

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import partita
from partita.checkpoint.owner import JOB_LOCK
from launch.harness import BIN, SCRIPT, check, env, losses, output, rank0_logs

pytestmark = pytest.mark.slow

RANKS = 2
BOUND_S = 90  # a restart of 2 ranks takes 10-25 s on a loaded 2-core machine


def partita_run(run_dir: Path, *args) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", str(RANKS), "--quiet", "--log-dir",
                           str(run_dir / "logs"), SCRIPT, str(run_dir), *map(str, args)],
                          capture_output=True, text=True, env=env(), timeout=240)
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """6 steps on 2 ranks: checkpoints of steps 2, 4 and 6 (every 2 steps, the last 3 kept)."""
    run = tmp_path_factory.mktemp("trained")
    proc, _ = partita_run(run)
    assert proc.returncode == 0, output(proc)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [".partita-job", "latest", "step-000002", "step-000004", "step-000006"]
    return run


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """A copy of the trained run (checkpoints and losses), without its logs."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("logs"))
    return tmp_path


def damage(data_file: Path) -> None:
    """Overwrite 8 bytes in the middle of the file: the file keeps its length and its structure."""
    content = bytearray(data_file.read_bytes())
    middle = len(content) // 2
    content[middle:middle + 8] = bytes(255 - b for b in content[middle:middle + 8])
    data_file.write_bytes(bytes(content))


def digests(root: Path) -> dict[str, str]:
    """Every checkpoint file's digest; not the job lock's, which names whichever job holds the directory."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != JOB_LOCK}


def test_a_damaged_latest_checkpoint_is_skipped_for_the_one_before(run_dir):
    ckpt = run_dir / "ckpt"
    damage(ckpt / "step-000006" / "__1_0.distcp")
    damaged = digests(ckpt / "step-000006")
    proc, took = partita_run(run_dir, "--steps", 8)
    assert proc.returncode == 0, output(proc)
    logs = rank0_logs(run_dir / "logs")
    assert f"cannot resume from {ckpt / 'step-000006'} (partita.load(path='{ckpt / 'step-000006'}'): rank" in logs, logs
    assert f"{ckpt / 'step-000006'} is damaged: its file __1_0.distcp changed after it was saved" in logs
    assert f"Load the previous checkpoint instead: {ckpt / 'step-000004'}); trying the one saved before it" in logs
    assert f"resumed from {ckpt / 'step-000004'} at step 4" in logs, logs
    # the skipped checkpoint is kept as it was, out of the way of the saves of steps 6 and 8 and of pruning
    aside = [p for p in ckpt.iterdir() if p.name.startswith("step-000006.skipped-")]
    assert len(aside) == 1 and digests(aside[0]) == damaged
    assert f"kept {ckpt / 'step-000006'}, which could not be resumed from, as {aside[0]}" in logs, logs
    assert partita.latest_checkpoint(ckpt) == str(ckpt / "step-000008")
    assert sorted(p.name for p in ckpt.iterdir() if p != aside[0]) == [".partita-job", "latest", "step-000004", "step-000006",
                                                                       "step-000008"]
    assert [r["step"] for r in losses(run_dir)] == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    check(run_dir, RANKS, steps=8)  # steps 4 and 5, computed twice, came out the same
    assert took < BOUND_S, f"{took:.0f} s"


def test_with_every_checkpoint_damaged_every_rank_stops_with_the_error_and_nothing_is_lost(run_dir):
    ckpt = run_dir / "ckpt"
    for step in (2, 4, 6):
        damage(ckpt / f"step-{step:06d}" / "__0_0.distcp")
    before = digests(ckpt)
    proc, took = partita_run(run_dir, "--steps", 8)
    assert proc.returncode == 1, output(proc)
    assert "SIGABRT" not in proc.stderr and "terminate called" not in proc.stderr, output(proc)
    stderr = {p.parent.name: p.read_text() for p in (run_dir / "logs").glob("*/attempt_0/*/stderr.log")}
    assert sorted(stderr) == [str(r) for r in range(RANKS)]
    for rank, text in stderr.items():
        assert "terminate called" not in text, f"rank {rank}:\n{text}"
        assert (f"partita.errors.CheckpointError: partita.elastic(path='{ckpt}'): none of its 3 checkpoint(s) can be "
                f"resumed from, so the job stops (nothing was renamed or deleted): {ckpt / 'step-000006'}: ") in text, \
            f"rank {rank}:\n{text}"
        assert "__0_0.distcp changed after it was saved" in text
    assert digests(ckpt) == before
    assert took < BOUND_S, f"{took:.0f} s"
