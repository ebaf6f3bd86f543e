"""`partita slurm --nodes K --ranks-per-node R script.py args...`: write a Slurm batch script and submit it.

The script needs no node list and no master address: srun starts every rank and partita finds the others
(or, with --launcher torchrun, srun starts one torch elastic agent per node). It asks Slurm to warn it before
the time limit, and puts itself back in the queue when training saved a checkpoint to resume from
(partita.elastic). partita checks with Slurm that the job can run at all before it submits it, then prints the
job id; --wait polls the job until it ends and exits with its status; --dry-run only prints the script.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from partita.launch import sbatch


def add_parser(sub) -> None:
    p = sub.add_parser("slurm", help="write a Slurm batch script for a training script and submit it",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    p.add_argument("--ranks-per-node", type=int, required=True, help="training processes per node")
    p.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    p.add_argument("--time", help="time limit, e.g. 30 or 01:00:00 (default: the partition's)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node")
    p.add_argument("--launcher", choices=sbatch.LAUNCHERS, default="srun",
                   help="srun: srun starts every rank (default); torchrun: one torch elastic agent per node")
    p.add_argument("--job-name", default="partita", help="Slurm job name (default partita)")
    p.add_argument("--log-dir", default="partita-logs", help="where the script and the job's output go")
    p.add_argument("--no-requeue", dest="requeue", action="store_false",
                   help="end the job when training stops before the time limit; by default a job whose training "
                        "saved a checkpoint to resume from (partita.elastic) goes back in the queue")
    p.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit with its status")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args) -> int:
    log_dir = os.path.abspath(args.log_dir)
    job = sbatch.SlurmJob(
        script=os.path.abspath(args.script), args=tuple(args.args), workdir=os.getcwd(), log_dir=log_dir,
        python=sys.executable, nodes=args.nodes, ranks_per_node=args.ranks_per_node, partition=args.partition,
        time=args.time, gpus_per_node=args.gpus_per_node, launcher=args.launcher, job_name=args.job_name,
        requeue=args.requeue,
    )
    text = sbatch.render(job, shlex.join(["partita", *sys.argv[1:]]))
    if args.dry_run:
        print(text, end="")
        return 0
    sbatch.check(text)
    os.makedirs(log_dir, exist_ok=True)  # Slurm does not create the output file's folder
    path = os.path.join(log_dir, f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch")
    with open(path, "w") as f:
        f.write(text)
    job_id = sbatch.submit(path)
    print(f"partita slurm: submitted job {job_id}\n  script: {path}\n  output: {job.output.replace('%j', str(job_id))}",
          flush=True)
    if not args.wait:
        return 0
    print(f"partita slurm: waiting for job {job_id} to end", flush=True)
    end = sbatch.wait(job_id)
    killed = f", ended by signal {end.signal}" if end.signal else ""
    print(f"partita slurm: job {job_id} {end.state}, exit code {end.exit_code}{killed}", flush=True)
    return end.exit_code if end.state in ("COMPLETED", "GONE") else max(1, end.exit_code)
