"""The planner's choices and the plan value: pure Python, no torch, no processes."""

import dataclasses
import re

import pytest

from partita.cluster import Cluster, DeviceSpec, Link
from partita.errors import BatchError, PlanError
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan import Constraints, Plan, choose_plan
from partita.plan.cost import CostModel, Layout
from partita.plan.plan import SHARDING_LEVELS, rank_layout

MB = 10**6


def model(work, param_mb=1, act_mb=0.1, call_s=5e-5):
    """Blocks with the given seconds of work per row (forward 1/3, backward 2/3) and a fixed cost per call
    (launching its ops), which makes very small micro-batches inefficient, as on real devices."""
    blocks = tuple(Block(i, f"layers.{i}", (i, i + 1), f"a{i}", f"z{i}", "sig", 1, Fit.line(0, 1), Fit.line(0, 1),
                         Fit.line(0, act_mb * MB), (f"p{i}",)) for i in range(len(work)))
    graph = ModelGraph(blocks, {f"p{i}": int(param_mb * MB) for i in range(len(work))},
                       tuple(Fit.line(0, 1e3) for _ in work[1:]), Fit.line(0, 1e3))
    profile = Profile("test", tuple(BlockCost(Fit.line(call_s, w / 3), Fit.line(2 * call_s, 2 * w / 3),
                                              Fit.line(0, act_mb * MB)) for w in work))
    return graph, profile


def cluster(world, memory_mb):
    device = DeviceSpec("test", int(memory_mb * MB), {"float32": 1e12}, 1e11, 1.0, 0.0, 0, 1e-5, 1e-4, 1e-4,
                        Link(1e-6, 1e10),
                        Link(1e-5, 1e9), world, "test")
    return Cluster(device, 1, world)


def test_data_parallel_when_the_model_fits():
    graph, profile = model([1e-4] * 8)
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=32, optimizer_factor=2)
    assert (plan.num_stages, plan.num_replicas, plan.micro_batches) == (1, 4, 1)
    assert any("data parallel only" in r for r in plan.reasons) and any("proven optimal" in r for r in plan.reasons)


def test_pipeline_when_the_model_does_not_fit_one_device():
    graph, profile = model([1e-4] * 8, param_mb=10)
    plan = choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,  # Adam: 8 x 40 MB
                       constraints=Constraints(sharding="none"))
    assert plan.num_stages > 1
    assert any("data parallel alone does not fit" in r for r in plan.reasons)
    assert plan.estimate.peak_memory_bytes <= 300 * MB
    assert all(s.memory_bytes <= 300 * MB for s in plan.stages)


def test_sharding_the_optimizer_state_lets_data_parallel_fit():
    """Adam's state (2 x 80 MB) does not fit beside the weights and gradients under data parallelism; shared by
    8 replicas (ZeRO-1) it does. The plan says which stages shard, what each replica keeps, and why."""
    graph, profile = model([1e-4] * 8, param_mb=10)
    with pytest.raises(PlanError):
        choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,
                    constraints=Constraints(stages=1, sharding="none"))
    plan = choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,
                       constraints=Constraints(stages=1))
    (stage,) = plan.stages
    assert stage.sharding == "optimizer"
    assert stage.memory["optimizer"] == stage.memory["params"] * 2 // 8
    assert any("(ZeRO-1) on stage(s) [0]" in r and "stage(s) [0] would not fit with less sharding" in r for r in plan.reasons)
    assert " optimizer " in plan.explain().splitlines()[2]


def test_sharding_fixed_by_the_caller():
    graph, profile = model([1e-4] * 8, param_mb=10)
    plan = choose_plan(graph, profile, cluster(8, 10**4), global_batch=64, optimizer_factor=2,
                       constraints=Constraints(stages=2, sharding="optimizer"))
    assert {s.sharding for s in plan.stages} == {"optimizer"}
    assert any("fixed by the caller" in r and "sharding=optimizer" in r for r in plan.reasons)
    assert not any("(ZeRO-1) on stage(s)" in r for r in plan.reasons)


def test_adam_needs_more_memory_than_sgd():
    graph, profile = model([1e-4] * 8, param_mb=10)
    unsharded = Constraints(sharding="none")
    adam = choose_plan(graph, profile, cluster(8, 330), global_batch=64, optimizer_factor=2, constraints=unsharded)
    sgd = choose_plan(graph, profile, cluster(8, 330), global_batch=64, optimizer_factor=0, constraints=unsharded)
    assert adam.stages[0].memory["optimizer"] == 2 * adam.stages[0].memory["params"]
    assert sgd.stages[0].memory["optimizer"] == 0
    assert any("data parallel alone does not fit" in r for r in adam.reasons)
    assert any("data parallel alone would take" in r for r in sgd.reasons)


