"""The bad-input and fault catalogue, as real `partita run -n 2` jobs: for each case the exit status, how long the
job took to end, and the message every rank printed.

Cases that live elsewhere, with real processes too: a killed rank (test_run.py), a stopped rank
(test_stopped_rank.py), a pipeline stage that raises on one rank of four, and ranks that go on after an error
(test_failing_stage.py), SIGTERM / SIGUSR1 and kill -9 during training or during a save (test_elastic.py), damaged and
crafted checkpoints (test_checkpoint_integrity.py, test_elastic_fallback.py, torch/test_checkpoint_files.py), bad
PARTITA_* settings (test_bad_settings.py), more ranks on a node than GPUs (gpu/test_cuda.py, where CUDA is;
unit/test_gpus.py here), the same errors on every rank of a pool of processes (distributed/test_bad_input.py), and
partita.save or partita.load on rank 0 only (distributed/test_checkpoint.py).
"""

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.harness import BIN, env, output

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).resolve().parent / "bad_input.py")
SECONDS = 40  # a job that waits for a collective instead would take the harness's PARTITA_TIMEOUT_S (60 s) and more


@dataclass(frozen=True)
class Case:
    name: str
    exit: int
    message: str  # printed by every rank
    ranks: tuple[int, ...] = (0, 1)  # where only some ranks can know it (one rank's own call): those


CATALOGUE = [
    Case("uneven_rows_data_parallel", 0, "global batch's 0."),
    Case("uneven_rows_pipeline", 1, "BatchError: ranks pass batches of different sizes (rank 0: 4, rank 1: 6 rows)"),
    Case("uneven_steps", 1, "partita.shutdown() was called on rank 1 after 2 calls of the model, while rank 0 made "
                            "call 3"),
    Case("micro_batches_do_not_split", 1, "BatchError: the global batch of 6 rows (2 ranks x 3) does not split into "
                                          "4 micro-batches whatever the layout"),
    Case("elastic_global_batch_does_not_split", 1, "CheckpointError: the global batch of 9 rows does not split "
                                                   "evenly over 2 ranks"),
    Case("elastic_loop_left_early", 1, "rank 0 in partita.elastic's check for a stop between steps after 2 calls of "
                                       "the model; rank 1 in partita.shutdown() after 2 calls of the model"),
    Case("float64_input", 1, "BatchError: input tensor #0 (shape (8, 8)) is torch.float64, but the model computes "
                             "it in torch.float32"),
    Case("capture_fails_on_one_rank", 1, "rank 1: "),
    Case("uncapturable", 1, "CaptureError: "),
    Case("corrupt_plan", 1, "PlanError: "),
    Case("plan_of_another_model", 1, "PlanError: the plan was made for another model"),
    Case("checkpoint_value_changed", 1, "step-000002 is damaged: its file __0_0.distcp changed after it was saved"),
    Case("checkpoint_truncated", 1, "CheckpointError: "),
    Case("checkpoint_crafted_metadata", 1, "CheckpointError: "),
    Case("checkpoint_of_another_model", 1, "CheckpointError: "),
    Case("meta_parent_redraws_children", 0, "the __init__ of '(the model)' (RedrawsChildren) (calling normal_) draws "
                                            "or writes its submodules' tensors again after building them"),
    Case("weights_not_finite", 0, "1 of the tensors read hold NaN or infinite values: 2.weight"),
    Case("zero_rows_data_parallel", 0, "equal"),
    Case("live_job_checkpoint_dir", 1, "is in use by another job"),
    # `if rank == 0: torch.save(model.module.state_dict(), path)`: rank 0 raises; rank 1 is told that rank 0 ended
    Case("module_state_dict_two_stages", 1, "PartitaError: model.module.state_dict() on rank 0: this rank holds only "
                                            "its part of the model", ranks=(0,)),
    Case("module_state_dict_zero3", 1, "PartitaError: model.module.state_dict() on rank 0: this rank holds only its "
                                       "part of the model", ranks=(0,)),
    Case("checkpoint_checksums_dev_zero", 1, "checksums name /dev/zero, which is not a file of the checkpoint"),
    Case("checkpoint_checksums_fifo", 1, "records a checksum of queue, which is not one of its files"),
    Case("checkpoint_checksums_removed", 1, "has no checksums"),
    Case("unused_parameter_data_parallel", 0, "equal"),
    Case("bad_safetensors_header", 1, "weights.safetensors'): ranks 0, 1: "),
    Case("uneven_rows_zero3", 1, "(1 stage x 2 replicas, sharding=\"parameters\")"),
    Case("uneven_rows_micro_batches", 1, "(1 stage x 2 replicas, 2 micro-batches)"),
    Case("zero_rows_first_batch", 1, "BatchError: the model's first call has 0 rows on every rank (2)"),
    Case("optimizer_of_another_model", 1, "PlanError: none of the optimizer's"),
]


