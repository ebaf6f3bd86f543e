"""A rank stopped by SIGSTOP under `partita run`: its peer names it once a collective times out, and the job ends
within seconds of that, instead of torch's agent waiting 30 s for the stopped rank to act on SIGTERM."""

import re
import subprocess
import time
from pathlib import Path

import pytest

from launch.harness import BIN, env, output

pytestmark = pytest.mark.slow

COLLECTIVE_TIMEOUT_S = 3

# rank 1 stops itself in its fourth step and writes the time of the stop to the file named by its argument. The
# steps run on a group with a short timeout, so that rank 0's collective fails soon after the stop, while joining
# keeps the harness's PARTITA_TIMEOUT_S (ranks that start slowly on a loaded machine still join).
STOPS = f"""
import os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import partita
partita.init()
group = dist.new_group(timeout=timedelta(seconds={COLLECTIVE_TIMEOUT_S}))
for step in range(1000):
    if partita.get_rank() == 1 and step == 3:
        open(sys.argv[1], "w").write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1), group=group)
    time.sleep(0.05)
"""


def test_a_stopped_rank_is_named_and_killed_at_once(tmp_path):
    script, stopped = tmp_path / "stops.py", tmp_path / "stopped"
    script.write_text(STOPS)
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script),
                           str(stopped)], capture_output=True, text=True, env=env(), timeout=120)
    seconds = time.time() - float(stopped.read_text())
    assert proc.returncode == 1, output(proc)
    named = re.search(r"LaunchError: rank 1 \(process (\d+)\) is stopped, so a collective of rank 0 failed",
                      proc.stderr)
    assert named, output(proc)
    pid = named.group(1)
    assert f"partita run: rank 1 (process {pid}) is stopped (SIGSTOP) and would not act on SIGTERM: killed it with " \
           "SIGKILL" in proc.stderr, output(proc)
    assert "partita run: rank 0 failed with exit code 1" in proc.stderr, output(proc)
    assert not Path(f"/proc/{pid}").exists()  # no stopped process left behind
    # the collective's timeout, a second to look at the peers, the exit; torch's agent alone waited 30 s more
    assert seconds < COLLECTIVE_TIMEOUT_S + 12, output(proc)


# the same under the default settings: the group's timeout is PARTITA_TIMEOUT_S's default (300 s), which long steps
# need; the ranks' watchdogs find the stopped rank
STOPS_WITH_DEFAULTS = """
import os, signal, sys, time
import torch, torch.distributed as dist
import partita
partita.init()
for step in range(1000):
    if partita.get_rank() == 1 and step == 3:
        open(sys.argv[1], "w").write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
"""


@pytest.mark.parametrize("launcher", ["partita run", "torchrun"])
def test_a_stopped_rank_ends_the_job_within_a_minute_under_the_default_settings(launcher, tmp_path):
    script, stopped = tmp_path / "stops.py", tmp_path / "stopped"
    script.write_text(STOPS_WITH_DEFAULTS)
    environ = env()
    del environ["PARTITA_TIMEOUT_S"]
    start = [str(BIN / "partita"), "run", "-n", "2"] if launcher == "partita run" else \
        [str(BIN / "python"), "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = subprocess.run(start + [str(script), str(stopped)], capture_output=True, text=True, env=environ,
                          timeout=200)
    seconds = time.time() - float(stopped.read_text())
    assert proc.returncode != 0, output(proc)
    named = re.search(r"partita: rank 1 \(process (\d+) on this machine, stopped: killed it with SIGKILL\) has not "
                      r"answered for \d+ s: it is stopped \(SIGSTOP\) or frozen", proc.stderr)
    assert named, output(proc)
    assert not Path(f"/proc/{named.group(1)}").exists()  # no stopped process left behind
    assert seconds < 60, output(proc)
