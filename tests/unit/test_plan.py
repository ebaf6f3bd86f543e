"""The planner and the plan value: pure Python, no torch, no processes."""

import itertools
import random

import pytest

from partita.errors import BatchError, PlanError
from partita.graph import Block, ModelGraph
from partita.graph.graph import Fit
from partita.plan import Plan, auto_plan
from partita.plan.partition import balance


def graph(flops, param_bytes=1000, act=10.0):
    blocks = tuple(Block(i, f"layers.{i}", (i, i + 1), f"a{i}", f"z{i}", "sig", 1, Fit.line(0, f),
                         Fit.line(0, f), Fit.line(0, act), (f"p{i}",)) for i, f in enumerate(flops))
    return ModelGraph(blocks, {f"p{i}": param_bytes for i in range(len(flops))},
                      tuple(Fit.line(0, 4.0) for _ in flops[1:]), Fit.line(0, 4.0))


def test_balance_is_exact_against_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 0.5, 1, 2, 3, 5, 8]) for _ in range(n)]
        ranges = balance(costs, k)
        assert len(ranges) == k and ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(k - 1))
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + c, c + (n,)))
                   for c in itertools.combinations(range(1, n), k - 1))
        assert max(sum(costs[a:b]) for a, b in ranges) == pytest.approx(best)


def test_data_parallel_when_the_model_fits():
    plan = auto_plan(graph([1] * 8), world_size=4, local_batch=8, device_memory_bytes=10**9, optimizer_factor=2)
    assert (plan.num_stages, plan.num_replicas, plan.num_microbatches) == (1, 4, 1)
    assert "data parallel only" in plan.explain()


def test_fewest_stages_that_fit_memory():
    # 8 blocks of 1 MB parameters, Adam: 4 MB per block of state; 12 MB per rank fits 2 blocks + activations
    g = graph([1] * 8, param_bytes=10**6)
    plan = auto_plan(g, world_size=8, local_batch=4, device_memory_bytes=12 * 10**6, optimizer_factor=2)
    assert plan.num_stages == 4 and plan.num_replicas == 2
    assert all(s.memory_bytes <= 12 * 10**6 for s in plan.stages)
    assert plan.schedule == "1F1B" and plan.num_microbatches >= plan.num_stages


def test_sgd_without_momentum_needs_less_memory_than_adam():
    g = graph([1] * 8, param_bytes=10**6)
    adam = auto_plan(g, world_size=8, local_batch=4, device_memory_bytes=14 * 10**6, optimizer_factor=2)
    sgd = auto_plan(g, world_size=8, local_batch=4, device_memory_bytes=14 * 10**6, optimizer_factor=0)
    assert sgd.num_stages < adam.num_stages


def test_stages_balanced_by_flops():
    plan = auto_plan(graph([1, 1, 1, 1, 4]), world_size=2, local_batch=4, device_memory_bytes=0,
                     optimizer_factor=0, stages=2)
    assert [s.blocks for s in plan.stages] == [(0, 4), (4, 5)]
    assert [s.ranks for s in plan.stages] == [(0,), (1,)]


def test_rank_layout_for_replicas_and_v_schedules():
    plan = auto_plan(graph([1] * 8), world_size=4, local_batch=4, device_memory_bytes=0, optimizer_factor=0,
                     stages=2)
    assert [s.ranks for s in plan.stages] == [(0, 2), (1, 3)]
    assert plan.replica_ranks(1) == (2, 3)
    v = auto_plan(graph([1] * 8), world_size=2, local_batch=4, device_memory_bytes=0, optimizer_factor=0,
                  stages=4, schedule="ZBVZeroBubble")
    assert [s.ranks for s in v.stages] == [(0,), (1,), (1,), (0,)]


def test_no_plan_fits_names_the_numbers():
    with pytest.raises(PlanError, match="no plan fits in memory: 1 stages need .* per rank"):
        auto_plan(graph([1] * 4, param_bytes=10**9), world_size=2, local_batch=4, device_memory_bytes=10**6,
                  optimizer_factor=2)


def test_indivisible_batch_names_a_valid_choice():
    with pytest.raises(BatchError, match=r"micro_batches from \[1, 2, 3, 6\]"):
        auto_plan(graph([1] * 4), world_size=4, local_batch=3, device_memory_bytes=0, optimizer_factor=0,
                  stages=2, micro_batches=4)


def test_plan_round_trips_through_json(tmp_path):
    plan = auto_plan(graph([1, 2, 3, 4]), world_size=4, local_batch=4, device_memory_bytes=10**9,
                     optimizer_factor=2, stages=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert '"ranks"' in path.read_text() and '"stages"' in path.read_text()


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(world_size=3), "ranks 0..2"),
    (lambda d: d["stages"][1].update(ranks=[1]), "same number of replicas"),
    (lambda d: d["stages"][1].update(blocks=[0, 4]), "consecutive"),
    (lambda d: d.update(schedule="Zigzag"), "unknown schedule"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(num_microbatches=1), "at least as many micro-batches"),
])
def test_invalid_plans_are_refused(change, match):
    plan = auto_plan(graph([1, 2, 3, 4]), world_size=4, local_batch=4, device_memory_bytes=0,
                     optimizer_factor=0, stages=2, schedule="1F1B")
    data = plan.to_dict()
    change(data)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data).validate()


def test_not_a_plan():
    with pytest.raises(PlanError, match="not a partita plan"):
        Plan.from_json('{"hello": 1}')
