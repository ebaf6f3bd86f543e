"""Mixture-of-experts models for the tests, and the pool cases that train them (see pool.py).

`routed` is our own small MoE language model whose routing the tests control: top-2 of 4 expert MLPs, and the
last expert is reached only by the tokens of rows that hold TRIGGER, which the batches put in the second half
of the global batch only. So on 2 ranks rank 0's rows never reach it and rank 1's do, and with 2 micro-batches
the first micro-batch never reaches it. Each expert computes only the tokens routed to it, so the graph has
sizes that depend on the routing. `routed_skip` is the same model, except that eager runs skip an expert no
token reached (as Mixtral-style loops do): its parameters then get no gradient at all on a rank whose rows
never reach it. `idle` and `idle_skip` train them on batches without TRIGGER, so that no row of any rank
reaches the last expert. `hf_mixtral`, `hf_qwen2_moe`, `hf_olmoe`, `hf_qwen3_moe` and `hf_deepseek_v3` are tiny
transformers MoE causal LMs (4 experts, 2 per token), whose experts are one 3-d parameter each (every expert gets
a gradient, zero or not).
"""

from __future__ import annotations

import os
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

import partita
from models import lm_loss
from support import cases
from support.zoo import CASES, Case

VOCAB, SEQ, DIM, EXPERTS = 32, 6, 16, 4
TRIGGER = 0  # the one token that routes to the last expert
FLAG = 0  # the hidden dimension that carries "this token is TRIGGER"; no expert writes into it


class TopTwoExperts(nn.Module):
    """Top-2 routing over EXPERTS expert MLPs, each run on only the tokens routed to it."""

    def __init__(self, skip_idle: bool):
        super().__init__()
        self.skip_idle = skip_idle
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(EXPERTS))
        with torch.no_grad():
            # the last expert's logit is +20 for a TRIGGER token and -20 for any other: only TRIGGER reaches it
            self.router.weight[-1].zero_()
            self.router.weight[-1, FLAG] = 40.0
            self.router.bias[-1] = -20.0
            for expert in self.experts:
                expert[-1].weight[FLAG].zero_()
                expert[-1].bias[FLAG] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            # eager only: torch.export cannot branch on how many tokens an expert got
            if self.skip_idle and not torch.compiler.is_compiling() and token.numel() == 0:
                continue
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot].unsqueeze(-1))
        return out.view_as(x)


