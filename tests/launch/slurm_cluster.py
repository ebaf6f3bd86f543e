"""A private single-node Slurm cluster for the tests: munged, slurmctld and slurmd in a scratch folder.

Private ports, a private munge socket and its own SLURM_CONF keep it apart from any other Slurm on the host.
CPUs=8 with config_overrides lets a 2-core machine run 8 tasks; proctrack/linuxproc and task/none need no
cgroups. `stop` cancels the jobs a failed test left and waits for their processes before it stops the daemons:
slurmstepd and the ranks run in sessions of their own and outlive slurmd. KillWait=5 (Slurm's default is 30 s)
lets a cancelled job's processes ignore SIGTERM for 5 s only.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.daemons import end, free_port, session, started_with

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "srun", "sinfo", "scontrol")
MUNGE_KEY = Path("/etc/munge/munge.key")  # written by the munge package's install script
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"

CONF = """\
ClusterName=partita-test
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
SlurmdParameters=config_overrides
NodeName={host} CPUs=8 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing() -> str:
    """Why this machine cannot run the cluster, or '' when it can."""
    lacking = [c for c in (*DAEMONS, *COMMANDS) if shutil.which(c) is None and not Path(f"/usr/sbin/{c}").exists()]
    if lacking:
        return f"Slurm is not installed ({', '.join(lacking)} missing): {INSTALL}"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs slurmd as root"
    if not MUNGE_KEY.exists():
        return f"{MUNGE_KEY} is missing: reinstall munge"
    return ""


def _scratch() -> Path:
    # not pytest's tmp_path: its folders are private to root, and munged runs as the munge user
    root = Path(tempfile.mkdtemp(prefix="pslurm", dir="/tmp"))
    root.chmod(0o755)
    return root


@dataclass
class SlurmCluster:
    root: Path = field(default_factory=_scratch)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict:
        """What Slurm's commands need to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *command: str) -> subprocess.CompletedProcess:
        """One of Slurm's commands, for this cluster."""
        return subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, **self.env), timeout=30)

    def _daemons(self) -> list[int]:
        files = [self.root / "slurmctld.pid", self.root / "slurmd.pid", self.root / "munge" / "munged.pid"]
        return [int(f.read_text().split()[0]) for f in files if f.exists()]

    def processes(self) -> list[int]:
        """Every process of this cluster: its daemons, and what its jobs run (slurmstepd, batch scripts, ranks)
        or what talks to it (srun), all started with its SLURM_CONF."""
        return started_with("SLURM_CONF", str(self.conf))

    def start(self) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        shutil.chown(munge, "munge", "munge")  # munged runs as munge and makes its socket there
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={munge}/munge.sock",
                        f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                        f"--seed-file={munge}/munged.seed"], check=True)
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(CONF.format(host=host, root=self.root, ctld_port=free_port(), slurmd_port=free_port()))
        for daemon in ("slurmctld", "slurmd"):  # each goes to the background once it runs
            subprocess.run([daemon, "-f", str(self.conf)], check=True, env=dict(os.environ, **self.env))
        self._wait_idle()

    def _wait_idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run("sinfo", "--noheader", "--format=%T").stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        log = (self.root / "log" / "slurmctld.log").read_text()[-2000:]
        raise RuntimeError(f"the test Slurm node is not idle after {timeout_s} s (state {state!r}); "
                           f"slurmctld log:\n{log}")

    def stop(self) -> None:
        """Cancel every job and wait until its processes are gone, then stop the daemons. Whatever of the cluster
        still runs then is killed by pid after a grace time, also when cancelling failed."""
        daemons = self._daemons()
        try:
            self._cancel_jobs(daemons)
        finally:
            end([*daemons, *self.processes()])
            shutil.rmtree(self.root, ignore_errors=True)

    def _cancel_jobs(self, daemons: list[int], timeout_s: float = 20) -> None:
        """scancel every job, and wait until slurmd and slurmstepd have ended its processes (SIGTERM, then SIGKILL
        after KillWait): nobody ends them once the daemons are gone."""
        if not self.conf.exists():  # the cluster never started
            return
        jobs = self.run("squeue", "--noheader", "--format=%A").stdout.split()
        if jobs:
            self.run("scancel", *jobs)
        # the daemons' sessions hold slurmctld's helper slurmscriptd; every other session is a job's (or a client's)
        theirs = {session(pid) for pid in daemons}
        deadline = time.monotonic() + timeout_s
        while any(session(p) not in theirs for p in self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
