"""`partita ray [--address ADDR] --workers N script.py args...`: run a training script in N Ray Train workers.

Each worker runs the script as `python script.py args` would, with Ray's process group already joined
(`partita.init()` adopts it). With --address ("HOST:6379" from `ray start --head`, "ray://HOST:10001", or "auto"),
or else RAY_ADDRESS, the job runs on that cluster, and the script's path must exist on every node; an address that
does not answer within --connect-timeout is an error. Without either, a local Ray cluster starts for the job alone
and stops after it, also when `ray start` left one running on this machine. Exits 0 when every worker finished,
1 when one failed.
"""

from __future__ import annotations

import argparse
import sys

import partita.ray
from partita.errors import PartitaError


def add_parser(sub) -> None:
    p = sub.add_parser("ray", help="run a training script in N Ray Train workers (TorchTrainer)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running Ray cluster (HOST:6379, ray://HOST:10001, auto); default: "
                                      "RAY_ADDRESS, else a local cluster for this job")
    p.add_argument("--workers", type=int, required=True, help="training processes (ranks)")
    p.add_argument("--cpus-per-worker", type=float, help="default 1, or the cluster's CPUs / workers when fewer")
    p.add_argument("--gpus", action="store_true", help="one GPU per worker")
    p.add_argument("--storage-path", help="where Ray keeps the run's results (default ~/ray_results)")
    p.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for the cluster's address to answer")
    p.add_argument("--max-failures", type=int, default=0,
                   help="restarts of every worker after one failed; partita.elastic resumes from its checkpoint")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        partita.ray.run(partita.ray.script_fn(args.script, args.args), args.workers, address=args.address,
                        cpus_per_worker=args.cpus_per_worker, use_gpu=args.gpus, storage_path=args.storage_path,
                        connect_timeout_s=args.connect_timeout, max_failures=args.max_failures)
    except PartitaError:
        raise
    except Exception as e:  # noqa: BLE001 - Ray's errors (a failed worker's TrainingFailedError) end the command
        print(f"partita ray: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"partita ray: all {args.workers} workers finished", flush=True)
    return 0
