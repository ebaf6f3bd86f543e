"""ZeRO-2 and ZeRO-3 (a stage's sharding "gradients" or "parameters"): torch's FSDP2 (`fully_shard`) over the
stage's replicas, one FSDP unit per block of the stage.

Why units are modules of partita's own: a stage is an fx graph whose operations read parameters as attributes,
while FSDP gathers a module's parameters around that module's forward. So each block's parameters move into a
`Unit`, built once per runtime and shared by every capture of the model (training calls, eval calls, ...);
the stage's graph is cut into pieces that each read at most one unit's parameters (torch.fx's split_module),
and each such piece runs as its unit's forward, which passes it the unit's parameters (whole, while FSDP has
them gathered) where the piece took them as arguments. A parameter-less FSDP root per stage runs around the
stage's forward, so that its units share one communication context.

- "gradients": a unit's parameters are gathered at the stage's first forward of a step and stay whole until
  its last backward (`reshard_after_forward=False`; resharded after the last micro-batch's backward only).
- "parameters": gathered around every forward and every backward, resharded after each.

Both reduce-scatter each micro-batch's gradients as soon as a unit's backward ends, so one unit's whole
gradient exists at a time, and each replica keeps and steps its shard of the gradients, parameters and
optimizer state. The replicas *sum* (FSDP's divide factor 1): partita scales every layout's gradients by
1 / (replicas x micro-batches) itself (`pipelined.py`). A parameter read by several blocks, or by another stage
(tied weights), stays whole on every replica and is summed after the pipeline as without sharding.

The user's module and optimizer hold the sharded parameters (DTensors) from then on: `parameter`, `state_dict`
and checkpoints gather them (`full_value`), and model or optimizer state loaded whole is cut to this replica's
shard (`shard_like`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.fx.passes.split_module import split_module

from partita.capture.split import aliased_input, memory_owner, written_args
from partita.errors import InternalError
from partita.graph import ModelGraph
from partita.plan.plan import FSDP_LEVELS, Plan
from partita.runtime.materialize import release_freed_memory
from partita.runtime.optim import repoint_optimizer
from partita.runtime.outputs import own_tensors
from partita.runtime.state import shard_like

class Unit(nn.Module):
    """The parameters of one block, gathered by FSDP around `forward`, which runs a piece of a stage's graph
    with them. Its outputs are tensors of their own, so that FSDP's hooks on them hold (`outputs`)."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        self.fqns = list(params)
        for k, p in enumerate(params.values()):
            self.register_parameter(f"p{k}", p)

    def forward(self, piece: fx.GraphModule, slots: tuple[tuple[int, int], ...], *args):
        """`piece` on `args` with parameter k of this unit inserted at position i for each (i, k) of `slots`
        (in increasing i)."""
        args = list(args)
        for position, k in slots:
            args.insert(position, getattr(self, f"p{k}"))
        return own_tensors(piece(*args))


class UnitCall(nn.Module):
    """A piece of a stage's graph that reads the parameters of `unit`, called through it."""

    def __init__(self, unit: Unit, piece: fx.GraphModule, slots: tuple[tuple[int, int], ...]):
        super().__init__()
        self.unit, self.piece, self.slots = unit, piece, slots

    def forward(self, *args):
        return self.unit(self.piece, self.slots, *args)


class StageRoot(nn.Module):
    """The FSDP root over one stage's units, run around the stage's whole forward: with it the units share one
    communication context (each unit its own root would keep its last reduce-scatter's input until the end
    of the backward: one whole gradient per unit instead of one in all)."""

    def __init__(self, units: list[Unit]):
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, stage: nn.Module, *args):
        return own_tensors(stage(*args))


class ThroughRoot(nn.Module):
    """A stage's module, run as its FSDP root's forward."""

    def __init__(self, root: StageRoot, stage: nn.Module):
        super().__init__()
        self.root, self.stage = root, stage

    def forward(self, *args):
        return self.root(self.stage, *args)


