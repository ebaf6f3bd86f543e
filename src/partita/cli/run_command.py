"""`partita run -n N script.py args...`: start N local processes with torch's elastic agent (torchrun's code).

Each rank's output goes to a file (paths printed at start) and to the console, prefixed by its rank. The
command's exit status is the job's: 0, or the exit code of the first rank that failed (128 + the signal's number
for a rank that a signal killed, as a shell reports it). With --max-restarts N, a rank that fails restarts all
ranks, up to N times: each restart is a new attempt, whose ranks join afresh and resume from the last checkpoint.

SIGTERM and SIGUSR1 (a preemption notice, Slurm's warning before the time limit) to this command go on to every
rank; ranks that use `partita.elastic` save at the next step boundary and stop. The command then exits with status
75 (partita.elasticity.stop.RESUME_EXIT_CODE) if the ranks of its last attempt stopped that way, so that a wrapper
can tell "run again to resume" from a failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import uuid

from partita import settings
from partita.errors import LaunchError
from partita.launch.threads import cores_per_rank, usable_cores
from partita.elasticity.stop import RESUME_EXIT_CODE

# The agent stops the ranks with the signal it received, for these. torch's list lacks SIGUSR1 (a preemption
# notice, Slurm's warning before the time limit), which would kill this command without the ranks saving.
PASSED_ON = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="start N local processes (torch elastic agent) running a script",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, dest="nproc", help="processes on this node")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic job (default 1)")
    p.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node); default: local")
    p.add_argument("--rdzv-id", default="", help="job id shared by all nodes (multi-node)")
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole job after a failure")
    p.add_argument("--last-call", type=int, default=5, metavar="S",
                   help="with --nnodes MIN:MAX, seconds to wait for more nodes once MIN joined, at the start and at "
                        "each restart (default 5; torchrun waits 30)")
    p.add_argument("--stop-timeout", type=int, default=60, metavar="S",
                   help="seconds the ranks get to save and exit after this command receives SIGTERM or SIGUSR1, "
                        "before they are killed (default 60)")
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
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    from partita.launch import agent

    problem = _usage_problem(args)
    if problem is not None:
        print(f"partita run: {problem}", file=sys.stderr)
        return 2
    resume_file = _prepare_environment(args.nproc, args.log_dir)
    logs = _printed_logs(args, resume_file)
    try:
        with agent.installed(args.stop_timeout):  # kills a rank stopped by SIGSTOP at once, not after 30 s
            launch_agent(_launch_config(args, logs), sys.executable, ["-u", args.script, *args.args])
    except (ChildFailedError, SignalException) as e:
        return _failed_status(e, args, logs, resume_file)
    print(f"partita run: all {args.nproc} ranks finished", flush=True)
    return 0


def _usage_problem(args) -> str | None:
    """What is wrong with the command line, if something is (a malformed --nnodes raises a LaunchError)."""
    if not os.path.exists(args.script):
        return f"no such script: {args.script}"
    if args.nproc < 1:
        return "-n must be at least 1"
    low, _ = _nodes(args.nnodes)
    if not args.rdzv_endpoint and low > 1:
        return (f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT and --rdzv-id on every node: "
                "without them no other node finds this one, and the job would wait for them.")
    return None


def _prepare_environment(nproc: int, log_dir: str) -> str:
    """Set what the agent and the ranks inherit; the resume file (see `_resume_file`)."""
    # each rank's share of the cores this command may run on (its CPU affinity), unless the user chose
    os.environ.setdefault("OMP_NUM_THREADS", str(cores_per_rank(usable_cores(), nproc)))
    # torch 2.13's agents share one store across rendezvous rounds, and a node that joins a running job (round 1
    # or later) waits forever for the store address that only the first round publishes (pytorch#135712):
    # each round gets a store of its own instead, hosted by its rank 0 on a fresh port
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # one hash seed for every rank, unless the user chose one: a model whose forward iterates over a set of strings
    # (Hugging Face's Gemma 3) captures its operations in that set's order, which follows the seed, and ranks that
    # captured different graphs cannot train together (planning.agree_on_graph refuses them)
    if not os.environ.get("PYTHONHASHSEED", "").isdigit():
        os.environ["PYTHONHASHSEED"] = "0"
    return _resume_file(log_dir)


def _printed_logs(args, resume_file: str):
    """The ranks' log files (torch's DefaultLogsSpecs), announced on the console at each attempt's start;
    `.last` is the latest attempt's files."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    class PrintedLogs(DefaultLogsSpecs):
        """torch's log layout, announced on the console when each attempt starts (torch calls `reify` then, before
        it starts the attempt's ranks). The attempts are counted here: torch names their folders by its restart
        count, which stays the same when the agent restarts the ranks because another node joined or left, and
        would then delete the logs of the attempt before."""

        last = None
        attempts = 0

        def reify(self, envs):
            attempt = str(PrintedLogs.attempts)
            PrintedLogs.attempts += 1
            # the marker says that the ranks of the last attempt saved and stopped; an attempt before it that
            # stopped (and was restarted) must not make a later crash look like a stop
            _remove(resume_file)
            dest = PrintedLogs.last = super().reify(
                {rank: {**env, "TORCHELASTIC_RESTART_COUNT": attempt} for rank, env in envs.items()})
            print(f"partita run: attempt {attempt}, logs of each rank:", flush=True)
            for local_rank in sorted(dest.stdouts):
                rank = envs[local_rank].get("RANK", local_rank)
                print(f"  rank {rank}: {dest.stdouts[local_rank]} (stderr: {dest.stderrs[local_rank]})", flush=True)
            return dest

    return PrintedLogs(log_dir=args.log_dir, redirects=Std.ALL, tee=Std.NONE if args.quiet else Std.ALL)


