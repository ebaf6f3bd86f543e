"""Run one captured graph under a plan on this rank.

Two call paths, chosen by the caller:

- `train_step` (a loss function was given, grad enabled, in train or eval mode): rows go to the first stage,
  targets to the last, the pipeline runs forward and backward of every micro-batch at once. The parameter
  gradients are held back and the global mean loss is returned; `loss.backward()` then adds them (times
  the gradient flowing into the loss) after summing them over the ranks that hold each parameter.
- `forward`: every micro-batch forward now. Outputs go back to the rank whose rows they are (scalars, such
  as a loss the model computes itself, become the global mean). If a gradient is needed, the outputs are
  tied into autograd so that the user's `loss.backward()` runs the pipeline backward.

Scaling, so that gradients match single-process training: micro-batch losses are summed by the pipeline; the
loss is a mean over R replicas x M micro-batches, so the summed gradient is scaled by 1/(R*M). Outputs returned row-wise follow DDP: each rank's loss is local, gradients average over the W
ranks, input gradients stay local.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx

from partita.capture.export import CapturedGraph
from partita.capture.shapes import shape_at
from partita.capture.split import split
from partita.errors import BatchError, PartitaError, PlanError
from partita.plan.plan import FSDP_LEVELS, Plan, check_batch
from partita.runtime.batch import Loss, checked_loss, rows_combination
from partita.runtime.fully_sharded import ShardedUnits, reshard_after_call, through_units
from partita.runtime.grads import GradSync, Gradients
from partita.runtime.pipeline import Pipeline
from partita.runtime.precision import LossScale, autocast
from partita.runtime.route import Replica, TensorSpec
from partita.runtime.state import broadcast_tensors
from partita.schedule import Action

_MAX_PIPELINES = 4  # micro-batch sizes kept ready at once (a smaller last batch, eval, ...)


@dataclass(frozen=True)
class Place:
    """This rank's place under a plan."""

    plan: Plan
    rank: int
    world_size: int
    device: torch.device
    replica_index: int
    replica: Replica
    pipeline_group: dist.ProcessGroup
    stage_groups: dict  # stage index -> group over its replicas (only with more than one replica)

    @property
    def first_rank(self) -> int:
        return self.plan.stages[0].ranks[self.replica_index]

    @property
    def last_rank(self) -> int:
        return self.plan.stages[-1].ranks[self.replica_index]


