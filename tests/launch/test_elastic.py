"""Job morphing under `partita run`, with real processes and real signals: a job that is stopped, killed or
resized continues from its latest checkpoint and trains as if nothing had happened (bit for bit in the same
world; to one process's losses, fp32 rtol 1e-5, in another). Slurm's requeue is in test_slurm.py, Ray's
restart in test_ray.py."""

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

import partita
from partita.elasticity.stop import RESUME_EXIT_CODE
from launch.daemons import free_port
from launch.harness import BIN, SCRIPT, by_step, check, env, losses, output, rank0_logs
from launch.train_script import make_model, make_optimizer

pytestmark = pytest.mark.slow


def partita_run(run_dir, ranks: int, *args, restarts: int = 0, **extra_env):
    return subprocess.run([str(BIN / "partita"), "run", "-n", str(ranks), "--max-restarts", str(restarts), "--quiet",
                           "--log-dir", str(run_dir / "logs"), SCRIPT, str(run_dir), *map(str, args)],
                          capture_output=True, text=True, env=env(**extra_env), timeout=240)


@pytest.fixture
def start():
    """start(run_dir, ranks, *args): `partita run` in the background, for a test that signals or kills it mid-run.
    Every process of the job carries PARTITA_TEST_NODE=marker in its environment; whatever is left of the jobs
    when the test ends, passed or failed, is killed."""
    jobs: list[tuple[str, subprocess.Popen]] = []

    def start_job(run_dir, ranks: int, *args, launcher_args=(), log_dir: str = "logs",
                  marker: str = "") -> subprocess.Popen:
        marker = marker or uuid.uuid4().hex
        job = subprocess.Popen([str(BIN / "partita"), "run", "-n", str(ranks), *map(str, launcher_args), "--quiet",
                                "--log-dir", str(run_dir / log_dir), SCRIPT, str(run_dir), *map(str, args)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env(PARTITA_TEST_NODE=marker))
        jobs.append((marker, job))
        return job

    yield start_job
    for marker, job in jobs:
        kill_marked(marker)
        job.communicate(timeout=30)


def test_kill_9_of_a_rank_restarts_from_the_last_checkpoint_bit_for_bit(reference_run, tmp_path):
    """Issue 5's test 1 as written: kill -9 of rank 2 in step 3 under `partita run --max-restarts 1`, no plan given
    (the planner runs, as in the uninterrupted reference run). The agent restarts the job, which resumes from the
    step-2 checkpoint under the plan it was saved with; the final parameters equal the uninterrupted run's."""
    proc = partita_run(tmp_path, 4, "--die-at", 3, "--die-rank", 2, restarts=1)
    assert proc.returncode == 0, output(proc)
    rows = losses(tmp_path)
    assert [(r["step"], r["attempt"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 1), (4, 1), (5, 1)]
    assert f"resumed from {tmp_path / 'ckpt' / 'step-000002'} at step 2" in rank0_logs(tmp_path / "logs")
    # plan-4.json is the restarted attempt's plan: the one the uninterrupted run made
    assert layout(tmp_path / "plan-4.json") == layout(reference_run["plan"])
    assert by_step(rows) == by_step(losses(reference_run["dir"]))
    final, reference = torch.load(tmp_path / "final.pt"), reference_run["final"]
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)
    died = float((tmp_path / "died").read_text())
    back = next(r["time"] for r in rows if r["time"] > died)
    print(f"kill -9 of rank 2 -> first step of the restarted job done: {back - died:.1f} s")
    assert back - died < 60  # 13-17 s on an idle 2-core machine (bench/restart_time.py); room for a loaded runner


def test_a_crash_after_an_earlier_stop_is_reported_as_a_crash(tmp_path):
    """Under `partita run --max-restarts 1`: a stop request after step 1 (the ranks save step 2 and exit 75; the
    agent restarts them), then kill -9 of rank 1 in step 3 with no restart left. The command reports the dead rank
    and its status, not the earlier attempt's stop: 75 means that the last attempt saved and stopped."""
    proc = partita_run(tmp_path, 2, "--stop-after", 1, "--die-at", 3, restarts=1)
    assert "stopping at step 2 (SIGUSR1) after saving" in rank0_logs(tmp_path / "logs")  # the earlier attempt
    assert [(r["step"], r["attempt"]) for r in losses(tmp_path)] == [(0, 0), (1, 0), (2, 1)]
    assert proc.returncode == 128 + signal.SIGKILL, output(proc)
    assert "rank 1 was killed by SIGKILL (no restart left of --max-restarts 1)" in proc.stderr, output(proc)
    assert "stopped to be resumed" not in proc.stderr, output(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_to_the_launcher_saves_stops_with_a_distinct_status_and_loses_no_step(start, tmp_path, sig):
    """What a preempted machine sees (SIGTERM), and a preemption notice or Slurm's warning before the time limit
    (SIGUSR1): the signal goes to `partita run` from outside, which passes it to every rank. They save after the
    step they are in, the command exits with 75, and running it again finishes the job."""
    steps = 60
    job = start(tmp_path, 2, "--steps", steps, "--step-sleep", 0.05)
    wait_for(lambda: len(losses_so_far(tmp_path)) >= 3, job, "the job to train")
    job.send_signal(sig)
    stdout, stderr = job.communicate(timeout=90)
    done = assert_stopped_and_saved(job, stdout, stderr, tmp_path)
    assert f"stopping at step {done} ({sig.name})" in rank0_logs(tmp_path / "logs")
    assert done < steps
    again = partita_run(tmp_path, 2, "--steps", steps)
    assert again.returncode == 0, output(again)
    assert [r["step"] for r in losses(tmp_path)] == list(range(steps))
    check(tmp_path, 2, steps)


def test_resizing_replans_and_keeps_the_global_batch(tmp_path):
    """4 ranks for 2 steps (2 stages), then 2 ranks for 2 steps and 4 ranks for 2 more, both as the planner
    chooses (here 1 x 2, then 1 x 4: data parallel suits this small model): each run resumes where the last
    stopped, under a plan of its own (other stages or replicas than the run before), with the same global batch,
    and the losses are one process's."""
    shapes = []
    for ranks, until, plan in ((4, 2, ["--stages", 2]), (2, 4, ["--auto-plan"]), (4, 6, ["--auto-plan"])):
        proc = partita_run(tmp_path, ranks, "--steps", until, *plan)
        assert proc.returncode == 0, output(proc)
        shapes.append(stages_and_replicas(tmp_path / f"plan-{ranks}.json"))
    # the planner may place 2 stages on each rank (a looped schedule) on 4 ranks: 2 x 4 as well as 2 x 2
    assert shapes[0][0] == 2 and shapes[1] != shapes[0] and shapes[2] != shapes[1], shapes
    logs = rank0_logs(tmp_path / "logs")
    for before, after in ((4, 2), (2, 4)):
        assert (f"the world changed from {before} to {after} rank(s), so the model is planned again; global batch 16 "
                f"= {after} rank(s) x {16 // after} rows") in logs, logs
    assert [(r["step"], r["world"]) for r in losses(tmp_path)] == [(0, 4), (1, 4), (2, 2), (3, 2), (4, 4), (5, 4)]
    check(tmp_path, 4, stages=shapes[2][0])  # the last plan


def test_nodes_that_join_and_leave_resize_a_running_job(start, tmp_path):
    """Two `partita run --nnodes 1:2` agents on this machine stand for the nodes of an elastic job. The job starts
    on one node (2 ranks); a second node joins (the agents restart their ranks: 4 ranks, each stopped rank saves
    first); the second node dies with every process on it (kill -9: back to 2 ranks). Each change re-plans and
    resumes from the latest checkpoint with the same global batch; the losses are one process's. SIGTERM then
    stops the job: its last attempt saves, and only that makes the status 75 (the attempt that saved before the
    second node joined does not count)."""
    port = free_port()
    markers = {name: f"node-{name}-{uuid.uuid4().hex}" for name in "ab"}

    def node(name: str) -> subprocess.Popen:
        return start(tmp_path, 2, "--steps", 400, "--step-sleep", 0.05, "--auto-plan", marker=markers[name],
                     log_dir=f"logs-{name}",
                     launcher_args=["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "morph",
                                    "--max-restarts", 3])

    def worlds() -> list[int]:
        return [r["world"] for r in losses_so_far(tmp_path)]

    first = node("a")
    wait_for(lambda: len(worlds()) >= 3, first, "the first node to train")
    second = node("b")
    wait_for(lambda: worlds().count(4) >= 3, first, "the job to grow to 4 ranks and save")  # saves every 2 steps
    kill_marked(markers["b"])  # the node goes away: its agent and its ranks
    second.wait(timeout=30)
    wait_for(lambda: worlds()[-1] == 2 and worlds().count(2) > worlds().index(4), first, "the job to shrink to 2")
    first.send_signal(signal.SIGTERM)  # enough: stop (and save) instead of training all 400 steps
    stdout, stderr = first.communicate(timeout=90)
    assert_stopped_and_saved(first, stdout, stderr, tmp_path)
    sizes = [w for i, w in enumerate(worlds()) if i == 0 or worlds()[i - 1] != w]
    assert sizes == [2, 4, 2], sizes
    logs = rank0_logs(tmp_path / "logs-a") + rank0_logs(tmp_path / "logs-b")
    for before, after in ((2, 4), (4, 2)):
        assert f"the world changed from {before} to {after} rank(s), so the model is planned again" in logs, logs
    # planned from the costs the session's first job measured (support.session.cache_dir): on a loaded machine a
    # pipeline of 2 stages may win over data parallelism, and either is right
    check(tmp_path, 2, len(by_step(losses(tmp_path))), stages=None)


def test_a_job_killed_while_it_saves_resumes_from_the_checkpoint_before(start, tmp_path):
    """Issue 5's test 4 with a sharded checkpoint: both ranks of a job stop in the save of step 4 once their data
    files are written (a test hook of the training script), and then the whole job is killed (kill -9 of the
    launcher and its ranks, as when the machine dies). The step-2 checkpoint stays the latest; a fresh `partita
    run` resumes from it, trains on as one process would, and its first save removes what the killed one left."""
    ckpt, marker = tmp_path / "ckpt", uuid.uuid4().hex
    job = start(tmp_path, 2, "--hang-in-save", 4, marker=marker)
    unfinished = wait_for(lambda: save_written_by_every_rank(ckpt, 4, ranks=2), job, "both ranks to write step 4")
    kill_marked(marker)
    assert job.wait(timeout=30) == -signal.SIGKILL
    assert partita.latest_checkpoint(ckpt) == str(ckpt / "step-000002") and unfinished.is_dir()
    assert [r["step"] for r in losses(tmp_path)] == [0, 1, 2, 3]
    again = partita_run(tmp_path, 2)
    assert again.returncode == 0, output(again)
    assert f"resumed from {ckpt / 'step-000002'} at step 2" in rank0_logs(tmp_path / "logs")
    assert [r["step"] for r in losses(tmp_path)] == [0, 1, 2, 3, 2, 3, 4, 5]
    check(tmp_path, 2)  # steps 2 and 3, computed twice, came out bit for bit the same (by_step)
    assert not unfinished.exists() and partita.latest_checkpoint(ckpt) == str(ckpt / "step-000006")


def test_ranks_that_see_different_checkpoints_stop_at_once_and_say_why(tmp_path):
    """Checkpoints on each node's own disk: rank 0's holds one, rank 1's none. Rank 0 alone would load it (a
    collective) while rank 1 trains, and both would wait until the process-group timeout. Instead every rank stops
    at once with an error that says what each rank sees and asks for a filesystem all nodes share."""
    model = make_model()
    partita.save(model, make_optimizer(model), tmp_path / "disk-0" / "ckpt", step=2)
    started = time.monotonic()
    proc = partita_run(tmp_path, 2, "--disk-per-rank", PARTITA_TIMEOUT_S="120")
    took = time.monotonic() - started
    assert proc.returncode == 1, output(proc)
    logs = rank0_logs(tmp_path / "logs")
    for words in ("rank 0 sees ckpt/step-000002", "rank 1 sees none", "a filesystem that all nodes share"):
        assert words in logs, logs
    assert took < 60, f"{took:.0f} s: the ranks waited for each other instead of stopping at once"


def assert_stopped_and_saved(job: subprocess.Popen, stdout: str, stderr: str, run_dir: Path) -> int:
    """The command exited with the resume status after the ranks saved the step after their last one; that step."""
    assert job.returncode == RESUME_EXIT_CODE == 75, f"exit {job.returncode}\n{stdout}\n{stderr}"
    assert "stopped to be resumed" in stderr
    done = losses(run_dir)[-1]["step"] + 1
    assert partita.latest_checkpoint(run_dir / "ckpt") == str(run_dir / "ckpt" / f"step-{done:06d}")
    return done


def losses_so_far(run_dir: Path) -> list[dict]:
    return losses(run_dir) if (run_dir / "losses.jsonl").exists() else []


def stages_and_replicas(plan_file: Path) -> tuple[int, int]:
    plan = json.loads(plan_file.read_text())
    return len(plan["stages"]), len(plan["stages"][0]["ranks"])


def layout(plan_file) -> tuple:
    """What decides a plan's arithmetic: stages (blocks, ranks, recompute), schedule and micro-batches; not the
    estimates, which hold the planner's own run time."""
    plan = json.loads(Path(plan_file).read_text())
    stages = [(tuple(s["blocks"]), tuple(s["ranks"]), s["recompute"]) for s in plan["stages"]]
    return plan["schedule"], plan["micro_batches"], stages


def save_written_by_every_rank(ckpt: Path, step: int, ranks: int) -> Path | None:
    """The temporary directory of the save of `step`, once every rank's data file is in it (DCP names them
    __<rank>_<n>.distcp)."""
    for unfinished in ckpt.glob(f"step-{step:06d}.tmp-*"):
        if all((unfinished / f"__{rank}_0.distcp").exists() for rank in range(ranks)):
            return unfinished
    return None


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 120):
    """Poll `condition` until it holds (returns its value) while `proc` runs, at most `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.1)
    return value


def kill_marked(marker: str) -> None:
    """kill -9 of every process started with PARTITA_TEST_NODE=marker: an agent and its ranks, which run in
    sessions of their own."""
    entry = f"PARTITA_TEST_NODE={marker}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue  # not ours to read, or gone already
