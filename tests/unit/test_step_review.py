"""A step measured against the plan's estimate: said, and beyond 15 % the plan reviewed with partita's cost per
step refitted to the measured step (planning.review_step)."""

import logging

from partita.plan import Constraints, choose_plan
from partita.planning import Planned, PlanRequest, review_step
from test_sharding_prices import cluster, graph_of


def test_a_step_near_its_estimate_is_said_and_one_far_from_it_reviews_the_plan():
    graph, profile = graph_of([1] * 8)
    c = cluster(2, 10**4)
    request = PlanRequest(Constraints(sharding="none"), None, 1)
    plan = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1, constraints=request.constraints)
    assert plan.runs_under_ddp
    planned, estimate = Planned(plan, profile, c), plan.estimate.step_s
    level, text = review_step(planned, graph, request, estimate * 1.1)
    assert level == logging.INFO and "(+10%)" in text and "Planned again" not in text
    # DDP's cost per step refitted to 30 times the estimate: pipelining the 8 blocks over the 2 ranks wins
    level, text = review_step(planned, graph, request, estimate * 30)
    assert level == logging.WARNING and "another layout is faster: stages=2" in text
    assert "this one: stages=1, micro_batches=1" in text
    # where the caller fixed the layout, it stays
    fixed = PlanRequest(Constraints(stages=1, micro_batches=1, sharding="none"), None, 1)
    level, text = review_step(planned, graph, fixed, estimate * 30)
    assert level == logging.WARNING and "this layout stays the fastest" in text


def test_a_plan_given_has_no_measurements_to_plan_again_with():
    graph, profile = graph_of([1] * 4)
    c = cluster(2, 10**4)
    plan = choose_plan(graph, profile, c, global_batch=16, optimizer_factor=1)
    level, text = review_step(Planned(plan, None, None), graph, PlanRequest(Constraints(), plan, 1),
                              plan.estimate.step_s * 2)
    assert level == logging.WARNING and "no measurements to plan again with" in text
