"""What runs is what was planned: on every rank, the compute actions the runtime executes in a training step
are, in order, those the planner's simulator used for the plan's estimate, for every schedule and both call
styles (partita computes the loss with torch's schedule classes, or the user's code computes it and partita
runs the order itself)."""

import re

import pytest

from partita.plan.explain import seconds
from partita.schedule.catalog import FORWARDS_FIRST_SCHEDULES, SCHEDULES, stages_per_rank

RUNS = [(schedule, "loss_fn") for schedule in SCHEDULES] + [(s, "outputs") for s in FORWARDS_FIRST_SCHEDULES]


@pytest.mark.parametrize("schedule,style", RUNS)
def test_executed_actions_are_the_simulated_orders(pools, schedule, style):
    stages = 2 * stages_per_rank(schedule)
    results = pools.run(2, "support.cases:executed_actions", schedule, stages, 4, style)
    simulated = results[0]["simulated"]
    assert len(simulated) == 2
    for rank, r in enumerate(results):
        assert r["schedule"] == schedule
        assert r["executed"] == simulated[r["position"]], f"rank {rank} ran another order than the simulated one"
        ops = {a.rstrip("0123456789")[-1] for a in r["executed"]}
        assert "F" in ops and ops & {"B", "I"}, f"rank {rank} ran no backward: {r['executed']}"


@pytest.mark.parametrize("schedule,style", [("1F1B", "loss_fn"), ("Interleaved1F1B", "loss_fn"),
                                            ("ZBVZeroBubble", "loss_fn"), ("GPipe", "outputs")])
def test_gradient_sums_start_during_each_stages_last_backward(pools, schedule, style):
    """As the cost model assumes (`CostModel.exposed_allreduce_s`): with 2 stages x 2 replicas and buckets of
    one parameter's size, every bucket's all-reduce starts while the last backward of its stage runs (its
    gradients are final), and the sums equal one process's gradients."""
    results = pools.run(4, "support.cases:gradient_sums", schedule, style, 1)
    for rank, r in enumerate(results):
        assert not r["far"], f"rank {rank}: gradients differ from one process's: {r['far']}"
        assert len(r["started_during"]) > 2, r
        assert set(r["started_during"]) <= set(r["held"]), f"rank {rank} started sums after the pipeline: {r}"


def test_without_overlap_gradient_sums_start_after_the_pipeline(pools):
    results = pools.run(4, "support.cases:gradient_sums", "1F1B", "loss_fn", 1, "off")
    for r in results:
        assert not r["far"] and r["started_during"] and set(r["started_during"]) == {None}, r


def test_rank_0_says_how_the_measured_step_compares_with_the_estimate(pools):
    """After its warm-up calls, partita times 5 steps and rank 0 says their median against the plan's estimate
    once (beyond 15 % it plans again: torch/test_step_review.py)."""
    results = pools.run(2, "support.cases:step_review")
    (said,) = results[0]["said"]
    assert "the median of 5" in said and f"the plan estimated {seconds(results[0]['estimate_s'])}" in said
    assert results[1]["said"] == []
    # what the caller's own clock saw around the same steps (zero_grad, the call, backward, step)
    measured_s = float(re.search(r"takes ([0-9.]+) ms", said)[1]) / 1e3
    walls = sorted(results[0]["walls_s"][3:])
    assert walls[0] * 0.5 <= measured_s <= walls[-1] * 1.05, (measured_s, walls)
