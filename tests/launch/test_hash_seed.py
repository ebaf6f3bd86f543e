"""Ranks whose interpreters hash strings differently capture a model that iterates over a set of strings in
different orders (issue 30, point 1: Hugging Face's Gemma 3 under torchrun). `partita run` starts every rank with
the same hash seed, and the job trains one process's losses; ranks started with different seeds, as torchrun
starts them, are refused on every rank with what differs and the fix."""

import json
import subprocess

import pytest

from launch.hash_seed_script import one_process_losses
from launch.harness import BIN, HERE, PYTHON, env, output
from support.pool import free_port

SCRIPT = str(HERE / "hash_seed_script.py")
SEEDS = ("0", "1")  # order {"local", "global"} differently (checked in each test through the ranks' seed files)


def unseeded_env(**extra) -> dict:
    """The launched job's environment: PYTHONHASHSEED only as `extra` sets it."""
    e = env(PARTITA_PROFILE="estimate")
    e.pop("PYTHONHASHSEED", None)
    return {**e, **extra}


def seeds(run_dir) -> list[dict]:
    return [json.loads((run_dir / f"seed-{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("model", ["kinds"])  # the seed does not depend on the model; Gemma 3 below
def test_partita_run_gives_every_rank_one_hash_seed_and_one_process_losses(tmp_path, model):
    proc = subprocess.run([str(BIN / "partita"), "run", "-n", "2", "--log-dir", str(tmp_path / "logs"), SCRIPT,
                           str(tmp_path), model], capture_output=True, text=True, env=unseeded_env(), timeout=300)
    assert proc.returncode == 0, output(proc)
    assert [s["PYTHONHASHSEED"] for s in seeds(tmp_path)] == ["0", "0"]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses == pytest.approx(one_process_losses(model), rel=1e-5)


def launched_by_hand(run_dir, model: str, hash_seeds=SEEDS) -> list[subprocess.CompletedProcess]:
    """The job's 2 ranks started as torchrun starts them, each with its own PYTHONHASHSEED."""
    port = free_port()
    procs = [subprocess.Popen([PYTHON, SCRIPT, str(run_dir), model], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=unseeded_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                          MASTER_PORT=str(port), PYTHONHASHSEED=hash_seeds[rank]))
             for rank in range(2)]
    done = [subprocess.CompletedProcess(p.args, 0, p.communicate(timeout=300)[0]) for p in procs]
    for proc, d in zip(procs, done):
        d.returncode = proc.returncode
    return done


@pytest.mark.parametrize("model", ["kinds", "gemma3"])
def test_ranks_with_different_hash_seeds_run_rank_0_s_graph_and_train_one_process_losses(tmp_path, model):
    ranks = launched_by_hand(tmp_path, model)
    orders = [s["order"] for s in seeds(tmp_path)]
    assert orders[0] != orders[1], "these seeds order the set alike here: pick two that do not"
    assert [r.returncode for r in ranks] == [0, 0], [r.stdout for r in ranks]
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses == pytest.approx(one_process_losses(model), rel=1e-5)
    assert ("rank 1 captured the model's operations in another order than rank 0 (rank 0 runs with "
            "PYTHONHASHSEED=0; rank 1 runs with PYTHONHASHSEED=1) and run them in rank 0's order") in ranks[0].stdout


@pytest.mark.parametrize("hash_seeds", [SEEDS, ("0", "0")])
def test_ranks_that_capture_different_operations_are_refused_on_every_rank(tmp_path, hash_seeds):
    ranks = launched_by_hand(tmp_path, "by_rank", hash_seeds)
    assert [r.returncode for r in ranks] == [3, 3], [r.stdout for r in ranks]
    errors = [(tmp_path / f"error-{r}.txt").read_text() for r in range(2)]
    assert errors[0] == errors[1]
    error = errors[0]
    assert "the ranks captured different graphs of the model" in error
    assert "rank 1 captured a graph that first differs from rank 0's at operation" in error
    if hash_seeds[0] == hash_seeds[1]:  # else the first difference is the set's order, and so named
        assert "rank 0 has `cos_2 = call_function aten.cos.default" in error
        assert "rank 1 `sin = call_function aten.sin.default" in error
    assert f"rank 0 runs with PYTHONHASHSEED={hash_seeds[0]}; rank 1 runs with PYTHONHASHSEED={hash_seeds[1]}" in error
    assert ("so the ranks iterate in different orders" if hash_seeds == SEEDS else "so the cause is elsewhere") in error
    assert "start every rank with the same PYTHONHASHSEED" in error
    assert not (tmp_path / "losses.json").exists()
