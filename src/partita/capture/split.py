"""Our own splitter: cut a captured graph into one fx module per pipeline stage.

torch's `pipeline()` fails on HF Llama/Qwen2 (pytorch#184361) and its `build_stage` hangs with V-shaped
schedules, so partita splits the exported graph itself. Each stage module:

- takes the tensors that cross into the stage (user inputs for stage 0), in a fixed order;
- reads parameters and buffers as attributes that are the user's own tensor objects (a parameter used by
  several stages is registered in each of them);
- recomputes shape arithmetic (`sym_size` and friends) from tensors it already has instead of receiving it;
- returns the tensors later stages need, passing through values that skip a stage; the last stage returns
  the model's output leaves.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from partita.capture.export import CapturedGraph
from partita.errors import InternalError, PlanError

_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten._assert_async.msg,
}
_SCALARS = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


class NodeKind(enum.Enum):
    """What a node of the captured graph is to the splitter."""

    INPUT = "input"  # a user input (placeholder)
    STATE = "state"  # a parameter or buffer (placeholder): each stage that reads it holds it as an attribute
    FREE = "free"  # a constant (get_attr) or shape arithmetic (a scalar): recomputed by each stage that needs it
    DROP = "drop"  # a runtime assertion of the export: dropped
    ITEM = "item"  # an element of an op's tuple result: in the unit of that op
    OP = "op"  # an operation on tensors: a unit of its own
    OUTPUT = "output"  # the graph's output node


def _kind(node: fx.Node, cap: CapturedGraph) -> NodeKind:
    if node.op == "placeholder":
        return NodeKind.INPUT if node.name in cap.user_inputs else NodeKind.STATE
    if node.op == "get_attr":
        return NodeKind.FREE
    if node.op == "output":
        return NodeKind.OUTPUT
    if node.target in _DROPPED:
        return NodeKind.DROP
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
            and isinstance(node.args[0].meta.get("val"), (list, tuple)):
        return NodeKind.ITEM
    if isinstance(node.meta.get("val"), _SCALARS):
        return NodeKind.FREE
    return NodeKind.OP


def units(cap: CapturedGraph) -> list[list[fx.Node]]:
    """The graph's operations grouped into units that a stage cut may not separate, in execution order."""
    out: list[list[fx.Node]] = []
    unit_of: dict[str, int] = {}
    for node in cap.gm.graph.nodes:
        kind = _kind(node, cap)
        if kind == NodeKind.OP:
            unit_of[node.name] = len(out)
            out.append([node])
        elif kind == NodeKind.ITEM:
            owner = unit_of[node.args[0].name]
            unit_of[node.name] = owner
            out[owner].append(node)
    return out


@dataclass
class StageGraph:
    """One stage's module and the values it exchanges with its neighbours."""

    index: int
    module: fx.GraphModule
    inputs: list[str]  # value names received (stage 0: user input placeholders)
    outputs: list[str]  # value names sent on (last stage: the model's tensor output leaves)
    parameters: dict[str, str]  # attribute name in `module` -> FQN of the user's parameter
    written_buffers: list[str]  # attribute names of buffers the stage updates in place (BatchNorm statistics)
    # torch's split backward (zero-bubble schedules: input gradients first, weight gradients later) finds every
    # weight gradient of the stage (`weights_meet_inputs`); where not, the stage runs its whole backward at once
    weights_meet_inputs: bool = True


def _is_tensor_value(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _dim_exprs(node: fx.Node) -> list:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return []
    return [d.node.expr if isinstance(d, torch.SymInt) else d for d in val.shape]


def _scalar_expr(node: fx.Node):
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, torch.SymInt) else None


