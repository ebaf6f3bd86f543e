"""Which dtype each input of a call must have, read off the captured graph.

torch.export traces with fake tensors whose matrix products do not check dtypes, so a float64 input into a
float32 model captures fine and fails only when a stage runs it: on one pipeline rank, while the others wait.
partita follows each floating-point input through the ops that keep its dtype to the first matrix product or
convolution, which torch computes in a single dtype, and asks there for the dtype of the other operand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from partita.capture.export import CapturedGraph
from partita.errors import BatchError

# torch computes these in the dtype of their operands, and refuses operands of different floating dtypes
_SINGLE_DTYPE_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
                     "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}


@dataclass(frozen=True)
class InputDtype:
    """Input `index` meets an operand of `dtype` in `op`, run by `module`."""

    index: int
    dtype: torch.dtype
    op: str
    module: str


def _op_name(node: fx.Node) -> str | None:
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return None
    return node.target._schema.name.split("::")[-1]


def _floating(node) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else None


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the model"
    path, kind = list(stack.values())[-1]
    name = path.split(".", 1)[1] if "." in path else path
    return f"module '{name}' ({getattr(kind, '__name__', kind)})"


def _meets(start: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, torch.dtype] | None:
    """The first single-dtype op that `start`'s value reaches through ops keeping `dtype`, with the dtype of
    another floating operand there."""
    seen, frontier = {start}, [start]
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if (_op_name(user) or "") in _SINGLE_DTYPE_OPS:
                others = [d for a in user.all_input_nodes if a is not node and (d := _floating(a)) is not None]
                if others:
                    return user, others[0]
            if _floating(user) == dtype:
                frontier.append(user)
    return None


def input_dtypes(cap: CapturedGraph) -> list[InputDtype]:
    """The dtype each floating-point input must have; raises BatchError if the captured call mixes dtypes."""
    rules = []
    for index, name in enumerate(cap.user_inputs):
        node = cap.node(name)
        dtype = _floating(node)
        met = _meets(node, dtype) if dtype is not None else None
        if met is None:
            continue
        op, other = met
        rule = InputDtype(index, other, str(_op_name(op)), _module_of(op))
        shape = tuple(cap.examples[index].shape) if index < len(cap.examples) else None
        if (error := _mismatch(rule, dtype, shape)) is not None:
            raise error
        rules.append(rule)
    return rules


def dtype_problem(rules: list[InputDtype], tensors: list[torch.Tensor]) -> BatchError | None:
    """The error for the first input of this call whose dtype is not what the model computes it in."""
    for rule in rules:
        if rule.index < len(tensors):
            t = tensors[rule.index]
            if (error := _mismatch(rule, t.dtype, tuple(t.shape))) is not None:
                return error
    return None


def _mismatch(rule: InputDtype, dtype: torch.dtype, shape: tuple | None) -> BatchError | None:
    if dtype == rule.dtype:
        return None
    what = f"input tensor #{rule.index}" + (f" (shape {shape})" if shape is not None else "")
    convert = {torch.float32: ".float()", torch.float64: ".double()", torch.float16: ".half()",
               torch.bfloat16: ".bfloat16()"}.get(rule.dtype, f".to({rule.dtype})")
    return BatchError(
        f"{what} is {dtype}, but the model computes it in {rule.dtype}: aten.{rule.op} in {rule.module} takes "
        f"it with a {rule.dtype} operand, and torch does not mix dtypes there. Convert the input "
        f"(x{convert}) or the model (model.to({dtype})) so that they match.")
