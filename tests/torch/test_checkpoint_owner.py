"""One job at a time per checkpoint directory (`checkpoint.owner`), with a real second process as the other job."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import partita
from partita.checkpoint import owner
from partita.errors import CheckpointError

SRC = str(Path(partita.__file__).resolve().parents[1])
HOLD = ("import sys\n"
        "from partita.checkpoint.owner import claim\n"
        "from pathlib import Path\n"
        "claim(Path(sys.argv[1]))\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n")


@pytest.fixture
def holder(tmp_path, monkeypatch):
    """Start another process that holds tmp_path/ckpt, as a job with the run id given (None: without one)."""
    started = []
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)

    def start(run_id: str | None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
        env["PYTHONPATH"] = SRC
        if run_id is not None:
            env["TORCHELASTIC_RUN_ID"] = run_id
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "ckpt")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    owner.release_all()
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_directory_held_by_a_live_job_is_refused_with_the_holder_and_the_fix(tmp_path, holder):
    other = holder("3f9a")
    with pytest.raises(CheckpointError) as caught:
        owner.claim(tmp_path / "ckpt")
    message = str(caught.value)
    assert f"{tmp_path / 'ckpt'} is in use by another job: process {other.pid} on " in message
    assert "(job torchrun 3f9a, since " in message and "Give this job a directory of its own" in message


def test_a_job_without_a_run_id_is_another_job(tmp_path, holder):
    holder(None)
    with pytest.raises(CheckpointError, match="job without a run id"):
        owner.claim(tmp_path / "ckpt")


def test_a_new_attempt_of_the_same_job_takes_the_directory_over(tmp_path, holder, monkeypatch):
    holder("3f9a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f9a")
    owner.claim(tmp_path / "ckpt")


def test_a_job_that_died_holds_nothing(tmp_path, holder):
    other = holder("3f9a")
    other.send_signal(signal.SIGKILL)
    other.wait()
    owner.claim(tmp_path / "ckpt")
    assert f'"pid": {os.getpid()}' in (tmp_path / "ckpt" / owner.JOB_LOCK).read_text()


def test_a_job_that_left_lets_another_take_it(tmp_path):
    """partita.shutdown() releases what the job held (`release_all`, a hook of leaving), though its process goes
    on."""
    owner.claim(tmp_path / "ckpt")
    owner.release_all()
    code = "import sys; from pathlib import Path; from partita.checkpoint.owner import claim; claim(Path(sys.argv[1]))"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ckpt")], check=True, env=dict(env, PYTHONPATH=SRC))
