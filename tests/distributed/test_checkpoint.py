"""Sharded checkpoints across world sizes and plans, on real gloo process pools (see support/pool.py)."""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest
import torch

import partita
from partita.checkpoint import export, latest_checkpoint, layout, owner
from partita.checkpoint.unpickling import read_metadata

CASE = "support.checkpoint_cases"
RTOL = 1e-5
TWO_BY_TWO = {"stages": 2, "replicas": 2, "schedule": "1F1B", "micro_batches": 4}


def assert_same_state(got: dict, want: dict) -> None:
    """Model and optimizer state bit for bit, and the same hyperparameters."""
    assert got["model"].keys() == want["model"].keys()
    for name, value in want["model"].items():
        np.testing.assert_array_equal(got["model"][name], value, err_msg=name)
    assert got["optim"].keys() == want["optim"].keys()
    for key, value in want["optim"].items():
        np.testing.assert_array_equal(got["optim"][key], value, err_msg=key)
    assert got["groups"] == want["groups"]


def check_resumed(loaded: list[dict], saved: list[dict]) -> None:
    for r in saved + loaded:
        assert not r["warnings"], f"a rank warned: {r['warnings']}"
    for rank, r in enumerate(loaded):
        assert_same_state(r["snapshot"], saved[0]["snapshot"])
        np.testing.assert_allclose(r["losses"], saved[0]["losses"], rtol=RTOL, err_msg=f"rank {rank}")
        assert r["info"]["step"] == 2 and r["info"]["extra"] == {"epoch": 1, "batch": 2, "files": ["a", "b"]}
        assert r["optimizer_state_of"] == r["trains"], f"rank {rank} keeps optimizer state it does not train"


def model_writers(root) -> dict[str, int]:
    """Which rank wrote each model tensor, from the DCP metadata (data files are named __<rank>_<n>.distcp)."""
    metadata = read_metadata(latest_checkpoint(root))
    return {index.fqn: int(info.relative_path.split("_")[2]) for index, info in metadata.storage_data.items()
            if index.fqn.startswith("model.")}


@pytest.fixture(scope="module")
def saved_gpt(pools, tmp_path_factory):
    """A small GPT (tied embedding / LM head) trained and saved on 4 ranks, 2 stages x 2 replicas, 1F1B."""
    root = tmp_path_factory.mktemp("gpt-2x2")
    results = pools.run(4, f"{CASE}:train_and_save", "gpt", str(root), TWO_BY_TWO)
    assert results[0]["plan"] == (2, 2)
    return root, results


def test_each_rank_writes_only_tensors_it_holds_and_replicas_share_the_writing(saved_gpt):
    root, saved = saved_gpt
    writer = model_writers(root)
    assert len(writer) == len(saved[0]["snapshot"]["model"])
    for key, rank in writer.items():
        assert key[len("model."):] in saved[rank]["writes"], f"rank {rank} wrote {key}, which it does not hold"
    assert set(writer.values()) == {0, 1, 2, 3}, "the second replica (ranks 2, 3) should share the writing"


@pytest.mark.parametrize("world,plan,after_first_call", [
    (2, {"stages": 2, "replicas": 1, "schedule": "1F1B", "micro_batches": 4}, False),
    (2, {"stages": 2, "replicas": 1, "schedule": "GPipe", "micro_batches": 2}, True),
    (2, {"stages": 1, "micro_batches": 1}, False),  # data parallel (torch DDP)
    (4, {"stages": 4, "schedule": "1F1B", "micro_batches": 4}, False),
], ids=["2ranks-2stages", "2ranks-2stages-loaded-after-first-call", "2ranks-ddp", "4ranks-4stages"])
def test_resume_on_another_world_and_plan(pools, saved_gpt, world, plan, after_first_call):
    """Parameters and Adam state equal the saved ones exactly; the next steps' losses equal the saving run's."""
    root, saved = saved_gpt
    loaded = pools.run(world, f"{CASE}:load_and_continue", "gpt", str(root), plan,
                       after_first_call=after_first_call)
    check_resumed(loaded, saved)
    assert loaded[0]["plan"][0] == plan["stages"]
    assert loaded[0]["info"]["world_size"] == 4 and loaded[0]["info"]["plan"] == (2, 2)
    for rank, r in enumerate(loaded):  # every rank r < 4 continues rank r's random streams
        assert r["info"]["rng_restored"] and r["draws"] == saved[rank]["draws"], f"rank {rank}"