@dataclass
class ShardedUnits:
    """This rank's FSDP units, in the order of the blocks they hold."""

    units: list[Unit] = field(default_factory=list)
    unit_of: dict[str, int] = field(default_factory=dict)  # parameter (canonical name) -> index in `units`
    stage_of_unit: list[int] = field(default_factory=list)
    levels: dict[int, str] = field(default_factory=dict)  # stage -> its level, for stages with units
    roots: dict[int, StageRoot] = field(default_factory=dict)  # stage -> the root over its units
    names: set[str] = field(default_factory=set)  # every parameter FSDP shards, on any rank (fsdp_parameters)

    def of_stage(self, stage: int) -> list[Unit]:
        return [u for u, s in zip(self.units, self.stage_of_unit) if s == stage]


def fsdp_parameters(plan: Plan, graph: ModelGraph) -> set[str]:
    """The parameters FSDP shards under `plan`, on every rank alike: those of stages with a FSDP level and more
    than one replica that one block alone reads."""
    readers: dict[str, int] = {}
    for block in graph.blocks:
        for fqn in set(block.params):
            readers[fqn] = readers.get(fqn, 0) + 1
    return {f for stage in plan.stages if stage.sharding in FSDP_LEVELS and len(stage.ranks) > 1
            for block in graph.blocks[slice(*stage.blocks)] for f in block.params if readers[f] == 1}


def shard_stages(module: nn.Module, optimizer: torch.optim.Optimizer | None, plan: Plan, graph: ModelGraph,
                 stage_groups: dict[int, dist.ProcessGroup | None], rank: int,
                 device: torch.device) -> ShardedUnits:
    """Shard the parameters of this rank's stages whose plan says "gradients" or "parameters" over their
    replicas; the user's module and optimizer take the sharded parameters. Collective over each such stage's
    replicas."""
    sharded = fsdp_parameters(plan, graph)
    out = ShardedUnits(names=sharded)
    named = dict(module.named_parameters(remove_duplicate=False))
    replaced: dict[int, nn.Parameter] = {}
    for stage in plan.stages:
        if rank not in stage.ranks or stage.sharding not in FSDP_LEVELS or len(stage.ranks) == 1:
            continue
        mesh = DeviceMesh.from_group(stage_groups[stage.index], device_type=device.type)
        out.levels[stage.index] = stage.sharding
        for block in graph.blocks[slice(*stage.blocks)]:
            own = sorted(set(block.params) & sharded)
            if not own:
                continue
            unit = Unit({f: named[f] for f in own})
            fully_shard(unit, mesh=mesh, reshard_after_forward=stage.sharding == "parameters")
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
            for k, f in enumerate(own):
                replaced[id(named[f])] = getattr(unit, f"p{k}")
                out.unit_of[f] = len(out.units)
            out.units.append(unit)
            out.stage_of_unit.append(stage.index)
        if out.of_stage(stage.index):
            root = StageRoot(out.of_stage(stage.index))
            fully_shard(root, mesh=mesh, reshard_after_forward=stage.sharding == "parameters")
            out.roots[stage.index] = root
    for name, p in named.items():
        if id(p) in replaced:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, replaced[id(p)])
    repoint_optimizer(optimizer, replaced, shard_like)
    del named, replaced
    release_freed_memory()  # the whole parameters the shards were cut from
    return out