@pytest.mark.parametrize("num_blocks, param_mb, ranks_per_pipeline", [(16, 2, 1), (8, 16, 4), (16, 8, 8)])
def test_the_shallowest_pipeline_within_the_margin_of_the_fastest_wins(num_blocks, param_mb, ranks_per_pipeline):
    """The fastest plan here pipelines over all 8 ranks; shallower ones trail it by more or less: data
    parallelism within 5% (16 blocks of 2 MB), 4 ranks per pipeline within 5% (8 blocks of 16 MB), nothing
    shallower within 5% (16 blocks of 8 MB)."""
    graph, profile = model([1e-4] * num_blocks, param_mb=param_mb)
    plan = choose_plan(graph, profile, cluster(8, 10**4), global_batch=32, optimizer_factor=0)
    assert plan.pipeline_size == ranks_per_pipeline
    told = [r for r in plan.reasons if "closer than the simulator can tell apart" in r]
    assert len(told) == (ranks_per_pipeline < 8)
    assert all("rather than the 8 of the fastest" in r for r in told)


def test_stages_balance_measured_time():
    graph, profile = model([1, 1, 1, 1, 4])
    plan = choose_plan(graph, profile, cluster(2, 10**4), global_batch=8, optimizer_factor=0,
        constraints=Constraints(stages=2, schedule="GPipe"))
    assert [s.blocks for s in plan.stages] == [(0, 4), (4, 5)]
    assert [s.ranks for s in plan.stages] == [(0,), (1,)]


def test_recomputation_when_activations_do_not_fit():
    graph, profile = model([1e-4] * 4, param_mb=1, act_mb=20)
    plan = choose_plan(graph, profile, cluster(2, 200), global_batch=8, optimizer_factor=0,
        constraints=Constraints(stages=2, micro_batches=4, schedule="GPipe"))
    assert any(s.recompute for s in plan.stages)
    with pytest.raises(PlanError, match="allow recomputation"):
        choose_plan(graph, profile, cluster(2, 200), global_batch=8, optimizer_factor=0,
            constraints=Constraints(stages=2, micro_batches=4, schedule="GPipe", recompute=False))


def test_rank_layout_for_replicas_and_v_schedules():
    assert rank_layout("1F1B", 2, 2) == [[0, 2], [1, 3]]
    assert rank_layout("ZBVZeroBubble", 4, 1) == [[0], [1], [1], [0]]
    assert rank_layout("Interleaved1F1B", 4, 1) == [[0], [1], [0], [1]]


def test_no_plan_fits_says_what_would():
    graph, profile = model([1e-4] * 4, param_mb=50)
    with pytest.raises(PlanError) as e:
        choose_plan(graph, profile, cluster(2, 300), global_batch=8, optimizer_factor=2)
    msg = str(e.value)
    assert "no plan fits in 286.1 MiB per rank" in msg and "the whole model on one rank needs" in msg
    assert "4 devices (same local batch) would fit" in msg


def test_indivisible_batch_names_a_valid_choice():
    graph, profile = model([1e-4] * 4)
    with pytest.raises(BatchError, match=r"micro_batches from \[1, 2, 3, 6\]"):
        choose_plan(graph, profile, cluster(4, 10**4), global_batch=12, optimizer_factor=0,
            constraints=Constraints(stages=2, micro_batches=4))


def test_micro_batches_alone_that_split_no_layout_say_the_batch_does_not_split():
    graph, profile = model([1e-4] * 4)
    with pytest.raises(BatchError) as e:
        choose_plan(graph, profile, cluster(2, 10**4), global_batch=6, optimizer_factor=0,
            constraints=Constraints(micro_batches=4))
    msg = str(e.value)
    assert "global batch of 6 rows (2 ranks x 3) does not split into 4 micro-batches whatever the layout" in msg
    assert "3 rows (2 replicas) or 6 rows (1 replica)" in msg and "micro_batches from [1, 2, 3, 6]" in msg


