"""Training across processes equals training in one process (fp32, rtol 1e-5, atol 1e-6)."""

import pytest


TRAINED = ("loss", "grad", "param", "optimizer", "state_dict")  # what every training run compares


def check(results: list[dict], *also: str, expect: tuple[str, ...] = TRAINED) -> dict:
    """Every rank compared every kind of quantity expected (`expect` and `also`), each within tolerance;
    return rank 0's report. A kind never compared fails: a comparison that silently stops happening must
    not pass."""
    for rank, r in enumerate(results):
        missing = sorted(set(expect + also) - set(r["diffs"]))
        assert not missing, f"rank {rank}: nothing of kind {missing} was compared"
        for kind, v in r["diffs"].items():
            assert v["excess"] <= 0, \
                f"rank {rank}: {kind} differs beyond tolerance at {v['worst']} (by {v['excess']:.3g})"
    return results[0]


def returned(style: str) -> tuple[str, ...]:
    """What a run compares beyond TRAINED because of its call style: the outputs, when they come back."""
    return ("output",) if style == "outputs" else ()


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
                        stages=stages, schedule=schedule), *returned(style))
    assert r["plan"][:2] == (stages, world // stages)


ZOO = ["lenet", "forkjoin", "shared_input", "shared_linear", "tied_embedding", "keywords", "embedding", "gpt",
       "hf_gpt2", "hf_bert", "hf_llama"]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_two_stages(pools, name):
    """Each model split in two stages (world 2), trained with the loss computed by partita."""
    r = check(pools.run(2, "support.cases:fidelity", name, stages=2, eval_batch=4), "eval")
    assert r["plan"][0] == 2


@pytest.mark.parametrize("name", ["shared_linear", "tied_embedding", "gpt", "forkjoin"])
def test_zoo_stages_and_replicas(pools, name):
    """Two stages x two replicas (world 4), outputs returned to the caller, SGD with momentum."""
    check(pools.run(4, "support.cases:fidelity", name, stages=2, replicas=2, style="outputs", optimizer="sgd"),
          "output")


def test_batchnorm_buffers_match_one_process(pools):
    """BatchNorm sees the whole batch (one replica, one micro-batch): running stats equal one process's."""
    r = check(pools.run(2, "support.cases:fidelity", "batchnorm", stages=2, replicas=1, micro_batches=1,
                        eval_batch=4), "eval")
    assert r["diffs"]["state_dict"]["checked"] >= 6  # running_mean, running_var, num_batches_tracked x 2


def test_model_that_returns_its_loss(pools):
    check(pools.run(2, "support.cases:fidelity", "loss_out", stages=2, style="outputs", eval_batch=4), "eval")


def test_model_without_parameters(pools):
    """No parameters: the outputs and the input gradients must still match."""
    check(pools.run(2, "support.cases:fidelity", "no_params", stages=2, style="outputs", input_grad=True),
          "output", "input_grad", expect=("loss",))


def test_input_gradients_with_loss_fn(pools):
    check(pools.run(4, "support.cases:fidelity", "mlp", stages=2, replicas=2, input_grad=True), "input_grad")


@pytest.mark.parametrize("style", ["loss_fn", "outputs"])
def test_gradient_accumulation(pools, style):
    """Two forward/backward calls per optimizer step."""
    check(pools.run(4, "support.cases:fidelity", "mlp", stages=2, replicas=2, style=style, accumulate=2),
          *returned(style))


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
