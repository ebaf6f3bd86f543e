"""A private single-node Slurm cluster for the tests: munged, slurmctld and slurmd in a scratch folder.

Private ports, a private munge socket and its own SLURM_CONF keep it apart from any other Slurm on the host.
CPUs=8 with config_overrides lets a 2-core machine run 8 tasks; proctrack/linuxproc and task/none need no
cgroups.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.daemons import end, free_port

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

    def _pid_files(self) -> list[Path]:
        return [self.root / "slurmctld.pid", self.root / "slurmd.pid", self.root / "munge" / "munged.pid"]

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
            state = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True,
                                   env=dict(os.environ, **self.env)).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        log = (self.root / "log" / "slurmctld.log").read_text()[-2000:]
        raise RuntimeError(f"the test Slurm node is not idle after {timeout_s} s (state {state!r}); "
                           f"slurmctld log:\n{log}")

    def stop(self) -> None:
        """Shut the daemons down; kill, by pid, whichever of them is still running after a grace time."""
        pids = [int(f.read_text().split()[0]) for f in self._pid_files() if f.exists()]
        if self.conf.exists():
            subprocess.run(["scontrol", "shutdown"], capture_output=True, env=dict(os.environ, **self.env), timeout=30)
        end(pids)
        shutil.rmtree(self.root, ignore_errors=True)
