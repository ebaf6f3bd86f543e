"""The launcher engines the tests start themselves, once per session, and always tear down."""

import subprocess

import pytest
import torch

from launch import ray_cluster, slurm_cluster
from launch.harness import BIN, SCRIPT, env, output


@pytest.fixture(scope="session")
def slurm():
    """A private single-node Slurm cluster (skips with what to install where Slurm is missing)."""
    if why := slurm_cluster.missing():
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def ray_head():
    """A private local Ray cluster (skips with what to install where Ray is missing)."""
    if why := ray_cluster.missing():
        pytest.skip(why)
    head = ray_cluster.RayHead(BIN / "ray", env())
    try:
        head.start()
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`partita run -n 4` of the training script, uninterrupted: the run that stopped, killed and resumed jobs of
    the same world must reproduce bit for bit (same plan, same arithmetic)."""
    run = tmp_path_factory.mktemp("reference4")
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "4", "--log-dir", str(run / "logs"), SCRIPT, str(run)],
                          capture_output=True, text=True, env=env(), timeout=240)
    assert proc.returncode == 0, output(proc)
    return {"dir": run, "proc": proc, "final": torch.load(run / "final.pt"), "plan": str(run / "plan-4.json")}