class Engine:
    def __init__(self, cap: CapturedGraph, stage_of_unit: list[int], place: Place, grads: GradSync,
                 anchor: torch.Tensor, sharded: ShardedUnits):
        self.cap = cap
        self.sharded = sharded
        # the check of how the loss combines rows, in the call under way (`_start_rows_check`)
        self._rows_check, self._rows_found = False, None
        self.place = place
        self.grads = grads
        self.anchor = anchor
        plan = place.plan
        self.graphs = split(cap, stage_of_unit, plan.num_stages)
        for g in self.graphs:
            if plan.stages[g.index].recompute and g.written_buffers:
                raise PlanError(f"the plan recomputes stage {g.index}, which updates buffers {g.written_buffers[:3]} "
                                "(BatchNorm statistics): a recomputation would update them twice. Set recompute "
                                "to false for that stage.")
        self.stage0_inputs = [cap.user_inputs.index(n) for n in self.graphs[0].inputs]
        self.out_nodes = [o for o in cap.outputs if isinstance(o, fx.Node)]
        self.loss_scale: LossScale | None = None  # float16: backwards run on the loss times its scale
        self._pipelines: OrderedDict = OrderedDict()
        self._last: Pipeline | None = None
        local = plan.stages_of(place.rank)
        self._written = [(place.stage_groups[g.index], plan.stages[g.index].ranks[0],
                          [getattr(g.module, b) for b in g.written_buffers])
                         for g in self.graphs if g.written_buffers and g.index in place.stage_groups
                         and g.index in local]
        for g in self.graphs:
            if g.index in sharded.levels:
                g.module = through_units(g.module, g.parameters, sharded, g.index)

    def _sync_buffers(self) -> None:
        """Every replica of a stage takes its first replica's buffers (BatchNorm statistics), as DDP does."""
        for group, src, buffers in self._written:
            broadcast_tensors(buffers, self.place.device, src=src, group=group)

    @property
    def plan(self) -> Plan:
        return self.place.plan

    def stage_parameters(self) -> dict[int, set[str]]:
        return {g.index: set(g.parameters.values()) for g in self.graphs}

    def _pipeline(self, micro_batch_rows: int, has_backward: bool, loss_fn) -> Pipeline:
        key = (micro_batch_rows, has_backward, loss_fn is not None)
        if key not in self._pipelines:
            p = self.place
            self._pipelines[key] = Pipeline(self.cap, self.graphs, self.plan, rank=p.rank, replica=p.replica_index,
                                            group=p.pipeline_group, device=p.device,
                                            micro_batch_rows=micro_batch_rows, has_backward=has_backward,
                                            loss_fn=loss_fn, sharded=self.sharded, grads=self.grads)
            while len(self._pipelines) > _MAX_PIPELINES:
                self._pipelines.popitem(last=False)
        self._pipelines.move_to_end(key)
        self._last = self._pipelines[key]
        return self._last

    def executed(self) -> list[Action]:
        """The compute actions the last call ran on this rank, in order."""
        return list(self._last.executed) if self._last is not None else []

    def _sizes(self, rows: tuple[int, ...]) -> tuple[int, int]:
        """(local rows, rows per micro-batch), after checking that the batch splits evenly."""
        p, plan = self.place, self.plan
        if len(set(rows)) > 1:
            passed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows))
            raise BatchError(
                f"ranks pass batches of different sizes ({passed} rows). This plan pipelines the model "
                f"({_pipelined_because(plan)}), which splits every rank's rows the same way, so every rank must pass "
                "the same number of rows: give each rank the same number of samples (a DistributedSampler does; a "
                "last short batch is then equally short on every rank). A plan that DDP runs (stages=1, "
                "micro_batches=1, sharding=\"none\" or \"optimizer\") weighs batches of different sizes by their rows "
                "instead.")
        local = rows[p.rank]
        check_batch(local * p.replica.size, plan.micro_batches, plan.num_replicas, p.world_size)
        return local, local * p.replica.size // plan.micro_batches

    def _gather_inputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        p = self.place
        rows = p.replica.gather_rows([tensors[i] for i in self.stage0_inputs], p.first_rank)
        if rows is None:
            return None
        return [r.detach().requires_grad_(tensors[i].requires_grad)
                for r, i in zip(rows, self.stage0_inputs)]

    def _scatter_input_grads(self, inputs: list[torch.Tensor] | None, tensors: list[torch.Tensor],
                             scale: float) -> list[torch.Tensor | None]:
        """Gradients of the caller's tensors that require grad, each on the rank whose rows they are."""
        p = self.place
        wanted = [k for k, i in enumerate(self.stage0_inputs) if tensors[i].requires_grad]
        if not wanted:
            return []
        full = None
        if p.rank == p.first_rank:
            full = [inputs[k].grad if inputs[k].grad is not None else torch.zeros_like(inputs[k])
                    for k in wanted]
        local = p.replica.scatter_rows(full, [TensorSpec.of(tensors[self.stage0_inputs[k]]) for k in wanted],
                                       p.first_rank)
        return [g * scale for g in local]

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.place.world_size > 1:
            dist.all_reduce(value)
        return value

    # ---- loss computed by partita: fused forward + backward ----------------------------------------
    def train_step(self, tensors: list[torch.Tensor], target: torch.Tensor, loss: Loss,
                   rows: tuple[int, ...]) -> tuple[torch.Tensor, Loss]:
        """The global batch's loss, its backward run, its gradients held until the caller's backward reaches
        them; and `loss`, checked on its first call where micro-batches or replicas are combined (`checked_loss`)."""
        _, micro_batch_rows = self._sizes(rows)
        p, plan = self.place, self.plan
        self._sync_buffers()

        scale = self._scale()
        self._start_rows_check(loss)

        def stage_loss(flat_out, tgt):
            # the pipeline keeps the first call's function: it reads the scale and the check of the call it runs
            # in; under autocast, on the last stage's outputs as they are (precision.py)
            out = self._unflatten(list(flat_out))
            with autocast(plan.precision, p.device):
                value = loss.fn(out, tgt)
                self._note_rows(loss.fn, out, tgt, value)
            return value * self._scale()

        pipe = self._pipeline(micro_batch_rows, True, stage_loss)
        inputs = self._gather_inputs(tensors)
        target_rows = p.replica.gather_rows([target], p.last_rank)
        saved = self.grads.stash()
        losses = pipe.step(_micro_batches(inputs, plan.micro_batches),
                           _split_rows(target_rows[0], plan.micro_batches) if target_rows else None)
        gradients = self.grads.take(saved)
        loss = self._rows_checked(loss)
        mean = loss.reduction == "mean"
        denominator = plan.num_replicas * plan.micro_batches if mean else 1
        total = torch.stack([x.detach() for x in losses]).sum() if losses else torch.zeros((), device=p.device)
        value = self._global_sum(total.to(torch.float32).reshape(())) / denominator / scale
        input_grads = self._scatter_input_grads(inputs, tensors, 1.0 / denominator)
        users = [t for k, t in enumerate(tensors) if t.requires_grad and k in self.stage0_inputs]
        step = _HeldGradients(self.grads, gradients, 1.0 / denominator, input_grads,
                              value.to(_loss_dtype(losses, value)), self.loss_scale)
        return _Loss.apply(step, self.anchor, *users), loss

    @property
    def _combines_rows(self) -> bool:
        """Whether a call's loss is combined from several (micro-batches or replicas) by rows."""
        return self.plan.micro_batches > 1 or self.plan.num_replicas > 1

    def _start_rows_check(self, loss: Loss) -> None:
        """Where micro-batches or replicas are combined and `loss` is not checked yet, this call's first loss on
        the last stage shows how it combines rows (`batch.rows_combination`)."""
        self._rows_check = self._combines_rows and not loss.checked
        self._rows_found = None

    def _note_rows(self, loss_fn, out, target: torch.Tensor, value: torch.Tensor) -> None:
        if self._rows_check:
            self._rows_check = False
            self._rows_found = rows_combination(loss_fn, out, target, value)

    def _rows_checked(self, loss: Loss) -> Loss:
        """`loss` as every rank's check showed it (every rank calls this after the pipeline, at the same call)."""
        if loss.checked or not self._combines_rows:
            return loss
        return checked_loss(loss, self._rows_found, self.place.device)

    # ---- everything else: forward now, backward (if any) when the user's loss gets here ----------
    def forward(self, tensors: list[torch.Tensor], target: torch.Tensor | None, loss: Loss | None, grad: bool,
                rows: tuple[int, ...]) -> tuple[object, Loss | None]:
        """The call's result (with `loss`: the global batch's loss, without gradients; else the outputs), and
        `loss`, checked on its first call where micro-batches or replicas are combined."""
        local, micro_batch_rows = self._sizes(rows)
        p, plan = self.place, self.plan
        self._sync_buffers()
        has_backward = grad and loss is None
        pipe = self._pipeline(micro_batch_rows, has_backward, None)
        inputs = self._gather_inputs(tensors)
        micro_batches = _micro_batches(inputs, plan.micro_batches)
        ctx = torch.enable_grad() if has_backward else torch.no_grad()
        with ctx:
            outs = pipe.forward(micro_batches)
        if not has_backward:
            reshard_after_call(self.sharded.units)
        if loss is not None:
            target_rows = p.replica.gather_rows([target], p.last_rank)
            return self._eval_loss(outs, target_rows, loss)
        leaves = self._route_outputs(outs, local)
        if not has_backward:
            return self._unflatten(leaves), loss
        users = [t for k, t in enumerate(tensors) if t.requires_grad and k in self.stage0_inputs]
        run = _PendingBackward(self, pipe, outs, inputs, tensors, leaves)
        result = _Outputs.apply(run, self.anchor, *users)
        return self._unflatten(list(result)), loss

    def _eval_loss(self, outs, target_rows, loss: Loss) -> tuple[torch.Tensor, Loss]:
        p, plan = self.place, self.plan
        self._start_rows_check(loss)
        total = torch.zeros((), device=p.device)
        if outs is not None:
            targets = _split_rows(target_rows[0], plan.micro_batches)
            values = []
            with torch.no_grad():
                for o, t in zip(outs, targets):
                    out = self._unflatten(list(o))
                    values.append(loss.fn(out, t))
                    self._note_rows(loss.fn, out, t, values[-1])
            total = sum(v.float() for v in values)
        loss = self._rows_checked(loss)
        total = self._global_sum(total.detach().reshape(()).clone())
        return (total / (plan.num_replicas * plan.micro_batches) if loss.reduction == "mean" else total), loss

    def _route_outputs(self, outs, local_rows: int) -> list[torch.Tensor]:
        """Each rank's rows of every batched output; scalar outputs as their global mean."""
        p, plan = self.place, self.plan
        batched = [k for k, n in enumerate(self.out_nodes) if n.meta["val"].dim() > 0]
        scalars = [k for k, n in enumerate(self.out_nodes) if n.meta["val"].dim() == 0]
        full = None
        if outs is not None:
            full = [torch.cat([o[k].detach() for o in outs]) for k in batched]
        specs = [TensorSpec(shape_at(self.out_nodes[k].meta["val"], local_rows), self.out_nodes[k].meta["val"].dtype)
                 for k in batched]
        mine = p.replica.scatter_rows(full, specs, p.last_rank)
        leaves: list = [None] * len(self.out_nodes)
        for k, t in zip(batched, mine):
            leaves[k] = t
        for k in scalars:
            val = self.out_nodes[k].meta["val"]
            s = sum(o[k].detach() for o in outs) if outs is not None else torch.zeros((), dtype=val.dtype, device=p.device)
            leaves[k] = self._global_sum(s.clone()) / (plan.num_replicas * plan.micro_batches)
        return leaves

    def _scale(self) -> float:
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def _unflatten(self, tensor_leaves: list):
        it = iter(tensor_leaves)
        leaves = [next(it) if isinstance(o, fx.Node) else o for o in self.cap.outputs]
        return pytree.tree_unflatten(leaves, self.cap.out_spec)

    def differentiable_outputs(self) -> list[bool]:
        return [self.cap.requires_grad.get(n.name, False) for n in self.out_nodes]