def run(case: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(run_dir / "logs"),
                           SCRIPT, case, str(run_dir)], capture_output=True, text=True,
                          env=env(PARTITA_PROFILE="estimate"), timeout=180)
    return proc, time.monotonic() - start


def rank_output(run_dir: Path, rank: int) -> str:
    return "".join(p.read_text() for name in ("stdout.log", "stderr.log")
                   for p in sorted((run_dir / "logs").glob(f"*/attempt_0/{rank}/{name}")))


@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: c.name)
def test_catalogue(case, tmp_path):
    proc, took = run(case.name, tmp_path)
    assert proc.returncode == case.exit, output(proc)
    assert took < SECONDS, f"{case.name} took {took:.0f} s to end\n{output(proc)}"
    for rank in case.ranks:
        assert case.message in rank_output(tmp_path, rank), f"rank {rank}\n{rank_output(tmp_path, rank)}"
    if case.exit:
        assert "partita run: rank" in proc.stderr and "failed with exit code 1" in proc.stderr, output(proc)
    if case.name.startswith("checkpoint_"):  # refused, not lost or replaced, and no code ran
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == \
            ["step-000001", "step-000002"]
        assert all((tmp_path / "ckpt" / s / "manifest.json").exists() for s in ("step-000001", "step-000002"))
        assert not (tmp_path / "pwned").exists()


def test_capture_failing_on_one_rank_names_that_rank_and_its_error(tmp_path):
    proc, _ = run("capture_fails_on_one_rank", tmp_path)
    for rank in range(2):
        assert "ValueError: a record on rank 1 is corrupt" in rank_output(tmp_path, rank)


def test_two_jobs_at_once_on_one_machine_both_train(tmp_path):
    start = time.monotonic()
    procs = [subprocess.Popen([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir", str(tmp_path / f"logs{k}"),
                               SCRIPT, "train", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env(PARTITA_PROFILE="estimate")) for k in range(2)]
    ends = [subprocess.CompletedProcess(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]
    for proc in ends:
        assert proc.returncode == 0, output(proc)
    assert time.monotonic() - start < 2 * SECONDS


def test_two_jobs_on_one_checkpoint_directory_one_is_refused(tmp_path):
    """Two jobs started together against one directory: the first to save or resume holds it until it ends; the
    other is refused on every rank, naming the directory and the holder (job), and its checkpoints replace none."""
    (tmp_path / "ended").mkdir()
    procs = [subprocess.Popen([str(BIN / "partita"), "run", "-n", "2", "--quiet", "--log-dir",
                               str(tmp_path / f"logs{k}"), SCRIPT, "shared_checkpoint_dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(PARTITA_PROFILE="estimate")) for k in range(2)]
    ends = [subprocess.CompletedProcess(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]
    assert sorted(e.returncode for e in ends) == [0, 1], "\n".join(map(output, ends))
    refused = next(k for k, e in enumerate(ends) if e.returncode)
    for rank in range(2):
        text = "".join(p.read_text() for p in (tmp_path / f"logs{refused}").glob(f"*/attempt_0/{rank}/stderr.log"))
        assert f"{tmp_path / 'ckpt'} is in use by another job: process" in text and "(job torchrun " in text, text
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == \
        ["step-000001", "step-000002", "step-000003"]

