"""The launcher engines the tests start themselves, once per session, and always tear down."""

import pytest

from launch import ray_cluster, slurm_cluster
from launch.harness import BIN, env


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
