"""Bad input gets the same clear error on every rank, naming the cause and the fix; nothing hangs."""

import re

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


@pytest.mark.parametrize("layout", ["", "_data_parallel", "_retried", "_retried_data_parallel"])
def test_a_loss_whose_values_contradict_its_reduction(pools, layout):
    """A loss that says it averages but sums would make partita's combination of micro-batches and ranks off by
    their number: the first call's values show it, and every rank stops with what to set; again if the caller
    catches the error and calls once more."""
    msg = errors(pools.run(2, "support.cases:bad_input", "loss_says_mean_but_sums" + layout), "PlanError")
    assert "reduction='mean', but its values are a sum over the batch's rows" in msg
    assert "Set loss_fn.reduction = 'sum'" in msg


@pytest.mark.parametrize("when", ["wrong_device", "wrong_device_later"])
def test_input_on_wrong_device_on_one_rank(pools, when):
    msg = errors(pools.run(2, "support.cases:bad_input", when), "BatchError")
    assert msg.startswith("rank 1:") and "meta" in msg and ".to('cpu')" in msg


def test_backward_through_a_call_whose_activations_a_later_call_replaced(pools):
    """Without loss_fn a pipelined plan keeps one call's activations: backward through an earlier call's
    outputs would have run on the later call's, silently; it is refused on every rank, with the fixes."""
    msg = errors(pools.run(2, "support.cases:bad_input", "two_calls_then_the_first_ones_backward"), "PartitaError")
    assert "followed by another call before this backward" in msg and "pass loss_fn=" in msg


def test_more_stages_than_graph_blocks(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "too_many_stages"), "PlanError")
    assert "at most 2 stages" in msg


def test_world_size_not_a_multiple_of_the_plan(pools):
    msg = errors(pools.run(4, "support.cases:bad_input", "world_not_multiple"), "PlanError")
    assert "3 stages" in msg and "[1, 2, 4]" in msg


def test_ranks_disagree_on_batch_size_in_a_pipeline(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "ranks_disagree"), "BatchError")
    assert "batches of different sizes (rank 0: 8, rank 1: 4 rows)" in msg and "pipelines the model" in msg
    assert "DistributedSampler" in msg
    assert "(stages=1, micro_batches=1, sharding=\"none\" or \"optimizer\") weighs" in msg


def test_ranks_disagree_under_data_parallel_without_a_loss_to_sum(pools):
    """The ranks agree on a call while DDP's forward runs; a call with no loss to sum over the ranks waits for
    that agreement all the same, before its backward's collectives."""
    msg = errors(pools.run(2, "support.cases:bad_input", "structure_disagrees_data_parallel"), "BatchError")
    assert "ranks disagree on their inputs" in msg and "True" in msg and "False" in msg


def test_sequence_lengths_may_differ_between_ranks_under_data_parallel(pools):
    first, second = pools.run(2, "support.cases:bad_input", "sequence_lengths_differ")
    assert first["error"] is None and first["loss"] == second["loss"]


def test_sequence_lengths_that_differ_under_a_sharded_layout_say_why_and_what_to_do(pools):
    """Data parallelism under an FSDP level runs as a pipeline: the error says that this plan needs the same
    sizes, and names the layout where they may differ."""
    msg = errors(pools.run(2, "support.cases:bad_input", "sequence_lengths_differ_sharded"), "BatchError")
    assert "ranks disagree on their inputs" in msg and "(5, 32)" in msg and "(7, 32)" in msg
    assert "This plan also needs the same sizes beyond the batch dimension" in msg and 'sharding="none"' in msg


def test_ranks_disagree_on_features(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "features_disagree"), "BatchError")
    assert "ranks disagree on their inputs" in msg and "(32,)" in msg and "(16,)" in msg


@pytest.mark.parametrize("scenario", ["float64", "float64_later"])
def test_input_of_another_dtype_than_the_model(pools, scenario):
    msg = errors(pools.run(2, "support.cases:bad_input", scenario), "BatchError")
    assert "input tensor #0 (shape (8, 32)) is torch.float64, but the model computes it in torch.float32" in msg
    assert "aten.linear in module" in msg and "x.float()" in msg


def test_capture_failing_on_one_rank_stops_every_rank_with_its_error(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "capture_fails_on_one_rank"), "CaptureError")
    assert msg.startswith("rank 1: ") and "ValueError: bad data on rank 1" in msg


@pytest.mark.parametrize("asked_on", [[], [0], [1], [0, 1]])
def test_a_stop_asked_on_some_ranks_stops_every_rank(pools, asked_on):
    """partita.elastic's check between steps (signals may reach only some ranks): every rank decides the same."""
    assert pools.run(2, "support.cases:stop_asked", asked_on) == [{"stop": bool(asked_on)}] * 2


@pytest.mark.parametrize("stages", [1, 2])
def test_a_rank_that_stops_early_ends_the_next_call_of_the_others(pools, stages):
    first, second = pools.run(2, "support.cases:bad_input", "one_rank_stops_early", str(stages))
    assert second == {"error": None, "all_left": False}  # the rank that left knows, and skips the barrier
    assert first["error"] == "PartitaError"
    # counts are the pool process's, over every case it ran: rank 0 is one call ahead of rank 1
    found = re.search(r"partita.shutdown\(\) was called on rank 1 after (\d+) calls of the model, while rank 0 "
                      r"made call (\d+)", first["message"])
    assert found and int(found[2]) == int(found[1]) + 1, first["message"]


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


def test_profiling_failing_on_one_rank_stops_every_rank_with_its_error(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "profiling_fails_on_one_rank"), "PartitaError")
    assert msg.startswith("rank 1 failed while measuring the model's blocks") and "RuntimeError: injected fault" in msg