def _micro_batches(inputs: list[torch.Tensor] | None, n: int) -> list[tuple[torch.Tensor, ...]] | None:
    """The first stage's inputs cut into `n` micro-batches of rows (None on other ranks)."""
    if inputs is None:
        return None
    chunks = [_split_rows(t, n) for t in inputs]
    return [tuple(c[m] for c in chunks) for m in range(n)]


def _split_rows(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    chunks = list(torch.tensor_split(t, n))
    if t.requires_grad and t.is_leaf:
        for c in chunks:
            c.retain_grad()
    return chunks


def _loss_dtype(losses, value) -> torch.dtype:
    return losses[0].dtype if losses else value.dtype


class _HeldGradients:
    """Gradients a fused step produced, waiting for the user's loss.backward()."""

    def __init__(self, grads: GradSync, gradients: Gradients, scale: float, input_grads: list, value: torch.Tensor,
                 loss_scale: LossScale | None):
        self.grads, self.gradients, self.scale, self.input_grads = grads, gradients, scale, input_grads
        self.value, self.loss_scale = value, loss_scale

    def apply(self, grad_output: torch.Tensor) -> list:
        self.grads.apply(self.gradients, self.scale * grad_output)
        if self.loss_scale is not None:
            self.loss_scale.scaled = True
        return [g * grad_output for g in self.input_grads]


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: _HeldGradients, anchor: torch.Tensor, *inputs):
        ctx.step = step
        return step.value

    @staticmethod
    def backward(ctx, grad_output):
        step, ctx.step = ctx.step, None
        if step is None:
            raise PartitaError("backward through the same loss twice; call the model again")
        return (None, None, *step.apply(grad_output.detach()))


