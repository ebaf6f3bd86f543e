"""A bad PARTITA_* value stops every rank at `partita.init()`, at once and with the same message, before any rank
waits for another; a PARTITA_* variable partita does not read gets a warning on rank 0."""

import subprocess
import time

import pytest

from launch.daemons import end, free_port
from launch.harness import PYTHON, env

JOIN = "import partita; partita.init(); partita.shutdown()"

pytestmark = pytest.mark.slow


def test_a_bad_value_stops_every_rank_at_init_with_the_same_message():
    address = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    started = time.monotonic()
    # rank 1 alone would wait for rank 0 until PARTITA_TIMEOUT_S (60 s) if it got as far as joining
    procs = [subprocess.Popen([PYTHON, "-c", JOIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(RANK=str(rank), WORLD_SIZE="2", PARTITA_MEMORY_LIMIT="0", **address))
             for rank in range(2)]
    try:
        ranks = [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate()) for p in procs]
    finally:
        end([p.pid for p in procs if p.poll() is None])
    assert time.monotonic() - started < 30
    message = ("partita.errors.SettingsError: PARTITA_MEMORY_LIMIT='0' is not valid: PARTITA_MEMORY_LIMIT takes a "
               "memory size above 0")
    for proc in ranks:
        assert proc.returncode == 1, proc.stderr
        assert message in proc.stderr, proc.stderr


def test_an_unknown_variable_is_named_on_rank_0_with_its_close_match():
    proc = subprocess.run([PYTHON, "-c", JOIN], capture_output=True, text=True, timeout=120,
                          env=env(PARTITA_MEMORY_LIMT="1GiB", PARTITA_LOG="off"))
    assert proc.returncode == 0, proc.stderr
    # on stderr even with PARTITA_LOG=off
    assert "PARTITA_MEMORY_LIMT is set, but partita reads no such setting: did you mean PARTITA_MEMORY_LIMIT?" \
        in proc.stderr, proc.stderr