def split(cap: CapturedGraph, stage_of_unit: list[int], num_stages: int) -> list[StageGraph]:
    """Build one module per stage; `stage_of_unit[i]` is the stage of unit i (non-decreasing)."""
    stage_of, local = _nodes_of_stages(units(cap), stage_of_unit, num_stages)
    cut = sorted(k for k in cuts_between_views_and_writes(cap) if stage_of_unit[k] != stage_of_unit[k + 1])
    if cut:
        raise InternalError(f"split was given a stage boundary after unit {cut[0]}, between a view of a tensor "
                            "and an in-place write into its memory, where the planner's blocks never end")
    kinds = {n.name: _kind(n, cap) for n in cap.gm.graph.nodes}
    order = {n.name: i for i, n in enumerate(cap.gm.graph.nodes)}
    out_nodes = _tensor_outputs(cap, kinds)
    needs, free_needed, first_use = _values_read(local, stage_of, kinds, out_nodes)
    substitute = _sizes_read_in_place(cap, local, needs, free_needed, first_use, kinds, order)
    inputs, outputs = _values_sent(cap, needs, stage_of, kinds, order, out_nodes)
    last = num_stages - 1
    return [
        _build(cap, s, local[s], inputs[s], outputs[s], kinds, substitute, s == last)
        for s in range(num_stages)
    ]


def _nodes_of_stages(groups: list[list[fx.Node]], stage_of_unit: list[int], num_stages: int,
                     ) -> tuple[dict[str, int], list[list[fx.Node]]]:
    """Each operation's stage (by node name), and each stage's operations in graph order."""
    if len(stage_of_unit) != len(groups):
        raise InternalError(f"split was given stages for {len(stage_of_unit)} units, the graph has {len(groups)}")
    if any(b < a for a, b in zip(stage_of_unit, stage_of_unit[1:])):
        raise InternalError(f"split was given stages that decrease along the graph: {stage_of_unit}")
    stage_of: dict[str, int] = {}
    local: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for group, s in zip(groups, stage_of_unit):
        for node in group:
            stage_of[node.name] = s
            local[s].append(node)
    for s in range(num_stages):
        if not local[s]:
            raise PlanError(f"stage {s} has no operations; use fewer stages than the graph's {len(groups)} blocks")
    return stage_of, local


def _tensor_outputs(cap: CapturedGraph, kinds: dict[str, NodeKind]) -> list[fx.Node]:
    """The nodes the model returns, which must be tensors (or inputs passed through)."""
    out_nodes = [o for o in cap.outputs if isinstance(o, fx.Node)]
    for o in out_nodes:
        if not _is_tensor_value(o) and kinds[o.name] != NodeKind.INPUT:
            raise PlanError(f"the model returns '{o.name}', which is not a tensor; return tensors only")
    return out_nodes


def _values_read(local: list[list[fx.Node]], stage_of: dict[str, int], kinds: dict[str, NodeKind],
                 out_nodes: list[fx.Node]) -> tuple[list[set[str]], list[list[fx.Node]], list[dict[str, int]]]:
    """What each stage reads directly: the tensor values it needs from before it (user inputs, other stages'
    results; the last stage also the outputs it does not compute), the free nodes (shape arithmetic,
    constants) it recomputes, and for each free node the position of its first reader in the stage."""
    num_stages = len(local)
    needs: list[set[str]] = [set() for _ in range(num_stages)]
    free_needed: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    first_use: list[dict[str, int]] = [{} for _ in range(num_stages)]

    def visit_free(s: int, node: fx.Node, seen: set[str], position: int):
        if node.name in seen:
            return
        seen.add(node.name)
        free_needed[s].append(node)
        first_use[s][node.name] = position
        for a in node.all_input_nodes:
            if kinds[a.name] == NodeKind.FREE:
                visit_free(s, a, seen, position)

    for s in range(num_stages):
        seen: set[str] = set()
        for position, node in enumerate(local[s]):
            for a in node.all_input_nodes:
                k = kinds[a.name]
                if k == NodeKind.INPUT or (k in (NodeKind.OP, NodeKind.ITEM) and stage_of[a.name] != s):
                    needs[s].add(a.name)
                elif k == NodeKind.FREE:
                    visit_free(s, a, seen, position)
        if s == num_stages - 1:
            for o in out_nodes:
                if kinds[o.name] == NodeKind.INPUT or stage_of.get(o.name) != s:
                    needs[s].add(o.name)
    return needs, free_needed, first_use


