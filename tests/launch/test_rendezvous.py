"""Ranks started with different world sizes, or a rank that never comes: a clear error on every rank, no hang."""

import re
import subprocess
import time

import pytest

from launch.daemons import free_port
from launch.harness import PYTHON, env

JOIN = "import partita; partita.init(); partita.shutdown()"


def start_ranks(world_sizes: list[int], **extra) -> list[subprocess.CompletedProcess]:
    """Start one process per entry, as rank i of a world of world_sizes[i], and wait for all of them."""
    address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([PYTHON, "-c", JOIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(RANK=str(rank), WORLD_SIZE=str(size), **address, **extra))
             for rank, size in enumerate(world_sizes)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_ranks_that_disagree_on_the_world_size_fail_fast_and_say_so():
    started = time.monotonic()
    ranks = start_ranks([2, 3])  # PARTITA_TIMEOUT_S is 60: failing well before it is failing fast
    assert time.monotonic() - started < 30
    for proc in ranks:
        assert proc.returncode != 0
        # the first claim to reach rank 0's store stands: usually rank 0's, but rank 1 may come first
        said = re.search(r"ranks disagree on the world size: rank (\d) on \S+ was started with a world of (\d), "
                         r"rank (\d) on \S+ with (\d)", proc.stderr)
        assert said, proc.stderr
        assert {said.group(1, 2), said.group(3, 4)} == {("0", "2"), ("1", "3")}, proc.stderr


@pytest.mark.slow
def test_a_rank_that_never_comes_is_named_after_the_timeout():
    ranks = start_ranks([3, 3], PARTITA_TIMEOUT_S="3")
    for proc in ranks:
        assert proc.returncode != 0
        assert "only 2 of 3 ranks reached the rendezvous" in proc.stderr and "missing ranks: 2" in proc.stderr, \
            proc.stderr
