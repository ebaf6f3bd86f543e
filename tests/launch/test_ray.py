"""Ray: `partita ray` trains like one process on a running cluster; a missing Ray or a silent address is an error."""

import json
import subprocess
import time

import pytest
import torch

from launch import ray_2d
from launch.daemons import free_port
from launch.harness import BIN, HERE, PYTHON, SCRIPT, check, env, losses, output


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
    out = tmp_path / "out.json"
    proc = subprocess.run([PYTHON, str(HERE / "ray_2d.py"), ray_head.address, str(out)], capture_output=True,
                          text=True, env=env(), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, output(proc)
    result = json.loads(out.read_text())
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


def test_partita_ray_without_ray_says_what_to_install(tmp_path):
    without_ray = ("import sys; sys.modules['ray'] = None; from partita.cli.main import main; "
                   "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([PYTHON, "-c", without_ray, "ray", "--workers", "2", SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "Ray is not installed in this Python: `pip install 'ray[default,train]'`" in proc.stderr
