"""The planner's prices for the four sharding levels (cost model formulas, the choice among them, the bounds
the search relies on): pure Python, no torch."""

import dataclasses
import random
import re

import pytest

from partita.cluster import Cluster, DeviceSpec, Link
from partita.cluster.cluster import RuntimeOverheads
from partita.errors import PlanError
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan import Constraints, choose_plan
from partita.plan.cost import GRAD_BUCKET_BYTES, CostModel, Layout
from partita.plan.search import layouts

from test_search import instance

MB = 10**6


def graph_of(param_mb, act_mb=0.1, shared=()):
    """Blocks with these parameter megabytes (1e-4 s of work per row each); `shared`: pairs of blocks that
    also read one parameter of 2 MB between them."""
    n = len(param_mb)
    extra = {i: f"t{k}" for k, pair in enumerate(shared) for i in pair}
    blocks = tuple(Block(i, f"layers.{i}", (i, i + 1), f"a{i}", f"z{i}", "sig", 1, Fit.line(0, 1), Fit.line(0, 1),
                         Fit.line(0, act_mb * MB), (f"p{i}",) + ((extra[i],) if i in extra else ()))
                   for i in range(n))
    param_bytes = {f"p{i}": int(mb * MB) for i, mb in enumerate(param_mb)}
    param_bytes.update({name: 2 * MB for name in extra.values()})
    graph = ModelGraph(blocks, param_bytes, tuple(Fit.line(0, 1e3) for _ in range(n - 1)), Fit.line(0, 1e3))
    profile = Profile("test", tuple(BlockCost(Fit.line(5e-5, 1e-4 / 3), Fit.line(1e-4, 2e-4 / 3),
                                              Fit.line(0, act_mb * MB)) for _ in range(n)))
    return graph, profile


def cluster(world, memory_mb):
    device = DeviceSpec("test", int(memory_mb * MB), {"float32": 1e12}, 1e11, 1.0, 0.0, 0, 1e-5, 1e-4, 1e-4,
                        Link(1e-6, 1e10), Link(1e-5, 1e9), world, "test")
    return Cluster(device, 1, world)


def test_memory_of_each_level_is_its_formula():
    """Stage 0 of 2 stages x 4 replicas, 4 micro-batches, Adam: blocks of 8 and 16 MB (U = 16 MB, P = 24 MB)."""
    graph, profile = graph_of([8, 16, 4, 4])
    R, O, M, rows = 4, 2, 4, 2
    model = CostModel(graph, profile, cluster(8, 10**4), O, Layout("1F1B", 2, 2, R, M, rows))
    P, U = 24 * MB, 16 * MB
    acts = 2 * 0.1 * MB * rows * model.in_flight[0]
    received = M * (1e3 * rows)  # the receive buffers of its outputs' gradients (the stage has no inputs)
    expect = {
        "none": (P, P, O * P, acts, received + min(P, GRAD_BUCKET_BYTES), P, 0),
        "optimizer": (P, P, O * P / R, acts, received + min(P, GRAD_BUCKET_BYTES), P / R, 0),
        "gradients": (P / R, P / R, O * P / R, acts, received + U, P / R, P + U),
        "parameters": (P / R, P / R, O * P / R, acts, received + U, P / R, min(2 * U, P) + U),
    }
    for level, (params, grads, optimizer, activations, buffers, step, gathered) in expect.items():
        m = model.priced(0, 0, 2, False, level).memory
        assert (m.params, m.grads, m.optimizer, m.activations, m.buffers, m.step_transient, m.gathered) == \
            tuple(map(int, (params, grads, optimizer, activations, buffers, step, gathered))), level
        assert m.total == m.params + m.grads + m.optimizer + m.buffers + max(m.activations + m.gathered,
                                                                              m.step_transient)


