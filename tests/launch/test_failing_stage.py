"""A stage that raises in a 2 x 2 pipeline (4 ranks) under `partita run` and the default settings (PARTITA_TIMEOUT_S
unset: 300 s): every rank ends within seconds with the same error, naming the rank and the stage that raised and
the error it came from, instead of waiting in a receive for the process group's timeout. A rank that catches that
error and calls the model again is refused, naming itself, rather than joining a collective the others left."""

import re
import subprocess
import time
from pathlib import Path

import pytest

from launch.harness import BIN, env, output

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "failing_stage.py")
SECONDS = 60  # from the failing step to the job's end, on a loaded machine; the bound


def run(case: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The job's end, and how long after the failing step began it ended."""
    environ = env(PARTITA_PROFILE="estimate")
    del environ["PARTITA_TIMEOUT_S"]  # the defaults: a wait for a collective would take 300 s
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "4", "--log-dir", str(run_dir / "logs"), SCRIPT, case,
                           str(run_dir)], capture_output=True, text=True, env=environ, timeout=400)
    return proc, time.time() - float((run_dir / "failing").read_text())


def rank_output(run_dir: Path, rank: int) -> str:
    return "".join(p.read_text() for name in ("stdout.log", "stderr.log")
                   for p in sorted((run_dir / "logs").glob(f"*/attempt_0/{rank}/{name}")))


@pytest.mark.parametrize("case, error", [
    ("tag", r"PartitaError: rank 2 failed while running stage 0's forward of micro-batch 1: RuntimeError: \[Stage 0\] "
            r"failed to run forward:, from IndexError: index out of range in self"),
    ("label", r"PartitaError: rank 3 failed while computing loss_fn on the outputs of stage 1 \(the last\) for "
              r"micro-batch 1: IndexError: Target 9 is out of bounds\."),
])
def test_a_failing_stage_ends_every_rank_with_its_rank_and_stage(case, error, tmp_path):
    proc, took = run(case, tmp_path)
    assert proc.returncode == 1, output(proc)
    assert took < SECONDS, f"took {took:.0f} s\n{output(proc)}"
    for rank in range(4):
        printed = rank_output(tmp_path, rank)
        assert f"rank {rank} step 1 loss" in printed and f"rank {rank} step 2" not in printed, printed
        assert re.search(error, printed), f"rank {rank}\n{printed}"


def test_a_rank_that_goes_on_after_the_error_is_refused_naming_itself(tmp_path):
    proc, took = run("goes_on", tmp_path)
    assert proc.returncode == 1, output(proc)
    assert took < SECONDS, f"took {took:.0f} s\n{output(proc)}"
    assert "SIGABRT" not in proc.stderr and "exitcode: -6" not in proc.stderr, output(proc)
    went_on = rank_output(tmp_path, 1)
    assert "rank 1 caught the error and goes on" in went_on, went_on
    assert re.search(r"PartitaError: rank 1 went on after the error every rank raised in its call 3 of the model "
                     r"\(rank 2 failed while running stage 0's forward of micro-batch 1: .*IndexError.*\)\. The job "
                     r"cannot go on", went_on), went_on
    for rank in (0, 2, 3):
        assert "PartitaError: rank 2 failed while running stage 0's forward" in rank_output(tmp_path, rank)


def test_a_rank_that_goes_on_after_its_own_error_under_data_parallel_is_refused_naming_itself(tmp_path):
    """Under DDP a rank's forward raises on that rank alone, and the others go on to the backward's sums: the rank
    that catches its error and calls the model again must not meet those with another collective (gloo aborted
    the others with "collective mismatch", blaming another rank)."""
    proc, took = run("data_parallel_goes_on", tmp_path)
    assert proc.returncode == 1, output(proc)
    assert took < SECONDS, f"took {took:.0f} s\n{output(proc)}"
    assert "SIGABRT" not in proc.stderr and "exitcode: -6" not in proc.stderr, output(proc)
    went_on = rank_output(tmp_path, 3)
    assert "rank 3 caught the error and goes on" in went_on, went_on
    assert "PartitaError: rank 3 went on after its own error in its call 3 of the model (IndexError: index out of " \
           "range in self), which the other ranks did not have" in went_on, went_on


def test_a_failing_stage_under_fsdp_ends_every_rank_with_its_rank_and_stage(tmp_path):
    """Under sharding="parameters" the stages' replicas gather and sum parameters inside their compute: the ranks
    held there for the failing rank never reach partita's statement at the end of the run. Each has heard of the
    failure from the failing rank's watchdog message, names it, and ends."""
    proc, took = run("sharded", tmp_path)
    assert proc.returncode == 1, output(proc)
    assert took < SECONDS, f"took {took:.0f} s\n{output(proc)}"
    for rank in range(4):
        printed = rank_output(tmp_path, rank)
        assert "rank 2 failed while running stage 0's forward of micro-batch 1: RuntimeError: [Stage 0] failed to " \
               "run forward:, from IndexError: index out of range in self" in printed, f"rank {rank}\n{printed}"
