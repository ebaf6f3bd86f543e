"""Describe a captured graph as blocks with numbers (FLOPs, bytes), counted on meta tensors.

Shapes in the captured graph are symbolic in the batch; every count is taken at batch 1 and 2 so that it
splits into a per-sample part and a fixed part. FLOPs of each op come from torch's FlopCounterMode run on
meta tensors (matmuls, convolutions, attention), plus one FLOP per output element for everything else.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from partita.capture.export import CapturedGraph
from partita.capture.shapes import concrete
from partita.capture.split import units
from partita.graph import Block, ModelGraph


def _concrete(x, batch: int):
    return concrete(x, batch, estimate=True)


def _meta(val, batch: int):
    if isinstance(val, torch.Tensor):
        shape = [int(_concrete(d, batch)) for d in val.shape]
        return torch.empty(shape, dtype=val.dtype, device="meta")
    return _concrete(val, batch)


def _bytes(val, batch: int) -> int:
    total = 0
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            numel = 1
            for d in leaf.shape:
                numel *= int(_concrete(d, batch))
            total += numel * leaf.element_size()
    return total


def _numel(val, batch: int) -> int:
    return sum(_bytes(leaf, batch) // leaf.element_size()
               for leaf in pytree.tree_leaves(val) if isinstance(leaf, torch.Tensor))


def _flops(node: fx.Node, batch: int) -> float:
    """FLOPs of one node's forward at the given batch size."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return float(_numel(node.meta.get("val"), batch))

    def arg(a):
        return _meta(a.meta.get("val"), batch) if isinstance(a, fx.Node) else _concrete(a, batch)

    try:
        args = pytree.tree_map(arg, node.args, is_leaf=lambda a: isinstance(a, fx.Node))
        kwargs = pytree.tree_map(arg, dict(node.kwargs), is_leaf=lambda a: isinstance(a, fx.Node))
        with FlopCounterMode(display=False) as counter:
            target(*args, **kwargs)
        matmul = counter.get_total_flops()
    except Exception:  # noqa: BLE001 - ops without meta kernels count by their output size only
        matmul = 0
    return float(matmul) if matmul else float(_numel(node.meta.get("val"), batch))


def _module(node: fx.Node) -> str:
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()
             if not path.startswith("_empty")]
    if not stack:
        return ""
    path = stack[-1]
    return path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)


def model_graph(cap: CapturedGraph) -> ModelGraph:
    """The planner's view of a captured graph."""
    groups = units(cap)
    placeholder_of = {n.name: n for n in cap.gm.graph.nodes if n.op == "placeholder"}
    param_bytes = {cap.fqn_of[p]: placeholder_of[p].meta["val"].numel() * placeholder_of[p].meta["val"].element_size()
                   for p in cap.parameters}
    blocks = []
    unit_of: dict[str, int] = {}
    for i, group in enumerate(groups):
        f1 = sum(_flops(n, 1) for n in group)
        f2 = sum(_flops(n, 2) for n in group)
        a1 = sum(_bytes(n.meta.get("val"), 1) for n in group)
        a2 = sum(_bytes(n.meta.get("val"), 2) for n in group)
        params = sorted({cap.fqn_of[a.name] for n in group for a in n.all_input_nodes if a.name in cap.parameters})
        blocks.append(Block(
            index=i, nodes=tuple(n.name for n in group), module=_module(group[0]),
            fwd_flops_per_sample=f2 - f1, fwd_flops_fixed=max(0.0, 2 * f1 - f2),
            params=tuple(params), activation_bytes_per_sample=float(a2 - a1),
        ))
        for n in group:
            unit_of[n.name] = i
    return ModelGraph(
        blocks=tuple(blocks), param_bytes=param_bytes,
        boundary_bytes_per_sample=_boundaries(cap, unit_of, len(groups)),
        input_bytes_per_sample=float(sum(
            _bytes(placeholder_of[n].meta["val"], 2) - _bytes(placeholder_of[n].meta["val"], 1)
            for n in cap.user_inputs)),
    )


def _boundaries(cap: CapturedGraph, unit_of: dict[str, int], num_units: int) -> tuple[float, ...]:
    """Bytes per sample of the tensors live across the cut after each unit."""
    delta = [0.0] * (num_units + 1)
    outputs = {o.name for o in cap.outputs if isinstance(o, fx.Node)}
    for node in cap.gm.graph.nodes:
        if node.op == "placeholder" and node.name not in cap.user_inputs:
            continue
        if node.name not in unit_of and node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        born = unit_of.get(node.name, -1)
        readers = [unit_of[u.name] for u in node.users if u.name in unit_of]
        dies = num_units if node.name in outputs else max(readers, default=born)
        size = float(_bytes(val, 2) - _bytes(val, 1))
        start = max(born, 0)
        if dies > start:  # live across cuts start .. dies-1 (cut k lies between unit k and unit k+1)
            delta[start] += size
            delta[dies] -= size
    live, out = 0.0, []
    for k in range(num_units - 1):
        live += delta[k]
        out.append(live)
    return tuple(out)