def test_constraints_that_cannot_hold():
    graph, profile = model([1e-4] * 4)
    with pytest.raises(PlanError, match=r"Choose stages from \[1, 2, 4\]"):
        choose_plan(graph, profile, cluster(4, 10**4), global_batch=8, optimizer_factor=0,
            constraints=Constraints(stages=3))
    with pytest.raises(PlanError, match="unknown schedule"):
        choose_plan(graph, profile, cluster(4, 10**4), global_batch=8, optimizer_factor=0,
            constraints=Constraints(schedule="Zigzag"))


def test_plan_round_trips_through_json_and_explains(tmp_path):
    graph, profile = model([1, 2, 3, 4])
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=16, optimizer_factor=2,
        constraints=Constraints(stages=2))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    text = path.read_text()
    assert '"stages"' in text and '"ranks"' in text and '"estimate"' in text
    table = plan.explain()
    assert "estimate:" in table and "bubble" in table and "samples/s" in table and "all-reduce" in table


@pytest.mark.parametrize("change,match", [
    (lambda d: d.update(world_size=3), "ranks 0..2"),
    (lambda d: d["stages"][1].update(ranks=[1]), "same number of replicas"),
    (lambda d: d["stages"][1].update(blocks=[0, 4]), "consecutive"),
    (lambda d: d.update(schedule="Zigzag"), "unknown schedule"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(micro_batches=1, schedule="1F1B"), "at least as many micro-batches"),
])
def test_invalid_plans_are_refused(change, match):
    graph, profile = model([1, 2, 3, 4])
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=16, optimizer_factor=0,
        constraints=Constraints(stages=2, schedule="GPipe"))
    data = plan.to_dict()
    change(data)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(data).validate()


def test_not_a_plan():
    with pytest.raises(PlanError, match="not a partita plan"):
        Plan.from_json('{"hello": 1}')


def test_plans_written_by_earlier_versions_still_load():
    """Version 1 called the micro-batch count `num_microbatches`; version 2 had no `sharding` per stage (it
    sharded nothing). Both load as the current version."""
    graph, profile = model([1, 2, 3, 4])
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=16, optimizer_factor=0,
                       constraints=Constraints(stages=2, micro_batches=2))
    assert plan.version == 3 and plan.to_dict()["micro_batches"] == 2
    two = plan.to_dict()
    two["version"] = 2
    for stage in two["stages"]:
        del stage["sharding"]
    assert Plan.from_dict(two).validate() == plan
    one = dict(two, version=1)
    one["num_microbatches"] = one.pop("micro_batches")
    assert Plan.from_dict(one).validate() == plan


def test_an_unknown_sharding_is_refused_and_every_level_runs():
    graph, profile = model([1, 2, 3, 4])
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=16, optimizer_factor=0,
                       constraints=Constraints(stages=2, micro_batches=2))
    data = plan.to_dict()
    for level in SHARDING_LEVELS:
        data["stages"][0]["sharding"] = level
        assert Plan.from_dict(data).validate().stages[0].sharding == level
    data["stages"][0]["sharding"] = "zero"
    with pytest.raises(PlanError, match=re.escape("unknown sharding 'zero'; choose one of none, optimizer, "
                                                  "gradients, parameters")):
        Plan.from_dict(data).validate()


def test_without_loss_fn_only_schedules_that_finish_every_forward_first():
    """The user's loss comes after every forward: the planner plans GPipe or LoopedBFS, and refuses 1F1B."""
    graph, profile = model([1e-4] * 8, param_mb=10)
    plan = choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,
                       constraints=Constraints(user_loss=True))
    assert plan.num_stages > 1 and plan.schedule in ("GPipe", "LoopedBFS")
    assert any("without loss_fn" in r for r in plan.reasons)
    with pytest.raises(PlanError, match="Pass loss_fn=... to parallelize to use 1F1B"):
        choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,
                    constraints=Constraints(schedule="1F1B", user_loss=True))



def test_constraints_allow_a_plan_only_if_it_honours_every_choice():
    graph, profile = model([1, 2, 3, 4])
    plan = choose_plan(graph, profile, cluster(4, 10**4), global_batch=16, optimizer_factor=0,
                       constraints=Constraints(stages=2, micro_batches=2, schedule="1F1B"))
    assert Constraints().allows(plan) and Constraints(stages=2, schedule="1F1B").allows(plan)
    assert not Constraints(stages=4).allows(plan) and not Constraints(micro_batches=4).allows(plan)
    assert not Constraints(user_loss=True).allows(plan)  # 1F1B cannot run when the user computes the loss
    assert not Constraints(recompute=True).allows(plan)


