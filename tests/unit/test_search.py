"""The search is exact within its space: it agrees with brute force on every small instance; its bounds never
exceed a simulated step; it proves its plan optimal on instances of the demo's size."""

import dataclasses
import itertools
import math
import random

import pytest

from partita.cluster import Cluster, DeviceSpec, Link
from partita.cluster.presets import DEVICES
from partita.cluster.cluster import RuntimeOverheads
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan.bounds import Remainder, gpipe, layout_bound
from partita.plan.cost import CostModel
from partita.plan.rank_loads import RankLoads, StageFloors
from partita.plan.search import (SEARCH_BUDGET, Constraints, PartitionSearch, _Warmup, evaluate, layouts,
                                 pair_dominated, search)
from partita.schedule import check_sizes, orders
from partita.sim import StageCosts, simulate


def instance(rng: random.Random, blocks: tuple[int, int] = (1, 7), worlds: tuple[int, ...] = (1, 2, 4)):
    n = rng.randint(*blocks)
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
    world = rng.choice(worlds)
    cluster = Cluster(device, num_nodes=max(1, world // 2), devices_per_node=min(world, 2))
    return graph, profile, cluster, rng.choice([4, 8, 12]), rng.choice([0.0, 1.0, 2.0])


def brute_force(graph, profile, cluster, batch, optimizer_factor, constraints=Constraints()):
    best = None
    for layout in layouts(graph, cluster, batch, constraints):
        found = brute_force_layout(CostModel(graph, profile, cluster, optimizer_factor, layout))
        if found is not None and (best is None or found < best):
            best = found
    return best


def searched_as_brute_force(model) -> bool:
    """Assert that the search of one layout finds brute force's step (or, like it, nothing); whether a plan was
    compared."""
    want = brute_force_layout(model)
    got = PartitionSearch(model, budget=10**7).run()
    assert (got is None) == (want is None), (model.layout, got, want)
    if got is not None:
        assert got.step_s == pytest.approx(want, rel=1e-12, abs=0), model.layout
    return got is not None


def brute_force_layout(model):
    """The fastest simulated step of every split and recomputation of one layout (None: none fits)."""
    best = None
    n, s = model.num_blocks, model.layout.num_stages
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


@pytest.mark.parametrize("seed", range(3))
def test_looped_layouts_agree_with_brute_force_on_three_ranks_per_pipeline(seed):
    """Looped layouts are searched rank by rank (both stages of a rank at once): with 6 ranks and up to 9
    blocks, pipelines of 3 ranks run 6 stages."""
    checked = sum(map(searched_as_brute_force, looped_models(random.Random(100 + seed), 6, (6, 9))))
    assert checked >= 2


@pytest.mark.parametrize("seed", range(2))
def test_a_search_taken_up_again_after_its_budget_ran_out_agrees_with_brute_force(seed):
    """A layout's search that ran out of budget (its ranks' load tables kept) and is run again with the full
    budget, as the second round of `search` does, still finds brute force's step."""
    stopped = 0
    for model in looped_models(random.Random(1500 + seed), 4, (6, 9)):
        want = brute_force_layout(model)
        partitions = PartitionSearch(model, budget=20)
        partitions.run()
        stopped += not partitions.complete
        got = partitions.run(budget=10**7)
        assert partitions.complete and (got is None) == (want is None), (model.layout, got, want)
        if got is not None:
            assert got.step_s == pytest.approx(want, rel=1e-12, abs=0), model.layout
    assert stopped >= 2


@pytest.mark.parametrize("seed", range(2))
def test_a_search_taken_up_again_skips_the_second_loop_starts_it_finished_and_agrees_with_brute_force(seed):
    """Taken up again with budgets that grow, a looped layout's search skips the second-loop starts an earlier run
    searched to the end, and still finds brute force's step (were it to skip one whose best plan it had not found,
    this would fail)."""
    skipped = 0
    for model in looped_models(random.Random(2100 + seed), 4, (6, 9)):
        want = brute_force_layout(model)
        partitions = PartitionSearch(model)
        for budget in (30, 60, 120, 10**7):
            skipped += len(partitions.searched)
            got = partitions.run(budget=budget)
        assert partitions.complete and (got is None) == (want is None), (model.layout, got, want)
        if got is not None:
            assert got.step_s == pytest.approx(want, rel=1e-12, abs=0), model.layout
    assert skipped >= 4


def looped_models(rng, count, blocks):
    """The cost models of the looped layouts with pipelines of 2 or 3 ranks of `count` random instances on 6
    ranks."""
    for _ in range(count):
        graph, profile, cluster, batch, factor = instance(rng, blocks=blocks, worlds=(6,))
        for layout in layouts(graph, cluster, batch, Constraints()):
            if layout.num_stages >= 4 and layout.schedule in ("Interleaved1F1B", "LoopedBFS"):
                yield CostModel(graph, profile, cluster, factor, layout)


def test_looped_layouts_agree_with_brute_force_on_four_ranks_per_pipeline():
    """With four ranks per pipeline, the ranks in the middle are bounded by simulating the chosen ones (see
    test_simulated_makespan_only_grows_with_each_duration)."""
    rng = random.Random(400)
    checked = 0
    for _ in range(3):
        graph, profile, cluster, batch, factor = instance(rng, blocks=(9, 9), worlds=(4,))
        for schedule in ("Interleaved1F1B", "LoopedBFS"):
            layout = max(layouts(graph, cluster, batch, Constraints(schedule=schedule, stages=8)),
                         key=lambda lay: lay.micro_batches)  # the most micro-batches: the most waiting
            checked += searched_as_brute_force(CostModel(graph, profile, cluster, factor, layout))
    assert checked >= 2


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble"])
def test_simulated_makespan_only_grows_with_each_duration(schedule):
    """The search bounds a partial plan by simulating it with the stages not chosen yet at their least
    durations: sound because the makespan is the longest path through a graph that the orders fix."""
    rng = random.Random(11)
    checked = 0
    for _ in range(60):
        p, m = rng.randint(1, 4), rng.randint(1, 8)
        s = p * (1 if schedule == "1F1B" else 2)
        try:
            check_sizes(schedule, s, p, m)
        except ValueError:
            continue
        costs = random_stage_costs(rng, s)
        shrink = lambda values: [v * rng.choice([0.0, rng.random(), 1.0]) for v in values]  # noqa: E731
        less = StageCosts(shrink(costs.forward_s), shrink(costs.backward_s), shrink(costs.send_activations_s),
                          shrink(costs.send_gradients_s))
        order = orders(schedule, s, p, m)
        assert simulate(order, less).makespan_s <= simulate(order, costs).makespan_s * (1 + 1e-12)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"])
def test_schedules_only_asked_for_agree_with_brute_force(schedule):
    """Zero-bubble schedules end with weight gradients, which send nothing back: the bounds count that."""
    rng = random.Random(7)
    agreed = 0
    for _ in range(12):
        graph, profile, cluster, batch, factor = instance(rng, worlds=(2, 4))
        constraints = Constraints(schedule=schedule)
        if not layouts(graph, cluster, batch, constraints):
            continue
        want = brute_force(graph, profile, cluster, batch, factor, constraints)
        result = search(graph, profile, cluster, global_batch=batch, optimizer_factor=factor, constraints=constraints)
        got = result.best.step_s if result.best else None
        assert result.proven_optimal and (got is None) == (want is None), (got, want)
        if got is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=0)
            agreed += 1
    assert agreed >= 3


def test_layout_bounds_never_exceed_a_simulated_step():
    """A layout's bound lets the search skip it unsearched, so it must hold for every split of its blocks."""
    rng = random.Random(5)
    checked = 0
    for _ in range(40):
        graph, profile, cluster, batch, factor = instance(rng)
        for layout in layouts(graph, cluster, batch, Constraints()):
            model = CostModel(graph, profile, cluster, factor, layout)
            bound = max(layout_bound(model), layout_bound(model, refined=True))
            n, s = graph.num_blocks, layout.num_stages
            for cuts in itertools.combinations(range(1, n), s - 1):
                for recompute in ([False] * s, [True] * s, [rng.random() < 0.5 for _ in range(s)]):
                    found = evaluate(model, list(zip((0,) + cuts, cuts + (n,))), recompute)
                    if found is not None:
                        assert bound <= found.step_s * (1 + 1e-12), (layout, cuts)
                        checked += 1
    assert checked > 100


def random_stage_costs(rng, num_stages, same_rank_sends=False):
    f = [rng.uniform(0, 3) for _ in range(num_stages)]
    b = [rng.uniform(0, 5) for _ in range(num_stages)]
    sends = [0.0 if same_rank_sends else rng.uniform(0, 1) for _ in range(num_stages)]
    return StageCosts(f, b, sends, [0.0] + sends[:-1])  # a cut's transfer takes as long both ways


@pytest.mark.parametrize("seed", range(4))
def test_gpipe_makespan_is_its_closed_form_and_bounds_looped_bfs(seed):
    """GPipe: sum(f) + sum(b) + transfers + (M-1)(max f + max b), exactly; LoopedBFS never less."""
    rng = random.Random(seed)
    for _ in range(100):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        costs = random_stage_costs(rng, p)
        total = sum(costs.forward_s) + sum(costs.backward_s) + 2 * sum(costs.send_activations_s[:-1])
        formula = gpipe(total, m, max(costs.forward_s), max(costs.backward_s))
        assert simulate(orders("GPipe", p, p, m), costs).makespan_s == pytest.approx(formula, rel=1e-12)
        costs = random_stage_costs(rng, 2 * p, same_rank_sends=p == 1)
        total = sum(costs.forward_s) + sum(costs.backward_s) + 2 * sum(costs.send_activations_s[:-1])
        looped = simulate(orders("LoopedBFS", 2 * p, p, m), costs).makespan_s
        assert looped >= gpipe(total, m, max(costs.forward_s), max(costs.backward_s)) * (1 - 1e-12)


def demo_like_gpt():
    """The demo's shape: a small GPT cut into 44 blocks (embedding, 4 layers of 10 blocks, norm, head tied to
    the embedding), on 4 CPU ranks sharing 2 cores with partita's measured overheads and 32 MiB free each."""
    d, seq, vocab, rate, f32 = 128, 64, 128, 50e9, 4
    parts = ([(seq * d * 5, 2 * seq * d, 2 * d), (6 * seq * d * d, 3 * seq * d, 3 * d * d + 3 * d)]
             + [(2 * seq * seq * d, seq * seq * 4, 0)] * 4
             + [(2 * seq * d * d, seq * d, d * d + d), (seq * d * 5, 2 * seq * d, 2 * d),
                (8 * seq * d * d, 4 * seq * d, 4 * d * d + 4 * d), (8 * seq * d * d, 4 * seq * d, 4 * d * d + d)])
    sizes = [(seq * d * 2 / 7.8e9, seq * d * f32, ("tok", "pos"))]
    params = {"tok": vocab * d * f32, "pos": seq * d * f32, "ln": 2 * d * f32}
    for layer in range(4):
        for i, (flops, acts, p) in enumerate(parts):
            sizes.append((flops / rate, acts * f32, (f"l{layer}.{i}",) if p else ()))
            if p:
                params[f"l{layer}.{i}"] = p * f32
    sizes += [(seq * d * 5 / rate, 2 * seq * d * f32, ("ln",)), (seq * d / rate, seq * d * f32, ()),
              (2 * seq * d * vocab / rate, seq * vocab * f32, ("tok",))]
    blocks = tuple(Block(i, f"b{i}", (i, i + 1), f"a{i}", f"z{i}", f"s{i}", 10, Fit.line(0, 1), Fit.line(0, 1),
                         Fit.line(0, acts), names) for i, (_, acts, names) in enumerate(sizes))
    graph = ModelGraph(blocks, params, tuple(Fit.line(0, seq * d * f32) for _ in sizes[1:]), Fit.line(0, 8))
    profile = Profile("demo-like", tuple(BlockCost(Fit.line(4e-5, s), Fit.line(8e-5, 2 * s), Fit.line(0, acts))
                                         for s, acts, _ in sizes))
    overhead = 510 * 2**20
    cpu = DeviceSpec("cpu", 6 * 2**30, {"float32": 104e9}, 7.8e9, 1.0, 15e-6, 330 * 2**20, 0.75e-3, 3.4e-3, 2.6e-3,
                     Link(180e-6, 1e9), Link(180e-6, 1e9), 4, "test")
    cluster = Cluster(cpu, 1, 4, p2p=Link(0.0, 1.08e9), allreduce=Link(5.8e-3, 4.5e8), allreduce_ranks=4,
                      memory_bytes=overhead + 32 * 2**20, fixed_overhead_bytes=overhead,
                      overheads=RuntimeOverheads(0.0, 9.0e-3, 1.6e-3, 0.0, 0.89), cores_per_node=2)
    return graph, profile, cluster


def uniform_model(num_blocks, world=16, layer_mb=50):
    """Equal transformer-like layers (forward 1 ms per row); weights, gradients and Adam state of the whole
    model take 4 (on 4 ranks) or 8 ranks' memory: every plan pipelines."""
    blocks = tuple(Block(i, f"l{i}", (i, i + 1), f"a{i}", f"z{i}", "layer", 10, Fit.line(0, 1), Fit.line(0, 1),
                         Fit.line(0, 16e6), (f"p{i}",)) for i in range(num_blocks))
    graph = ModelGraph(blocks, {f"p{i}": layer_mb * 10**6 for i in range(num_blocks)},
                       tuple(Fit.line(0, 2e6) for _ in range(num_blocks - 1)), Fit.line(0, 8))
    profile = Profile("uniform", tuple(BlockCost(Fit.line(2e-4, 1e-3), Fit.line(4e-4, 2e-3), Fit.line(0, 16e6))
                                       for _ in range(num_blocks)))
    memory = 2**30 + 2 * num_blocks * layer_mb * 10**6 * 5 // min(world, 8)
    device = DeviceSpec("gpu", memory, {"float32": 1e13}, 1e12, 0.7, 1e-5, 2**30, 1e-4, 1e-3,
                        3e-4, Link(5e-6, 1.5e11), Link(1e-5, 2.5e10), 8, "test")
    return graph, profile, Cluster(device, world // min(world, 8), min(world, 8))


def gpt_like(num_blocks, world):
    """bench/search_time.py's gpt: an embedding, equal transformer layers (hidden 1024, 512 tokens), an LM head
    tied to the embedding (vocabulary 32k) on A100-like ranks; the model's weights, gradients and Adam state
    take 4 ranks' memory (on 4 ranks) or 8."""
    hidden, seq, vocab, flops, f32 = 1024, 512, 32000, 13.6e12, 4
    layer_flops = 24 * seq * hidden * hidden + 4 * seq * seq * hidden
    sizes = [(seq * hidden * 8 / 1.5e12, 3e-5, seq * hidden * f32, ("tok",))]
    sizes += [(layer_flops / flops, 2e-4, 34 * seq * hidden, (f"l{i}",)) for i in range(num_blocks - 2)]
    sizes += [(2 * seq * hidden * vocab / flops, 5e-5, seq * vocab * f32 * 2, ("tok", "ln"))]
    params = {"tok": vocab * hidden * f32, "ln": 2 * hidden * f32}
    params |= {f"l{i}": 12 * hidden * hidden * f32 for i in range(num_blocks - 2)}
    blocks = tuple(Block(i, f"b{i}", (i, i + 1), f"a{i}", f"z{i}", f"s{i}", 10, Fit.line(0, 1), Fit.line(0, 1),
                         Fit.line(0, acts), names) for i, (_, _, acts, names) in enumerate(sizes))
    graph = ModelGraph(blocks, params, tuple(Fit.line(0, seq * hidden * f32) for _ in sizes[1:]), Fit.line(0, 8))
    profile = Profile("gpt-like", tuple(BlockCost(Fit.line(call, row), Fit.line(2 * call, 2 * row), Fit.line(0, acts))
                                        for row, call, acts, _ in sizes))
    per_node = min(world, 8)
    memory = 2**30 + 2 * int(sum(params.values()) * 5) // per_node
    return graph, profile, Cluster(DEVICES["A100-40GB"], world // per_node, per_node, memory_bytes=memory)


@pytest.mark.parametrize("case, world, schedule", [("demo", 4, None), ("uniform-12", 4, None),
                                                   ("uniform-44", 16, "1F1B"), ("gpt-44", 4, None)])
def test_representative_instances_are_searched_to_the_end(case, world, schedule):
    """The demo's 44-block GPT on 4 ranks (which used to run out of budget), equal layers that must be
    pipelined, and a GPT whose best plan lies far from the balanced boundaries of the layouts with the least
    bounds (the search used to spend its budget on those and return a plan 5 % slower), are proven optimal
    (bench/search_time.py times these and larger ones)."""
    if case == "demo":
        graph, profile, cluster = demo_like_gpt()
    elif case.startswith("gpt"):
        graph, profile, cluster = gpt_like(int(case.split("-")[1]), world)
    else:
        graph, profile, cluster = uniform_model(int(case.split("-")[1]), world)
    result = search(graph, profile, cluster, global_batch=8 * world, optimizer_factor=2.0,
                    constraints=Constraints(schedule=schedule))
    assert result.best is not None and result.proven_optimal, (result.nodes, result.layouts_searched)
    assert result.lower_bound_s == result.best.step_s


@pytest.mark.parametrize("seed", range(2))
def test_rank_by_rank_bounds_never_exceed_a_completions_makespan(seed):
    """Every state of the rank-by-rank search of a looped layout bounds the makespan of every completion of
    it: walking each split's ranks in order, each state's bound is at most that split's simulated makespan
    (the later ranks' bound counts each starting a first-loop stage after the one before it)."""
    checked = 0
    for model in looped_models(random.Random(700 + seed), 4, (6, 8)):
        partitions = PartitionSearch(model)
        p, n = model.layout.pipeline_size, model.num_blocks
        for cuts in itertools.combinations(range(1, n), 2 * p - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            costs = [model.stage(stage, a, b) for stage, (a, b) in enumerate(ranges)]
            if None in costs:
                continue
            state, made = partitions._pair_root(), []
            for r in range(p):
                state = partitions._pair_child(r, ranges[r][1], ranges[r + p][1], ranges[p][0], state, costs[r],
                                               costs[r + p])
                if state is None:
                    break  # memory: no completion of this split fits
                made.append(state.bound)
            if state is not None:
                found = evaluate(model, ranges, [c.recompute for c in costs])
                assert max(made) <= found.trace.makespan_s * (1 + 1e-12), (model.layout, cuts)
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("seed", range(2))
def test_a_looped_split_keeps_an_optimum_without_dominated_ranks(seed):
    """Every split of random small looped layouts steps as fast with its ranks' ways to run their stages
    (recomputation, sharding) limited to those `pair_dominated` keeps as with all of them that fit; and the
    rule leaves some out (were it to drop a way that some optimum needs, this would fail)."""
    checked = dropped = 0
    for model in looped_models(random.Random(1700 + seed), 6, (6, 8)):
        p, n = model.layout.pipeline_size, model.num_blocks
        for cuts in itertools.combinations(range(1, n), 2 * p - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            options = [[c for c in (model.stage(k, a, b, False), model.stage(k, a, b, True)) if c is not None]
                       for k, (a, b) in enumerate(ranges)]
            best = kept = math.inf
            for costs in itertools.product(*options):
                found = evaluate(model, ranges, [c.recompute for c in costs])
                if found is None:
                    continue
                best = min(best, found.step_s)
                dominated = any(pair_dominated(model, (costs[r], costs[r + p]), options[r], options[r + p])
                                for r in range(p))
                dropped += dominated
                if not dominated:
                    kept = min(kept, found.step_s)
            assert kept == best, (model.layout, ranges, kept, best)
            checked += best < math.inf
    assert checked > 50 and dropped > 10, (checked, dropped)


@pytest.mark.parametrize("seed", range(2))
def test_rank_loads_never_cut_a_split_within_the_limit(seed):
    """RankLoads (the least second-loop position from which the ranks after each one can still keep within a
    makespan, block by block) accepts every state of every split whose simulated makespan is within its limit,
    and rejects states of some splits (it cuts something)."""
    checked = cut = 0
    for model, ranges, makespan, table in fitting_looped_splits(random.Random(900 + seed)):
        p, x = model.layout.pipeline_size, ranges[model.layout.pipeline_size][0]
        loads = table(x, makespan * (1 + 1e-12))
        for r in range(p):
            assert loads.feasible(r, ranges[r][0], ranges[r + p][0]), (model.layout, ranges, r)
        tighter = table(x, makespan * 0.9)
        cut += not all(tighter.feasible(r, ranges[r][0], ranges[r + p][0]) for r in range(p))
        checked += 1
    assert checked > 50 and cut > checked // 2, (checked, cut)


@pytest.mark.parametrize("seed", range(2))
def test_rank_loads_seeded_from_a_looser_table_never_cut_a_split_within_the_limit(seed):
    """A table of loads seeded from one for a higher limit, of the same x or of a window of x's that holds it
    (which has worked out every rank and first-loop position), accepts every state of every split within its
    own limit, as unseeded ones do; seeded instead from a table for 0.9 x the limit (not a looser one), it cuts
    some split: the seeds take effect."""
    checked = cut = 0
    pick = random.Random(seed)
    for model, ranges, makespan, table in fitting_looped_splits(random.Random(1900 + seed)):
        p, n, x = model.layout.pipeline_size, model.num_blocks, ranges[model.layout.pipeline_size][0]
        held = (pick.randint(p, x), pick.randint(x, n - p)) if checked % 2 else x
        looser, tighter = table(held, makespan * 1.05), table(x, makespan * 0.9)
        for r, c in itertools.product(range(p), range(n)):
            looser.least_second_start(r, c)
            tighter.least_second_start(r, c)
        seeded, wrong = table(x, makespan * (1 + 1e-12), looser), table(x, makespan * (1 + 1e-12), tighter)
        for r in range(p):
            assert seeded.feasible(r, ranges[r][0], ranges[r + p][0]), (model.layout, ranges, r)
        cut += not all(wrong.feasible(r, ranges[r][0], ranges[r + p][0]) for r in range(p))
        checked += 1
    assert checked > 50 and cut > checked // 2, (checked, cut)


@pytest.mark.parametrize("seed", range(2))
def test_rank_loads_lowered_by_a_partial_plans_shift_never_cut_its_split(seed):
    """Walking each split's ranks in order, the table of loads for the split's step less the least tail and less
    the shift of the ranks chosen so far (`loads_shift`: what their stages take more than the table counts, and
    their tails more than the least) still lets the ranks after them through; the shifts are not all zero (were
    they too large, this would fail)."""
    checked = shifted = 0
    for model, ranges, _, table in fitting_looped_splits(random.Random(1300 + seed)):
        p = model.layout.pipeline_size
        partitions = PartitionSearch(model)
        found = evaluate(model, ranges, [None] * (2 * p))
        costs = found.stages
        state = partitions._pair_root()
        for r in range(p - 1):
            shift = partitions.loads_shift(state, r, ranges[r][1], costs[r])
            loads = table(ranges[p][0], found.step_s * (1 + 1e-12) - partitions.least_tail_s - shift)
            assert loads.feasible(r + 1, ranges[r + 1][0], ranges[r + 1 + p][0]), (model.layout, ranges, r, shift)
            shifted += shift > 1e-3 * found.step_s
            checked += 1
            state = partitions._pair_child(r, ranges[r][1], ranges[r + p][1], ranges[p][0], state, costs[r],
                                           costs[r + p])
            if state is None:
                break  # its bound reached the best step: nothing further to check
    assert checked > 100 and shifted > checked // 4, (checked, shifted)


def fitting_looped_splits(rng: random.Random):
    """(model, stage ranges, simulated makespan, RankLoads of (x, limit)) of every split of random small looped
    layouts that fits memory."""
    for model in looped_models(rng, 4, (6, 8)):
        p, n = model.layout.pipeline_size, model.num_blocks
        partitions = PartitionSearch(model)
        floors = StageFloors(model)
        warmups = [partitions.warmups[r].pair(r, r + p) for r in range(p)]

        def table(x, limit, looser=None):
            return RankLoads(floors, partitions.rest, x, limit, model.capacity, None, warmups, looser)

        for cuts in itertools.combinations(range(1, n), 2 * p - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            found = evaluate(model, ranges, [None] * (2 * p))
            if found is not None:
                yield model, ranges, found.trace.makespan_s, table


@pytest.mark.parametrize("seed", range(2))
def test_a_window_of_rank_loads_never_cuts_what_one_of_its_xs_allows(seed):
    """RankLoads of a window of second-loop starts x is a relaxation of each x's: its least second-loop
    positions are never above those of any x in it, so it never rules out an x whose split keeps within its
    limit; and at 0.9 x the limit some window rules out its x (it cuts something)."""
    checked = cut = 0
    rng = random.Random(1100 + seed)
    for model, ranges, makespan, table in fitting_looped_splits(rng):
        p, n = model.layout.pipeline_size, model.num_blocks
        x = ranges[p][0]
        window = (rng.randint(p, x), rng.randint(x, n - p))
        one, wide = table(x, makespan * (1 + 1e-12)), table(window, makespan * (1 + 1e-12))
        assert wide.least_second_start(0, 0) <= x, (model.layout, ranges, window)
        for r, c in itertools.product(range(p), range(n)):
            assert wide.least_second_start(r, c) <= one.least_second_start(r, c), (model.layout, window, r, c)
        cut += table(window, makespan * 0.9).least_second_start(0, 0) > x
        checked += 1
    assert checked > 20 and cut > checked // 4, (checked, cut)


def sharded_models(rng: random.Random, count: int):
    """The cost models of the layouts with replicas of `count` random instances on 4 ranks, some with a slow
    optimizer step or fast links, where sharding a stage may step faster than running it unsharded."""
    for _ in range(count):
        graph, profile, cluster, batch, factor = instance(rng, blocks=(4, 7), worlds=(4,))
        device = dataclasses.replace(cluster.device, mem_bandwidth_bps=rng.choice([1e11, 1e9]),
                                     intra_node=Link(rng.choice([1e-5, 0.0]), rng.choice([1e10, 1e12])))
        cluster = dataclasses.replace(cluster, device=device)
        for layout in layouts(graph, cluster, batch, Constraints()):
            if layout.num_replicas > 1:
                yield CostModel(graph, profile, cluster, factor, layout)


def stage_ranges(model):
    """Every (stage, start, stop) a stage of the model may take: the first starts at the first block, the last
    ends at the last one, and every stage has a block at least."""
    n, stages = model.num_blocks, model.layout.num_stages
    for stage, (a, b) in itertools.product(range(stages), itertools.combinations(range(n + 1), 2)):
        last = stage == stages - 1
        if (a == 0) == (stage == 0) and a >= stage and (b == n) == last and b <= n - stages + 1 + stage:
            yield stage, a, b


@pytest.mark.parametrize("seed", range(2))
def test_a_stage_runs_sharded_only_where_unsharded_it_does_not_fit_when_its_floors_say_so(seed):
    """Where `StageFloors.shards_only_when_too_big` says a sharding level never steps faster than unsharded,
    `CostModel.stage` runs a stage at that level only where unsharded it does not fit, and its blocks reach the
    first stop too big (`CostModel.first_too_big`); the rule applies somewhere, and elsewhere stages run sharded
    where they would fit unsharded (were the rule to say so there, this would fail)."""
    applied = faster = 0
    for model in sharded_models(random.Random(2300 + seed), 20):
        floors = StageFloors(model)
        for (stage, a, b), rc in itertools.product(stage_ranges(model), (False, True)):
            cost = model.stage(stage, a, b, rc)
            if cost is None or cost.sharding == "none":
                continue
            fits = model.priced(stage, a, b, rc, "none").memory.total <= model.capacity
            if floors.shards_only_when_too_big(stage, cost.sharding):
                stops = model.first_too_big(stage, rc)
                assert not fits and a < len(stops) and b >= stops[a], (model.layout, stage, a, b, rc, cost.sharding)
                applied += 1
            else:
                faster += fits
    assert applied > 20 and faster > 100, (applied, faster)


@pytest.mark.parametrize("seed", range(2))
def test_stage_floors_never_exceed_a_way_the_search_runs_a_stage_that_holds_them(seed):
    """For every stage [a, b) and every stage that holds it, each way the search may run the longer one
    (`CostModel.stage`, with recomputation and without) takes at least one of StageFloors' options for [a, b) in
    work, memory and work less forward; and some of those ways are stages too big to run unsharded whose work
    is the least of any such stage (`least_too_big`, to which their options are raised: were that raise 1 %
    higher in work, or half again as high in memory, this would fail)."""
    checked = tight = 0
    for model in sharded_models(random.Random(2500 + 2 * seed), 24):
        floors = StageFloors(model)
        ways = {}
        for stage, a, b in stage_ranges(model):
            ways[stage, a, b] = [c for c in (model.stage(stage, a, b, False), model.stage(stage, a, b, True)) if c]
        for (stage, a, b), options in ((key, floors.options(*key, None)) for key in ways):
            for a2, b2 in itertools.product(range(a + 1), range(b, model.num_blocks + 1)):
                for way in ways.get((stage, a2, b2), []):
                    below = [o for o in options if o[0] <= way.work_s * (1 + 1e-12) and o[1] <= way.memory.total
                             and o[0] - o[2] <= way.bwd_s * (1 + 1e-12)]
                    assert below, (model.layout, stage, (a, b), (a2, b2), way, options)
                    checked += 1
                    if floors.shards_only_when_too_big(stage, way.sharding):
                        tight += floors.least_too_big(stage, way.recompute, way.sharding)[0] >= 0.999 * way.work_s
    assert checked > 1000 and tight > 10, (checked, tight)


@pytest.mark.parametrize("seed", range(2))
def test_the_second_stage_ends_tried_hold_every_split_that_fits_memory(seed):
    """With no best step to cut by, the ends that the rank-by-rank search tries for each rank's second-loop stage
    (`_second_stops`: cut where the stage's floors over the ways it may run, `StageFloors`, exceed the room that
    the rank's first stage leaves) hold those of every split of random small looped layouts, with every way to run
    its stages that fits memory; were the cut made at 0.8 x that room, this would fail."""
    checked = 0
    for model in looped_models(random.Random(2700 + seed), 6, (6, 8)):
        p, n = model.layout.pipeline_size, model.num_blocks
        partitions = PartitionSearch(model, budget=10**9)  # (the tables' checks count against it)
        partitions.floors = StageFloors(model)
        partitions.pair_warmups = [partitions.warmups[r].pair(r, r + p) for r in range(p)]
        for cuts in itertools.combinations(range(1, n), 2 * p - 1):
            ranges = list(zip((0,) + cuts, cuts + (n,)))
            ways = [[c for c in (model.stage(k, a, b, False), model.stage(k, a, b, True)) if c]
                    for k, (a, b) in enumerate(ranges)]
            for costs in itertools.product(*ways):
                state = partitions._pair_root()
                for r in range(p - 1):
                    if costs[r].memory.total + costs[r + p].memory.total > model.capacity:
                        break  # this rank's ways do not fit together
                    ends = partitions._second_stops(r, ranges[r + p][0], ranges[r][1], ranges[p][0], state, costs[r])
                    assert ranges[r + p][1] in list(ends), (model.layout, ranges, r)
                    checked += 1
                    state = partitions._pair_child(r, ranges[r][1], ranges[r + p][1], ranges[p][0], state, costs[r],
                                                   costs[r + p])
    assert checked > 1000, checked


def rank_ends_bound(order, costs, m):
    """`_Warmup.bound` of one rank with every stage known (prefixes and round trips from the costs)."""
    f, b, send = costs.forward_s, costs.backward_s, costs.send_activations_s
    s = len(f)
    fwd_at = [sum(f[j] + send[j] for j in range(k)) for k in range(s)]
    bwd_at = [sum(b[j] + send[j] for j in range(k)) for k in range(s)]
    total_f, total_b = fwd_at[-1] + f[-1], bwd_at[-1] + b[-1]
    round_trip = lambda k: total_f - fwd_at[k] - f[k] + total_b - bwd_at[k] - b[k]  # noqa: E731
    stages = {stage for stage, _, _ in order}
    work = m * sum(f[k] + b[k] for k in stages)
    return _Warmup.of(order).bound(f, b, fwd_at, bwd_at, round_trip, fwd_at[min(stages)], work)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"])
def test_rank_warmup_and_cooldown_bound_never_exceeds_the_makespan(schedule):
    """A rank's first backward waits for micro-batch 0's round trip, its last forward's backward for that
    micro-batch's: each rank's bound is at most the simulated makespan, and with equal stages under 1F1B it
    is the makespan exactly (so an inflated bound fails here)."""
    rng = random.Random(31)
    checked = exact = 0
    for _ in range(80):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        s = p * (1 if schedule in ("GPipe", "1F1B") else 2)
        try:
            check_sizes(schedule, s, p, m)
        except ValueError:
            continue
        equal = rng.random() < 0.3
        costs = random_stage_costs(rng, s, same_rank_sends=p == 1)
        if equal:
            costs = StageCosts([1.0] * s, [2.0] * s, [0.0] * s, [0.0] * s)
        order = orders(schedule, s, p, m)
        makespan = simulate(order, costs).makespan_s
        bound = max(rank_ends_bound(order[r], costs, m) for r in range(p))
        assert bound <= makespan * (1 + 1e-12), (schedule, p, m, bound, makespan)
        checked += 1
        exact += equal and schedule == "1F1B" and bound == pytest.approx(makespan, rel=1e-12)
    assert checked >= 30
    assert schedule != "1F1B" or exact >= 3


def test_most_activations_is_at_least_those_of_any_blocks_within_the_work():
    """The fractional knapsack that caps what a rank whose work is bounded keeps: never less than the
    activations of any set of blocks whose work fits (brute force), and met by some set when the blocks fit
    whole."""
    rng = random.Random(3)
    for _ in range(20):
        graph, profile, cluster, batch, factor = instance(rng, blocks=(1, 7))
        layout = layouts(graph, cluster, batch, Constraints())[0]
        model = CostModel(graph, profile, cluster, factor, layout)
        rest, n = Remainder(model), graph.num_blocks
        acts = [model.activation_bytes(i, i + 1) for i in range(n)]
        work = [model.work(i, i + 1) for i in range(n)]
        limit = rng.uniform(0, sum(work))
        most = rest.most_activations([(0, n)], limit)
        best = max(sum(acts[i] for i in chosen) for k in range(n + 1) for chosen in itertools.combinations(range(n), k)
                   if sum(work[i] for i in chosen) <= limit * (1 - 1e-12))
        assert best <= most * (1 + 1e-12) + 1e-6
        assert rest.most_activations([(0, n)], sum(work) * 2) == pytest.approx(sum(acts), rel=1e-12)


def test_forced_recomputation_is_at_most_what_any_fitting_plan_recomputes():
    """`Remainder.recomputed` over the whole model, with each rank's room after its receive buffers and its
    rank's least micro-batches held: never more than the forward that a plan which fits recomputes (of blocks
    with activations), given at least that plan's largest per-rank work (brute force over splits and
    recomputation); and more than nothing on some instances, so the test can fail."""
    rng = random.Random(11)
    checked = forced_some = 0
    for _ in range(60):
        graph, profile, cluster, batch, factor = instance(rng, blocks=(2, 7))
        if rng.random() < 0.5:  # every cut as large: the receive buffers take much of the room
            graph = dataclasses.replace(graph, boundary_bytes=(Fit.line(0, 1e6),) * (graph.num_blocks - 1))
        for layout in layouts(graph, cluster, batch, Constraints()):
            model = CostModel(graph, profile, cluster, factor, layout)
            rest, n, s, p = Remainder(model), graph.num_blocks, layout.num_stages, layout.pipeline_size
            position = [model.ranks[k][0] % p for k in range(s)]
            held = [min(model.in_flight[k] for k in range(s) if position[k] == r) for r in range(p)]
            rooms = [rest.room(r) for r in range(p)]
            fwd = [model.forward_s(i, i + 1) - model.action_s for i in range(n)]
            work = [f + model.backward_s(i, i + 1, 0) - model.action_s for i, f in enumerate(fwd)]
            acts = [model.activation_bytes(i, i + 1) for i in range(n)]
            least = rest.recomputed([(0, n)], rooms, held)
            forced_some += 0 < least < math.inf
            for cuts in itertools.combinations(range(1, n), s - 1):
                ranges = list(zip((0,) + cuts, cuts + (n,)))
                for recompute in itertools.product([False, True], repeat=s):
                    if evaluate(model, ranges, list(recompute)) is None:
                        continue
                    done = sum(fwd[i] for (a, b), rc in zip(ranges, recompute) if rc for i in range(a, b) if acts[i])
                    rank_work = max(sum(work[i] for k, (a, b) in enumerate(ranges) if position[k] == r
                                        for i in range(a, b)) for r in range(p))
                    assert rest.recomputed([(0, n)], rooms, held, rank_work) <= done * (1 + 1e-12) + 1e-15, \
                        (layout, ranges, recompute)
                    checked += 1
    assert checked > 200
    assert forced_some >= 3


def test_the_look_for_a_shallower_plan_spends_a_quarter_of_the_budget_in_all(monkeypatch):
    """choose_plan then searches each shallower depth for a plan within SIMPLER_WITHIN of the fastest. On a
    model whose searches run out of budget, the depths share one quarter of the search budget: each spending
    a quarter of its own made GPT-3 175B's planning 1.5 s longer (bench/planner_time.py)."""
    import partita.plan.choose as choose

    spent = []
    real_search = choose.search

    def recorded(*args, **kwargs):
        result = real_search(*args, **kwargs)
        spent.append(result.nodes)
        return result

    monkeypatch.setattr(choose, "search", recorded)
    graph, profile, cluster = gpt_like(100, 16)
    plan = choose.choose_plan(graph, profile, cluster, global_batch=8 * cluster.world_size, optimizer_factor=2.0)
    shallower = spent[1:]
    assert len(shallower) >= 2 and plan.pipeline_size > 2, spent  # more than one depth was looked at
    assert sum(shallower) <= SEARCH_BUDGET // 4 * 1.01, spent
