"""A training script as a user writes it (`partita.parallelize` + `partita.elastic`); every launcher test runs it.

    <launcher> train_script.py RUN_DIR [--steps N] [--stages S | --auto-plan] [--plan PLAN.json]
                                       [--die-at STEP --die-rank R] [--stop-after STEP] [--step-sleep S]
                                       [--hang-in-save STEP] [--disk-per-rank]

It trains 2 stages (one in one process; the planner chooses replicas, placement and schedule) unless told
otherwise, with Adam, on a fixed global batch per step whatever the world size, so every run computes one process's
losses. Checkpoints go to RUN_DIR/ckpt every 2 steps. Rank 0 appends one JSON line per step to RUN_DIR/losses.jsonl
(step, loss, world size, attempt of torch's agent, run of a requeued Slurm job, time), the plan of each world size
it ran in to RUN_DIR/plan-<world>.json, and at the end the final parameters to RUN_DIR/final.pt.

--die-at: rank R kills itself with SIGKILL at that step, once (it leaves RUN_DIR/died with the time of death).
--stop-after: rank 0 sends itself SIGUSR1 after finishing that step (a stop request mid-run).
--hang-in-save: every rank stops in the save of that step's checkpoint, after writing its data files, until it is
killed (a job killed while it writes a checkpoint, every time).
--disk-per-rank: each rank works in RUN_DIR/disk-<rank> and keeps its checkpoints under the relative path `ckpt`:
the same path names another directory on each rank, as a path on each node's own disk would.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import partita

GLOBAL_BATCH, HIDDEN, LAYERS, STEPS = 16, 32, 6, 6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
                                 for _ in range(LAYERS)])


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, HIDDEN, generator=g), torch.randn(GLOBAL_BATCH, HIDDEN, generator=g)


def hang_in_save(step: int) -> None:
    """Make this process's checkpoint writer stop in the save of `step` once its data files are on disk."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_hang(self, plan, planner):
        written = write(self, plan, planner)
        if f"step-{step:06d}.tmp-" in str(self.path):  # the save's temporary directory
            time.sleep(600)  # killed long before
        return written

    FileSystemWriter.write_data = write_then_hang


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--plan")
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--stop-after", type=int)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait in each step (a slower job)")
    ap.add_argument("--stages", type=int, help="stages (default: 2, or 1 in one process)")
    ap.add_argument("--auto-plan", action="store_true", help="let the planner choose the layout")
    ap.add_argument("--hang-in-save", type=int, metavar="STEP", help="stop in the save of STEP until killed")
    ap.add_argument("--disk-per-rank", action="store_true", help="checkpoints on each rank's own 'disk'")
    args = ap.parse_args()
    run = Path(args.run_dir).resolve()  # --disk-per-rank changes the working directory
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # restarts by torch's elastic agent
    requeue = int(os.environ.get("SLURM_RESTART_COUNT", "0"))  # runs of a requeued Slurm job

    partita.init()
    rank, world = partita.get_rank(), partita.get_world_size()
    model = make_model()
    opt = make_optimizer(model)
    stages = None if args.auto_plan or args.plan else args.stages or (2 if world > 1 else 1)
    model = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), plan=args.plan, stages=stages)
    ckpt = run / "ckpt"
    if args.disk_per_rank:
        (run / f"disk-{rank}").mkdir(exist_ok=True)
        os.chdir(run / f"disk-{rank}")
        ckpt = Path("ckpt")
    if args.hang_in_save is not None:
        hang_in_save(args.hang_in_save)
    job = partita.elastic(model, opt, ckpt, global_batch=GLOBAL_BATCH, save_every=2)
    (run / f"pid-{rank}").write_text(str(os.getpid()))
    for step in job.steps(args.steps):
        if args.die_at == step and rank == args.die_rank and not (run / "died").exists():
            (run / "died").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(args.step_sleep)
        x, y = global_batch(step)
        opt.zero_grad()
        loss = model(x[job.rows], y[job.rows])
        loss.backward()
        opt.step()
        if rank == 0:
            if step == job.start_step:
                model.plan.save(run / f"plan-{world}.json")
            with open(run / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "world": world, "attempt": attempt, "requeue": requeue,
                                    "time": time.time()}) + "\n")
            if args.stop_after == step:
                os.kill(os.getpid(), signal.SIGUSR1)
    state = model.state_dict()
    if rank == 0:
        torch.save(state, run / "final.pt")
    partita.shutdown()


if __name__ == "__main__":
    main()
