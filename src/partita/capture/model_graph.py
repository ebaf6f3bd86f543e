"""Describe a captured graph as blocks with numbers (FLOPs, bytes), counted on meta tensors.

Shapes in the captured graph are symbolic in the batch; every count is taken at batch 1 and 2, so it is a
line in the rows. FLOPs of each op come from torch's FlopCounterMode run on meta tensors (matmuls,
convolutions, attention), plus one per output element for everything else.

Blocks group the splitter's units by module: the coarsest module depth at which no block holds more than
1/32 of the model's work (a transformer's layers, or inside them for a shallow model). Operations of the
root module (glue such as `x + pos`) join the block that follows them. A cut that a tensor with a size read
from tensor values would cross (a mixture of experts' per-expert tokens) is no block boundary, nor is a cut
between a view of a tensor and a later in-place write into its memory that the view is read at or after.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from partita.capture.export import CapturedGraph
from partita.capture.listing import digest, module_of, node_lines, shape_text
from partita.capture.shapes import concrete, value_dependent
from partita.capture.split import cuts_between_views_and_writes, units, written_args
from partita.graph import Block, ModelGraph
from partita.graph.graph import Fit

_FINEST_SHARE = 1 / 32  # a block may hold at most this share of the work, unless it is a single module


def _concrete(x, batch: int):
    return concrete(x, batch, estimate=True)


def _meta(val, batch: int):
    if isinstance(val, torch.Tensor):
        return torch.empty([int(_concrete(d, batch)) for d in val.shape], dtype=val.dtype, device="meta")
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


def _traffic(node: fx.Node, batch: int) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs."""
    return sum(_bytes(a.meta.get("val"), batch) for a in node.all_input_nodes) + _bytes(node.meta.get("val"), batch)


def _line(group: list[fx.Node], measure) -> Fit:
    return Fit.through(1, sum(measure(n, 1) for n in group), 2, sum(measure(n, 2) for n in group))


def _op_text(node: fx.Node, requires_grad: dict[str, bool]) -> str:
    """The op with the shapes of its tensor arguments and output, which of them need a gradient, and the values
    of its other arguments: ops with equal texts count and run the same (an arange's length or a reduction's
    dims are arguments; the first layer of a stack computes no gradient for its input, the others do). A device
    counts by its type: each rank captures on its own GPU (cuda:0, cuda:1, ...), and the ranks must name the
    same blocks alike to share out measuring them."""
    def arg(a):
        if isinstance(a, torch.device):
            return repr(torch.device(a.type))
        if not isinstance(a, fx.Node):
            return repr(a)
        return shape_text(a.meta.get("val")) + ("^" if requires_grad.get(a.name) else "")

    args = pytree.tree_map(arg, (node.args, dict(node.kwargs)), is_leaf=lambda a: isinstance(a, fx.Node))
    return f"{node.target}{args}->{shape_text(node.meta.get('val'))}"


@dataclass
class _Unit:
    nodes: list[fx.Node]
    path: list[str]
    flops: Fit
    traffic: Fit
    activations: Fit
    params: set[str]
    signature: str
    writes_buffers: bool


def _units(cap: CapturedGraph) -> list[_Unit]:
    out = []
    # units with one signature (the same ops on the same shapes: every layer of a transformer) count the same,
    # so each distinct one is counted once; counting runs every op on meta tensors, twice
    counted: dict[str, tuple[Fit, Fit, Fit]] = {}
    for group in units(cap):
        path = module_of(group[0])
        text = ";".join(_op_text(n, cap.requires_grad) for n in group)
        if text not in counted:
            counted[text] = (_line(group, _flops), _line(group, _traffic),
                             _line(group, lambda n, b: _bytes(n.meta.get("val"), b)))
        flops, traffic, activations = counted[text]
        out.append(_Unit(
            nodes=group, path=path.split(".") if path else [],
            flops=flops, traffic=traffic, activations=activations,
            params={cap.fqn_of[a.name] for n in group for a in n.all_input_nodes if a.name in cap.parameters},
            signature=text,
            writes_buffers=any(a.name in cap.fqn_of and a.name not in cap.parameters
                               for n in group for a in written_args(n)),
        ))
    return out


def _segments(us: list[_Unit]) -> list[tuple[int, int, str]]:
    """[start, stop) unit ranges and module names of the blocks (see the module docstring)."""
    n = len(us)
    # root-module glue takes the path of the next op inside a module (or of the last one, at the end)
    paths: list[list[str] | None] = [u.path or None for u in us]
    following = None
    for i in reversed(range(n)):
        following = paths[i] if paths[i] is not None else following
        paths[i] = paths[i] if paths[i] is not None else following
    if all(p is None for p in paths):  # everything at the root: every op is its own block
        return [(i, i + 1, "") for i in range(n)]
    preceding = None
    for i in range(n):
        preceding = paths[i] if paths[i] is not None else preceding
        paths[i] = paths[i] if paths[i] is not None else preceding
    cost = [u.flops.at(1) + u.traffic.at(1) for u in us]
    total = sum(cost) or 1.0
    depth_max = max(len(p) for p in paths)
    for depth in range(1, depth_max + 1):
        keys = [".".join(p[:depth]) for p in paths]
        ranges = []
        for i, key in enumerate(keys):
            if ranges and ranges[-1][2] == key and ranges[-1][1] == i:
                ranges[-1] = (ranges[-1][0], i + 1, key)
            else:
                ranges.append((i, i + 1, key))
        if max(sum(cost[a:b]) for a, b, _ in ranges) <= _FINEST_SHARE * total:
            break
    return ranges


