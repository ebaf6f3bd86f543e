"""Training across processes equals training in one process (fp32, rtol 1e-5, atol 1e-6)."""

import pytest


def check(results: list[dict]) -> dict:
    """Every rank's every comparison within tolerance; return rank 0's report."""
    for rank, r in enumerate(results):
        for kind, v in r["diffs"].items():
            assert v["excess"] <= 0, f"rank {rank}: {kind} differs beyond tolerance at {v['worst']} (by {v['excess']:.3g})"
    return results[0]


MATRIX = [  # world, stages, schedule
    (1, 1, None), (2, 1, None), (4, 1, None),
    (2, 2, "GPipe"), (2, 2, "1F1B"),
    (4, 2, "GPipe"), (4, 2, "1F1B"),
    (4, 4, "GPipe"), (4, 4, "1F1B"),
]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
@pytest.mark.parametrize("world,stages,schedule", MATRIX)
def test_mlp_matrix(pools, world, stages, schedule, style, optimizer):
    r = check(pools.run(world, "support.cases:fidelity", "mlp", style=style, optimizer=optimizer,
                        stages=stages, schedule=schedule))
    assert r["plan"][:2] == (stages, world // stages)


ZOO = ["lenet", "forkjoin", "shared_input", "shared_linear", "tied_embedding", "keywords", "embedding", "gpt",
       "hf_gpt2", "hf_bert", "hf_llama"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_two_stages(pools, name):
    """Each model split in two stages (world 2), trained with the loss computed by partita."""
    r = check(pools.run(2, "support.cases:fidelity", name, stages=2, eval_batch=4))
    assert r["plan"][0] == 2


@pytest.mark.parametrize("name", ["shared_linear", "tied_embedding", "gpt", "forkjoin"])
def test_zoo_stages_and_replicas(pools, name):
    """Two stages x two replicas (world 4), outputs returned to the caller, SGD with momentum."""
    check(pools.run(4, "support.cases:fidelity", name, stages=2, replicas=2, style="outputs", optimizer="sgd"))


def test_batchnorm_buffers_match_one_process(pools):
    """BatchNorm sees the whole batch (one replica, one micro-batch): running stats equal one process's."""
    r = check(pools.run(2, "support.cases:fidelity", "batchnorm", stages=2, replicas=1, micro_batches=1,
                        eval_batch=4))
    assert r["diffs"]["state_dict"]["checked"] >= 6  # running_mean, running_var, num_batches_tracked x 2


def test_model_that_returns_its_loss(pools):
    r = check(pools.run(2, "support.cases:fidelity", "loss_out", stages=2, style="outputs", eval_batch=4))
    assert "loss" in r["diffs"]


def test_model_without_parameters(pools):
    """No parameters: the outputs and the input gradients must still match."""
    r = check(pools.run(2, "support.cases:fidelity", "no_params", stages=2, style="outputs", input_grad=True))
    assert r["diffs"]["input_grad"]["checked"] > 0


def test_input_gradients_with_loss_fn(pools):
    r = check(pools.run(4, "support.cases:fidelity", "mlp", stages=2, replicas=2, input_grad=True))
    assert r["diffs"]["input_grad"]["checked"] > 0


@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
def test_gradient_accumulation(pools, style):
    """Two forward/backward calls per optimizer step."""
    check(pools.run(4, "support.cases:fidelity", "mlp", stages=2, replicas=2, style=style, accumulate=2))


def test_state_dict_round_trip_into_another_plan(pools):
    """Model and optimizer state saved under 2 stages x 2 replicas load into a fresh 4-stage run."""
    r = check(pools.run(4, "support.cases:fidelity", "gpt", stages=2, replicas=2, roundtrip={"stages": 4}))
    assert any("after reload" in v["worst"] or v["checked"] for v in r["diffs"].values())


@pytest.mark.parametrize("schedule,stages", [("Interleaved1F1B", 4), ("LoopedBFS", 4),
                                             ("InterleavedZeroBubble", 4), ("ZBVZeroBubble", 4),
                                             ("DualPipeV", 4)])
def test_more_schedules(pools, schedule, stages):
    """Schedules that put two stages on each rank (world 2)."""
    r = check(pools.run(2, "support.cases:fidelity", "mlp", stages=stages, schedule=schedule))
    assert r["plan"][3] == schedule


def test_batchnorm_replicas_keep_one_set_of_statistics(pools):
    """With 2 replicas, eval on every rank uses the statistics state_dict() returns (replica 0's, as DDP)."""
    for r in pools.run(4, "support.cases:batchnorm_replicas", 2):
        assert r["replicas"] == 2 and r["stats_moved"] > 0
        assert r["max_diff"] <= 1e-6, r
