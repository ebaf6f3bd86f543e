"""How long a job needs to train again after a rank dies, and to stop cleanly when asked.

    python bench/restart_time.py [--ranks 4] [--repeats 3]

A training script with `partita.elastic` (the RaNNC tutorial MLP, 8 x Linear(512, 512), Adam, 2 stages x
2 replicas, a checkpoint every 4 steps) runs under `partita run --max-restarts 1`; one rank kills itself with
SIGKILL in step 9. Printed, as medians of --repeats jobs:

- kill -> training again: from the kill to the end of the first step of the restarted job (the agent notices,
  stops the other ranks, starts new ones; they import torch, join, plan, load the checkpoint, train a step);
- a cold start for comparison: from `partita run` starting to the end of the first step;
- stop latency: from SIGTERM to the launcher until every rank has saved and the command has exited.

Goal (issue 5): kill -> training again under 30 s on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 300  # a job here takes 15-40 s; one that has not trained or ended by then never will

SCRIPT = """
import json, os, signal, sys, time
from pathlib import Path
import torch
import partita
sys.path.insert(0, {examples!r})
from models import TutorialMLP

run, die_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
partita.init()
rank = partita.get_rank()
torch.manual_seed(0)
model = TutorialMLP(512, 8)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), stages=2)
job = partita.elastic(model, opt, run / "ckpt", global_batch=64, save_every=4)
for step in job.steps(steps):
    if step == die_at and rank == 1 and not (run / "died").exists():
        (run / "died").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 512, generator=g)[job.rows], torch.randn(64, 512, generator=g)[job.rows]
    opt.zero_grad(); model(x, y).backward(); opt.step()
    time.sleep(0.02)
    if rank == 0:
        with open(run / "steps.jsonl", "a") as f:
            f.write(json.dumps({{"step": step, "time": time.time()}}) + "\\n")
partita.shutdown()
"""


def _env() -> dict:
    import os

    return dict(os.environ, OMP_NUM_THREADS="1", PARTITA_LOG="off",
                PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _steps(run: Path) -> list[dict]:
    path = run / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _partita_run(run: Path, script: Path, ranks: int, *args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "partita"), "run", "-n", str(ranks), "--quiet", "--log-dir",
            str(run / "logs"), *args, str(script)]


def kill_and_restart(script: Path, ranks: int, env: dict) -> tuple[float, float]:
    """(cold start -> first step done, kill -> first step of the restarted job done), in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        started = time.time()
        subprocess.run([*_partita_run(run, script, ranks, "--max-restarts", "1"), str(run), "9", "14"], check=True,
                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=JOB_TIMEOUT_S)
        rows = _steps(run)
        died = float((run / "died").read_text())
        return rows[0]["time"] - started, next(r["time"] for r in rows if r["time"] > died) - died


def stop_latency(script: Path, ranks: int, env: dict) -> float:
    """SIGTERM to `partita run` -> the command has exited after every rank saved."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        proc = subprocess.Popen([*_partita_run(run, script, ranks), str(run), "-1", "100000"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_steps(run, proc, 6)
            sent = time.time()
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
        finally:
            _stop(proc)
        if code != 75:
            raise RuntimeError(f"partita run exited with {code} after SIGTERM, not 75{_rank0_log_tail(run)}")
        return time.time() - sent


def _wait_for_steps(run: Path, proc: subprocess.Popen, count: int) -> None:
    """Until the job has trained `count` steps; an error if it ends first or takes longer than JOB_TIMEOUT_S."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while len(_steps(run)) < count:
        if proc.poll() is not None:
            raise RuntimeError(f"partita run exited with {proc.returncode} before the job trained {count} steps"
                               f"{_rank0_log_tail(run)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the job trained {len(_steps(run))} of {count} steps in {JOB_TIMEOUT_S} s: it is stuck "
                               f"(or the machine far too busy to measure on){_rank0_log_tail(run)}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    """End a job that is still running: SIGTERM lets the agent stop its ranks (they run in sessions of their own
    and would outlive a killed agent); SIGKILL if that does not end it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _rank0_log_tail(run: Path, lines: int = 15) -> str:
    """The end of rank 0's stderr, for an error message (the run's directory is deleted afterwards)."""
    logs = sorted((run / "logs").glob("*/attempt_*/0/stderr.log"))
    tail = logs[-1].read_text(errors="replace").splitlines()[-lines:] if logs else []
    return "; the end of rank 0's log:\n" + "\n".join(tail) if tail else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = _env()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT.format(examples=str(ROOT / "examples")))
        env["PARTITA_CACHE_DIR"] = str(Path(tmp) / "cache")
        restarts = [kill_and_restart(script, args.ranks, env) for _ in range(args.repeats)]
        stops = [stop_latency(script, args.ranks, env) for _ in range(args.repeats)]
    cold = statistics.median(c for c, _ in restarts)
    back = statistics.median(b for _, b in restarts)
    print(f"restart_time: {args.ranks} ranks, 2 stages x {args.ranks // 2} replicas, medians of {args.repeats} jobs")
    print(f"restart_time: cold start -> first step done: {cold:.1f} s "
          f"(runs: {', '.join(f'{c:.1f}' for c, _ in restarts)})")
    print(f"restart_time: kill -9 of a rank -> training again: {back:.1f} s "
          f"(runs: {', '.join(f'{b:.1f}' for _, b in restarts)}; goal under 30 s)")
    print(f"restart_time: SIGTERM to partita run -> saved and exited: {statistics.median(stops):.1f} s "
          f"(runs: {', '.join(f'{s:.1f}' for s in stops)})")


if __name__ == "__main__":
    main()
