"""`mpirun -np 4 python train_script.py`, with no partita command and no MASTER_ADDR, trains like one process."""

import shutil
import subprocess

import pytest

from launch.harness import PYTHON, SCRIPT, check, env, output

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("mpirun") is None,
                                 reason="Open MPI is not installed: apt-get install openmpi-bin libopenmpi-dev")]

# root in CI containers, and 4 ranks on 2 cores
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np"]


def test_mpirun(tmp_path):
    pytest.importorskip("mpi4py", reason="pip install mpi4py: rank 0 broadcasts the rendezvous address with it")
    proc = subprocess.run([*MPIRUN, "4", PYTHON, SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env(),
                          timeout=240)
    assert proc.returncode == 0, output(proc)
    assert "launched by mpirun (address broadcast with mpi4py): 4 ranks = 1 node x 4 ranks per node" in proc.stderr
    check(tmp_path, 4)


def test_mpirun_without_mpi4py_meets_at_a_port_from_the_job_id(tmp_path):
    # as if mpi4py were not installed; 2 ranks only join and sum (the training is test_mpirun's)
    script = ("import sys; sys.modules['mpi4py'] = None\n"
              "import torch, torch.distributed as dist, partita\n"
              "world = partita.init()\n"
              "total = torch.ones(1); dist.all_reduce(total); assert total.item() == world.world_size == 2\n"
              "partita.shutdown()\n")
    proc = subprocess.run([*MPIRUN, "2", PYTHON, "-c", script], capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, output(proc)
    assert "launched by mpirun (port from MPI job" in proc.stderr
