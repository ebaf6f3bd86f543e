"""Mixture-of-experts models (see support/moe_cases.py): blocks are measured on the routing a real forward
computes, no stage cut separates tokens from the experts they were routed to, and training across processes
equals training in one process (fp32, rtol 1e-5, atol 1e-6) where some experts get no tokens on a rank or in
a micro-batch."""

import math

import pytest
import torch

from partita.capture.model_graph import model_graph
from partita.capture.export import capture
from partita.capture.meta import meta_graph
from partita.capture.shapes import shape_at
from partita.capture.split import split
from partita.profile.block_times import measure_blocks
from support.moe_cases import EXPERTS, MOE_CASES, tokens_per_expert
from test_fidelity import check

LAST = EXPERTS - 1


def _captured(name: str, rows: int = 4):
    torch.manual_seed(0)
    case = MOE_CASES[name]
    model = case.make()
    args, kwargs, _ = case.batch(rows, torch.Generator().manual_seed(0))
    cap = capture(model, args, kwargs)
    return model, cap, model_graph(cap)


def test_the_last_expert_is_reached_only_by_the_second_half_of_a_batch():
    """What the fidelity runs below rely on: the rows of rank 0 (of 2), of replica 0 (of 2) and of the first of
    2 micro-batches give the last expert no token, in both layers; the other rows do, except in idle batches."""
    for name in ("routed", "routed_skip", "idle", "idle_skip"):
        for global_rows in (16, 32):
            half = global_rows // 2
            first, second = (tokens_per_expert(name, rows, global_rows)
                             for rows in (slice(0, half), slice(half, global_rows)))
            assert all(c[LAST] == 0 for c in first)
            assert all((c[LAST] == 0) == name.startswith("idle") for c in second)


@pytest.mark.parametrize("name", ["routed", "hf_mixtral", pytest.param("hf_qwen2_moe", marks=pytest.mark.slow),
                                  pytest.param("hf_olmoe", marks=pytest.mark.slow)])
def test_blocks_are_measured_on_the_routing_of_a_real_forward(name):
    """Made-up inputs gave the experts garbage indices (IndexError, or allocations of petabytes); every block
    is now measured on the values a forward of the call's own inputs gives it, and measuring leaves the model
    as it was."""
    model, cap, graph = _captured(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    costs = measure_blocks(cap, graph, 4, torch.device("cpu"), show_progress=False)
    assert set(costs) == {b.signature for b in graph.blocks}
    for cost in costs.values():
        for fit in (cost.fwd_s, cost.bwd_s, cost.activation_bytes):
            assert all(math.isfinite(v) for line in fit.lines for v in line)
        assert cost.fwd_s.at(8) > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_no_stage_cut_separates_tokens_from_their_experts():
    """The tokens routed to an expert have a size read from the routing, which no stage could size a receive
    buffer for: each MoE layer is one block, and a pipeline cut at any block boundary has static shapes."""
    _, cap, graph = _captured("routed")
    assert [b.name for b in graph.blocks if "experts" in b.name] == []
    for b in graph.blocks[:-1]:
        stop = b.units[1]
        _, second = split(cap, [0] * stop + [1] * (graph.num_units - stop), 2)
        for value in second.inputs:
            shape_at(cap.node(value).meta["val"], 8)  # raises for a size that depends on values


@pytest.mark.parametrize("name", ["routed", "hf_mixtral"])
def test_planning_for_hardware_you_do_not_have(name, tmp_path, monkeypatch):
    """`partita plan` captures the model built on the meta device."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    factory = {"routed": "RoutedLM", "hf_mixtral": "hf_mixtral"}[name]
    graph, cached = meta_graph(f"support.moe_cases:{factory}", ["12:int64"])
    assert not cached and graph.num_blocks > 2


def fidelity(pools, world: int, name: str, *also: str, **options) -> dict:
    return check(pools.run(world, "support.moe_cases:fidelity", name, **options), *also)


DATA_PARALLEL = {"stages": 1, "micro_batches": 1}
PIPELINE = {"stages": 2, "replicas": 1, "micro_batches": 2}
SLOW_HF = pytest.param("hf_mixtral", marks=pytest.mark.slow)


@pytest.mark.parametrize("name", ["routed", "routed_skip", SLOW_HF])
def test_data_parallel(pools, name):
    """DDP on 2 ranks: rank 0's rows never reach the last expert (with routed_skip, its parameters get no
    gradient at all there), rank 1's do."""
    r = fidelity(pools, 2, name, **DATA_PARALLEL)
    assert r["plan"][:3] == (1, 2, 1)


