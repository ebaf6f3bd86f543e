"""Concrete shapes from the captured graph's symbolic ones (every symbol stands for the batch)."""

from __future__ import annotations

import functools

import torch

from partita.errors import PlanError


def _value_symbols(expr) -> list:
    """The symbols of `expr` that stand for sizes read from tensor values (export's unbacked symbols)."""
    return [s for s in expr.free_symbols if str(s).startswith("u")]


def value_dependent(val) -> bool:
    """Whether a tensor's size depends on the values of tensors (a nonzero's, say), not only on the batch."""
    return isinstance(val, torch.Tensor) and any(
        isinstance(d, torch.SymInt) and _value_symbols(d.node.expr) for d in val.shape)


def concrete(x, batch: int, estimate: bool = False):
    """A symbolic size, or a plain value, with every batch symbol set to `batch`.

    Sizes that depend on tensor values are an error, or with `estimate` taken as `batch` too.
    """
    for sym_type, py_type in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
        if isinstance(x, sym_type):
            expr = x.node.expr
            if not estimate and _value_symbols(expr):
                raise PlanError(
                    f"a tensor's size ({expr}) depends on tensor values, not only on the batch size; partita "
                    "cannot size the buffers that carry it between stages. Keep such ops (nonzero, masked "
                    "select, ...) inside one stage or make their output size fixed."
                )
            return py_type(_substituted(expr, batch))
    return x


@functools.lru_cache(maxsize=4096)
def _substituted(expr, batch: int):
    """`expr` with every symbol set to `batch`: a graph's sizes are a few expressions, each met at many nodes, and
    sympy's substitution costs 0.4 ms."""
    return expr.subs({s: batch for s in expr.free_symbols})


def shape_at(val: torch.Tensor, batch: int, estimate: bool = False) -> tuple[int, ...]:
    return tuple(int(concrete(d, batch, estimate)) for d in val.shape)


def meta_like(val: torch.Tensor, batch: int, requires_grad: bool, estimate: bool = False) -> torch.Tensor:
    """An empty meta tensor with `val`'s dtype, at the given batch size (see `concrete` for `estimate`)."""
    t = torch.empty(shape_at(val, batch, estimate), dtype=val.dtype, device="meta")
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))
