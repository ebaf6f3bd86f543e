"""Each rank builds and holds only its part of the model, whichever way the model comes: built on the CPU, on
the meta device, or read from a weight file. Training then equals one process (fp32, rtol 1e-5), and a meta
model's initial values equal the CPU-built model's bit for bit."""

import pytest

from test_bad_input import errors
from test_fidelity import check, fidelity

LAYOUTS = [(2, 1, None, 1), (2, 2, "1F1B", 4), (4, 2, "GPipe", 2)]  # world, stages, schedule, micro-batches
# BatchNorm sees the whole batch only with one replica and one micro-batch
META_CASES = [(name, *layout) for name in ("mlp", "tied_embedding") for layout in LAYOUTS] + [
    ("batchnorm", 2, 2, None, 1)]


@pytest.mark.parametrize("name,world,stages,schedule,micro_batches", META_CASES)
def test_built_on_the_meta_device(pools, name, world, stages, schedule, micro_batches):
    results = pools.run(world, "support.cases:fidelity", name, build="meta", stages=stages, schedule=schedule,
                        micro_batches=micro_batches)
    check(results, "initial")
    # under a pipeline no rank holds the whole model, and together the ranks hold all of it
    held = [set(r["held"]) for r in results]
    every = set().union(*held)
    if stages > 1:
        assert all(h < every for h in held), f"a rank holds the whole model: {held}"
    else:  # torch's DDP keeps every parameter on every rank
        assert all(h == every for h in held)


@pytest.mark.parametrize("name", ["mlp", "tied_embedding"])
def test_built_on_the_meta_device_with_an_init_fn(pools, name):
    """init_fn= runs as model.apply(init_fn) runs it after building on the CPU (children first, in their order;
    a tied weight takes the last write), a parent's init writing its child's weight included: the initial
    values equal that model's bit for bit, though no rank holds the whole model."""
    results = pools.run(2, "support.cases:fidelity", name, build="meta", init_fn="scaled_normal", stages=2,
                        schedule="1F1B", micro_batches=4)
    check(results, "initial")
    held = [set(r["held"]) for r in results]
    assert all(h < set().union(*held) for h in held), f"a rank holds the whole model: {held}"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("build", ["cpu", "meta"])
def test_weights_from_a_file(pools, tmp_path, suffix, build):
    r = fidelity(pools, 2, "tied_embedding", "initial", build=build, weights=str(tmp_path / f"w{suffix}"),
                 stages=2, micro_batches=2)
    assert r["plan"][0] == 2


def test_meta_module_that_nothing_initializes(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "meta_without_init"), "ModelError")
    assert "'1' (_Scale)" in msg and "init_fn=" in msg and "reset_parameters()" in msg


def test_model_on_the_meta_device_on_one_rank_only(pools):
    msg = errors(pools.run(2, "support.cases:bad_input", "meta_on_one_rank"), "ModelError")
    assert "built the model differently" in msg and "torch.device('meta')" in msg


def test_weights_missing_a_tensor(pools, tmp_path):
    msg = errors(pools.run(2, "support.cases:bad_input", "weights_missing", str(tmp_path / "w.pt")),
                 "CheckpointError")
    assert "does not fit this model" in msg and "layers.1.bias" in msg


@pytest.mark.parametrize("world,stages,micro_batches", [(1, 1, 1), (2, 2, 2)])
@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_bert"])
def test_hugging_face_model_on_the_meta_device_with_its_own_init(pools, name, world, stages, micro_batches):
    """init_fn=model._init_weights initializes what reset_parameters() does not (Llama's rotary frequencies,
    GPT-2's Conv1D) and what a parent initializes in its children (GPT-2 scales its c_proj weights from the
    attention and MLP blocks), in the order Hugging Face builds the model: every rank holds its part only, with
    the values of the model built on the CPU from the same seed, bit for bit, and training it gives the losses
    that training the CPU-built model gives."""
    results = pools.run(world, "support.cases:hf_on_meta", name, stages=stages, micro_batches=micro_batches)
    for rank, r in enumerate(results):
        assert not r["differ"], f"rank {rank}: initial values unlike the CPU-built model's: {r['differ']}"
        assert r["losses"] == r["cpu_losses"], f"rank {rank}: {r['losses']} vs the CPU-built {r['cpu_losses']}"
        assert r["losses"] == results[0]["losses"] and r["finite"]
    held, every = [set(r["held"]) for r in results], set(results[0]["every"])
    assert set().union(*held) == every
    assert all(h < every for h in held) if stages > 1 else held == [every]
