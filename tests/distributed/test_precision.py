"""Mixed precision: partita computing in bfloat16 (torch.autocast, float32 master weights) against one process
running the same model under torch.autocast, across 1, 2 and 4 stages."""

import pytest

LAYOUTS = [(1, 4, 1), (2, 2, 2), (4, 1, 4)]  # stages, replicas, micro-batches
# Relative difference allowed between partita's losses and the single process's under autocast: half of
# bfloat16's unit roundoff (2^-8). The two compute the same ops in the same dtypes, except that partita keeps a
# value crossing a stage boundary in float32 (as captured) where the single process rounds it to bfloat16 at
# the next op it feeds: at most one such rounding per value, averaged over the loss's terms. Seen here: 5e-6.
TOLERANCE = 2e-3


@pytest.mark.parametrize("stages,replicas,micro_batches", LAYOUTS)
def test_bf16_losses_follow_one_process_under_autocast(pools, stages, replicas, micro_batches):
    results = pools.run(4, "support.cases:precision_losses", "gpt", "bf16", stages=stages, replicas=replicas,
                        micro_batches=micro_batches)
    r = results[0]
    assert r["plan"][:3] == (stages, replicas, micro_batches) and r["precision"] == "bf16"
    assert all(x["partita"] == r["partita"] for x in results), "ranks disagree on the global loss"
    ours = [float.fromhex(v) for v in r["partita"]]
    for step, (got, want, fp32) in enumerate(zip(ours, r["autocast"], r["fp32"])):
        print(f"step {step}: partita {got:.6f}, one process under autocast {want:.6f}, in float32 {fp32:.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, r["autocast"]))
    assert worst <= TOLERANCE, f"losses differ by {worst:.2e} of the reference's"
    # and bf16 is what ran: partita is much closer to the one process under autocast than to float32
    assert 2 * sum(abs(a - b) for a, b in zip(ours, r["autocast"])) < sum(abs(a - b) for a, b in zip(ours, r["fp32"]))


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (2, 2)])  # DDP; a pipeline
def test_the_loss_runs_under_autocast_on_the_outputs_as_computed(pools, stages, micro_batches):
    """As in a one-process loop under torch.autocast: cross entropy reads the bfloat16 logits (read as float32
    copies, the H200 spent 2 ms more of a 41 ms GPT-2 step); outputs returned to the user are float32, as
    captured. The first call's check of how the loss combines rows (batch.rows_combination) reads them as well,
    without gradients, once per half of the batch it compares with the whole."""
    results = pools.run(2, "support.cases:what_the_loss_sees", "bf16", stages=stages, replicas=2 // stages,
                        micro_batches=micro_batches)
    for rank, r in enumerate(results):
        assert r["plan"][:3] == (stages, 2 // stages, micro_batches), r["plan"]
        computes_loss = stages == 1 or rank == 1  # the last stage's rank
        training = [(dtype, autocast) for dtype, autocast, grad in r["seen"] if grad]
        assert training == ([("torch.bfloat16", True)] * micro_batches if computes_loss else []), (rank, r)
        checking = [(dtype, autocast) for dtype, autocast, grad in r["seen"] if not grad]
        assert checking == ([("torch.bfloat16", True)] * 2 if computes_loss else []), (rank, r)
        assert r["outputs"] == "torch.float32", (rank, r)


@pytest.mark.parametrize("stages,replicas,micro_batches", [(1, 2, 1), (2, 1, 2)])
def test_fp16_losses_follow_one_process_with_torchs_loss_scaling(pools, stages, replicas, micro_batches):
    """float16 under autocast with partita's loss scaling against one process with torch.amp.GradScaler. Same
    tolerance argument as bf16, with float16's unit roundoff (2^-11): half of it."""
    results = pools.run(2, "support.cases:precision_losses", "gpt", "fp16", stages=stages, replicas=replicas,
                        micro_batches=micro_batches)
    r = results[0]
    assert r["plan"][:3] == (stages, replicas, micro_batches) and r["precision"] == "fp16"
    assert all(x["partita"] == r["partita"] for x in results)
    ours = [float.fromhex(v) for v in r["partita"]]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, r["autocast"]))
    assert worst <= 2.0 ** -12, f"losses differ by {worst:.2e} of the reference's"


@pytest.mark.parametrize("sharding", ["none", "optimizer"])
def test_fp16_gradients_read_unscaled_on_every_rank(pools, sharding):
    """get_param_grad and clip_grad_norm_ see the gradients of the loss itself, also of parameters whose
    optimizer state the other replica keeps (ZeRO-1), against one process with torch.amp.GradScaler."""
    for r in pools.run(2, "support.cases:fp16_gradients", stages=1, replicas=2, micro_batches=2,
                       sharding=sharding):
        assert r["plan"][:3] == (1, 2, 2) and r["sharding"] == [sharding], r
        _check_fp16_gradients(r)


@pytest.mark.parametrize("stages,replicas,micro_batches,sharding",
                         [(1, 2, 1, "none"), (2, 1, 2, "none"), (1, 2, 2, "gradients")])  # DDP, a pipeline, FSDP
def test_fp16_gradients_read_between_accumulating_backwards(pools, stages, replicas, micro_batches, sharding):
    """Gradients read (get_param_grad, clip_grad_norm_) after the first of two backwards that accumulate before
    one step: the second still adds onto gradients of the same scale, and the step divides them once, as one
    process with torch.amp.GradScaler that reads nothing in between."""
    for r in pools.run(2, "support.cases:fp16_gradients", calls=2, stages=stages, replicas=replicas,
                       micro_batches=micro_batches, sharding=sharding):
        assert r["plan"][:3] == (stages, replicas, micro_batches) and set(r["sharding"]) == {sharding}, r
        _check_fp16_gradients(r)


def _check_fp16_gradients(r: dict) -> None:
    worst = max(r["differences"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-2, worst
    for norm, want in r["norms"]:
        assert abs(norm - want) <= 1e-2 * want, (norm, want)


@pytest.mark.parametrize("stages", [1, 2])
def test_fp16_overflow_skips_the_step_on_every_rank(pools, stages):
    """A forced overflow everywhere (loss scale 2^60), then one in a gradient only rank 1 holds: each time every
    rank skips the step; at a sane scale the next step trains."""
    for r in pools.run(2, "support.cases:fp16_overflow", stages=stages):
        assert r["kept_after_overflow"] and r["scale_after_overflow"] == 2.0 ** 59, r
        assert r["kept_after_one_rank_overflowed"], r
        assert r["grads_finite"] and r["moved_after"], r


def test_fp16_without_the_optimizer_is_refused(pools):
    from test_bad_input import errors

    msg = errors(pools.run(2, "support.cases:bad_input", "fp16_without_optimizer"), "PlanError")
    assert "precision='fp16' needs the optimizer passed to parallelize" in msg


def test_a_plan_given_in_another_precision_is_refused(pools, tmp_path):
    from test_bad_input import errors

    path = str(tmp_path / "plan.json")
    pools.run(2, "support.cases:bad_input", "save_plan", path)  # an fp32 plan
    msg = errors(pools.run(2, "support.cases:bad_input", "plan_in_other_precision", path), "PlanError")
    assert "the plan given computes in fp32, but parallelize was asked for precision='bf16'" in msg
