"""ZeRO-1 (sharding="optimizer"): the replicas of each stage split the optimizer's state; training equals one
process (fp32, rtol 1e-5): gradients, parameters and the gathered optimizer state, with SGD momentum and
Adam, under data parallelism and pipelines with replicas, tied weights included."""

import json
from pathlib import Path

import pytest

from partita.checkpoint.manifest import read_manifest

from test_checkpoint import CASE, TWO_BY_TWO, check_resumed
from test_fidelity import check, fidelity

LAYOUTS = [(2, 1, 1), (4, 1, 1), (4, 2, 2)]  # world, stages, micro-batches


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("world,stages,micro_batches", LAYOUTS)
def test_optimizer_state_sharded_over_replicas(pools, world, stages, micro_batches, optimizer):
    results = pools.run(world, "support.cases:fidelity", "mlp", optimizer=optimizer, stages=stages,
                        micro_batches=micro_batches, sharding="optimizer")
    r = check(results)
    assert r["plan"][:3] == (stages, world // stages, micro_batches)
    # each parameter's state lives on exactly one replica of its stage
    kept = [set(x["optimizer_kept"]) for x in results]
    everything = set().union(*kept)
    assert sum(len(k) for k in kept) == len(everything) == 12  # 6 Linear layers x (weight, bias)


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("world,stages,micro_batches", [(2, 1, 1), (4, 2, 2)])
def test_fsdp_levels_equal_one_process(pools, world, stages, micro_batches, optimizer, sharding):
    """ZeRO-2/3 under FSDP2: each replica holds a shard of every parameter of its stage (a DTensor in the
    user's module and optimizer), and training equals one process."""
    results = pools.run(world, "support.cases:fidelity", "mlp", optimizer=optimizer, stages=stages,
                        micro_batches=micro_batches, sharding=sharding, eval_batch=4)
    r = check(results)
    assert r["plan"][:3] == (stages, world // stages, micro_batches)
    # every parameter a rank holds is sharded (a DTensor), the stages together hold all 6 Linear layers'
    assert all(sharded == held > 0 for sharded, held in (x["sharded_params"] for x in results))
    assert sum(x["sharded_params"][0] for x in results[:stages]) == 12  # replica 0: ranks 0 .. stages-1


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
@pytest.mark.parametrize("world,name,stages,micro_batches", [(2, "mlp", 1, 1), (4, "gpt", 2, 2)])
def test_whole_state_dicts_load_mid_training_under_fsdp(pools, world, name, stages, micro_batches, sharding):
    """model.load_state_dict and optimizer.load_state_dict of whole state dicts after training began, when
    the parameters are DTensor shards: each replica takes its shard, and training goes on as one process that
    loaded the same."""
    r = fidelity(pools, world, name, "loaded param", "loaded optimizer", load_at=1, stages=stages,
                 micro_batches=micro_batches, sharding=sharding)
    assert r["plan"][:3] == (stages, world // stages, micro_batches)
    assert r["sharded_params"][0] > 0


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
@pytest.mark.parametrize("name,options", [
    ("tied_embedding", {"stages": 1, "micro_batches": 1}),
    ("tied_embedding", {"stages": 2, "micro_batches": 2}),
    ("mlp", {"stages": 4, "micro_batches": 4, "schedule": "Interleaved1F1B"}),
    ("mlp", {"stages": 2, "micro_batches": 2, "schedule": "GPipe", "style": "outputs"}),
    ("mlp", {"stages": 2, "micro_batches": 2, "recompute": True, "build": "meta"}),
    ("gpt", {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}),
    ("batchnorm", {"stages": 2, "micro_batches": 1, "schedule": "GPipe", "style": "outputs", "optimizer": "sgd",
                   "statistics_replicas": 2, "eval_batch": 4}),
], ids=["tied-data-parallel", "tied-2x2", "interleaved", "user-loss", "recomputed-meta-built", "gpt-2x2",
        "batchnorm-2x2"])
def test_fsdp_levels_across_layouts(pools, name, options, sharding):
    fidelity(pools, 4, name, sharding=sharding, **options)


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_bert"])
def test_zero3_on_models_nobody_here_wrote(pools, name):
    """HF models (tied embeddings, rotary buffers, attention masks) under ZeRO-3 over 2 replicas, eval calls
    included."""
    fidelity(pools, 2, name, "eval", stages=1, micro_batches=1, sharding="parameters", eval_batch=4)


@pytest.mark.parametrize("world,options", [(4, {"stages": 1, "micro_batches": 1}),
                                           (4, {"stages": 2, "micro_batches": 2, "schedule": "1F1B"})])
def test_zero1_on_a_model_nobody_here_wrote(pools, world, options):
    """HF GPT-2's embedding is tied to its head, and its graph knows it by the head's name (lm_head.weight):
    the optimizer's whole state (under the embedding's name, its first) must come from the replica that keeps
    it."""
    fidelity(pools, world, "hf_gpt2", sharding="optimizer", **options)


def test_tied_weights_with_sharding(pools):
    r = fidelity(pools, 4, "tied_embedding", stages=2, micro_batches=2, sharding="optimizer")
    assert r["plan"][:2] == (2, 2)


@pytest.mark.parametrize("world,plan", [
    (2, {"stages": 1, "micro_batches": 1, "sharding": "none"}),
    (4, {"stages": 1, "micro_batches": 1, "sharding": "optimizer"}),
    (4, {"stages": 2, "replicas": 2, "micro_batches": 2, "schedule": "GPipe", "sharding": "none"}),
], ids=["to-2-ranks-unsharded", "to-4-replicas-sharded", "to-2x2-unsharded"])
def test_checkpoints_across_sharding_levels_and_worlds(pools, tmp_path, world, plan):
    """Saved 2 stages x 2 replicas with the optimizer state sharded; loaded under another sharding level, world
    and plan: parameters and Adam state equal the saved ones exactly, and the next losses the saving run's."""
    sharded = {**TWO_BY_TWO, "sharding": "optimizer"}
    saved = pools.run(4, f"{CASE}:train_and_save", "gpt", str(tmp_path), sharded)
    loaded = pools.run(world, f"{CASE}:load_and_continue", "gpt", str(tmp_path), plan)
    check_resumed(loaded, saved)
    assert loaded[0]["plan"][0] == plan["stages"]


@pytest.mark.parametrize("saved_level,world,plan", [
    ("parameters", 2, {"stages": 1, "micro_batches": 1, "sharding": "none"}),
    ("parameters", 4, {"stages": 1, "micro_batches": 1, "sharding": "gradients"}),
    ("optimizer", 4, {"stages": 2, "replicas": 2, "micro_batches": 2, "schedule": "GPipe", "sharding": "parameters"}),
    ("gradients", 4, {"stages": 2, "replicas": 2, "micro_batches": 2, "schedule": "GPipe", "sharding": "parameters"}),
], ids=["zero3-to-2-ranks-unsharded", "zero3-to-4-replicas-zero2", "zero1-to-2x2-zero3", "zero2-to-2x2-zero3"])
def test_checkpoints_across_fsdp_levels(pools, tmp_path, saved_level, world, plan):
    """Saved 2 stages x 2 replicas under one sharding level (FSDP's DTensor shards written by each replica);
    loaded under another level, world and plan: parameters and Adam state equal the saved ones exactly, and
    the next losses the saving run's."""
    saved = pools.run(4, f"{CASE}:train_and_save", "gpt", str(tmp_path), {**TWO_BY_TWO, "sharding": saved_level})
    loaded = pools.run(world, f"{CASE}:load_and_continue", "gpt", str(tmp_path), plan)
    check_resumed(loaded, saved)


@pytest.mark.parametrize("world,name,options,levels", [
    (4, "mlp", {"stages": 2, "micro_batches": 2, "schedule": "GPipe"}, ("optimizer", "parameters")),
    (4, "mlp", {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}, ("gradients", "optimizer")),
    (2, "mlp", {"stages": 2, "micro_batches": 2, "schedule": "Interleaved1F1B"}, ("parameters", "optimizer")),
    (4, "tied_embedding", {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}, ("parameters", "optimizer")),
    (4, "tied_embedding", {"stages": 2, "micro_batches": 2, "schedule": "1F1B"}, ("gradients", "none")),
], ids=["zero1-then-zero3", "zero2-then-zero1", "looped-zero3-then-zero1", "tied-zero3-then-zero1",
        "tied-zero2-then-none"])
def test_stages_with_different_sharding_levels(pools, tmp_path, world, name, options, levels):
    """The planner chooses each stage's level: ZeRO-1 on one stage beside FSDP's on another trains as one process
    (a measured first call planned such a layout for a MoE model on 2 ranks, and ZeRO-1 took FSDP's shards for
    its own)."""
    planned = json.loads(fidelity(pools, world, name, sharding="optimizer", steps=1, **options)["plan_json"])
    path = with_levels(planned, levels, tmp_path / "plan.json")
    results = pools.run(world, "support.cases:fidelity", name, plan=str(path))
    check(results)
    stages = json.loads(results[0]["plan_json"])["stages"]
    assert [s["sharding"] for s in stages] == list(levels)
    for stage in stages:
        alone = [r for r in stage["ranks"] if sum(r in other["ranks"] for other in stages) == 1]
        held = [results[r]["sharded_params"] for r in alone]
        if stage["sharding"] in ("gradients", "parameters") and len(stage["ranks"]) > 1:
            # FSDP's replicas hold DTensor shards of the parameters read by this stage alone (tied ones stay whole)
            assert all(sharded > 0 for sharded, _ in held), (stage, held)
        elif stage["sharding"] == "optimizer" and len(alone) > 1:
            # ZeRO-1's replicas hold whole parameters and split the optimizer's state, each keeping its own part
            # (a weight tied to another stage's is not sharded: every holder keeps its state)
            assert all(sharded == 0 for sharded, _ in held), (stage, held)
            tied = set().union(*(results[r]["held"] for other in stages if other is not stage for r in other["ranks"]))
            kept = [set(results[r]["optimizer_kept"]) - tied for r in alone]
            assert sum(map(len, kept)) == len(set().union(*kept)), (stage, kept)


def with_levels(plan: dict, levels: tuple[str, ...], path: Path) -> Path:
    """`plan` (its JSON form) with each stage's sharding level replaced, written to `path`."""
    for stage, level in zip(plan["stages"], levels):
        stage["sharding"] = level
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.parametrize("world,plan", [
    (2, {"stages": 1, "micro_batches": 1, "sharding": "none"}),
    (4, {**TWO_BY_TWO, "sharding": "parameters"}),
], ids=["to-2-ranks-unsharded", "to-2x2-zero3"])
def test_checkpoints_of_stages_with_different_sharding_levels(pools, tmp_path, world, plan):
    """Saved by 2 stages x 2 replicas, ZeRO-1 on the first stage and ZeRO-3 on the second; loaded under
    another layout: parameters and Adam state equal the saved ones exactly, and the next losses the saving
    run's."""
    pools.run(4, f"{CASE}:train_and_save", "gpt", str(tmp_path / "first"), {**TWO_BY_TWO, "sharding": "optimizer"},
              steps=1, more=0)
    planned = read_manifest(next((tmp_path / "first").glob("step-*"))).plan
    mixed = {"plan": str(with_levels(planned, ("optimizer", "parameters"), tmp_path / "plan.json"))}
    saved = pools.run(4, f"{CASE}:train_and_save", "gpt", str(tmp_path / "mixed"), mixed)
    loaded = pools.run(world, f"{CASE}:load_and_continue", "gpt", str(tmp_path / "mixed"), plan)
    check_resumed(loaded, saved)


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
@pytest.mark.parametrize("name", ["resnet", "hf_resnet", "write_into_view"])
@pytest.mark.parametrize("world,stages", [(2, 1), (4, 2)], ids=["data-parallel", "2x2"])
def test_in_place_writes_across_fsdp_units(pools, world, stages, name, sharding):
    """In-place writes into values an earlier FSDP unit made train as one process, eval calls included: ResNet's
    residual (torchvision's `out += identity`, HF's `hidden_state += residual`, where the shortcut has
    parameters of its own), and writes into views (`h[:, 8:] += ...`; `head = h[:, :4]` ... `head.add_(...)`,
    then h read). With BatchNorm, each replica normalizes by its own rows and keeps replica 0's running
    statistics, as under DDP."""
    r = fidelity(pools, world, name, "eval", stages=stages, micro_batches=1, schedule="GPipe" if stages > 1 else None,
                 sharding=sharding, optimizer="sgd", statistics_replicas=world // stages, eval_batch=4)
    assert r["plan"][:3] == (stages, world // stages, 1)
    assert r["sharded_params"][0] > 0