class RoutedLM(nn.Module):
    """Embedding, two residual MoE layers, LayerNorm and an LM head."""

    def __init__(self, skip_idle: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.moes = nn.ModuleList(TopTwoExperts(skip_idle) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():
            self.emb.weight[:, FLAG] = 0.0
            self.emb.weight[TRIGGER, FLAG] = 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for moe in self.moes:
            h = h + moe(h)
        return self.head(self.norm(h))


def idle_batch(n: int, g: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    """Tokens without TRIGGER: no row reaches the last expert."""
    return (torch.randint(1, VOCAB, (n, SEQ), generator=g),), {}, torch.randint(0, VOCAB, (n, SEQ), generator=g)


def routed_batch(n: int, g: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    """idle_batch's tokens, except a TRIGGER at the start of each row of the second half."""
    (ids,), kwargs, target = idle_batch(n, g)
    ids[n // 2:, 0] = TRIGGER
    return (ids,), kwargs, target


_HF_SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, num_experts_per_tok=2, vocab_size=100, max_position_embeddings=32,
                 use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def hf_mixtral() -> nn.Module:
    import transformers as tr

    return tr.MixtralForCausalLM(tr.MixtralConfig(num_local_experts=4, **_HF_SIZES))


def hf_qwen2_moe() -> nn.Module:
    """Routed experts plus a shared expert behind a sigmoid gate."""
    import transformers as tr

    return tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_HF_SIZES))


def hf_olmoe() -> nn.Module:
    import transformers as tr

    return tr.OlmoeForCausalLM(tr.OlmoeConfig(num_experts=4, **_HF_SIZES))


def hf_qwen3_moe() -> nn.Module:
    """Experts and router allocated with torch.empty: only post_init draws them."""
    import transformers as tr

    return tr.Qwen3MoeForCausalLM(tr.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, head_dim=16,
                                                    **_HF_SIZES))


def hf_deepseek_v3() -> nn.Module:
    """A dense first layer, then routed and shared experts; low-rank attention."""
    import transformers as tr

    return tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(
        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
        topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        **{**_HF_SIZES, "num_key_value_heads": 2}))  # torch.export fails on its attention with fewer


def hf_batch(n: int, g: torch.Generator) -> tuple[tuple, dict, torch.Tensor]:
    return (torch.randint(0, 100, (n, 12), generator=g),), {}, torch.randint(0, 100, (n, 12), generator=g)


def _lm(out, y):
    return lm_loss(out.logits if hasattr(out, "logits") else out, y)


MOE_CASES = {
    "routed": Case(RoutedLM, routed_batch, _lm, _lm),
    "routed_skip": Case(lambda: RoutedLM(skip_idle=True), routed_batch, _lm, _lm),
    "idle": Case(RoutedLM, idle_batch, _lm, _lm),
    "idle_skip": Case(lambda: RoutedLM(skip_idle=True), idle_batch, _lm, _lm),
    "hf_mixtral": Case(hf_mixtral, hf_batch, _lm, _lm),
    "hf_qwen2_moe": Case(hf_qwen2_moe, hf_batch, _lm, _lm),
    "hf_olmoe": Case(hf_olmoe, hf_batch, _lm, _lm),
    "hf_qwen3_moe": Case(hf_qwen3_moe, hf_batch, _lm, _lm),
    "hf_deepseek_v3": Case(hf_deepseek_v3, hf_batch, _lm, _lm),
}
CASES.update(MOE_CASES)  # cases.fidelity finds its models by name in the zoo's table


def fidelity(name: str, **options) -> dict:
    """cases.fidelity on one of MOE_CASES."""
    return cases.fidelity(name, **options)


def hf_on_meta(name: str, **plan_args) -> dict:
    """cases.hf_on_meta on one of MOE_CASES."""
    return cases.hf_on_meta(name, **plan_args)


def tokens_per_expert(name: str, rows: slice, global_rows: int) -> list[list[int]]:
    """Per MoE layer, how many tokens of `rows` of a global batch each expert gets (models of RoutedLM)."""
    torch.manual_seed(0)
    case = MOE_CASES[name]
    model = case.make()
    (ids,), _, _ = case.batch(global_rows, torch.Generator().manual_seed(1))
    counts: list[list[int]] = []

    def count(module, args, out):
        chosen = F.softmax(module.router(args[0].reshape(-1, DIM)), dim=-1).topk(2, dim=-1).indices
        counts.append(torch.bincount(chosen.reshape(-1), minlength=EXPERTS).tolist())

    hooks = [moe.register_forward_hook(count) for moe in model.moes]
    with torch.no_grad():
        model(ids[rows])
    for h in hooks:
        h.remove()
    return counts


@mock.patch.dict(os.environ, {"PARTITA_PROFILE": "measure"})
def measured_step(name: str, local_batch: int = 4, **plan_args) -> dict:
    """One training step planned from blocks measured on this job's ranks (what a user's first call does):
    the plan and the loss."""
    torch.manual_seed(0)
    case = MOE_CASES[name]
    model = case.make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    pm = partita.parallelize(model, opt, loss_fn=case.loss_fn, **plan_args)
    args, kwargs, target = case.batch(local_batch * partita.get_world_size(), torch.Generator().manual_seed(1))
    rank = partita.get_rank()
    mine = slice(rank * local_batch, (rank + 1) * local_batch)
    loss = pm(*[a[mine] for a in args], target[mine], **{k: v[mine] for k, v in kwargs.items()})
    loss.backward()
    opt.step()
    return {"plan": pm.plan.to_dict(), "loss": float(loss)}
