"""Bad input gets the same clear error on every rank, naming the cause and the fix; nothing hangs."""

import pytest


def errors(results, kind):
    for r in results:
        assert r["error"] == kind, r
    return results[0]["message"]


def test_batch_not_divisible_at_first_call(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "indivisible"), "BatchError")
    assert "6 rows" in msg and "4 micro-batches x 2 replicas" in msg and "[1, 2, 3, 6]" in msg


def test_batch_not_divisible_later(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "indivisible_later"), "BatchError")
    assert "4 micro-batches" in msg and "[1, 2, 3, 6]" in msg


@pytest.mark.parametrize("when", ["wrong_device", "wrong_device_later"])
def test_input_on_wrong_device_on_one_rank(pools, when):
    msg = errors(pools.run(2, "support.cases:bad_input", when), "BatchError")
    assert msg.startswith("rank 1:") and "meta" in msg and ".to('cpu')" in msg


def test_more_stages_than_graph_blocks(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "too_many_stages"), "PlanError")
    assert "at most 2 stages" in msg


def test_world_size_not_a_multiple_of_the_plan(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "world_not_multiple"), "PlanError")
    assert "3 stages" in msg and "[1, 2, 4]" in msg


def test_ranks_disagree_on_batch_shape(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "ranks_disagree"), "BatchError")
    assert "disagree" in msg and "(4, 32)" in msg and "(8, 32)" in msg


def test_saved_plan_loads_and_checks(pools, tmp_path):
    path = str(tmp_path / "plan.json")
    saved = pools.run(2, "support.cases:bad_input", "save_plan", path)[0]["plan"]
    # the fidelity tests plan from estimates; this plan is the one made from costs measured across ranks
    assert saved["estimate"]["profile"].startswith("measured"), saved["estimate"]
    used = pools.run(2, "support.cases:bad_input", "use_plan", path)
    assert all(r["plan"] == saved for r in used)
    msg = errors(pools.run(2, "support.cases:bad_input", "plan_for_other_model", path), "PlanError")
    assert "another model" in msg
    msg = errors(pools.run(4, "support.cases:bad_input", "use_plan", path), "PlanError")
    assert "for 2 ranks but this job has 4" in msg
