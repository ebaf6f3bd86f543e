"""Hugging Face architectures built from their config classes with tiny sizes, as fidelity cases.

transformers lists its causal language models by model type (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES); each is
built from its config class with the sizes below (what a config calls them: its attribute_map translates the
common names), dropout off and no cache, trained on random token ids with the next-token loss.
"""

from __future__ import annotations

import torch
from torch import nn

from models import lm_loss
from support.zoo import CASES, Case

VOCAB, SEQUENCE = 96, 8
SIZES = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 64, "head_dim": 8,
    "use_cache": False, "tie_word_embeddings": False,
    # encoder-decoder and older names
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "ffn_dim": 64, "d_ff": 64,
    "d_kv": 8, "num_layers": 2, "num_heads": 4, "n_positions": 64, "max_seq_len": 64, "seq_length": 64,
    # mixtures of experts, linear attention, state spaces: small and few
    "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "n_group": 1, "topk_group": 1, "state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 4,
    "sliding_window": 4, "attention_chunk_size": 4,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}
def causal_lm_types() -> dict[str, str]:
    """Model type -> causal LM class name, as transformers lists them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    """`model_type`'s config with tiny sizes (those of SIZES it has), dropout off."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    given = {k: v for k, v in SIZES.items() if k in known}
    # every dropout off, whatever the config calls it (dropout_p, resid_pdrop, attention_probs_dropout_prob, ...)
    given.update({k: 0.0 for k, v in config.to_dict().items()
                  if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float)})
    return AutoConfig.for_model(model_type, **given)


MAX_PARAMETERS = 3_000_000  # more: a size this config calls by a name not in SIZES


class NotTiny(Exception):
    pass


def build(model_type: str) -> nn.Module:
    """The tiny causal LM (NotTiny if the config's sizes did not all shrink)."""
    import transformers

    cls = getattr(transformers, causal_lm_types()[model_type])
    config = tiny_config(model_type)
    with torch.device("meta"):
        counted = sum(p.numel() for p in cls(config).parameters())
    if counted > MAX_PARAMETERS:
        raise NotTiny(f"{counted} parameters with the tiny sizes: a size has a name not in SIZES")
    return cls(config)


def _loss(out, target):
    return lm_loss(out.logits, target)


def _batch(n, g):
    ids = torch.randint(3, VOCAB, (n, SEQUENCE), generator=g)
    return (), {"input_ids": ids}, torch.randint(3, VOCAB, (n, SEQUENCE), generator=g)


def case_name(model_type: str) -> str:
    return f"hf_arch_{model_type}"


def register(model_type: str) -> str:
    """A fidelity case for `model_type` in support.zoo's CASES, in this process; its name."""
    name = case_name(model_type)
    CASES[name] = Case(lambda: build(model_type), _batch, _loss, _loss)
    return name


def fidelity(model_type: str, **options) -> dict:
    """support.cases.fidelity on `model_type`'s tiny causal LM."""
    from support import cases

    return cases.fidelity(register(model_type), **options)


def one_process(model_type: str) -> dict:
    """Built, called and differentiated in one process (no partita): what went wrong, if anything."""
    try:
        torch.manual_seed(0)
        model = build(model_type)
        _, kwargs, target = _batch(4, torch.Generator().manual_seed(0))
        _loss(model(**kwargs), target).backward()
    except Exception as e:  # noqa: BLE001 - reported by the sweep
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
    return {"error": None, "params": sum(p.numel() for p in model.parameters())}