def test_a_pipeline_of_one_micro_batch_says_why():
    """Fixed costs per call make small micro-batches slow: the plan pipelines one micro-batch, and its reasons
    give the simulated step of the same stages split into more micro-batches, and why it is slower."""
    graph, profile = model([1e-4] * 8, param_mb=10, call_s=5e-3)
    plan = choose_plan(graph, profile, cluster(8, 300), global_batch=64, optimizer_factor=2,
                       constraints=Constraints(sharding="none"))  # sharded, data parallelism alone would fit
    assert plan.num_stages > 1 and plan.micro_batches == 1
    [why] = [r for r in plan.reasons if r.startswith("one micro-batch:")]
    assert "the fastest split of the same stages into more, 2 micro-batches of 8 rows" in why
    step = float(why.split("simulates ")[1].split(" s per step")[0])
    assert step > plan.estimate.step_s and "bubble shrinks from 50%" in why and "compute grows" in why
    [kept] = [r for r in plan.reasons if r.startswith("no recomputation:")]
    assert "recomputing every stage would take" in kept


def test_one_row_per_replica_does_not_split():
    graph, profile = model([1e-4] * 8, param_mb=10, call_s=5e-3)
    plan = choose_plan(graph, profile, cluster(8, 300), global_batch=4, optimizer_factor=2,
                       constraints=Constraints(stages=2))
    assert (plan.num_replicas, plan.micro_batches) == (4, 1)
    assert "one micro-batch: each replica computes a single row, which does not split" in plan.reasons


def test_the_last_stage_holds_what_the_loss_keeps_of_the_outputs():
    """Outputs of 2 MB per row: the loss keeps a copy of each micro-batch's outputs it holds, a pipeline the
    outputs too, and the backward makes one micro-batch's gradient of them; no other stage holds any of it."""
    graph, profile = model([1e-4] * 4)
    with_outputs = dataclasses.replace(graph, output_bytes=Fit.line(0, 2 * MB))
    c = cluster(4, 10**4)
    for layout, held, copies in ((Layout("GPipe", 2, 2, 2, 4, 2), 4, 2), (Layout("GPipe", 1, 1, 4, 1, 8), 1, 1)):
        plain, loss = (CostModel(g, profile, c, 2, layout) for g in (graph, with_outputs))
        last = layout.num_stages - 1
        assert plain.in_flight[last] == held
        added = (loss.priced(last, 2 if last else 0, 4, False, "none").memory.activations
                 - plain.priced(last, 2 if last else 0, 4, False, "none").memory.activations)
        assert added == (copies * held + 1) * 2 * MB * layout.micro_batch_rows
        if last:
            assert loss.priced(0, 0, 2, False, "none").memory == plain.priced(0, 0, 2, False, "none").memory


def test_a_timed_fit_is_never_cheaper_per_row_below_the_rows_timed():
    line = Fit.through(2, 2e-3, 16, 32e-3)  # falls to zero rows faster than in proportion: a negative fixed cost
    fit = Fit.timed(2, 2e-3, 16, 32e-3)
    assert line.lines[0][0] < 0
    assert fit.at(2) == pytest.approx(2e-3) and fit.at(16) == pytest.approx(32e-3)
    assert fit.at(8) == pytest.approx(line.at(8))  # between the measurements: the line
    assert fit.at(1) == pytest.approx(1e-3) and line.at(1) < 1e-3  # below: the smaller measurement's cost per row
    assert Fit.timed(2, 5e-3, 16, 19e-3) == Fit.through(2, 5e-3, 16, 19e-3)  # a fixed cost >= 0: the line alone


def test_blocks_timed_cheaper_per_row_at_few_rows_do_not_split_the_batch_into_single_rows():
    """Timed alone at 2 and 16 rows, a block's line has a negative fixed cost (2 rows ran in a hot cache);
    extended to one row, it made micro-batches of one row look cheapest per row. Micro-batches of 2 rows, as
    timed, are the cheapest there are."""
    graph, _ = model([1e-4] * 8)
    timed = Profile("test", tuple(BlockCost(Fit.timed(2, 2e-4, 16, 3.2e-3), Fit.timed(2, 4e-4, 16, 6.4e-3),
                                            Fit.line(0, 0.1 * MB)) for _ in range(8)))
    plan = choose_plan(graph, timed, cluster(1, 10**4), global_batch=16, optimizer_factor=2)
    assert plan.micro_batches == 8
