"""A step measured against the plan's estimate: said, and beyond 15 % the plan reviewed with partita's cost per
step refitted to the measured step (planning.review_step)."""

import dataclasses
import logging
import re

from partita.plan import Constraints, choose_plan
from partita.planning import OFF_BY, SWITCH_GAIN, UNDO_LOSS, Planned, PlanRequest, review_step, review_switch
from test_sharding_prices import cluster, graph_of


def test_a_step_near_its_estimate_is_said_and_one_far_from_it_reviews_the_plan():
    graph, profile = graph_of([1] * 8)
    c = cluster(2, 10**4)
    request = PlanRequest(Constraints(sharding="none"), None, 1)
    plan = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1, constraints=request.constraints)
    assert plan.runs_under_ddp
    planned, estimate = Planned(plan, profile, c), plan.estimate.step_s
    review = review_step(planned, graph, request, estimate * 1.1)
    assert review.level == logging.INFO and "(+10%)" in review.text and "Planned again" not in review.text
    assert review.faster is None
    # DDP's cost per step refitted to 30 times the estimate: pipelining the 8 blocks over the 2 ranks wins, by
    # far enough to switch to it
    review = review_step(planned, graph, request, estimate * 30)
    assert review.level == logging.WARNING and "another layout is faster: stages=2" in review.text
    assert "this one: stages=1, micro_batches=1" in review.text
    assert review.faster.plan.num_stages == 2 and review.faster.profile is profile
    assert review.faster.cluster.step_overhead_s(False) > c.step_overhead_s(False)
    # where the caller fixed the layout, it stays
    fixed = PlanRequest(Constraints(stages=1, micro_batches=1, sharding="none"), None, 1)
    review = review_step(planned, graph, fixed, estimate * 30)
    assert review.level == logging.WARNING and "this layout stays the fastest" in review.text
    assert review.faster is None


def test_a_faster_layout_is_switched_to_only_when_it_gains_enough():
    """Measured just beyond OFF_BY, pipelining wins by less than SWITCH_GAIN: said, not switched to."""
    graph, profile = graph_of([1] * 8)
    c = cluster(2, 10**4)
    request = PlanRequest(Constraints(sharding="none"), None, 1)
    plan = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1, constraints=request.constraints)
    planned = Planned(plan, profile, c)
    little = review_step(planned, graph, request, plan.estimate.step_s * (1 + OFF_BY + 0.005))
    assert "another layout is faster: stages=2" in little.text and little.faster is None
    assert re.search(r"per step, [0-9]% less .*too little to pay for switching. This job keeps its layout",
                     little.text), little.text
    enough = review_step(planned, graph, request, plan.estimate.step_s * 1.3)
    gain = 1 - enough.faster.plan.estimate.step_s / (plan.estimate.step_s * 1.3)
    assert gain >= SWITCH_GAIN and "too little" not in enough.text


def test_a_plan_given_has_no_measurements_to_plan_again_with():
    graph, profile = graph_of([1] * 4)
    c = cluster(2, 10**4)
    plan = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1)
    review = review_step(Planned(plan, None, None), graph, PlanRequest(Constraints(), plan, 1),
                         plan.estimate.step_s * 2)
    assert review.level == logging.WARNING and "no measurements to plan again with" in review.text
    assert review.faster is None


def test_a_switch_that_made_the_steps_slower_is_undone():
    graph, profile = graph_of([1] * 8)
    c = cluster(2, 10**4)
    before = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1,
                         constraints=Constraints(stages=1, sharding="none"))
    now = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1,
                      constraints=Constraints(stages=2, sharding="none"))
    planned = Planned(before, profile, c)
    kept = review_switch(planned, 0.2, now, 0.15)
    assert kept.faster is None and kept.level == logging.INFO
    assert kept.text == ("after switching layouts a training step takes 150 ms, 200 ms before (-25%): this job keeps "
                         f"the layout it switched to (stages=2, micro_batches={now.micro_batches}, "
                         f"schedule={now.schedule!r}, sharding='none')")
    undone = review_switch(planned, 0.2, now, 0.2 * (1 + UNDO_LOSS) + 3e-3)
    assert undone.faster is planned and undone.level == logging.WARNING
    assert "(+6%): the layout before is faster (stages=1, micro_batches=1" in undone.text, undone.text
    noise = review_switch(planned, 0.2, now, 0.2 * (1 + UNDO_LOSS) - 1e-3)  # no slower beyond noise: no switch back
    assert noise.faster is None and noise.level == logging.INFO
    assert "(+4%), as fast as before within the measurements' noise (5%): this job keeps the layout it switched to" \
        in noise.text, noise.text


def test_a_plan_given_without_an_estimate_is_only_said():
    """A plan made or edited by hand may hold no estimate: the measured step is said, nothing reviewed (it once
    raised an InternalError on every rank at the call that completed the measurement)."""
    graph, profile = graph_of([1] * 4)
    plan = dataclasses.replace(choose_plan(graph, profile, cluster(2, 10**4), global_batch=16, optimizer_factor=1),
                               estimate=None)
    review = review_step(Planned(plan, None, None), graph, PlanRequest(Constraints(), plan, 1), 0.25)
    assert review.level == logging.INFO and review.faster is None
    assert review.text.endswith("250 ms (the median of 5, from a call of the model to the end of its backward or "
                                "optimizer step); the plan given holds no estimate to compare it with"), review.text