def through_units(stage_module: fx.GraphModule, parameters: dict[str, str], sharded: ShardedUnits,
                  stage: int) -> nn.Module:
    """`stage_module` (one stage's graph, reading parameters as attributes; `parameters`: attribute -> canonical
    name) cut into pieces that each read the parameters of at most one unit, every such piece called through
    its unit, which passes it the parameters; the whole run through the stage's root."""
    unit_attrs = {a: sharded.unit_of[f] for a, f in parameters.items() if f in sharded.unit_of}
    if not unit_attrs:
        return stage_module
    part: dict[str, int] = {}
    current = -1  # operations before the first unit's parameters are read run in a piece of their own
    for node in stage_module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        read = {unit_attrs[a.target] for a in node.all_input_nodes if a.op == "get_attr" and a.target in unit_attrs}
        if len(read) > 1 or (read and min(read) < current):
            raise InternalError(f"stage {stage}: operation {node.name} reads parameters of FSDP units {sorted(read)} "
                                f"after unit {current}'s; this capture orders the model's blocks differently "
                                "from the planned one")
        current = read.pop() if read else current
        part[node.name] = current
    _copy_values_written_across_units(stage_module.graph, part)
    pieces = {p: k for k, p in enumerate(sorted(set(part.values())))}
    unit_of_piece = {f"submod_{k}": p for p, k in pieces.items()}  # split_module's names for the pieces
    # split_module passes attributes to the pieces as arguments: those of a unit come from the unit instead
    top = split_module(stage_module, stage_module, lambda n: pieces[part[n.name]], keep_original_order=True)
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        unit_index = unit_of_piece[node.target]
        if unit_index < 0:
            continue
        unit = sharded.units[unit_index]
        slots, args = [], []
        for position, a in enumerate(node.args):
            if isinstance(a, fx.Node) and a.op == "get_attr" and a.target in unit_attrs:
                slots.append((position, unit.fqns.index(parameters[a.target])))
            else:
                args.append(a)
        node.args = tuple(args)
        setattr(top, node.target, UnitCall(unit, getattr(top, node.target), tuple(slots)))
    # the unit's parameters are no longer read as attributes (not a dead-code pass: it would drop pieces whose
    # only effect is updating buffers in place)
    for node in [n for n in top.graph.nodes if n.op == "get_attr" and n.target in unit_attrs and not n.users]:
        top.graph.erase_node(node)
        if hasattr(top, node.target):
            delattr(top, node.target)
    top.graph.lint()
    top.recompile()
    return ThroughRoot(sharded.roots[stage], top)


def _copy_values_written_across_units(graph: fx.Graph, part: dict[str, int]) -> None:
    """A unit's piece that writes in place into memory that an earlier piece made (its result, the stage's input,
    or a view of one) writes into a copy of its own, made before the piece first reads that memory; every later
    reader reads the copy, which holds the write, as it would have read the written memory. Views of that
    memory that earlier pieces took and later ones read are taken again, of the copy.

    FSDP's pre-forward hook passes a unit's inputs through one autograd function (RegisterPostBackwardFunction),
    which makes each a view among its several outputs, and autograd refuses in-place writes into such views
    ("Output 1 of RegisterPostBackwardFunction is a view and is being modified inplace": ResNet's
    `hidden_state += residual` where the shortcut has parameters of its own). Memory the piece makes itself
    and buffers (which need no gradient: the hook passes them as they are) are written as they are, with no
    copy. The piece before the first unit runs outside FSDP's hooks."""
    for node in list(graph.nodes):
        piece = part.get(node.name, -1)
        if piece < 0:
            continue
        for written in written_args(node):
            if part.get(memory_owner(written, lambda n: part.get(n.name) == piece).name) == piece:
                continue  # made by this piece, views included
            owner = memory_owner(written)
            if owner.op == "get_attr":
                continue
            nodes = list(graph.nodes)
            earlier = [n for n in nodes if part.get(n.name, -1) < piece and memory_owner(n) is owner]
            first = next(k for k, n in enumerate(nodes)
                         if part.get(n.name) == piece and any(a in earlier for a in n.all_input_nodes))
            again: dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(nodes[first]):
                for view in earlier:
                    if written_args(view) and view is not owner:  # an in-place op: its result is its input
                        again[view] = again[aliased_input(view)]
                        continue
                    if view is owner:
                        again[view] = graph.call_function(torch.ops.aten.clone.default, (owner,))
                        again[view].meta = dict(view.meta)
                    else:
                        again[view] = graph.node_copy(view, lambda a: again.get(a, a))
                    part[again[view].name] = piece
            for later in nodes[first:]:
                for view, copy in again.items():
                    later.replace_input_with(view, copy)
            for copy in reversed(list(dict.fromkeys(again.values()))):
                if not copy.users:
                    graph.erase_node(copy)


def reshard_after_call(units: list[Unit]) -> None:
    """Units kept gathered across a step ("gradients") free their whole parameters after a call with no
    backward (an eval call), so that the next step gathers the values the optimizer stepped."""
    for unit in units:
        unit.reshard()