def _sizes_read_in_place(cap: CapturedGraph, local: list[list[fx.Node]], needs: list[set[str]],
                         free_needed: list[list[fx.Node]], first_use: list[dict[str, int]],
                         kinds: dict[str, NodeKind], order: dict[str, int]) -> dict[tuple[int, str], tuple[str, int]]:
    """Shape arithmetic a stage recomputes: a size it can read from a tensor it already has (received, or
    computed before the size is needed) becomes (stage, size node) -> (that tensor, dim); otherwise the stage
    receives the tensor the size is taken from (added to `needs`)."""
    substitute: dict[tuple[int, str], tuple[str, int]] = {}
    for s in range(len(local)):
        local_names = {n.name for n in local[s]}
        for f in free_needed[s]:
            available = needs[s] | {n.name for n in local[s][:first_use[s][f.name]]}
            for a in f.all_input_nodes:
                if kinds[a.name] not in (NodeKind.OP, NodeKind.ITEM, NodeKind.INPUT) \
                        or a.name in available or a.name in local_names:
                    continue
                expr = _scalar_expr(f)
                src = None
                if f.target is torch.ops.aten.sym_size.int and expr is not None:
                    for cand in sorted(available, key=order.get):
                        dims = _dim_exprs(cap.node(cand))
                        if expr in dims:
                            src = (cand, dims.index(expr))
                            break
                if src is not None:
                    substitute[(s, f.name)] = src
                else:
                    needs[s].add(a.name)
    return substitute


def _values_sent(cap: CapturedGraph, needs: list[set[str]], stage_of: dict[str, int],
                 kinds: dict[str, NodeKind], order: dict[str, int], out_nodes: list[fx.Node],
                 ) -> tuple[list[list[str]], list[list[str]]]:
    """The values each stage receives and sends on, in graph order: a value crosses every stage from its
    producer to its last reader. Every stage receives something (a message starts it); the last stage sends
    the model's outputs."""
    num_stages = len(needs)
    producer: dict[str, int] = {}
    last_reader: dict[str, int] = {}
    for s in range(num_stages):
        for name in needs[s]:
            producer[name] = 0 if kinds[name] == NodeKind.INPUT else stage_of[name]
            last_reader[name] = max(last_reader.get(name, -1), s)
    crossing = sorted(last_reader, key=order.get)
    inputs = [[v for v in crossing if producer[v] < s <= last_reader[v]
               or (s == 0 and kinds[v] == NodeKind.INPUT)] for s in range(num_stages)]
    inputs[0] = [v for v in cap.user_inputs if v in last_reader]
    if not inputs[0]:
        inputs[0] = cap.user_inputs[:1]
    for s in range(1, num_stages):
        if not inputs[s]:  # a stage that reads nothing from before still needs a message to start
            inputs[s] = inputs[0][:1]
            for t in range(1, s):
                if inputs[0][0] not in inputs[t]:
                    inputs[t].append(inputs[0][0])
    outputs = [inputs[s + 1] for s in range(num_stages - 1)] + [[o.name for o in out_nodes]]
    return inputs, outputs


