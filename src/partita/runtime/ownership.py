"""Who holds what under a plan: the stage of every operation, the parameters of every stage, the owner of
every state tensor.

A rank holds the tensors its stages read (`kept_by`); the others are meta on it. The owner of a parameter is the lowest rank that runs a stage reading it (every holder has the same value after
a step, since gradients are summed over exactly those ranks); a buffer belongs to the first rank of the first
stage whose operations use it. Gathering the whole model, saving a checkpoint and keeping optimizer state all
follow these maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from partita.capture.export import CapturedGraph
from partita.capture.split import units
from partita.graph import ModelGraph
from partita.plan.plan import Plan
from partita.runtime.groups import param_ranks


@dataclass(frozen=True)
class Ownership:
    stage_of_node: dict[str, int]  # operation of the planned capture -> its stage
    stage_of_unit: tuple[int, ...]  # the planned capture's units (see capture.split.units) -> stage
    stage_params: dict[int, set[str]]  # stage -> parameters (canonical names) its operations read
    stage_buffers: dict[int, set[str]]  # stage -> buffers (canonical names) its operations read
    owner: dict[str, int]  # state_dict name (every alias of a tied weight) -> the rank whose copy is current
    plan: Plan

    def stages_of_param(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for stage, fqns in self.stage_params.items():
            for fqn in fqns:
                out.setdefault(fqn, set()).add(stage)
        return out

    def trained_by(self, rank: int) -> set[str]:
        """Canonical names of the parameters `rank` trains (those its stages read)."""
        return {f for s in self.plan.stages_of(rank) for f in self.stage_params[s]}

    def kept_by(self, rank: int, module: nn.Module) -> set[str]:
        """The state_dict names (every alias) of the tensors `rank` holds: those its stages read, and those it
        owns (rank 0 owns what no stage reads)."""
        state = named_state(module)
        read = {f for s in self.plan.stages_of(rank) for f in self.stage_params[s] | self.stage_buffers[s]}
        ids = {id(state[f]) for f in read if f in state}
        return {n for n, t in state.items() if id(t) in ids or self.owner.get(n, 0) == rank}


def named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, every alias of a tied one included."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def aliases(named: dict[str, torch.Tensor], fqn: str) -> list[str]:
    """Every name under which the tensor called `fqn` appears (tied weights have several)."""
    return [name for name, t in named.items() if t is named[fqn]]


def ownership(module: nn.Module, cap: CapturedGraph, graph: ModelGraph, plan: Plan) -> Ownership:
    stage_of_unit = tuple(graph.stage_of_unit(plan.stage_of_block()))
    stage_of_node = {node.name: stage for group, stage in zip(units(cap), stage_of_unit) for node in group}
    stage_params = {s.index: graph.params_of(*s.blocks) for s in plan.stages}
    parameters = dict(module.named_parameters(remove_duplicate=False))
    owner = {name: ranks[0] for fqn, ranks in param_ranks(plan, stage_params).items()
             for name in aliases(parameters, fqn)}
    buffers = dict(module.named_buffers(remove_duplicate=False))
    stage_buffers: dict[int, set[str]] = {s.index: set() for s in plan.stages}
    first_use: dict[str, int] = {}
    for node in cap.gm.graph.nodes:
        for a in node.all_input_nodes:
            if a.name in cap.fqn_of and a.name not in cap.parameters and node.name in stage_of_node:
                stage_buffers[stage_of_node[node.name]].add(cap.fqn_of[a.name])
                first_use.setdefault(cap.fqn_of[a.name], stage_of_node[node.name])
    for fqn, stage in first_use.items():
        for name in aliases(buffers, fqn):
            owner[name] = plan.stages[stage].ranks[0]
    return Ownership(stage_of_node, stage_of_unit, stage_params, stage_buffers, owner, plan)