@pytest.mark.parametrize("name,schedule", [("routed", "1F1B"), ("routed_skip", "GPipe"),
                                           pytest.param("hf_mixtral", "1F1B", marks=pytest.mark.slow)])
def test_two_stages_two_micro_batches(pools, name, schedule):
    """2 stages x 1 replica: the first micro-batch gives the last expert no token, the second does."""
    r = fidelity(pools, 2, name, "eval", schedule=schedule, eval_batch=4, **PIPELINE)
    assert r["plan"][:3] == (2, 1, 2)


@pytest.mark.parametrize("name", ["routed", SLOW_HF])
def test_two_stages_two_replicas(pools, name):
    """2 stages x 2 replicas (world 4): replica 0's rows never reach the last expert, replica 1's do."""
    r = fidelity(pools, 4, name, "output", stages=2, replicas=2, micro_batches=2, style="outputs")
    assert r["plan"][:3] == (2, 2, 2)


@pytest.mark.parametrize("name,plan", [("idle", PIPELINE), ("idle_skip", DATA_PARALLEL)], ids=["pipeline", "ddp"])
def test_an_expert_no_row_reaches(pools, name, plan):
    """No row of any rank reaches the last expert. Its gradient is zero where the model runs it on no tokens,
    in one process and in the pipeline; where eager code skips it (idle_skip, under DDP) it stays None, and
    Adam keeps no state for it, as in one process."""
    fidelity(pools, 2, name, **plan)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the captured graph cannot skip an expert without tokens as this model's eager code does: "
                   "its gradient is zero under a pipeline (as under torch.compile), None in one process")
def test_an_expert_that_eager_code_skips_everywhere_in_a_pipeline(pools):
    """A known difference, kept visible: a pipeline runs the graph, which runs the idle expert on no tokens."""
    fidelity(pools, 2, "idle_skip", **PIPELINE)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["routed", "hf_mixtral"])
def test_first_call_measures_and_trains(pools, name):
    """What a user's first call does on 2 ranks: measure the blocks (on each rank's share), plan, train."""
    results = pools.run(2, "support.moe_cases:measured_step", name, stages=2)
    assert all(r["plan"]["estimate"]["profile"].startswith("measured") for r in results)
    assert all(math.isfinite(r["loss"]) and r["loss"] == results[0]["loss"] for r in results)


@pytest.mark.parametrize("name", ["hf_qwen3_moe", "hf_deepseek_v3", pytest.param("hf_mixtral", marks=pytest.mark.slow),
                                  pytest.param("hf_olmoe", marks=pytest.mark.slow)])
def test_hugging_face_moe_built_on_the_meta_device(pools, name):
    """Experts and routers allocated with torch.empty draw nothing until post_init: built on the meta device with
    init_fn=model._init_weights, every rank holds its part of the model with the CPU-built model's values, bit
    for bit, and trains to its losses."""
    results = pools.run(2, "support.moe_cases:hf_on_meta", name, stages=2, micro_batches=2)
    for rank, r in enumerate(results):
        assert not r["differ"], f"rank {rank}: initial values unlike the CPU-built model's: {r['differ']}"
        assert r["losses"] == r["cpu_losses"] and r["finite"]
    held = [set(r["held"]) for r in results]
    assert set().union(*held) == set(results[0]["every"]) and all(h < set(results[0]["every"]) for h in held)