def _build(cap, s, nodes, inputs, outputs, kinds, substitute, is_last) -> StageGraph:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    attrs: dict = {}
    parameters: dict[str, str] = {}
    placeholders = set()
    for name in inputs:
        env[name] = graph.placeholder(name)
        env[name].meta = dict(cap.node(name).meta)
        placeholders.add(name)

    def get(node: fx.Node) -> fx.Node:
        if node.name in env:
            return env[node.name]
        kind = kinds[node.name]
        if kind == NodeKind.STATE:
            attrs[node.name] = cap.tensor(node.name)
            if node.name in cap.parameters:
                parameters[node.name] = cap.fqn_of[node.name]
            new = graph.get_attr(node.name)
        elif kind == NodeKind.FREE and node.op == "get_attr":
            attrs[node.target] = getattr(cap.gm, node.target)
            new = graph.get_attr(node.target)
        elif kind == NodeKind.FREE and (s, node.name) in substitute:
            src, dim = substitute[(s, node.name)]
            new = graph.call_function(torch.ops.aten.sym_size.int, (get(cap.node(src)), dim))
        elif kind == NodeKind.FREE:
            new = graph.node_copy(node, get)
        else:
            raise InternalError(f"stage {s} reads '{node.name}' ({kind.value}) but nothing provides it")
        new.meta = dict(node.meta)
        env[node.name] = new
        return new

    written: list[str] = []
    local_names = {n.name for n in nodes}
    written_inputs = placeholders & {memory_owner(value, lambda n: n.name in local_names).name
                                     for node in nodes for value in written_args(node)}
    for node in nodes:
        _clone_written_inputs(graph, node, env, written_inputs)
        env[node.name] = graph.node_copy(node, get)
        written += [a.name for a in written_args(node) if a.name in cap.fqn_of and a.name not in cap.parameters]
    for value, buffer in cap.buffer_updates:
        if value in env and value not in placeholders:
            graph.call_function(torch.ops.aten.copy_.default, (get(cap.node(buffer)), env[value]))
            written.append(buffer)
    results = []
    for name in outputs:
        value = env[name] if name in env else get(cap.node(name))
        val = cap.node(name).meta.get("val")
        if not is_last and isinstance(val, torch.Tensor) and not _contiguous(val):
            value = graph.call_method("contiguous", (value,))
        results.append(value)
    graph.output(tuple(results))
    graph.eliminate_dead_code()
    module = fx.GraphModule(attrs, graph, class_name=f"Stage{s}")
    return StageGraph(s, module, list(inputs), list(outputs), parameters, sorted(set(written)),
                      _weights_meet_inputs(cap, nodes, inputs, outputs))


def _weights_meet_inputs(cap: CapturedGraph, nodes: list[fx.Node], inputs: list[str], outputs: list[str]) -> bool:
    """Whether every differentiable path from a parameter of the stage to its outputs meets a value computed
    from a stage input that needs a gradient.

    torch's split backward computes the input gradients first and keeps the gradients of the values where the
    parameters' paths join the inputs' ones; the weight gradients come later from those alone. A path that
    never joins (a stage whose inputs need no gradient, as token ids after a stage without parameters; a
    branch computed from such inputs only) gives its parameters no gradient, silently."""
    needs = cap.requires_grad
    from_inputs = {name for name in inputs if needs.get(name, False)}
    from_weights = {name for name in cap.parameters if cap.tensor(name).requires_grad}
    for node in nodes:
        # a tuple-valued op has no flag of its own: its elements (getitem) carry theirs
        differentiable = needs.get(node.name, True)
        read = {a.name for a in node.all_input_nodes}
        # a region of ops in one node (autocast, set_grad_enabled) may pass a weight's path to one element
        # without meeting the inputs' paths in another: its elements count as from the weights if any can be
        region = isinstance(node.target, torch._ops.HigherOrderOperator)
        if differentiable and region and read & from_weights:
            from_weights.add(node.name)
        elif differentiable and read & from_inputs:
            from_inputs.add(node.name)
        elif differentiable and read & from_weights:
            from_weights.add(node.name)
    return not from_weights.intersection(outputs)


