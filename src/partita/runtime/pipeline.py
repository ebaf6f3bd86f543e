"""This rank's pipeline stages, on torch.distributed.pipelining, run in the order the plan's schedule gives.

Stages are `PipelineStage`s given static shapes (from the captured graph at the micro-batch size), so torch
runs no shape-inference forward: that extra forward would move BatchNorm statistics and cost a step.

partita runs them itself, in the order of the plan's schedule (`partita.schedule.orders`: torch's designs,
GPipe, 1F1B, interleaved, zero-bubble, ..., checked against torch's classes by tests/torch/test_schedule_orders.py),
which is the order the planner simulated, and exchanges their messages in time steps every rank of the pipeline
shares (`partita.schedule.lockstep` says why). One driver, two ways to call it:
- `Pipeline.step`: forward and backward of every micro-batch in one call, the loss computed by partita.
- `Pipeline.forward` then `Pipeline.backward`: the forwards of the schedule's order now, its backwards later,
  when the user's own loss reaches partita's outputs; the planner gives such calls only schedules that run
  every forward before any backward (`Constraints.user_loss`).
Why not torch's schedule classes: they have no way to split forward and backward by user code, their
exchanges differ between torch 2.11 and 2.13, and with one driver what runs is by construction the order the
planner simulated.

Every stage records the actions it runs (`executed`), so tests hold the runtime to the simulated order.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from partita.capture.export import CapturedGraph
from partita.capture.shapes import meta_like
from partita.capture.split import StageGraph
from partita.plan.plan import Plan
from partita.errors import InternalError
from partita.runtime import agreement
from partita.runtime.fully_sharded import ShardedUnits
from partita.runtime.grads import GradSync
from partita.runtime.outputs import own_tensors
from partita.runtime.precision import LowPrecision
from partita.runtime.torch_stage import VersionedStage, prepare_static
from partita.schedule import Action, orders
from partita.schedule.lockstep import Exchange, lockstep
from partita.schedule.action import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD
from partita.schedule.catalog import SPLIT_BACKWARD_SCHEDULES

class RecordingStage(VersionedStage):
    """A PipelineStage that notes every compute action it runs in `executed` (a list its rank's stages share).

    `gathered_for_step`: FSDP units whose parameters stay gathered from the stage's first forward to its last
    backward of a step (sharding "gradients"): partita's modules call them, so torch's stage, which handles
    only a stage module that is itself FSDP's, leaves them to this stage. `grads` learns which backward is the
    stage's last of the step, whose gradients are final (`last_backward`).

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
        self.output_args = kwargs["output_args"]  # meta tensors: the shapes and dtypes of what it sends on
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
        # this rank's actions in the order of the plan's schedule, in time steps every rank of the pipeline shares
        # (schedule.lockstep says why): all of them in one call (`step`), or the forwards now and the backwards
        # when the user's loss reaches the outputs (`forward`, `backward`)
        self.orders = orders(plan.schedule, plan.num_stages, plan.pipeline_size, plan.micro_batches)
        self.position = replica_ranks.index(rank)
        # each stage's micro-batch whose backward finishes its weights' gradients (a B, or the W after an I)
        self.last_backward = {a.stage: a.micro_batch for a in self.orders[self.position]
                              if a.op in (FULL_BACKWARD, BACKWARD_WEIGHT)}
        self.has_backward = has_backward
        self.loss_fn = loss_fn
        self._prepared = False
        self._in_loss = False  # computing the loss of the last stage's outputs
        self.forwards_run = 0  # calls of `forward`: a later one replaces the activations an earlier one kept

    @functools.cached_property
    def steps(self) -> tuple[Exchange, ...]:
        return lockstep(self.orders, self.plan.num_stages)[self.position]

    @functools.cached_property
    def forward_steps(self) -> tuple[Exchange, ...]:
        return lockstep([[a for a in o if a.op == FORWARD] for o in self.orders], self.plan.num_stages)[self.position]

    @functools.cached_property
    def backward_steps(self) -> tuple[Exchange, ...]:
        return lockstep([[a for a in o if a.op != FORWARD] for o in self.orders], self.plan.num_stages)[self.position]

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(self, micro_batches: list[tuple] | None, targets: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch, in the schedule's order (the loss computed by partita:
        `loss_fn` on the last stage's outputs and `targets`); the last stage's loss per micro-batch (empty on
        other ranks)."""
        losses: dict[int, torch.Tensor] = {}
        self._run(self.steps, micro_batches, targets=targets, losses=losses)
        return [losses[mb] for mb in range(self.micro_batches)] if self.has_last else []

    def forward(self, micro_batches: list[tuple] | None) -> list[tuple[torch.Tensor, ...]] | None:
        """The schedule's forwards on this rank; the last stage's outputs, per micro-batch (None elsewhere)."""
        self.forwards_run += 1
        outputs: dict[int, tuple] = {}
        self._run(self.forward_steps, micro_batches, outputs=outputs)
        return [outputs[mb] for mb in range(self.micro_batches)] if self.has_last else None

    def backward(self, last_stage_losses: list[torch.Tensor] | None) -> None:
        """The schedule's backwards on this rank, after `forward`; the last stage starts from `last_stage_losses`
        (one per micro-batch)."""
        self._run(self.backward_steps, None, losses=dict(enumerate(last_stage_losses or ())), begins=False)

    def _run(self, steps: tuple[Exchange, ...], micro_batches: list[tuple] | None, *,
             targets: list[torch.Tensor] | None = None, losses: dict[int, torch.Tensor] | None = None,
             outputs: dict[int, tuple] | None = None, begins: bool = True) -> None:
        """Run `steps` (a phase, or the whole step); `begins`: a new step starts (not the backwards of one whose
        forwards ran)."""
        if not self._prepared:
            for stage in self.stages:
                prepare_static(stage, self.micro_batches, self.has_backward)
            self._prepared = True
        if begins:
            for stage in self.stages:
                stage.clear_runtime_states()
            self.executed.clear()
        posted, kept = _Posted(), {}
        failed: _Failed | None = None
        self._in_loss = False
        for step in steps:
            sends = []
            if step.action is not None and failed is None:
                if self._receives_input(step.action):
                    posted.wait_for(step.action)  # an error here is the messages': the protocol itself broke
                try:
                    sends = self._compute(step, micro_batches, targets, losses, outputs, kept)
                except Exception as e:  # noqa: BLE001 - every kind must reach the other ranks
                    failed = _Failed(step.step, step.action, e, self._in_loss)
                    agreement.failing(e, failed.while_running())
            if failed is not None and step.action is not None:
                sends = self._stand_in_sends(step)
            receives = [op for a in step.receives for op in (
                self.by_index[a.stage].get_fwd_recv_ops(a.micro_batch) if a.op == FORWARD
                else self.by_index[a.stage].get_bwd_recv_ops(a.micro_batch))]
            posted.post(step, sends + receives)
        posted.wait_all()
        # every rank of the job hears whether any failed, and raises the same error where one did
        if failed is None:
            agreement.end_of_pipeline(None)
        else:
            agreement.end_of_pipeline(failed.problem, failed.while_running(), failed.step)

    def _receives_input(self, action: Action) -> bool:
        """Whether `action`'s input comes in a message (rather than from the micro-batch, the loss, a stage on this
        rank or its own input half)."""
        stage = self.by_index[action.stage]
        if action.op == FORWARD:
            return not stage.is_first and action.stage - 1 not in self.by_index
        if action.op == BACKWARD_WEIGHT:
            return False
        return not stage.is_last and action.stage + 1 not in self.by_index

    def _stand_in_sends(self, step: Exchange) -> list[dist.P2POp]:
        """After this rank failed, the messages it owes its peers in `step`, filled with zeros: they wait for
        them in this step's group, and learn at the end of the run that the run failed (`_run`)."""
        if step.sends_to is None:
            return []
        action = step.action
        stage = self.by_index[action.stage]
        if action.op == FORWARD:
            zeros = tuple(torch.zeros(m.shape, dtype=m.dtype, device=stage.device) for m in stage.output_args)
            stage.fwd_cache[action.micro_batch] = (zeros, [])
            return stage.get_fwd_send_ops(action.micro_batch)
        # torch's stage sends zeros for an input's gradient that is None, in the gradient's shape
        stage.bwd_cache[action.micro_batch] = (None,) * len(stage.args_recv_info[0])
        return stage.get_bwd_send_ops(action.micro_batch)

    def _compute(self, step: Exchange, micro_batches, targets, losses, outputs, kept: dict) -> list[dist.P2POp]:
        """Run `step`'s action, its input taken from the first stage's micro-batch, the stage before it on this
        rank, or the messages received (waited for before); the messages that send its output on."""
        action = step.action
        stage, mb = self.by_index[action.stage], action.micro_batch
        if action.op == FORWARD:
            args: tuple = ()
            if stage.is_first:
                args = micro_batches[mb]
            elif action.stage - 1 in self.by_index:
                stage.set_local_fwd_input(kept.pop((action.stage - 1, mb)), mb)
            out = stage.forward_one_chunk(mb, args, {}, save_forward_output=False)  # torch 2.11: {}, not None
            if stage.is_last:
                if outputs is not None:
                    outputs[mb] = out if isinstance(out, tuple) else (out,)
                if targets is not None:
                    self._in_loss = True  # what a failure names (`_Failed`)
                    losses[mb] = self.loss_fn(out, targets[mb])
                    self._in_loss = False
                return []
            if step.sends_to is None:
                kept[(action.stage, mb)] = out
                return []
            return stage.get_fwd_send_ops(mb)
        if action.op == BACKWARD_WEIGHT:
            stage.backward_weight_one_chunk(mb, last_backward=self.last_backward[action.stage] == mb)
            return []
        loss = None
        if stage.is_last:
            loss = losses[mb]
        elif action.stage + 1 in self.by_index:
            stage.set_local_bwd_input(self.by_index[action.stage + 1].get_local_bwd_output(mb), mb)
        whole = action.op == FULL_BACKWARD
        stage.backward_one_chunk(mb, loss=loss, full_backward=whole,
                                 last_backward=whole and self.last_backward[action.stage] == mb)
        return stage.get_bwd_send_ops(mb) if step.sends_to is not None else []


_OPS = {FORWARD: "forward", FULL_BACKWARD: "backward", BACKWARD_INPUT: "backward (its input gradients)",
        BACKWARD_WEIGHT: "backward (its weight gradients)"}


@dataclass(frozen=True)
class _Failed:
    """The action of this rank that raised, in time step `step` of the run."""

    step: int
    action: Action
    problem: Exception
    in_loss: bool  # in loss_fn, on the last stage's outputs

    def while_running(self) -> str:
        a = self.action
        if self.in_loss:
            return f"computing loss_fn on the outputs of stage {a.stage} (the last) for micro-batch {a.micro_batch}"
        return f"running stage {a.stage}'s {_OPS[a.op]} of micro-batch {a.micro_batch}"


class _Received:
    """The receives of one group of messages, waited for once (gloo's works cannot be waited for twice)."""

    def __init__(self, works: list):
        self.works = works
        self.waited = False

    def wait(self) -> None:
        if not self.waited:
            _wait(self.works)
            self.waited = True


class _Posted:
    """The message groups this rank posted in a run of steps. An action waits only for the receives of the group
    that brought its input; sends are waited for at the end (a sender need not wait for its receiver)."""

    def __init__(self):
        self.receiving: dict[Action, _Received] = {}  # an action -> the receives of the group bringing its input
        self.groups: list[tuple[list[dist.P2POp], _Received, list]] = []  # the ops keep the tensors they send alive

    def post(self, step: Exchange, ops: list[dist.P2POp]) -> None:
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # gloo: a work per op
            received = _Received([w for op, w in zip(ops, works) if op.op is dist.irecv])
            sends = [w for op, w in zip(ops, works) if op.op is not dist.irecv]
        else:  # NCCL: one for the group, and waiting for it only orders the GPU's stream
            received, sends = _Received(works), []
        self.groups.append((ops, received, sends))
        for action in step.receives:
            self.receiving[action] = received

    def wait_for(self, action: Action) -> None:
        if action not in self.receiving:
            raise InternalError(f"{action}'s input was never received")
        self.receiving.pop(action).wait()

    def wait_all(self) -> None:
        for _, received, sends in self.groups:
            received.wait()
            _wait(sends)
        self.groups.clear()
        self.receiving.clear()
