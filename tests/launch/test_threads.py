"""CPU threads per rank: the share of the cores this process may use, unless the user set OMP_NUM_THREADS (the 1
that torchrun sets is not the user's)."""

import json
import subprocess

import pytest

from launch.harness import BIN, PYTHON, env, output
from partita.launch.threads import threads_per_rank, usable_cores

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "OMP_NUM_THREADS": "1"}


def no_omp() -> dict:
    """The launched jobs' environment without the OMP_NUM_THREADS=1 of the tests."""
    return {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}


@pytest.mark.parametrize("cores, ranks, environ, agent_started_with, threads", [
    (8, 4, {}, None, 2),  # nobody chose: the share
    (3, 2, {}, None, 1),
    (2, 4, {}, None, 1),  # more ranks than cores: still one thread each
    (8, 4, {"OMP_NUM_THREADS": "3"}, None, None),  # the user's (mpirun, srun, by hand)
    (8, 4, TORCHRUN, {"PATH": "/bin"}, 2),  # torchrun set it: the agent started without it
    (8, 4, TORCHRUN, {"OMP_NUM_THREADS": "1"}, None),  # the user gave it to torchrun
    (8, 4, TORCHRUN, None, None),  # the agent's environment unreadable: the user's, to be safe
])
def test_threads_per_rank(cores, ranks, environ, agent_started_with, threads):
    assert threads_per_rank(cores, ranks, environ, agent_started_with) == threads


# what a rank of 2 on an 8-core node would get, from the environment torchrun really gives it
RANK_ON_8_CORES = """
import json, os, sys
from partita.launch.threads import launcher_environ, threads_per_rank
threads = threads_per_rank(8, int(os.environ["LOCAL_WORLD_SIZE"]), os.environ, launcher_environ(os.environ))
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    json.dump(threads, f)
"""


@pytest.mark.slow
@pytest.mark.parametrize("users_omp, threads", [(None, 4), ("1", None)])
def test_torchruns_own_omp_num_threads_is_told_from_the_users(tmp_path, users_omp, threads):
    script = tmp_path / "rank.py"
    script.write_text(RANK_ON_8_CORES)
    environ = env(OMP_NUM_THREADS=users_omp) if users_omp else no_omp()
    proc = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)],
                          capture_output=True, text=True, env=environ, timeout=120)
    assert proc.returncode == 0, output(proc)
    assert [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)] == [threads, threads]
    assert ("Setting OMP_NUM_THREADS" in proc.stderr) == (users_omp is None)  # torchrun's warning when it sets it


THREADS_AFTER_INIT = ("import os, torch, partita; partita.init(); "
                      "print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads()); partita.shutdown()")


@pytest.mark.slow
@pytest.mark.skipif(usable_cores() < 2, reason="needs 2 cores, to run on fewer than the machine has")
def test_the_cores_are_those_of_the_affinity_not_the_machine(tmp_path):
    """Pinned to one core, `partita run -n 1` and a plain process train on one thread (os.cpu_count() says more)."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS_AFTER_INIT)
    pinned = ["taskset", "--cpu-list", "0"]
    run = subprocess.run([*pinned, str(BIN / "partita"), "run", "-n", "1", "--quiet", "--log-dir", str(tmp_path),
                          str(script)], capture_output=True, text=True, env=no_omp(), timeout=120)
    assert run.returncode == 0, output(run)
    logs = "".join(p.read_text() for p in tmp_path.glob("*/attempt_0/0/stdout.log"))
    assert logs.split() == ["1", "1"], output(run) + logs  # partita run's OMP_NUM_THREADS, then torch's threads
    alone = subprocess.run([*pinned, PYTHON, str(script)], capture_output=True, text=True, env=no_omp(), timeout=120)
    assert alone.returncode == 0 and alone.stdout.split() == ["None", "1"], output(alone)
