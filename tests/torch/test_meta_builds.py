"""A model built on the meta device gets, bit for bit, the values the same model built on the CPU from the same
seed has, whatever its constructor does: Hugging Face mixture-of-experts models whose experts and routers are
allocated with torch.empty and drawn only by post_init, Mamba (whose init makes tensors on a child's device), a
parent that draws its children's tensors again (nanoGPT); where partita cannot build the model again to see
what its constructor did, a warning names the modules it assumes things about. Run here in one process: one
rank keeps everything, or half of the tensors (the others are then initialized and dropped)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from partita.runtime.materialize import initial_of, materialize
from partita.runtime.ownership import named_state

from models import SmallGPT, TutorialMLP

_SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=64, num_experts_per_tok=2, vocab_size=100, max_position_embeddings=32,
              use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _hf(name: str) -> nn.Module:
    import transformers as tr

    if name == "qwen3_moe":
        return tr.Qwen3MoeForCausalLM(tr.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, head_dim=16,
                                                        **_SIZES))
    if name == "deepseek_v3":
        return tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(
            n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
            topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            **_SIZES))
    if name == "mixtral":
        return tr.MixtralForCausalLM(tr.MixtralConfig(num_local_experts=4, **_SIZES))
    if name == "olmoe":
        return tr.OlmoeForCausalLM(tr.OlmoeConfig(num_experts=4, **_SIZES))
    if name == "qwen2_moe":
        return tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=32, **_SIZES))
    if name == "mamba":
        return tr.MambaForCausalLM(tr.MambaConfig(num_hidden_layers=2, hidden_size=32, state_size=4, vocab_size=100,
                                                  use_cache=False))
    if name == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                                use_cache=False, bos_token_id=0, eos_token_id=0))
    raise KeyError(name)


@dataclass
class GPTConfig:
    vocab: int = 64
    dim: int = 16
    layers: int = 2


class NanoGPT(nn.Module):
    """nanoGPT's way: the parent draws every Linear and Embedding again after building them, then its residual
    projections smaller, and zeroes its head's bias; it keeps its config."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.emb = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(config.dim, 4 * config.dim), nn.GELU(),
                                                  nn.Linear(4 * config.dim, config.dim)) for _ in range(config.layers))
        self.head = nn.Linear(config.dim, config.vocab)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.layers))
        self.head.bias.data.zero_()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)


class Gain(nn.Module):
    """Its own parameter, drawn in __init__, and no reset_parameters()."""

    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(d))


class Unkept(nn.Module):
    """Its constructor's argument is not kept under its name: partita cannot build it again."""

    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.gain = Gain(width)


def _ones_for_gains(module: nn.Module) -> None:
    if isinstance(module, Gain):
        nn.init.ones_(module.gain)


def _built_both_ways(make, init_fn=None, keep_every=1):
    torch.manual_seed(0)
    want = {n: t.clone() for n, t in named_state(make()).items()}
    torch.manual_seed(0)
    with torch.device("meta"):
        model = make()
    keep = {n for i, n in enumerate(named_state(model)) if i % keep_every == 0}
    materialize(model, None, keep, device=torch.device("cpu"),
                initial=initial_of(model, init_fn(model) if init_fn else None, None))
    got = named_state(model)
    return want, got, keep


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "qwen2_moe", "mamba", "gpt2"])
@pytest.mark.parametrize("keep_every", [1, 2])
def test_hugging_face_models_on_the_meta_device_equal_the_cpu_built(name, keep_every):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        want, got, keep = _built_both_ways(lambda: _hf(name), lambda m: m._init_weights, keep_every)
    differ = [n for n in keep if not torch.equal(got[n], want[n])]
    assert not differ, f"{len(differ)} of {len(keep)} differ from the CPU-built model: {differ[:5]}"
    assert all(got[n].is_meta for n in set(got) - keep)


def test_a_parent_that_draws_its_children_again_is_replayed():
    want, got, keep = _built_both_ways(lambda: NanoGPT(GPTConfig()))
    assert not [n for n in keep if not torch.equal(got[n], want[n])]


def test_a_model_partita_cannot_build_again_is_warned_about_naming_the_modules():
    with pytest.warns(UserWarning, match=r"cannot build Unkept again .*'width'.*'gain' \(Gain\) \(without reset"):
        _built_both_ways(lambda: Unkept(8), lambda m: _ones_for_gains)


def test_a_parent_partita_cannot_build_again_that_draws_its_children_again_is_named():
    """SmallGPT keeps none of its arguments and draws its blocks' weights again in __init__."""
    with pytest.warns(UserWarning, match=r"cannot build SmallGPT again .*the __init__ of '\(the model\)' "
                                         r"\(SmallGPT\) \(calling normal_\) draws or writes its submodules' tensors"):
        _built_both_ways(lambda: SmallGPT(vocab=32, dim=16, heads=2, layers=2, context=8))


def test_a_plain_model_partita_cannot_build_again_is_not_warned_about():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        want, got, keep = _built_both_ways(lambda: TutorialMLP(16, 3))
    assert all(torch.equal(got[n], want[n]) for n in keep)


def test_the_random_stream_is_left_where_it_was():
    torch.manual_seed(5)
    with torch.device("meta"):
        model = NanoGPT(GPTConfig())
    initial = initial_of(model, None, None)
    before = torch.get_rng_state()
    materialize(model, None, set(named_state(model)), device=torch.device("cpu"), initial=initial)
    assert torch.equal(torch.get_rng_state(), before)


def test_mamba_that_partita_cannot_build_again_is_warned_about_not_a_torch_error():
    """Its init makes a tensor on a child's .device (meta until the init touches it): that tensor is made on the
    CPU, where the init runs, and the warning names the modules partita cannot see into."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _hf("mamba")
    model.config.hidden_size = 48  # built again, it would differ
    with pytest.warns(UserWarning, match=r"cannot build MambaForCausalLM again .*'backbone.embeddings.weight' is "
                                         r"\(100, 48\).*'backbone.layers.0.mixer' \(MambaMixer\)"):
        materialize(model, None, set(named_state(model)), device=torch.device("cpu"),
                    initial=initial_of(model, model._init_weights, None))
    assert all(torch.isfinite(t).all() for t in named_state(model).values() if t.is_floating_point())


class KeptGain(nn.Module):
    """Draws its own parameter in __init__, has no reset_parameters(), and keeps its argument."""

    def __init__(self, d: int):
        super().__init__()
        self.d = d
        self.gain = nn.Parameter(torch.randn(d) * 0.1 + 1)


def test_a_sequential_is_built_again_module_by_module():
    """A torch container is the construction of each of its modules, in its order: a module without
    reset_parameters() that draws in __init__ needs no init_fn, and a Linear without a bias is built again so."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        want, got, keep = _built_both_ways(lambda: nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), KeptGain(8),
                                                                 nn.ModuleList([nn.Linear(8, 4)])), keep_every=2)
    assert not [n for n in keep if not torch.equal(got[n], want[n])]
