"""Weight files for `parallelize(..., weights=PATH)`, in one process: every format partita reads, reading a
subset, tied weights, dtype conversion, and the errors for files that do not fit the model."""

from __future__ import annotations

import json
import re
import sys
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import partita
from partita.checkpoint.weights import TensorInfo, match_weights, open_weights
from partita.errors import CheckpointError


class Net(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.norm = nn.BatchNorm1d(d)
        self.out = nn.Linear(d, 3)


class Tied(nn.Module):
    def __init__(self, vocab=20, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight


def trained_net() -> Net:
    """A Net whose every tensor differs from a fresh one's (BatchNorm's running statistics included)."""
    torch.manual_seed(0)
    net = Net()
    for t in net.state_dict().values():
        t.add_(torch.randn_like(t) if t.is_floating_point() else 3)
    return net


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def load_into(model: nn.Module, path, strict: bool = True) -> None:
    """What the runtime does with weights=: match the names, read every tensor, copy it in."""
    weights = open_weights(path)
    state = model.state_dict(keep_vars=True)
    sources = match_weights(weights, state, strict=strict)
    tensors = weights.read({sources[n]: state[n].dtype for n in state}, "cpu")
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(tensors[sources[name]])


def assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# --- formats ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", [lambda s: s, lambda s: {"model": s, "optimizer": {"state": {}}, "step": 3},
                                  lambda s: {"state_dict": s, "epoch": 1}], ids=["plain", "model", "state_dict"])
def test_torch_save_file(tmp_path, wrap):
    net = trained_net()
    torch.save(wrap(net.state_dict()), tmp_path / "w.pt")
    weights = open_weights(tmp_path / "w.pt")
    assert weights.infos() == {n: TensorInfo.of(t) for n, t in net.state_dict().items()}
    fresh = Net()
    load_into(fresh, tmp_path / "w.pt")
    assert_same(fresh, state_of(net))


def test_read_returns_exactly_the_named_tensors_converted_to_the_dtype_asked(tmp_path):
    net = trained_net()
    save_file(net.state_dict(), tmp_path / "w.safetensors")
    got = open_weights(tmp_path / "w.safetensors").read({"out.weight": torch.float64, "norm.running_mean": torch.float32})
    assert list(got) == ["out.weight", "norm.running_mean"]
    assert got["out.weight"].dtype == torch.float64
    assert torch.equal(got["out.weight"], net.out.weight.detach().double())
    assert torch.equal(got["norm.running_mean"], net.norm.running_mean)


def test_read_gives_tensors_that_own_their_memory(tmp_path):
    net = trained_net()
    torch.save(net.state_dict(), tmp_path / "w.pt")
    weights = open_weights(tmp_path / "w.pt")
    first = weights.read({"inp.bias": torch.float32})["inp.bias"]
    first.zero_()  # a view into the memory-mapped file would change what the next read returns
    assert torch.equal(weights.read({"inp.bias": torch.float32})["inp.bias"], net.inp.bias.detach())


def test_safetensors_file_and_folder_of_one_file(tmp_path):
    net = trained_net()
    save_file(net.state_dict(), tmp_path / "model.safetensors")
    for path in (tmp_path / "model.safetensors", tmp_path):
        fresh = Net()
        load_into(fresh, path)
        assert_same(fresh, state_of(net))


def test_folder_with_a_pytorch_model_bin(tmp_path):
    net = trained_net()
    torch.save(net.state_dict(), tmp_path / "pytorch_model.bin")
    fresh = Net()
    load_into(fresh, tmp_path)
    assert_same(fresh, state_of(net))


def test_safetensors_of_another_dtype_is_converted_to_the_models(tmp_path):
    net = trained_net()
    save_file({n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in net.state_dict().items()},
              tmp_path / "w.safetensors")
    assert open_weights(tmp_path / "w.safetensors").infos()["out.weight"].dtype == torch.bfloat16
    fresh = Net()
    load_into(fresh, tmp_path / "w.safetensors")
    assert fresh.out.weight.dtype == torch.float32
    assert torch.equal(fresh.out.weight, net.out.weight.detach().to(torch.bfloat16).float())


def test_hugging_face_sharded_folder_with_a_tied_weight(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    saved = transformers.GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=True)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and "lm_head.weight" not in index["weight_map"]
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(config)
    load_into(fresh, tmp_path)  # lm_head.weight is transformer.wte.weight, which the file holds
    assert_same(fresh, state_of(saved))


