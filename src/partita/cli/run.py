"""`partita run -n N script.py args...`: start N local processes with torch's elastic agent (torchrun's code).

Each rank's output goes to a file (paths printed at start) and to the console, prefixed by its rank. The
command's exit status is the job's: 0, or the exit code of the first rank that failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from partita.errors import LaunchError


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="start N local processes (torch elastic agent) running a script",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, dest="nproc", help="processes on this node")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic job (default 1)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node); default: local")
    p.add_argument("--rdzv-id", default="", help="job id shared by all nodes (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole job after a failure")
    p.add_argument("--log-dir", default="partita-logs", help="where each rank's stdout/stderr files go")
    p.add_argument("--quiet", action="store_true", help="only files, no rank output on the console")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _nodes(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes takes N or MIN:MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise LaunchError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return low, high


def run(args) -> int:
    # torch's launcher modules are imported here, so that `partita --help` stays fast
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    if not os.path.exists(args.script):
        print(f"partita run: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.nproc < 1:
        print("partita run: -n must be at least 1", file=sys.stderr)
        return 2
    low, high = _nodes(args.nnodes)
    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // args.nproc)))

    class PrintedLogs(DefaultLogsSpecs):
        """torch's log layout, announced on the console when each attempt starts."""

        last = None

        def reify(self, envs):
            dest = PrintedLogs.last = super().reify(envs)
            restart = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
            print(f"partita run: attempt {restart}, logs of each rank:", flush=True)
            for local_rank in sorted(dest.stdouts):
                rank = envs[local_rank].get("RANK", local_rank)
                print(f"  rank {rank}: {dest.stdouts[local_rank]} (stderr: {dest.stderrs[local_rank]})", flush=True)
            return dest

    standalone = not args.rdzv_endpoint
    config = LaunchConfig(
        min_nodes=low, max_nodes=high, nproc_per_node=args.nproc,
        run_id=args.rdzv_id or str(uuid.uuid4()), role="rank",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0" if standalone else args.rdzv_endpoint,
        rdzv_configs={"is_host": True} if standalone else {},
        max_restarts=args.max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=PrintedLogs(log_dir=args.log_dir, redirects=Std.ALL, tee=Std.NONE if args.quiet else Std.ALL),
    )
    try:
        launch_agent(config, sys.executable, ["-u", args.script, *args.args])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        logs = PrintedLogs.last.stderrs.get(failure.local_rank, args.log_dir) if PrintedLogs.last else args.log_dir
        print(f"partita run: rank {rank} failed with exit code {failure.exitcode}; its log: {logs}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    print(f"partita run: all {args.nproc} ranks finished", flush=True)
    return 0