class _PendingBackward:
    """A forward whose pipeline backward runs when the user's loss reaches its outputs."""

    def __init__(self, engine: Engine, pipe: Pipeline, outs, inputs, tensors, leaves):
        self.engine, self.pipe, self.outs, self.inputs, self.tensors = engine, pipe, outs, inputs, tensors
        self.leaves = leaves
        self.forward = pipe.forwards_run  # which of the pipeline's forwards kept the activations this needs

    def backward(self, grad_leaves: tuple) -> list:
        with torch.enable_grad():  # autograd runs Function.backward with grad mode off
            return self._backward(grad_leaves)

    def _backward(self, grad_leaves: tuple) -> list:
        if self.pipe.forwards_run != self.forward:  # every rank made the same calls: each raises here alike
            raise PartitaError(
                "backward through the outputs of a call of the model that was followed by another call before "
                "this backward: without loss_fn a pipelined plan keeps the activations of one call at a time, "
                "and the later call replaced them. Call backward on each call's loss before calling the model "
                "again (gradients add up over calls), or pass loss_fn= to parallelize, with which any number of "
                "calls may wait for one backward")
        e, p, plan = self.engine, self.engine.place, self.engine.plan
        differentiable = e.differentiable_outputs()
        batched = [k for k, n in enumerate(e.out_nodes) if n.meta["val"].dim() > 0 and differentiable[k]]
        scalars = [k for k, n in enumerate(e.out_nodes) if n.meta["val"].dim() == 0 and differentiable[k]]
        local = [(grad_leaves[k] if grad_leaves[k] is not None else torch.zeros_like(self.leaves[k]))
                 / p.world_size for k in batched]
        rows = p.replica.gather_rows(local, p.last_rank)
        losses = None
        if self.outs is not None:
            per_mb = [_split_rows(r, plan.micro_batches) for r in rows]
            weight = 1.0 / (plan.num_replicas * plan.micro_batches)
            losses = []
            for m, out in enumerate(self.outs):
                terms = [(out[k] * g[m]).sum() for k, g in zip(batched, per_mb) if out[k].requires_grad]
                terms += [out[k] * (grad_leaves[k] * weight) for k in scalars
                          if grad_leaves[k] is not None and out[k].requires_grad]
                if not terms:  # the user's loss did not use any output: a zero that still reaches the stages
                    terms = [o.sum() * 0 for o in out if o.requires_grad]
                losses.append(sum(terms) * e._scale())
        saved = e.grads.stash()
        self.pipe.backward(losses)
        e.grads.apply(e.grads.take(saved), 1.0)
        if e.loss_scale is not None:
            e.loss_scale.scaled = True
        self.outs = None
        return e._scatter_input_grads(self.inputs, self.tensors, float(p.world_size))


class _Outputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _PendingBackward, anchor: torch.Tensor, *inputs):
        ctx.run = run
        differentiable = run.engine.differentiable_outputs()
        ctx.mark_non_differentiable(*[t for t, d in zip(run.leaves, differentiable) if not d])
        return tuple(run.leaves)

    @staticmethod
    def backward(ctx, *grad_leaves):
        run, ctx.run = ctx.run, None
        if run is None:
            raise PartitaError("backward through the same outputs twice; call the model again")
        return (None, None, *run.backward(grad_leaves))


def _pipelined_because(plan: Plan) -> str:
    """'1 stage x 2 replicas, 2 micro-batches, sharding="parameters"': what makes a plan partita's pipelined one."""
    why = [f"{plan.num_stages} stage{'s' if plan.num_stages > 1 else ''} x {plan.num_replicas} replicas"]
    if plan.micro_batches > 1:
        why.append(f"{plan.micro_batches} micro-batches")
    why += sorted({f"sharding=\"{s.sharding}\"" for s in plan.stages if s.sharding in FSDP_LEVELS})
    return ", ".join(why)