def test_more_sharding_holds_less_for_big_parameters_and_small_activations():
    graph, profile = graph_of([40] * 8, act_mb=0.01)
    model = CostModel(graph, profile, cluster(8, 10**4), 2, Layout("1F1B", 2, 2, 4, 4, 2))
    totals = [model.priced(0, 0, 4, False, level).memory.total
              for level in ("parameters", "gradients", "optimizer", "none")]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_time_of_each_level():
    """Per micro-batch: "gradients" reduce-scatters in each backward, "parameters" also gathers before each
    forward and backward, one collective per unit (block); per step "gradients" gathers once, "optimizer"
    after the step; FSDP's levels step their shard and all-reduce nothing. With more than one micro-batch
    "parameters" is the slower."""
    graph, profile = graph_of([8, 16, 4, 4])
    R, M = 4, 4
    c = cluster(8, 10**4)
    model = CostModel(graph, profile, c, 2, Layout("1F1B", 2, 2, R, M, 2))
    P, ranks = 24 * MB, model.ranks[0]
    assert model.unit_count(0, 2) == 2
    gather, reduce = 2 * c.allgather_s(P / 2, ranks), 2 * c.reduce_scatter_s(P / 2, ranks)
    allreduce = c.allreduce_s(P, ranks)
    none, zero1, zero2, zero3 = (model.priced(0, 0, 2, False, level)
                                 for level in ("none", "optimizer", "gradients", "parameters"))
    assert (zero2.fwd_s, zero2.bwd_s) == pytest.approx((none.fwd_s, none.bwd_s + reduce))
    assert (zero3.fwd_s, zero3.bwd_s) == pytest.approx((none.fwd_s + gather, none.bwd_s + gather + reduce))
    assert (zero2.collective_s, zero3.collective_s) == pytest.approx((reduce, 2 * gather + reduce))
    assert [x.gather_s for x in (none, zero1, zero2, zero3)] == pytest.approx([0, c.allgather_s(P, ranks), gather, 0])
    assert [x.allreduce_s for x in (none, zero1, zero2, zero3)] == pytest.approx([allreduce, allreduce, 0, 0])
    assert [x.optimizer_s for x in (none, zero1, zero2, zero3)] == \
        pytest.approx([none.optimizer_s, none.optimizer_s / R, none.optimizer_s / R, none.optimizer_s / R])
    assert zero2.apply_gradients_s == zero3.apply_gradients_s == pytest.approx(P / R * 2 / c.device.mem_bandwidth_bps)
    assert model.tail_s(zero3) == pytest.approx(zero3.apply_gradients_s + zero3.optimizer_s)
    assert model.stage_time_s(zero3) - model.stage_time_s(zero2) == pytest.approx((2 * M - 1) * gather)
    # the job's own optimizer timed (profile.optimizer_bps): its rate, not the bytes it must move, prices the step
    timed = CostModel(graph, dataclasses.replace(profile, optimizer_bps=1e9), c, 2, Layout("1F1B", 2, 2, R, M, 2))
    assert [timed.priced(0, 0, 2, False, level).optimizer_s for level in ("none", "parameters")] == \
        pytest.approx([P / 1e9, P / R / 1e9])
    # recomputed, "parameters" runs the forward again after the backward's gather: no third gather
    assert model.priced(0, 0, 2, True, "parameters").bwd_s == pytest.approx(zero3.bwd_s + none.fwd_s)
    assert model.stage(0, 0, 2).sharding != "parameters"  # everything fits: the slowest level is not taken


def test_a_stage_takes_the_fastest_level_that_fits():
    """Memory for each level in turn: the stage takes the least sharded one that fits, "parameters" last."""
    graph, profile = graph_of([40] * 8, act_mb=0.01)
    lay = Layout("1F1B", 2, 2, 4, 4, 2)
    probe = CostModel(graph, profile, cluster(8, 10**4), 2, lay)
    need = {level: probe.priced(0, 0, 4, False, level).memory.total
            for level in ("none", "optimizer", "gradients", "parameters")}
    for level, total in need.items():
        model = CostModel(graph, profile, cluster(8, total / MB), 2, lay)
        assert model.stage(0, 0, 4, False).sharding == level
    assert CostModel(graph, profile, cluster(8, need["parameters"] / MB - 1), 2, lay).stage(0, 0, 4, False) is None


def test_only_parameters_fits_so_the_plan_shards_them_and_says_why():
    """8 blocks of 10 MB under Adam on 8 ranks of 100 MB, one stage: ZeRO-2 holds every parameter whole while
    computing (80 MB beside the shards), ZeRO-3 only three blocks' worth."""
    graph, profile = graph_of([10] * 8)
    plan = choose_plan(graph, profile, cluster(8, 100), global_batch=64, optimizer_factor=2,
                       constraints=Constraints(stages=1))
    (stage,) = plan.stages
    assert stage.sharding == "parameters"
    assert stage.memory["params"] == stage.memory["grads"] == 10 * MB
    assert stage.memory["optimizer"] == 20 * MB and stage.memory["gathered"] == 30 * MB
    [why] = [r for r in plan.reasons if "(ZeRO-3" in r]
    assert "on stage(s) [0]" in why and "stage(s) [0] would not fit with less sharding" in why
    assert re.search(r"stage 0 holds [\d.]+ MiB instead of [\d.]+ MiB \([\d.]+ MiB less\) and takes [\d.]+ ms more "
                     r"per step \(collectives [\d.]+ ms per micro-batch, all-reduce 0 ms instead of [\d.]+", why)
    assert " parameters " in plan.explain().splitlines()[2]
    with pytest.raises(PlanError, match='sharding="parameters"'):  # the no-plan message says what would fit
        choose_plan(graph, profile, cluster(8, 100), global_batch=64, optimizer_factor=2,
                    constraints=Constraints(stages=1, sharding="gradients"))