@pytest.mark.parametrize("world,plan", [(2, {"stages": 2, "replicas": 1, "schedule": "1F1B", "micro_batches": 4}),
                                        (2, {"stages": 1, "micro_batches": 1})], ids=["2stages", "ddp"])
def test_resume_a_model_built_on_the_meta_device(pools, saved_gpt, world, plan):
    """Loaded before its first call, a model built on the meta device has no memory to read into: each rank
    reads its part as the first call materializes it, and the optimizer state right after."""
    root, saved = saved_gpt
    loaded = pools.run(world, f"{CASE}:load_and_continue", "gpt", str(root), plan, build="meta")
    check_resumed(loaded, saved)
    for rank, r in enumerate(loaded):
        assert r["info"]["rng_restored"] and r["draws"] == saved[rank]["draws"], f"rank {rank}"


@pytest.mark.parametrize("name,saved_plan,world,plan", [
    ("hf_gpt2", {**TWO_BY_TWO, "sharding": "optimizer"}, 2, {"stages": 1, "micro_batches": 1}),
    ("hf_llama", {**TWO_BY_TWO, "sharding": "parameters"}, 2, {"stages": 2, "schedule": "GPipe", "micro_batches": 2}),
    ("hf_bert", {"stages": 1, "micro_batches": 1}, 4, {**TWO_BY_TWO, "sharding": "gradients"}),
], ids=["gpt2-2x2-zero1-to-ddp", "llama-2x2-zero3-to-2-stages", "bert-ddp-to-2x2-zero2"])
def test_checkpoints_of_models_nobody_here_wrote(pools, tmp_path, name, saved_plan, world, plan):
    """Hugging Face models, called with keyword inputs (GPT-2's tied embedding is named lm_head.weight in
    its graph): saved under one layout, loaded under another, parameters and Adam state equal exactly."""
    saved = pools.run(4, f"{CASE}:train_and_save", name, str(tmp_path), saved_plan)
    loaded = pools.run(world, f"{CASE}:load_and_continue", name, str(tmp_path), plan)
    check_resumed(loaded, saved)


FP16_LAYOUTS = [({"stages": 1, "micro_batches": 1}, False, "cpu"), ({"stages": 2, "micro_batches": 2}, False, "cpu"),
                ({"stages": 2, "micro_batches": 2}, True, "cpu"), ({"stages": 2, "micro_batches": 2}, False, "meta")]


@pytest.mark.parametrize("plan,after_first_call,build", FP16_LAYOUTS,
                         ids=["ddp", "2stages", "2stages-after-first-call", "2stages-meta-built"])
def test_fp16_resumes_with_the_loss_scale_it_saved(pools, tmp_path, plan, after_first_call, build):
    """float16 whose gradients overflowed before the save: the resumed run goes on from the saved loss scale,
    skipping exactly the steps the uninterrupted run skipped, and ends with its weights, bit for bit."""
    saved = pools.run(2, f"{CASE}:train_and_save", "loud_mlp", str(tmp_path), plan, steps=4, more=4,
                      precision="fp16")
    at_save, at_end = saved[0]["loss_scales"]
    assert at_save[0] < 2.0 ** 16 and at_end != at_save, "the scale must move before and after the save"
    loaded = pools.run(2, f"{CASE}:load_and_continue", "loud_mlp", str(tmp_path), plan, more=4,
                       after_first_call=after_first_call, build=build, precision="fp16")
    for rank, r in enumerate(loaded):
        # a model built on the meta device makes one call (without gradients) before its snapshot
        assert r["loss_scales"] == [at_save if after_first_call or build == "meta" else None, at_end], f"rank {rank}"
        assert_same_state(r["snapshot"], saved[0]["snapshot"])
        assert r["losses"] == saved[0]["losses"], f"rank {rank}"
        assert_same_state(r["final"], saved[0]["final"])