def test_hand_written_indexes_of_safetensors_and_torch_shards(tmp_path):
    net = trained_net()
    state = net.state_dict()
    first = {n: t for n, t in state.items() if n.startswith("inp.")}
    rest = {n: t for n, t in state.items() if n not in first}
    for folder, save, suffix, index in [(tmp_path / "st", save_file, "safetensors", "model.safetensors.index.json"),
                                        (tmp_path / "pt", torch.save, "bin", "pytorch_model.bin.index.json")]:
        folder.mkdir()
        save(first, folder / f"a.{suffix}")
        save(rest, folder / f"b.{suffix}")
        weight_map = {n: f"a.{suffix}" if n in first else f"b.{suffix}" for n in state}
        (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        weights = open_weights(folder)
        assert weights.infos() == {n: TensorInfo.of(t) for n, t in state.items()}
        assert torch.equal(weights.read({"out.bias": torch.float32})["out.bias"], net.out.bias.detach())
        fresh = Net()
        load_into(fresh, folder)
        assert_same(fresh, state_of(net))


def test_partita_checkpoint_root_or_step_dir_gives_the_model_tensors_only(tmp_path):
    net = trained_net()
    opt = torch.optim.Adam(net.parameters())
    partita.save(net, opt, tmp_path, step=1)
    with torch.no_grad():
        net.out.bias.add_(1)
    step_dir = partita.save(net, opt, tmp_path, step=2)
    for path, expected in ((tmp_path, state_of(net)), (step_dir, state_of(net))):
        weights = open_weights(path)
        assert weights.infos() == {n: TensorInfo.of(t) for n, t in net.state_dict().items()}  # no optimizer state
        fresh = Net()
        load_into(fresh, path)
        assert_same(fresh, expected)
    older = open_weights(tmp_path / "step-000001").read({"out.bias": torch.float32})["out.bias"]
    assert torch.equal(older + 1, net.out.bias.detach())


def test_partita_checkpoint_with_tied_weights(tmp_path):
    torch.manual_seed(0)
    tied = Tied()
    partita.save(tied, None, tmp_path, step=1)
    fresh = Tied()
    load_into(fresh, tmp_path)
    assert torch.equal(fresh.head.weight, tied.emb.weight) and fresh.head.weight is fresh.emb.weight


def test_damaged_partita_checkpoint_is_refused_before_it_is_read(tmp_path):
    step_dir = partita.save(trained_net(), None, tmp_path, step=1)
    data = next(p for p in tmp_path.joinpath(step_dir).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"damaged: its file {data.name} changed after it was saved"):
        open_weights(tmp_path).read({"out.bias": torch.float32})


# --- names that do not fit ---------------------------------------------------------------------------------------

def saved(tmp_path, state: dict[str, torch.Tensor]):
    save_file(state, tmp_path / "w.safetensors")
    return open_weights(tmp_path / "w.safetensors")


def test_missing_tensors_are_named(tmp_path):
    state = Net().state_dict()
    weights = saved(tmp_path, {n: t for n, t in state.items() if not n.startswith("norm.")})
    with pytest.raises(CheckpointError, match=r"does not fit this model: 5 of the model's tensors are not in it "
                                              r"\(norm\.weight, norm\.bias, norm\.running_mean, norm\.running_var, "
                                              r"norm\.num_batches_tracked\)\. Pass the weights saved from this model"):
        match_weights(weights, Net().state_dict(keep_vars=True), strict=False)


def test_a_missing_tied_weight_names_both_its_names(tmp_path):
    weights = saved(tmp_path, {"other": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"1 of the model's tensors are not in it \(emb\.weight or head\.weight\)"):
        match_weights(weights, Tied().state_dict(keep_vars=True), strict=False)


def test_extra_tensors_are_an_error_only_when_strict(tmp_path):
    model = Net()
    weights = saved(tmp_path, {**model.state_dict(), "head.weight": torch.zeros(2), "head.bias": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"2 of its tensors are not in the model \(head\.bias, head\.weight\); "
                                              r"pass strict=False to ignore"):
        match_weights(weights, model.state_dict(keep_vars=True), strict=True)
    sources = match_weights(weights, model.state_dict(keep_vars=True), strict=False)
    assert sources == {n: n for n in model.state_dict()}


def test_mis_shaped_tensors_are_named_with_both_shapes(tmp_path):
    weights = saved(tmp_path, {**Net().state_dict(), "out.weight": torch.zeros(3, 9)})
    with pytest.raises(CheckpointError, match=re.escape("1 has another shape: out.weight ([3, 9] in the file, "
                                                        "[3, 8] in the model)")):
        match_weights(weights, Net().state_dict(keep_vars=True), strict=True)


def test_many_names_are_cut_short(tmp_path):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(5)])
    weights = saved(tmp_path, {"x": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"10 of the model's tensors are not in it \(0\.weight, 0\.bias, "
                                              r"1\.weight, 1\.bias, 2\.weight and 5 more\)"):
        match_weights(weights, model.state_dict(keep_vars=True), strict=False)


def test_a_prefix_on_the_files_names_is_pointed_out(tmp_path):
    model = Net()
    weights = saved(tmp_path, {"transformer." + n: t for n, t in model.state_dict().items()})
    with pytest.raises(CheckpointError, match=r"The file's names start with 'transformer\.' where the model's do not "
                                              r"\(e\.g\. transformer\.inp\.weight for inp\.weight\).*"
                                              r"k\.removeprefix\('transformer\.'\)"):
        match_weights(weights, model.state_dict(keep_vars=True), strict=False)


def test_a_prefix_on_the_models_names_is_pointed_out_tied_weights_too(tmp_path):
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Tied()

    wrapper = Wrapper()
    weights = saved(tmp_path, {"emb.weight": wrapper.model.emb.weight.detach().clone()})  # a tied weight saved once
    with pytest.raises(CheckpointError, match=r"The model's names start with 'model\.' where the file's do not.*"
                                              r"pass the module it holds as 'model'"):
        match_weights(weights, wrapper.state_dict(keep_vars=True), strict=True)


def test_no_prefix_hint_when_the_names_differ_otherwise(tmp_path):
    model = Net()
    weights = saved(tmp_path, {"transformer.inp.weight": model.inp.weight.detach(), "unrelated": torch.zeros(1)})
    with pytest.raises(CheckpointError) as raised:
        match_weights(weights, model.state_dict(keep_vars=True), strict=False)
    assert "names start with" not in str(raised.value) and "Pass the weights saved from this model" in str(raised.value)


def test_reading_a_name_the_file_lacks_is_an_error(tmp_path):
    weights = saved(tmp_path, Net().state_dict())
    with pytest.raises(CheckpointError, match=r"holds no tensor named nothing"):
        weights.read({"nothing": torch.float32})


# --- paths that are not weights ----------------------------------------------------------------------------------

def test_a_path_that_does_not_exist(tmp_path):
    with pytest.raises(CheckpointError, match=r"the path does not exist\. Pass a torch\.save file, a safetensors"):
        open_weights(tmp_path / "nothing.pt")


def test_a_file_of_another_format(tmp_path):
    (tmp_path / "w.txt").write_text("not weights")
    with pytest.raises(CheckpointError, match=r"neither a torch\.save file nor a safetensors file"):
        open_weights(tmp_path / "w.txt")


def test_a_damaged_safetensors_file(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(CheckpointError, match=r"is not a readable safetensors file"):
        open_weights(tmp_path / "w.safetensors").infos()


def test_safetensors_without_the_package_says_how_to_install_it(tmp_path, monkeypatch):
    save_file({"a": torch.zeros(1)}, tmp_path / "w.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors raises ImportError
    with pytest.raises(CheckpointError, match=r"no safetensors package to read it: pip install safetensors"):
        open_weights(tmp_path / "w.safetensors").infos()


def test_a_torch_save_file_that_holds_no_state_dict(tmp_path):
    torch.save({"epoch": 3, "config": {"lr": 0.1}}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"holds a dict with entries 'epoch', 'config', not a state dict"):
        open_weights(tmp_path / "a.pt").infos()
    torch.save([torch.zeros(1)], tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"holds a list, not a state dict"):
        open_weights(tmp_path / "b.pt").infos()


class Pickled:
    pass


def test_a_torch_save_file_with_code_is_refused(tmp_path):
    torch.save({"w": torch.zeros(1), "obj": Pickled()}, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=r"cannot read .* as weights \(UnpicklingError.*never runs code") as raised:
        open_weights(tmp_path / "w.pt").infos()
    assert "weights_only" not in str(raised.value)


def test_folders_that_hold_no_weights_partita_reads(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds no weights partita reads\. Pass a file"):
        open_weights(tmp_path)
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    save_file({"b": torch.zeros(1)}, tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"holds 2 \.safetensors files and no index"):
        open_weights(tmp_path)


def test_a_shard_index_naming_a_missing_shard_or_tensor(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"incomplete: its shard b\.safetensors, named in "
                                              r"model\.safetensors\.index\.json, is missing"):
        open_weights(tmp_path).infos()
    index.write_text(json.dumps({"weight_map": {"a": "a.safetensors", "c": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"says tensor c is in a\.safetensors, which does not hold it"):
        open_weights(tmp_path).infos()
    index.write_text(json.dumps({"weight_map": {"a": "../a.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names shard '\.\./a\.safetensors', which is not a file of its folder"):
        open_weights(tmp_path)


def test_an_unfinished_partita_checkpoint_is_refused(tmp_path):
    (tmp_path / "step-000001.tmp-abcd").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in"):
        open_weights(tmp_path)


def test_non_finite_values_are_warned_about_by_name(tmp_path):
    """A safetensors file carries no checksums: NaN or infinite values read from it are named in a warning."""
    save_file({"a": torch.tensor([1.0, float("nan")]), "b": torch.ones(2), "c": torch.tensor([float("-inf")])},
              str(tmp_path / "w.safetensors"))
    weights = open_weights(tmp_path / "w.safetensors")
    with pytest.warns(UserWarning, match=r"2 of the tensors read hold NaN or infinite values: a, c"):
        weights.read({"a": torch.float32, "b": torch.float32, "c": torch.float32})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights.read({"b": torch.float32})
