"""This rank's pipeline stages, on torch.distributed.pipelining, run in the order the plan's schedule gives.

Stages are `PipelineStage`s given static shapes (from the captured graph at the micro-batch size), so torch
runs no shape-inference forward: that extra forward would move BatchNorm statistics and cost a step.

Two ways to run them, both in the order of the plan's schedule, the order the planner simulated
(`partita.schedule.orders`):
- `Pipeline.step`: torch's own schedule class (GPipe, 1F1B, interleaved, zero-bubble, ...) runs forward and
  backward of every micro-batch in one call. Used when partita computes the loss itself. The schedule orders
  are those torch's classes run (tests/torch/test_schedule_orders.py).
- `Pipeline.forward` then `Pipeline.backward`: the forwards of the schedule's order now, its backwards later,
  when the user's own loss reaches partita's outputs. torch has no schedule whose forward and backward are
  split by user code, so partita runs the order itself, exchanging messages in time steps shared by the
  pipeline's ranks (`partita.schedule.lockstep` says why); the planner gives such calls only schedules that
  run every forward before any backward (`Constraints.user_loss`).

Every stage records the actions it runs (`executed`), so tests hold the runtime to the simulated order.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from partita.capture.export import CapturedGraph
from partita.capture.shapes import meta_like
from partita.capture.split import StageGraph
from partita.plan.plan import Plan
from partita.runtime.fully_sharded import ShardedUnits
from partita.runtime.grads import GradSync
from partita.runtime.outputs import own_tensors
from partita.runtime.precision import LowPrecision
from partita.runtime.torch_stage import VersionedStage, prepare_for_schedule, prepare_static
from partita.schedule import Action, orders
from partita.schedule.lockstep import Exchange, lockstep
from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from partita.schedule.catalog import SPLIT_BACKWARD_SCHEDULES

class RecordingStage(VersionedStage):
    """A PipelineStage that notes every compute action it runs in `executed` (a list its rank's stages share).

    `gathered_for_step`: FSDP units whose parameters stay gathered from the stage's first forward to its last
    backward of a step (sharding "gradients"): partita's modules call them, so torch's stage, which handles
    only a stage module that is itself FSDP's, leaves them to this stage. `grads` learns which backward is the
    stage's last of the step, whose gradients are final (torch's schedules say so: `last_backward`).

    `whole_backward`: under zero-bubble schedules the stage computes its weight gradients with its input
    gradients, in the input half (I), and nothing in the weight half (W): torch's split backward would find
    none of them for a stage whose parameters' paths never join its inputs' (`StageGraph.weights_meet_inputs`;
    torch runs its first stage's backward whole in W for the same reason, a later stage it does not check). The
    simulator still times such a stage's halves as split: its weight work runs in I instead of W, which
    delays the input gradients it sends upstream, so the step can take longer than simulated (the planner
    does not know which stages these are: it plans blocks, capture decides this per stage)."""

    def __init__(self, *args, executed: list[Action], gathered_for_step: list, grads: GradSync,
                 whole_backward: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.executed = executed
        self.gathered_for_step = gathered_for_step
        self.grads = grads
        self.whole_backward = whole_backward
        self._done_whole: set[int] = set()  # micro-batches whose W ran with their I

    def _reshard_after(self, last_backward: bool) -> None:
        for unit in self.gathered_for_step:
            unit.set_reshard_after_backward(last_backward)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.executed.append(Action(self.stage_index, FORWARD, fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        op = FULL_BACKWARD if full_backward else BACKWARD_INPUT
        self.executed.append(Action(self.stage_index, op, bwd_chunk_id))
        self._reshard_after(last_backward)
        if not full_backward and self.whole_backward:
            self._done_whole.add(bwd_chunk_id)
            full_backward = True
        with self._final(last_backward and full_backward):
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        self.executed.append(Action(self.stage_index, BACKWARD_WEIGHT, bwd_chunk_id))
        with self._final(last_backward):
            if bwd_chunk_id in self._done_whole:
                self._done_whole.discard(bwd_chunk_id)
                return None
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        # the input half's gradients come from autograd.grad as the ops left them (an expanded or transposed
        # input's are strided), and a send takes contiguous tensors only; a whole backward reads them from .grad,
        # which autograd keeps contiguous
        grads = self.bwd_cache.get(bwd_chunk_id)
        if grads is not None:
            self.bwd_cache[bwd_chunk_id] = tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return super().get_bwd_send_ops(bwd_chunk_id)

    def _final(self, last_backward: bool) -> contextlib.AbstractContextManager:
        return self.grads.final_backward(self.stage_index) if last_backward else contextlib.nullcontext()


class Recomputed(torch.nn.Module):
    """A stage that keeps only its inputs from the forward and runs the forward again in the backward."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.stage, *args, use_reentrant=False)


class DetachableOutputs(torch.nn.Module):
    """A stage whose outputs torch's split backward can detach in place (see `outputs`)."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        return own_tensors(self.stage(*args))


def _static_shapes(cap: CapturedGraph, names: list[str], micro_batch_rows: int) -> tuple:
    return tuple(meta_like(cap.node(n).meta["val"], micro_batch_rows, cap.requires_grad[n]) for n in names)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class Pipeline:
    """The PipelineStages of this rank for one micro-batch size, with the schedule that runs them."""

    def __init__(self, cap: CapturedGraph, graphs: list[StageGraph], plan: Plan, *, rank: int, replica: int,
                 group: dist.ProcessGroup, device: torch.device, micro_batch_rows: int, has_backward: bool,
                 sharded: ShardedUnits, grads: GradSync, loss_fn=None):
        self.plan = plan
        self.micro_batches = plan.micro_batches
        replica_ranks = plan.replica_ranks(replica)
        position = {s.index: replica_ranks.index(s.ranks[replica]) for s in plan.stages}
        self.executed: list[Action] = []
        self.stages: list[RecordingStage] = []
        for index in plan.stages_of(rank):
            g = graphs[index]
            outputs = _static_shapes(cap, g.outputs, micro_batch_rows)
            module = g.module
            if plan.precision != "fp32":
                # the last stage's outputs go to the loss as they are when partita computes it (precision.py)
                keeps = index == plan.num_stages - 1 and loss_fn is not None
                module = LowPrecision(module, plan.precision, device, None if keeps else [t.dtype for t in outputs])
            if plan.stages[index].recompute:
                module = Recomputed(module)
            if plan.schedule in SPLIT_BACKWARD_SCHEDULES and index < plan.num_stages - 1:
                module = DetachableOutputs(module)
            stage = RecordingStage(module, index, plan.num_stages, device,
                                   input_args=_static_shapes(cap, g.inputs, micro_batch_rows),
                                   output_args=outputs, group=group, executed=self.executed,
                                   gathered_for_step=sharded.of_stage(index)
                                   if sharded.levels.get(index) == "gradients" else [], grads=grads,
                                   whole_backward=index > 0 and not g.weights_meet_inputs)
            stage.stage_index_to_group_rank = dict(position)
            self.stages.append(stage)
        self.by_index = {s.stage_index: s for s in self.stages}
        # this rank's actions in the order of the plan's schedule, split for the driver's two phases, each run
        # in the time steps of every rank's messages (schedule.lockstep says why)
        everyone = orders(plan.schedule, plan.num_stages, plan.pipeline_size, plan.micro_batches)
        position = replica_ranks.index(rank)
        self.forward_steps = lockstep([[a for a in o if a.op == FORWARD] for o in everyone], plan.num_stages)[position]
        self.backward_steps = lockstep([[a for a in o if a.op != FORWARD] for o in everyone],
                                       plan.num_stages)[position]
        self.last_backward = {e.action.stage: e.action.micro_batch  # each stage's last micro-batch
                              for e in self.backward_steps if e.action is not None}
        self.has_backward = has_backward
        self.loss_fn = loss_fn
        self._schedule = None
        self._prepared = False
        self.forwards_run = 0  # calls of `forward`: a later one replaces the activations an earlier one kept

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    # ---- torch's schedules: forward and backward in one call --------------------------------------
    def step(self, inputs: tuple, target: torch.Tensor | None) -> list[torch.Tensor]:
        """Run forward and backward of every micro-batch; return the last stage's micro-batch losses."""
        if self._schedule is None:
            cls = get_schedule_class(self.plan.schedule)
            stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
            self._schedule = cls(stages, n_microbatches=self.micro_batches, loss_fn=self.loss_fn,
                                 scale_grads=False)
            prepare_for_schedule(self._schedule, self.stages, self.micro_batches, self.has_backward)
        self.executed.clear()
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        if self.has_last:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            self._schedule.step(*args, return_outputs=False)
        return losses

    # ---- partita's driver: forward now, backward when the user's loss reaches us ------------------
    def _prepare(self) -> None:
        for stage in self.stages:
            prepare_static(stage, self.micro_batches, self.has_backward)
        self._prepared = True

    def forward(self, micro_batches: list[tuple] | None) -> list[tuple[torch.Tensor, ...]] | None:
        """The schedule's forwards on this rank; the last stage's outputs, per micro-batch (None elsewhere)."""
        if not self._prepared:
            self._prepare()
        for stage in self.stages:
            stage.clear_runtime_states()
        self.forwards_run += 1
        self.executed.clear()
        posted, kept = _Posted(), {}
        outputs: dict[int, tuple] = {}
        for step in self.forward_steps:
            sends: list[dist.P2POp] = []
            if step.action is not None:
                stage, mb = self.by_index[step.action.stage], step.action.micro_batch
                args: tuple = ()
                if stage.is_first:
                    args = micro_batches[mb]
                elif step.action.stage - 1 in self.by_index:
                    stage.set_local_fwd_input(kept.pop((step.action.stage - 1, mb)), mb)
                else:
                    posted.wait_for(step.action)
                out = stage.forward_one_chunk(mb, args, {}, save_forward_output=False)  # torch 2.11: {}, not None
                if stage.is_last:
                    outputs[mb] = out if isinstance(out, tuple) else (out,)
                elif step.sends_to is None:
                    kept[(step.action.stage, mb)] = out
                else:
                    sends = stage.get_fwd_send_ops(mb)
            posted.post(step, sends + [op for a in step.receives
                                       for op in self.by_index[a.stage].get_fwd_recv_ops(a.micro_batch)])
        posted.wait_all()
        return [outputs[mb] for mb in range(self.micro_batches)] if self.has_last else None

    def backward(self, last_stage_losses: list[torch.Tensor] | None) -> None:
        """The schedule's backwards on this rank; the last stage starts from `last_stage_losses` (one per
        micro-batch)."""
        posted = _Posted()
        for step in self.backward_steps:
            sends: list[dist.P2POp] = []
            if step.action is not None:
                stage, mb = self.by_index[step.action.stage], step.action.micro_batch
                loss = None
                if stage.is_last:
                    loss = last_stage_losses[mb]
                elif step.action.stage + 1 in self.by_index:
                    stage.set_local_bwd_input(self.by_index[step.action.stage + 1].get_local_bwd_output(mb), mb)
                else:
                    posted.wait_for(step.action)
                stage.backward_one_chunk(mb, loss=loss, full_backward=True,
                                         last_backward=self.last_backward[step.action.stage] == mb)
                if step.sends_to is not None:
                    sends = stage.get_bwd_send_ops(mb)
            posted.post(step, sends + [op for a in step.receives
                                       for op in self.by_index[a.stage].get_bwd_recv_ops(a.micro_batch)])
        posted.wait_all()


class _Posted:
    """The message groups this rank posted in a phase, each waited for when an action needs what it received
    (and every one by the phase's end): a send is never waited for before it must be."""

    def __init__(self):
        self.groups: list[tuple[tuple[Action, ...], list]] = []
        self.arrived: set[Action] = set()

    def post(self, step: Exchange, ops: list[dist.P2POp]) -> None:
        if ops:
            self.groups.append((step.receives, dist.batch_isend_irecv(ops)))

    def wait_for(self, action: Action) -> None:
        while action not in self.arrived:
            if not self.groups:
                raise RuntimeError(f"partita internal error: {action}'s input was never received")
            receives, works = self.groups.pop(0)
            _wait(works)
            self.arrived.update(receives)

    def wait_all(self) -> None:
        for _, works in self.groups:
            _wait(works)
        self.groups.clear()
