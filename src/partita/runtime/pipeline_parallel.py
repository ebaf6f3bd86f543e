"""Any plan with more than one stage or micro-batch: the captured graph split into stages, run on
torch.distributed.pipelining, one pipeline per replica.

partita sums gradients itself (`grads.GradSync`) instead of wrapping stages in DDP: a rank may need several
gradient groups (its stage's replicas, and the union of stages for each tied weight), which torch's wrappers,
one group per module, do not express. Where the plan shards a stage's parameters or gradients, FSDP sums its
blocks' own gradients over the stage's replicas (`fully_sharded.py`), and partita those of tied weights.

One `Engine` per kind of call (the train/eval mode of every module, call structure, which parameters require
grad): each is a capture of the model split into the planned stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partita.capture.export import CapturedGraph, capture
from partita.capture.listing import digest, node_lines
from partita.capture.split import carry_stages, check_ownership
from partita.plan.plan import Plan
from partita.runtime.batch import Call, Loss
from partita.runtime.grads import GradSync
from partita.runtime.fully_sharded import ShardedUnits
from partita.runtime.groups import MadeGroups, gradient_groups, pipeline_groups
from partita.runtime.ownership import Ownership
from partita.runtime.pipelined import Engine, Place
from partita.runtime.route import Replica
from partita.runtime.run import Runtime
from partita.runtime.same_graph import agreed_capture
from partita.schedule import Action


def place_of(plan: Plan, rank: int, world_size: int, device: torch.device,
             stage_groups: dict[int, dist.ProcessGroup | None], made: MadeGroups) -> Place:
    """This rank's place under `plan`, with the process groups it needs. Collective: every rank creates every
    group, in the same order."""
    replicas = pipeline_groups(plan, made)
    j = plan.replica_of(rank)
    group = replicas[j] if replicas[j] is not None else dist.group.WORLD
    return Place(plan=plan, rank=rank, world_size=world_size, device=device, replica_index=j,
                 replica=Replica(plan.replica_ranks(j), group, rank, device), pipeline_group=group,
                 stage_groups=stage_groups)


class PipelineParallel(Runtime):
    def __init__(self, module: nn.Module, cap: CapturedGraph, plan: Plan, ownership: Ownership, *,
                 loss: Loss | None, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
                 device: torch.device, signature_key: tuple, stage_groups: dict[int, dist.ProcessGroup | None],
                 sharded: ShardedUnits, made: MadeGroups):
        super().__init__(module, plan, ownership, rank, device, made)
        self.loss = loss
        self.optimizer = optimizer
        self.sharded = sharded
        self.place = place_of(plan, rank, world_size, device, stage_groups, made)
        self.grads = GradSync(gradient_groups(plan, ownership.stage_params, rank, self.parameters, made,
                                              sharded.names),
                              self._params_of_stages(plan.stages_of(rank)))
        # the autograd node every returned loss or output hangs from, so that backward reaches partita
        self.anchor = torch.zeros((), requires_grad=True)
        # captured for planning, in training's modes: the engine of training calls with the first call's structure
        self._last = self._engine(cap, list(ownership.stage_of_unit))
        self.engines = {(cap.modes, signature_key, self._requires_grad()): self._last}
        if optimizer is not None:
            self.keep_optimizer_state_here(optimizer)

    def __call__(self, call: Call):
        self.grads.follow_trained()
        engine = self._engine_for(call)
        # eval mode changes what modules compute, not whether gradients flow: as in torch, grad mode decides
        if self.loss is not None and torch.is_grad_enabled():
            result, self.loss = engine.train_step(call.tensors, call.target, self.loss, call.rows)
        else:
            result, self.loss = engine.forward(call.tensors, call.target, self.loss, torch.is_grad_enabled(),
                                               call.rows)
        return result

    def executed(self) -> list[Action]:
        """The compute actions the last call ran on this rank, in order."""
        return self._last.executed()

    def stage_boundaries(self) -> str:
        """The ownership's, and the values each stage of the first call's engine receives and sends."""
        graphs = next(iter(self.engines.values())).graphs
        return super().stage_boundaries() + repr([(g.index, g.inputs, g.outputs, sorted(g.parameters.values()))
                                                  for g in graphs])

    def _params_of_stages(self, stages: tuple[int, ...]) -> dict[int, set[int]]:
        """For each of `stages`, the ids of the parameters it reads (under any of their names, when tied)."""
        return {s: {id(self.parameters[f]) for f in self.ownership.stage_params.get(s, ())} for s in stages}

    def _requires_grad(self) -> tuple:
        return tuple(p.requires_grad for p in self.parameters.values())

    def scale_loss(self, optimizer: torch.optim.Optimizer) -> None:
        super().scale_loss(optimizer)
        for engine in self.engines.values():
            engine.loss_scale = self.loss_scale

    def _engine(self, cap: CapturedGraph, stage_of_unit: list[int]) -> Engine:
        engine = Engine(cap, stage_of_unit, self.place, self.grads, self.anchor, self.sharded)
        engine.loss_scale = self.loss_scale
        check_ownership(engine.graphs, self.ownership.stage_params)
        return engine

    def _engine_for(self, call: Call) -> Engine:
        """The engine for this kind of call; another kind is captured again and cut where the plan cut."""
        key = (call.modes, call.signature.key, self._requires_grad())
        if key not in self.engines:
            cap = capture(self.module, call.args, call.kwargs)
            cap = agreed_capture(cap, digest(node_lines(cap.gm)))
            self.engines[key] = self._engine(
                cap, carry_stages(cap, self.ownership.stage_of_node, self.ownership.stages_of_param()))
        self._last = self.engines[key]
        return self._last