def test_data_parallel_with_fsdp_levels_is_costed_as_pipelined():
    """One stage and one micro-batch run under torch's DDP unless sharded by FSDP: then partita's pipelined
    runtime runs them, with its overheads, and no DDP overlap of an all-reduce with the backward."""
    graph, profile = graph_of([10] * 8)
    c = cluster(4, 10**4)
    for level, pipelined in (("none", False), ("optimizer", False), ("gradients", True), ("parameters", True)):
        model = CostModel(graph, profile, c, 2, Layout("GPipe", 1, 1, 4, 1, 8, level))
        assert model.pipelined == pipelined and model.layout.data_parallel_only
        assert model.action_s == (c.action_overhead_s if pipelined else 0.0)
        assert model.step_overhead_s == c.step_overhead_s(pipelined)
    plan = choose_plan(graph, profile, c, global_batch=32, optimizer_factor=2,
                       constraints=Constraints(stages=1, micro_batches=1, sharding="parameters"))
    model = CostModel(graph, profile, c, 2, Layout("GPipe", 1, 1, 4, 1, 8, "parameters"))
    cost = model.stage(0, 0, 8, False)
    assert cost.sharding == "parameters" and cost.allreduce_s == 0.0
    assert plan.estimate.step_s == pytest.approx(cost.fwd_s + cost.bwd_s + c.step_overhead_s(True)
                                                 + cost.apply_gradients_s + cost.optimizer_s)
    # unfixed, data parallelism alone is offered under DDP and under each FSDP level
    dp = [lay.sharding for lay in layouts(graph, c, 32, Constraints(stages=1, micro_batches=1))]
    assert dp == [None, "gradients", "parameters"]


def test_a_parameter_several_blocks_read_stays_whole():
    """Blocks 0 and 3 share a parameter (a tied weight across the stages [0, 2) and [2, 4)), blocks 1 and 2 one
    within the second stage: FSDP's levels keep both whole (runtime.fully_sharded); a unit is a block's own
    parameters."""
    graph, profile = graph_of([8, 4, 4, 4], shared=[(0, 3), (1, 2)])
    R = 4
    c = cluster(8, 10**4)
    model = CostModel(graph, profile, c, 2, Layout("1F1B", 2, 2, R, 4, 2))
    assert model.units(0, 2) == (4 * MB, 8 * MB)  # t0 and t1 (2 MB each) whole; block 0's own 8 MB
    assert model.units(2, 4) == (4 * MB, 4 * MB)
    assert model.units(0, 4) == (4 * MB, 8 * MB)
    whole, P = 4 * MB, 16 * MB
    cost = model.priced(0, 0, 2, False, "gradients")
    kept = whole + (P - whole) / R
    assert (cost.memory.params, cost.memory.optimizer) == (int(kept), int(2 * kept))
    assert cost.memory.gathered == (P - whole) + 8 * MB
    assert cost.allreduce_s == pytest.approx(c.allreduce_s(whole, model.ranks[0]))
    units = model.unit_count(0, 2)
    assert units == 2 and cost.gather_s == pytest.approx(units * c.allgather_s((P - whole) / units, model.ranks[0]))