def model_graph(cap: CapturedGraph) -> ModelGraph:
    """The planner's view of a captured graph."""
    us = _units(cap)
    placeholder_of = {n.name: n for n in cap.gm.graph.nodes if n.op == "placeholder"}
    param_bytes = {}
    for p in cap.parameters:
        val = placeholder_of[p].meta["val"]
        param_bytes[cap.fqn_of[p]] = val.numel() * val.element_size()
    unit_of = {n.name: i for i, u in enumerate(us) for n in u.nodes}
    crossings = _crossings(cap, unit_of, len(us))
    blocks = []
    sealed = _sealed_cuts(crossings) | cuts_between_views_and_writes(cap)
    for i, (start, stop, name) in enumerate(_join_sealed(_segments(us), sealed)):
        group = us[start:stop]
        blocks.append(Block(
            index=i, name=name, units=(start, stop), first_node=group[0].nodes[0].name,
            last_node=group[-1].nodes[-1].name,
            signature=hashlib.sha256("|".join(u.signature for u in group).encode()).hexdigest()[:16],
            num_ops=sum(len(u.nodes) for u in group),
            fwd_flops=_sum(u.flops for u in group), fwd_bytes=_sum(u.traffic for u in group),
            activation_bytes=_sum(u.activations for u in group),
            params=tuple(sorted(set().union(*(u.params for u in group)))),
            writes_buffers=any(u.writes_buffers for u in group),
        ))
    per_unit = _boundaries(crossings, len(us))
    outputs = [o for o in cap.outputs if isinstance(o, fx.Node)]
    return ModelGraph(
        blocks=tuple(blocks), param_bytes=param_bytes,
        boundary_bytes=tuple(per_unit[b.units[1] - 1] for b in blocks[:-1]),
        input_bytes=Fit.through(1, sum(_bytes(placeholder_of[n].meta["val"], 1) for n in cap.user_inputs),
                                2, sum(_bytes(placeholder_of[n].meta["val"], 2) for n in cap.user_inputs)),
        output_bytes=Fit.through(1, sum(_bytes(o.meta["val"], 1) for o in outputs),
                                 2, sum(_bytes(o.meta["val"], 2) for o in outputs)),
        digest=digest(node_lines(cap.gm)),
    )


def _sum(fits) -> Fit:
    total = Fit.line(0.0, 0.0)
    for f in fits:
        total = total + f
    return total


def _crossings(cap: CapturedGraph, unit_of: dict[str, int], num_units: int) -> list[tuple[torch.Tensor, int, int]]:
    """Each tensor that lives across cuts, with the cuts it crosses: start .. dies-1 (cut k lies between unit k
    and unit k+1)."""
    out = []
    outputs = {o.name for o in cap.outputs if isinstance(o, fx.Node)}
    for node in cap.gm.graph.nodes:
        is_input = node.op == "placeholder" and node.name in cap.user_inputs
        if not is_input and node.name not in unit_of:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        born = unit_of.get(node.name, -1)
        readers = [unit_of[u.name] for u in node.users if u.name in unit_of]
        dies = num_units if node.name in outputs else max(readers, default=born)
        start = max(born, 0)
        if dies > start:
            out.append((val, start, dies))
    return out


def _boundaries(crossings: list[tuple[torch.Tensor, int, int]], num_units: int) -> list[Fit]:
    """Bytes of the tensors live across the cut after each unit, as lines in the rows."""
    delta = [[0.0, 0.0] for _ in range(num_units + 1)]
    for val, start, dies in crossings:
        b1, b2 = _bytes(val, 1), _bytes(val, 2)
        for k, sign in ((start, 1), (dies, -1)):
            delta[k][0] += sign * (2 * b1 - b2)
            delta[k][1] += sign * (b2 - b1)
    live, out = [0.0, 0.0], []
    for k in range(num_units - 1):
        live = [live[0] + delta[k][0], live[1] + delta[k][1]]
        out.append(Fit.line(*live))
    out.append(Fit.line(0.0, 0.0))
    return out


def _sealed_cuts(crossings: list[tuple[torch.Tensor, int, int]]) -> set[int]:
    """Cuts that a tensor whose size depends on tensor values crosses (the tokens routed to one expert): no
    stage could receive it, because a pipeline sizes its receive buffers before the values exist."""
    return {k for val, start, dies in crossings if value_dependent(val) for k in range(start, dies)}


def _join_sealed(ranges: list[tuple[int, int, str]], sealed: set[int]) -> list[tuple[int, int, str]]:
    """Blocks joined across sealed cuts, named by the module the joined ones share."""
    out: list[tuple[int, int, str]] = []
    for start, stop, name in ranges:
        if out and out[-1][1] - 1 in sealed:
            first, _, first_name = out.pop()
            out.append((first, stop, _common_module(first_name, name)))
        else:
            out.append((start, stop, name))
    return out


def _common_module(a: str, b: str) -> str:
    """'moe.experts.0' and 'moe.router' -> 'moe'."""
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)