def _launch_config(args, logs):
    """The torch elastic agent's configuration: a standalone job without --rdzv-endpoint."""
    from torch.distributed.launcher.api import LaunchConfig

    from partita.launch import agent

    low, high = _nodes(args.nnodes)
    standalone = not args.rdzv_endpoint
    return LaunchConfig(
        min_nodes=low, max_nodes=high, nproc_per_node=args.nproc,
        run_id=args.rdzv_id or str(uuid.uuid4()), role="rank",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0" if standalone else args.rdzv_endpoint,
        rdzv_configs={"last_call_timeout": args.last_call, **({"is_host": True} if standalone else {})},
        max_restarts=args.max_restarts, monitor_interval=0.1, start_method="spawn",
        signals_to_handle=PASSED_ON, logs_specs=logs, **agent.config_fields(args.stop_timeout),
    )


def _failed_status(e, args, logs, resume_file: str) -> int:
    """The command's exit status when the job did not finish (ChildFailedError or SignalException `e`), after
    saying why: the ranks saved to be resumed, a signal stopped the command, or the first rank that failed."""
    from torch.distributed.elastic.multiprocessing import SignalException

    from partita.launch import agent

    if os.path.exists(resume_file):
        with open(resume_file) as f:
            saved = f.read()
        print(f"partita run: the ranks saved {saved} and stopped to be resumed; run the same command again to "
              f"continue (exit status {RESUME_EXIT_CODE})", file=sys.stderr)
        return RESUME_EXIT_CODE
    if isinstance(e, SignalException):
        print(f"partita run: stopped by {e.sigval.name}; the ranks were stopped too", file=sys.stderr)
        return 128 + e.sigval
    rank, failure = _first_failure(e.failures, agent.Agent.killed)
    logs_at = logs.last.stderrs.get(failure.local_rank, args.log_dir) if logs.last else args.log_dir
    spent = f" (no restart left of --max-restarts {args.max_restarts})" if args.max_restarts else ""
    print(f"partita run: rank {rank} {_how(failure.exitcode)}{spent}; its log: {logs_at}", file=sys.stderr)
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


def _resume_file(log_dir: str) -> str:
    """Where `partita.elastic` in the ranks notes that it saved a checkpoint and stopped to be resumed: the
    launcher's own (a `partita slurm` batch script's), or a fresh one of this command. Each attempt starts
    without it."""
    given = settings.resume_file()
    if given is not None:
        return given
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(os.path.abspath(log_dir), f"resume-{uuid.uuid4().hex}")
    os.environ["PARTITA_RESUME_FILE"] = path  # the ranks inherit it
    return path


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _first_failure(failures: dict, killed: set[int]) -> tuple:
    """The rank that failed first. torch stamps failures in whole seconds, and the ranks that a dead rank takes
    down, or that the agent stops (SIGTERM; SIGKILL for the `killed` ones, which were stopped), often share its
    second: among those, a rank that exited by itself or died of another signal comes first."""
    def order(item):
        rank, code = item[0], item[1].exitcode
        return item[1].timestamp, code == -signal.SIGTERM or rank in killed, code > 0
    return min(failures.items(), key=order)


def _how(exitcode: int) -> str:
    if exitcode >= 0:
        return f"failed with exit code {exitcode}"
    try:
        return f"was killed by {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"