def test_fp16_loads_a_checkpoint_without_a_loss_scale(pools, tmp_path):
    """A checkpoint that kept no loss scale (float32's, or one saved before partita kept it) loads into a float16
    run, whose scale starts over as in a new job, also where the run's first step had moved it."""
    pools.run(2, f"{CASE}:train_and_save", "loud_mlp", str(tmp_path), {"stages": 2, "micro_batches": 2})
    loaded = pools.run(2, f"{CASE}:load_and_continue", "loud_mlp", str(tmp_path), {"stages": 2, "micro_batches": 2},
                       after_first_call=True, precision="fp16")
    for r in loaded:
        assert r["info"]["step"] == 2 and r["loss_scales"][0] == (2.0 ** 16, 0), r


def test_export_of_a_sharded_checkpoint_loads_into_the_plain_model(saved_gpt, tmp_path):
    from support.zoo import CASES

    root, saved = saved_gpt
    done = export(root, tmp_path / "gpt.pt")
    plain = CASES["gpt"].make()
    plain.load_state_dict(torch.load(done.path, weights_only=True))
    for name, value in saved[0]["snapshot"]["model"].items():
        np.testing.assert_array_equal(plain.state_dict()[name].numpy(), value, err_msg=name)


def test_two_ranks_to_four(pools, tmp_path):
    """Saved on 2 ranks data-parallel (DDP), resumed on 4 (2 stages x 2 replicas): ranks 2 and 3 keep their
    own RNG."""
    saved = pools.run(2, f"{CASE}:train_and_save", "mlp", str(tmp_path), {"stages": 1, "micro_batches": 1})
    assert set(model_writers(tmp_path).values()) == {0, 1}, "identical copies: both ranks share the writing"
    loaded = pools.run(4, f"{CASE}:load_and_continue", "mlp", str(tmp_path), TWO_BY_TWO)
    check_resumed(loaded, saved)
    assert [r["info"]["rng_restored"] for r in loaded] == [True, True, False, False]
    assert [r["draws"] for r in loaded[:2]] == [r["draws"] for r in saved]
    assert loaded[0]["info"]["world_size"] == 2 and loaded[0]["info"]["plan"] == (1, 2)


def test_torch_ddp_module_saves_rank0_buffers_and_loads_in_one_process(pools, tmp_path):
    from support.zoo import CASES

    saved = pools.run(2, f"{CASE}:plain_ddp_save", str(tmp_path))
    model = CASES["batchnorm"].make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert partita.load(model, opt, tmp_path).world_size == 2
    assert not np.array_equal(saved[0]["state"]["bn1.running_mean"], saved[1]["state"]["bn1.running_mean"])
    for name, value in saved[0]["state"].items():
        np.testing.assert_array_equal(model.state_dict()[name].numpy(), value, err_msg=name)
    for p, value in zip(model.parameters(), saved[0]["momentum"]):
        np.testing.assert_array_equal(opt.state[p]["momentum_buffer"].numpy(), value)