def _contiguous(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides may not decide; a copy is always safe
        return False


# Ops that update running statistics without saying so in their schema: argument positions written.
_STATISTICS_WRITTEN = {
    torch.ops.aten.batch_norm.default: (3, 4),
    torch.ops.aten.instance_norm.default: (3, 4),
}


def written_args(node: fx.Node) -> list[fx.Node]:
    """The inputs an op writes into (in-place ops, BatchNorm's running statistics)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = [value for arg, value in zip(schema.arguments, node.args)
               if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node)]
    written += [node.args[i] for i in _STATISTICS_WRITTEN.get(node.target, ())
                if i < len(node.args) and isinstance(node.args[i], fx.Node)]
    return written


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose memory `node`'s result is (a view, an in-place op's result, an element of a split), or
    None where the result has memory of its own."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if isinstance(source, fx.Node) and aliased_input(source) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    return next((value for arg, value in zip(schema.arguments, node.args)
                 if arg.alias_info is not None and isinstance(value, fx.Node)), None)


def memory_owner(value: fx.Node, within: Callable[[fx.Node], bool] = lambda node: True) -> fx.Node:
    """The value whose memory `value` is: `value` followed back through views, in-place ops (which return
    their input) and splits, as long as `within` holds for the view. A write into `value` writes into it."""
    while within(value) and (source := aliased_input(value)) is not None:
        value = source
    return value


def cuts_between_views_and_writes(cap: CapturedGraph) -> set[int]:
    """Cuts (k: between unit k and unit k+1, see `units`) between a view of a tensor and an in-place write into
    that tensor's memory that the view is read at or after (`head = h[:, :4]` ... `head.add_(y)`, then h read):
    the stage or FSDP unit of the write must hold the view, taken of the tensor it received. A tensor crosses a
    cut as a value of its own, so a view of it sent beside it, written in place on the other side, would not
    write into it."""
    unit_of = {n.name: k for k, group in enumerate(units(cap)) for n in group}
    order = {n.name: i for i, n in enumerate(cap.gm.graph.nodes)}
    owner_of = {name: memory_owner(cap.node(name)).name for name in unit_of}
    cuts: set[int] = set()
    for name, unit in unit_of.items():
        for written in written_args(cap.node(name)):
            owner = memory_owner(written).name
            if owner in cap.fqn_of:
                continue  # a buffer: held by every stage that reads it, not sent
            for view, its_owner in owner_of.items():
                if its_owner == owner and view != owner and order[view] < order[name] \
                        and any(order[u.name] >= order[name] for u in cap.node(view).users):
                    cuts |= set(range(unit_of[view], unit))
    return cuts


def _clone_written_inputs(graph: fx.Graph, node: fx.Node, env: dict, written_inputs: set[str]) -> None:
    """The stage reads a received tensor that it writes into (or into a view of) from a copy, made at its first
    read: received tensors are autograd leaves, and autograd refuses writes into them and their views."""
    for value in node.all_input_nodes:
        if value.name in written_inputs and env[value.name].op == "placeholder":
            clone = graph.call_function(torch.ops.aten.clone.default, (env[value.name],))
            clone.meta = dict(value.meta)
            env[value.name] = clone


def carry_stages(cap: CapturedGraph, stage_of_node: dict[str, int], stages_of_param: dict[str, set[int]],
                 ) -> list[int]:
    """Stages for the units of another capture of the same model (eval mode, other call constants).

    A unit whose first node the planned graph also has keeps that node's stage; an unknown unit goes to a
    stage holding the parameters it reads, else stays with the unit before it. Stages never decrease.
    """
    out, current = [], 0
    for group in units(cap):
        stage = stage_of_node.get(group[0].name)
        if stage is None:
            used = [stages_of_param.get(cap.fqn_of[a.name], set()) for n in group for a in n.all_input_nodes
                    if a.name in cap.parameters]
            common = set.intersection(*used) if used else set()
            later = sorted(s for s in common if s >= current)
            stage = later[0] if later else current
        current = max(current, stage)
        out.append(current)
    return out


def check_ownership(graphs: list[StageGraph], stage_params: dict[int, set[str]]) -> None:
    """Every stage must read only parameters that its ranks train."""
    for g in graphs:
        foreign = set(g.parameters.values()) - stage_params.get(g.index, set())
        if foreign:
            raise PlanError(
                f"this call's graph puts parameters {sorted(foreign)[:4]} on stage {g.index}, which the plan "
                "does not train there; the model's structure changed since it was planned. Call "
                "partita.parallelize again on the model to plan for this call."
            )
