"""The search is exact within its space: it agrees with brute force on every small instance."""

import itertools
import random

import pytest

from partita.cluster import Cluster, DeviceSpec, Link
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan.cost import CostModel
from partita.plan.search import Constraints, _layout_bound, evaluate, layouts, search


def instance(rng: random.Random):
    n = rng.randint(1, 7)
    blocks, param_bytes = [], {}
    for i in range(n):
        params = (f"p{i}",) + (("tied",) if rng.random() < 0.2 else ())
        param_bytes[f"p{i}"] = rng.choice([0, 1, 4, 16]) * 10**6
        blocks.append(Block(i, f"b{i}", (i, i + 1), f"a{i}", f"z{i}", "s", 1, Fit.line(0, 1), Fit.line(0, 1),
                            Fit.line(0, 1), params))
    param_bytes["tied"] = 8 * 10**6
    graph = ModelGraph(tuple(blocks), param_bytes,
                       tuple(Fit.line(0, rng.choice([1e3, 1e5, 1e6])) for _ in range(n - 1)), Fit.line(0, 1e3))
    profile = Profile("random", tuple(
        BlockCost(Fit.line(rng.uniform(0, 1e-3), rng.uniform(1e-4, 1e-2)),
                  Fit.line(rng.uniform(0, 2e-3), rng.uniform(1e-4, 2e-2)),
                  Fit.line(0, rng.choice([1e5, 1e6, 4e6]))) for _ in range(n)))
    device = DeviceSpec("test", rng.choice([60, 100, 200, 10**4]) * 10**6, {"float32": 1e12}, 1e11, 1.0, 0.0,
                        10 * 10**6, rng.choice([0.0, 1e-4]), rng.choice([0.0, 1e-3]), rng.choice([0.0, 5e-4]),
                        Link(1e-5, 1e10), Link(5e-5, 1e9), 2, "random")
    world = rng.choice([1, 2, 4])
    cluster = Cluster(device, num_nodes=max(1, world // 2), devices_per_node=min(world, 2))
    return graph, profile, cluster, rng.choice([4, 8, 12]), rng.choice([0.0, 1.0, 2.0])


def brute_force(graph, profile, cluster, batch, optimizer_factor):
    best = None
    for layout in layouts(graph, cluster, batch, Constraints()):
        model = CostModel(graph, profile, cluster, optimizer_factor, layout)
        n, s = graph.num_blocks, layout.num_stages
        for cuts in itertools.combinations(range(1, n), s - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            for recompute in itertools.product([False, True], repeat=s):
                found = evaluate(model, ranges, list(recompute))
                if found is not None and (best is None or found.step_s < best):
                    best = found.step_s
    return best


@pytest.mark.parametrize("seed", range(8))
def test_search_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    agreed = 0
    for _ in range(25):
        graph, profile, cluster, batch, factor = instance(rng)
        want = brute_force(graph, profile, cluster, batch, factor)
        result = search(graph, profile, cluster, global_batch=batch, optimizer_factor=factor)
        assert result.proven_optimal
        got = result.best.step_s if result.best else None
        assert (got is None) == (want is None), (got, want)
        if got is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=0), (result.best.layout, got, want)
            agreed += 1
    assert agreed >= 12  # most instances have a feasible plan


def test_layout_bounds_never_exceed_a_simulated_step():
    """A layout's bound lets the search skip it unsearched, so it must hold for every split of its blocks."""
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        graph, profile, cluster, batch, factor = instance(rng)
        for layout in layouts(graph, cluster, batch, Constraints()):
            model = CostModel(graph, profile, cluster, factor, layout)
            n, s = graph.num_blocks, layout.num_stages
            for cuts in itertools.combinations(range(1, n), s - 1):
                found = evaluate(model, list(zip((0,) + cuts, cuts + (n,))), [False] * s)
                if found is not None:
                    assert _layout_bound(model) <= found.step_s * (1 + 1e-12), (layout, cuts)
                    checked += 1
    assert checked > 100

