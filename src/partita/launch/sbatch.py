"""Slurm batch jobs for `partita slurm`: the script, the resource check, submission and the job's state.

The script replaces the hand-written node lists and master addresses of the usual Slurm tutorials: either srun
starts every rank and `partita.init()` reads srun's variables (`srun` mode), or srun starts one torch elastic
agent per node (`partita run`), and the agents meet at the first node of the allocation (`torchrun` mode).

>>> job = SlurmJob(script="/home/me/train.py", nodes=2, ranks_per_node=4, workdir="/home/me",
...                log_dir="/home/me/partita-logs", python="/venv/bin/python")
>>> print(render(job, "partita slurm --nodes 2 --ranks-per-node 4 train.py").splitlines()[-1])
exit "$status"
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import textwrap
import time
from dataclasses import dataclass

from partita.errors import LaunchError

LAUNCHERS = ("srun", "torchrun")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


@dataclass(frozen=True)
class SlurmJob:
    """What to run and what to ask Slurm for."""

    script: str  # the training script, an absolute path
    workdir: str  # the job runs here
    log_dir: str  # the job's output file, and the stop file of the time-limit warning, go here
    python: str  # the Python that runs the ranks (the one that runs `partita slurm`, so the same packages)
    args: tuple[str, ...] = ()
    nodes: int = 1
    ranks_per_node: int = 1
    partition: str | None = None
    time: str | None = None  # Slurm's format: minutes, or [D-]HH:MM:SS
    gpus_per_node: int = 0
    launcher: str = "srun"  # one of LAUNCHERS
    job_name: str = "partita"
    warn_before_end_s: int = 120  # Slurm signals the batch script this long before the time limit
    requeue: bool = True  # training that stopped to be resumed (partita.elastic) puts the job back in the queue

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1 or self.gpus_per_node < 0:
            raise LaunchError(f"need at least 1 node and 1 rank per node, got {self.nodes} node(s) x "
                              f"{self.ranks_per_node} rank(s), {self.gpus_per_node} GPUs per node")
        if self.launcher not in LAUNCHERS:
            raise LaunchError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")

    @property
    def output(self) -> str:
        return f"{self.log_dir}/{self.job_name}-%j.out"


def _directives(job: SlurmJob) -> list[str]:
    """The #SBATCH lines, in groups, each after a comment that says what it asks for."""
    gpus = f", {job.gpus_per_node} GPU(s) per node" if job.gpus_per_node else ""
    resources = [f"--job-name={job.job_name}", f"--nodes={job.nodes}"]
    if job.launcher == "srun":
        resources += [f"--ntasks-per-node={job.ranks_per_node}"]
    else:  # one agent per node, with a CPU for each of its ranks
        resources += ["--ntasks-per-node=1", f"--cpus-per-task={job.ranks_per_node}"]
    resources += [f"--partition={job.partition}"] if job.partition else []
    resources += [f"--time={job.time}"] if job.time else []
    resources += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    groups = [
        (f"{job.nodes} node(s) x {job.ranks_per_node} rank(s) per node = {job.nodes * job.ranks_per_node} "
         f"ranks{gpus}, started by {job.launcher}.", resources),
        ("The output of this script and of every rank goes to one file per job; the job runs in the folder that "
         "`partita slurm` ran in.", [f"--output={job.output}", f"--chdir={job.workdir}"]),
    ]
    if job.requeue:
        groups.append(("The job may put itself back in the queue (at the end of this script); its output file "
                       "then keeps the output of the runs before.", ["--requeue", "--open-mode=append"]))
    return [line for text, options in groups for line in (*_comment(text), *(f"#SBATCH {o}" for o in options))]


def _comment(text: str) -> list[str]:
    """A paragraph as shell comment lines of at most 110 characters."""
    return textwrap.wrap(text, 110, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)


def _launch(job: SlurmJob) -> list[str]:
    """The lines that start the ranks, with why."""
    command = shlex.join([job.script, *job.args])
    python = shlex.quote(job.python)
    if job.launcher == "srun":
        return [
            *_comment(f"srun starts all {job.nodes * job.ranks_per_node} ranks. partita.init() in each reads its "
                      "place from srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) and meets the others on the step's "
                      "first node, at a port derived from the job id (export MASTER_ADDR and MASTER_PORT to choose "
                      "them). --kill-on-bad-exit: a failed rank ends the job; no rank waits for it."),
            f"launch=(srun --kill-on-bad-exit=1 {python} -u {command})",
        ]
    return [
        *_comment(f"srun starts one torch elastic agent per node (`partita run`), each starting {job.ranks_per_node} "
                  "ranks; the agents meet at the first node of the allocation (c10d rendezvous)."),
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "rendezvous_port=$((20000 + (SLURM_JOB_ID + 997 * ${SLURM_RESTART_COUNT:-0}) % 10000))  # a requeued job: "
        "another port",
        f"launch=(srun --kill-on-bad-exit=1 {python} -m partita.cli.main run -n {job.ranks_per_node} "
        f"--nnodes {job.nodes}",
        '        --rdzv-endpoint "$head_node:$rendezvous_port" --rdzv-id "$SLURM_JOB_ID"',
        f"        --log-dir {shlex.quote(job.log_dir)} {command})",
    ]