def test_memory_floors_are_lower_bounds_that_grow_with_the_stage():
    """The search cuts on memory_floor: it must not exceed the memory of the stage under any level or
    recomputation, and must not shrink as the stage grows (tied parameters included)."""
    rng = random.Random(3)
    checked = 0
    for _ in range(40):
        graph, profile, c, batch, factor = instance(rng, worlds=(2, 4))
        for lay in layouts(graph, c, batch, Constraints()):
            model = CostModel(graph, profile, c, factor, lay)
            n = graph.num_blocks
            for stage in range(lay.num_stages):
                for a in range(n):
                    floors = [model.memory_floor(stage, a, b) for b in range(a + 1, n + 1)]
                    assert floors == sorted(floors)
                    for b, floor in zip(range(a + 1, n + 1), floors):
                        if stage == lay.num_stages - 1 and b < n:
                            continue  # no stage after the last to send to
                        for sharding in model.shardings:
                            for rc in (False, True):
                                assert floor <= model.priced(stage, a, b, rc, sharding).memory.total
                                checked += 1
    assert checked > 1000


def test_zero_bubble_schedules_do_not_run_fsdp_levels():
    """A zero-bubble schedule computes the weight gradients after the input gradients, when FSDP has already
    reduced a block's: the planner never pairs them, a fixed pair is refused before planning, and so is a plan
    that pairs them."""
    graph, profile = graph_of([10] * 8)
    c = cluster(8, 10**4)
    for schedule in ("ZBVZeroBubble", "InterleavedZeroBubble"):
        plan = choose_plan(graph, profile, c, global_batch=64, optimizer_factor=2,
                           constraints=Constraints(stages=4, schedule=schedule))
        assert {s.sharding for s in plan.stages} <= {"none", "optimizer"}
        with pytest.raises(PlanError, match=f"{schedule} splits each backward.*sharding='optimizer'"):
            choose_plan(graph, profile, c, global_batch=64, optimizer_factor=2,
                        constraints=Constraints(stages=4, schedule=schedule, sharding="parameters"))
        sharded = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, sharding="gradients")
                                                         for s in plan.stages))
        with pytest.raises(PlanError, match="stage 0: .*runs on torch's FSDP"):
            sharded.validate()
    assert Constraints(sharding="gradients").schedule_problem("1F1B") is None


def test_measured_collectives_price_fsdp_and_data_parallelism_chooses_ddp_where_they_are_slow():
    """gloo's reduce-scatter took 1.5 all-reduces and its all-gather one (4 CPU ranks, bench/ddp_parity.py's
    MLP): measured, they are priced as measured, rescaled to the group like the all-reduce, one per unit; then
    data parallelism of 10 blocks of 1 MiB is fastest under DDP, not under ZeRO-2's 10 reduce-scatters."""
    graph, profile = graph_of([1] * 10)
    allreduce = Link(5e-3, 4.5e8)
    measured = cluster(4, 10**4)
    measured = dataclasses.replace(measured, allreduce=allreduce, allreduce_ranks=4,
                                   reduce_scatter=Link(7e-3, 3e8), allgather=Link(5e-3, 4.5e8))
    ranks = (0, 1, 2, 3)
    assert measured.reduce_scatter_s(MB, ranks) == pytest.approx(7e-3 + MB / 3e8)
    assert measured.allgather_s(MB, ranks[:2]) == pytest.approx(5e-3 / 3 + MB / 4.5e8 * (1 / 2) / (3 / 4))
    assert cluster(4, 10**4).reduce_scatter_s(MB, ranks) == pytest.approx(cluster(4, 10**4).allreduce_s(MB, ranks) / 2)
    model = CostModel(graph, profile, measured, 1, Layout("GPipe", 1, 1, 4, 1, 4))
    zero2 = model.priced(0, 0, 10, False, "gradients")
    assert zero2.collective_s == pytest.approx(10 * measured.reduce_scatter_s(MB, ranks))
    plan = choose_plan(graph, profile, measured, global_batch=16, optimizer_factor=1,
                       constraints=Constraints(stages=1, micro_batches=1))
    assert plan.stages[0].sharding == "none"


def test_fsdp_collectives_cost_the_measured_interference_as_ddp_all_reduce_does():
    """They run while the units compute; on cores the ranks share both slow down (runtime overheads)."""
    graph, profile = graph_of([8, 16, 4, 4])
    alone = cluster(8, 10**4)
    shared = dataclasses.replace(alone, overheads=RuntimeOverheads(0.0, 0.0, 0.0, 0.0, 1.5))
    layout = Layout("1F1B", 2, 2, 4, 4, 2)
    for level in ("gradients", "parameters"):
        a, b = (CostModel(graph, profile, c, 2, layout).priced(0, 0, 2, False, level) for c in (alone, shared))
        assert b.collective_s == pytest.approx(2.5 * a.collective_s) and a.collective_s > 0
        assert b.gather_s == pytest.approx(2.5 * a.gather_s)
