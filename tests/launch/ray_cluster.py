"""A private local Ray cluster for the tests: `ray start --head --block` in a session of its own.

Every port Ray would otherwise take by default is chosen free, and its files go to a short private folder (Ray's
socket paths must stay under 108 characters), so it stays apart from any other Ray on the host. `stop` kills the
whole session by pid: SIGTERM makes Ray drain for up to 30 s, and `ray stop` would end every Ray on the host.
"""

import importlib.util
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.daemons import end, free_port, in_session

NUM_CPUS = 2


@dataclass
class RayHead:
    ray: Path  # the `ray` command of the Python under test
    env: dict
    port: int = field(default_factory=free_port)
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pray", dir="/tmp"))
    process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> None:
        command = [str(self.ray), "start", "--head", "--block", f"--port={self.port}", f"--num-cpus={NUM_CPUS}",
                   f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
                   f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats",
                   f"--temp-dir={self.temp_dir}"]
        log = open(Path(self.temp_dir) / "head.log", "w")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if "Ray runtime started" in (Path(self.temp_dir) / "head.log").read_text():
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test Ray head did not start: {(Path(self.temp_dir) / 'head.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            for _ in range(10):  # a few rounds: the raylet may start a worker while the first round is killed
                end(in_session(self.process.pid), grace_s=0, sig=signal.SIGKILL)
            self.process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def missing() -> str:
    """Why this machine cannot run the cluster, or '' when it can."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed: pip install 'ray[default,train]'"
    return ""

