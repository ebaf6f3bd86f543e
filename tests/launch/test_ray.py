"""Ray: `partita ray` trains like one process on a running cluster, and `partita.ray.run` without an address on a
cluster of its own; a missing Ray or a silent address is an error."""

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from launch import ray_2d
from launch.daemons import end, free_port, started_with
from launch.harness import BIN, HERE, PYTHON, SCRIPT, check, env, losses, output


def ray_env(ray_tmpdir: Path, **extra) -> dict:
    """The job's environment with Ray's temp folder (RAY_TMPDIR/ray) of the test's own, and no RAY_ADDRESS of
    the caller's."""
    e = {k: v for k, v in env(RAY_TMPDIR=str(ray_tmpdir)).items() if k != "RAY_ADDRESS"}
    return {**e, **extra}


def _still_running(ray_tmpdir: Path, within_s: float) -> list[int]:
    """The processes of the cluster that used `ray_tmpdir` that are still running `within_s` seconds after the
    job ended (ray.shutdown() stops a local cluster's processes, which then take a moment to exit)."""
    deadline = time.monotonic() + within_s
    while (left := started_with("RAY_TMPDIR", str(ray_tmpdir))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def latest_cluster(ray_tmpdir: Path, address: str) -> None:
    """Note `address` as the cluster that `ray start` started last on this machine, where Ray looks for it."""
    (ray_tmpdir / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(address)


@pytest.mark.slow
def test_partita_ray_trains_like_one_process_and_restarts_after_a_failure(ray_head, tmp_path):
    """4 Ray Train workers (2 stages x 2 replicas); worker 1 is killed with SIGKILL in step 3, Ray Train's failure
    handling (--max-failures 1) starts every worker again, and partita.elastic resumes from the last checkpoint."""
    proc = subprocess.run([str(BIN / "partita"), "ray", "--address", ray_head.address, "--workers", "4",
                           "--max-failures", "1", "--storage-path", str(tmp_path / "ray-results"), SCRIPT,
                           str(tmp_path), "--die-at", "3", "--die-rank", "1"],
                          capture_output=True, text=True, env=env(), timeout=300)
    assert proc.returncode == 0, output(proc)
    assert "launched by ray (Ray Train run partita-" in proc.stdout + proc.stderr
    assert [r["step"] for r in losses(tmp_path)] == [0, 1, 2, 2, 3, 4, 5]  # killed in step 3: resumed at step 2
    check(tmp_path, 4)


@pytest.mark.slow
def test_the_2d_example_of_ray_users_is_a_plain_model_and_partita_ray_run(ray_head, tmp_path):
    """Without an address, on a local cluster of its own: not the one that `ray start` started last on this machine
    (ray_head here), which Ray's own default would join, and nothing of it runs once the run has ended."""
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="pray", dir="/tmp"))  # short: Ray's socket paths are limited to 107
    latest_cluster(ray_tmpdir, ray_head.address)
    try:
        proc = subprocess.run([PYTHON, str(HERE / "ray_2d.py"), str(tmp_path)], capture_output=True, text=True,
                              env=ray_env(ray_tmpdir), cwd=tmp_path, timeout=240)
        left = _still_running(ray_tmpdir, within_s=20)
    finally:
        end(started_with("RAY_TMPDIR", str(ray_tmpdir)))
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    assert proc.returncode == 0, output(proc)
    result = json.loads((tmp_path / "out.json").read_text())
    assert not result["cluster"].endswith(f":{ray_head.port}") and left == [], (result["cluster"], left)
    assert [s["ranks"] for s in result["plan"]["stages"]] == [[0, 2], [1, 3]]  # 2 stages x 2 replicas
    model = ray_2d.make_model()  # one process on the 4 workers' batches, concatenated in rank order
    x, y = (torch.cat(parts) for parts in zip(*(ray_2d.batch(rank) for rank in range(4))))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    expected = []
    for _ in result["losses"]:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    assert result["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_a_cluster_too_small_for_the_workers_is_an_error_not_a_wait(ray_head, tmp_path):
    proc = subprocess.run([str(BIN / "partita"), "ray", "--address", ray_head.address, "--workers", "8",
                           "--cpus-per-worker", "1", SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 2, output(proc)
    assert "the Ray cluster is too small for 8 workers (CPU: 8 needed, 2 in the cluster)" in proc.stderr


@pytest.mark.slow
def test_an_address_that_does_not_answer_is_an_error_not_a_wait():
    pytest.importorskip("ray", reason="pip install 'ray[default,train]'")
    import partita.ray
    from partita.errors import LaunchError

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(LaunchError, match=f"no Ray cluster answers at {address}"):
        partita.ray.run(print, workers=2, address=address, connect_timeout_s=3)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("given", ["--address", "RAY_ADDRESS", "--address auto"])
def test_partita_ray_at_an_address_that_does_not_answer_is_an_error_not_a_wait(tmp_path, given):
    """Also when the address comes from RAY_ADDRESS or stands for the latest cluster (auto): ray.init would try
    for minutes."""
    pytest.importorskip("ray", reason="pip install 'ray[default,train]'")
    port = free_port()
    address = f"127.0.0.1:{port}"
    latest_cluster(tmp_path, address)  # a cluster that `ray start` started and that has ended since
    options = {"--address": ["--address", address], "RAY_ADDRESS": [], "--address auto": ["--address", "auto"]}
    environ = ray_env(tmp_path, **({"RAY_ADDRESS": address} if given == "RAY_ADDRESS" else {}))
    started = time.monotonic()
    proc = subprocess.run([str(BIN / "partita"), "ray", *options[given], "--connect-timeout", "3", "--workers", "2",
                           SCRIPT, str(tmp_path)], capture_output=True, text=True, env=environ, timeout=60)
    assert proc.returncode == 2, output(proc)
    named = "RAY_ADDRESS " if given == "RAY_ADDRESS" else ""
    # auto: the address as Ray resolved it, which may name this host by another IP
    assert f"no Ray cluster answers at {named}" in proc.stderr and f":{port} (" in proc.stderr, output(proc)
    assert time.monotonic() - started < 30


def test_partita_ray_without_ray_says_what_to_install(tmp_path):
    without_ray = ("import sys; sys.modules['ray'] = None; from partita.cli.main import main; "
                   "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([PYTHON, "-c", without_ray, "ray", "--workers", "2", SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "Ray is not installed in this Python: `pip install 'ray[default,train]'`" in proc.stderr