def test_keep_prunes_and_unfinished_saves_are_ignored_then_removed(pools, tmp_path):
    pools.run(2, f"{CASE}:save_steps", "mlp", str(tmp_path), [1], keep=2)
    unfinished = tmp_path / "step-000002.tmp-deadbeef"  # a save of a later step that died mid-write
    unfinished.mkdir()
    (unfinished / "__0_0.distcp").write_bytes(b"\0" * 100)
    (unfinished / layout.SAVING).write_text(socket.gethostname())  # the lock its process took, gone with it
    live = tmp_path / "step-000009.tmp-0123abcd"  # another job's save in progress
    live.mkdir()
    lock = layout.SaveLock()
    lock.take(live)
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-000001")
    assert pools.run(2, f"{CASE}:load_latest", "mlp", str(tmp_path)) == [1, 1]
    try:
        paths = pools.run(2, f"{CASE}:save_steps", "mlp", str(tmp_path), [2, 3, 4], keep=2)[0]
    finally:
        lock.release()
    assert not unfinished.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [owner.JOB_LOCK, "latest", "step-000003", "step-000004",
                                                          live.name]
    assert latest_checkpoint(tmp_path) == paths[-1] == str(tmp_path / "step-000004")


def test_errors_reach_every_rank(pools, tmp_path):
    """A checkpoint of another model, a damaged one, and a bad argument on one rank only: every rank raises
    the same CheckpointError (none is left waiting)."""
    pools.run(2, f"{CASE}:save_steps", "mlp", str(tmp_path), [1], keep=1)
    results = pools.run(2, f"{CASE}:failures", "foreign_model", str(tmp_path))
    assert {r["error"] for r in results} == {"CheckpointError"} and results[0] == results[1]
    assert "does not fit this model" in results[0]["message"]

    results = pools.run(2, f"{CASE}:failures", "bad_extra_on_one_rank", str(tmp_path / "other"))
    assert {r["error"] for r in results} == {"CheckpointError"} and results[0] == results[1]
    assert "rank 1" in results[0]["message"] and "JSON" in results[0]["message"]
    assert latest_checkpoint(tmp_path / "other") is None

    (tmp_path / "step-000001" / "__1_0.distcp").unlink()
    results = pools.run(2, f"{CASE}:failures", "damaged", str(tmp_path))
    assert {r["error"] for r in results} == {"CheckpointError"} and results[0] == results[1]
    assert "__1_0.distcp is missing" in results[0]["message"]


@pytest.mark.parametrize("call", ["save", "load", "state_dict", "get_param", "barrier"])
@pytest.mark.parametrize("plan", [{"stages": 1}, {"stages": 2}], ids=["ddp", "pipeline"])
def test_save_or_load_on_rank_0_only_is_an_error_on_every_rank_at_once(pools, tmp_path, call, plan):
    """`if rank == 0: partita.save(...)` (or partita.barrier(), the model's state_dict(), get_param()) while rank 1
    calls the model:
    both raise the same PartitaError, which says that these are collective, within seconds (the process group's
    timeout is 30 s), under DDP too, where a read gathers nothing."""
    results = pools.run(2, f"{CASE}:on_rank0_only", call, str(tmp_path), plan)
    assert {r["error"] for r in results} == {"PartitaError"}, results
    assert results[0]["message"] == results[1]["message"].replace("seen on rank 1", "seen on rank 0")
    message = results[0]["message"]
    where = {"save": r"partita\.save\(path=.*", "load": r"partita\.load\(path=.*",
             "state_dict": r"model\.state_dict\(\)", "get_param": r"model\.get_param\('layers\.0\.weight'\)",
             "barrier": r"partita\.barrier\(\)"}[call]
    assert re.search(rf"rank 0 in {where} after \d+ calls of the model; rank 1 in call \d+ of the model", message), \
        message
    assert "are collective" in message and "not under `if rank == 0:`" in message, message
    assert max(r["seconds"] for r in results) < 10, results


def test_save_on_rank_0_only_while_rank_1_shuts_down(pools, tmp_path):
    rank0, rank1 = pools.run(2, f"{CASE}:on_rank0_only", "save_then_shutdown", str(tmp_path), {"stages": 1})
    assert rank0["error"] == "PartitaError" and "rank 1 in partita.shutdown() after" in rank0["message"], rank0
    assert rank1["all_left"] is False and max(rank0["seconds"], rank1["seconds"]) < 10