def render(job: SlurmJob, command_line: str) -> str:
    """The batch script: readable, commented, ready for `sbatch`."""
    warn = job.warn_before_end_s
    lines = [
        "#!/bin/bash",
        "# Written by `partita slurm` for:",
        f"#   {command_line}",
        *_directives(job),
        *_comment(f"Slurm sends SIGUSR1 to this script {warn} s before the time limit. B: means this shell only: a "
                  "rank without a handler would die of it. The trap below records it in PARTITA_STOP_FILE, which "
                  "training can check to save a checkpoint in time."),
        f"#SBATCH --signal=B:USR1@{warn}",
        "",
        *_comment("Files that training (partita.elastic) reads and writes: the stop file, which the trap below "
                  "writes when Slurm's warning comes" + (", and the resume file, which training writes when it "
                  "saved a checkpoint to resume from." if job.requeue else ".")),
        f'export PARTITA_STOP_FILE="{job.log_dir}/{job.job_name}-$SLURM_JOB_ID.stop"',
        *(["export PARTITA_RESUME_FILE=\"$PARTITA_STOP_FILE.resume\"",
           *_comment("A requeued job keeps its id: the files of its previous run must not stop this one."),
           'rm -f "$PARTITA_STOP_FILE" "$PARTITA_RESUME_FILE"'] if job.requeue else []),
        "trap 'echo \"partita: the time limit is near: wrote $PARTITA_STOP_FILE\"; touch \"$PARTITA_STOP_FILE\"' USR1",
        "",
        *_comment("One hash seed for every rank: a model whose forward iterates over a set of strings captures its "
                  "operations in that set's order, which follows the seed, and every rank must capture the same "
                  "graph."),
        'export PYTHONHASHSEED="${PYTHONHASHSEED:-0}"',
        "",
        *_launch(job),
        "",
        *_comment("srun runs in the background because bash runs a trap only between commands; a trap also ends "
                  "`wait` early, so wait again until srun has ended. The job's exit status is srun's."),
        '"${launch[@]}" &',
        "srun_pid=$!",
        "while true; do",
        '  wait "$srun_pid"; status=$?',
        '  kill -0 "$srun_pid" 2>/dev/null || break',
        "done",
        *_requeue(job),
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _requeue(job: SlurmJob) -> list[str]:
    """Lines that put the job back in the queue when training stopped to be resumed, with why."""
    if not job.requeue:
        return []
    return [
        "",
        *_comment("Training that uses partita.elastic saves a checkpoint when it sees the stop file, writes "
                  "PARTITA_RESUME_FILE and stops. Then the job goes back in the queue (same job id, "
                  "SLURM_RESTART_COUNT + 1) and resumes from that checkpoint. Without it, the job just ends."),
        'if [ -e "$PARTITA_RESUME_FILE" ]; then',
        '  echo "partita: training saved a checkpoint to resume from ($(cat "$PARTITA_RESUME_FILE")): requeueing job '
        '$SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "fi",
    ]


def _slurm(*command: str, script: str | None = None) -> subprocess.CompletedProcess:
    """Run one of Slurm's commands, with an error that says what to install when it is missing."""
    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]} is not installed here (not on PATH): partita slurm submits jobs with "
                          "Slurm's commands. Run it on a Slurm login node, or use --dry-run to only print the script.")
    return subprocess.run(command, input=script, capture_output=True, text=True, timeout=60)


def check(script: str) -> None:
    """Ask Slurm whether it could ever run the batch script (sbatch --test-only), without submitting it.

    sbatch accepts a job that asks for more nodes or CPUs than its partition has and leaves it pending forever;
    --test-only refuses it at once.
    """
    probe = _slurm("sbatch", "--test-only", script=script)
    if probe.returncode != 0:
        cluster = _slurm("sinfo", "--noheader", "--format=%P: %D node(s), %c CPUs per node, GPUs %G").stdout
        raise LaunchError(
            f"Slurm cannot run this job: {probe.stderr.strip()}. The cluster has:\n{cluster.rstrip()}\n"
            "Ask for fewer nodes, ranks per node or GPUs, or another --partition."
        )


def submit(script_path: str) -> int:
    """Submit the batch script; the job id."""
    done = _slurm("sbatch", "--parsable", script_path)
    if done.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {done.stderr.strip()}")
    return int(done.stdout.strip().split(";")[0])


@dataclass(frozen=True)
class JobState:
    """A job's state as `scontrol show job` reports it."""

    state: str  # PENDING, RUNNING, COMPLETED, FAILED, ... or GONE once Slurm has forgotten the job
    exit_code: int
    signal: int  # the signal that ended the batch script, 0 if none
    reason: str

    @property
    def finished(self) -> bool:
        return self.state in FINISHED or self.state == "GONE"


def job_state(job_id: int) -> JobState:
    """The job's state now (scontrol: sacct needs accounting, which small clusters often lack)."""
    shown = _slurm("scontrol", "show", "job", "--oneliner", str(job_id))
    if shown.returncode != 0:  # "Invalid job id": the job ended longer ago than Slurm's MinJobAge
        return JobState("GONE", 0, 0, shown.stderr.strip())
    fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
    exit_code, _, signal = fields.get("ExitCode", "0:0").partition(":")
    return JobState(fields.get("JobState", "UNKNOWN"), int(exit_code), int(signal or 0), fields.get("Reason", ""))


def wait(job_id: int, poll_s: float = 2.0) -> JobState:
    """Poll the job until it has finished (sbatch --wait backs off to tens of seconds between polls)."""
    while not (now := job_state(job_id)).finished:
        time.sleep(poll_s)
    return now
