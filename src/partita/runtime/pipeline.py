"""This rank's pipeline stages, on torch.distributed.pipelining.

Stages are `PipelineStage`s given static shapes (from the captured graph at the micro-batch size), so torch
runs no shape-inference forward: that extra forward would move BatchNorm statistics and cost a step.

Two ways to run them:
- `Pipeline.step`: torch's own schedule (GPipe, 1F1B, interleaved, zero-bubble, ...) runs forward and
  backward of every micro-batch in one call. Used when partita computes the loss itself.
- `Pipeline.forward` then `Pipeline.backward`: forward of all micro-batches now, backward later, when the
  user's own loss reaches partita's outputs. torch has no schedule whose forward and backward are split by
  user code, so this driver is partita's; it runs stages breadth-first (all micro-batches of stage s, then
  of stage s+1), which is deadlock-free for any placement of stages on ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from partita.capture.export import CapturedGraph
from partita.capture.shapes import meta_like
from partita.capture.split import StageGraph
from partita.plan.plan import Plan


class Recomputed(torch.nn.Module):
    """A stage that keeps only its inputs from the forward and runs the forward again in the backward."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.stage, *args, use_reentrant=False)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _p2p(ops: list[dist.P2POp]) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


class Pipeline:
    """The PipelineStages of this rank for one micro-batch size, with the schedule that runs them."""

    def __init__(self, cap: CapturedGraph, graphs: list[StageGraph], plan: Plan, rank: int, replica: int,
                 group: dist.ProcessGroup, device: torch.device, mb_rows: int, has_backward: bool,
                 loss_fn=None):
        self.plan = plan
        self.micro_batches = plan.micro_batches
        replica_ranks = plan.replica_ranks(replica)
        position = {s.index: replica_ranks.index(s.ranks[replica]) for s in plan.stages}
        self.stages: list[PipelineStage] = []
        for index in plan.stages_of(rank):
            g = graphs[index]
            module = Recomputed(g.module) if plan.stages[index].recompute else g.module
            stage = PipelineStage(
                module, index, plan.num_stages, device,
                input_args=tuple(meta_like(cap.node(n).meta["val"], mb_rows, cap.requires_grad[n]) for n in g.inputs),
                output_args=tuple(meta_like(cap.node(n).meta["val"], mb_rows, cap.requires_grad[n]) for n in g.outputs),
                group=group,
            )
            stage.stage_index_to_group_rank = dict(position)
            self.stages.append(stage)
        self.has_backward = has_backward
        self.loss_fn = loss_fn
        self._schedule = None
        self._prepared = False

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
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        if self.has_last:
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:
            self._schedule.step(*args, return_outputs=False)
        return losses

    # ---- partita's driver: forward now, backward when the user's loss reaches us ------------------
    def _prepare(self) -> None:
        # torch prepares stages inside its schedules' private initialisation; this driver does the same
        # for static shapes: no metadata exchange, recv buffers sized from the shapes given above.
        for stage in self.stages:
            stage.has_backward = self.has_backward
            stage._inference_mode = InferenceMode.STATIC
            stage._prepare_forward_infra(self.micro_batches, (), {}, self.has_backward)
            if self.has_backward:
                stage._prepare_backward_infra(self.micro_batches)
        self._prepared = True

    def forward(self, micro_batches: list[tuple] | None) -> list[tuple[torch.Tensor, ...]] | None:
        """Forward every micro-batch through this rank's stages; the last stage's outputs, per micro-batch."""
        if not self._prepared:
            self._prepare()
        sends, outputs = [], None
        previous: list | None = None
        for stage in self.stages:
            stage.clear_runtime_states()
            current = []
            local_prev = previous is not None and stage.stage_index - 1 == self._local_before(stage)
            for mb in range(self.micro_batches):
                if stage.is_first:
                    args = micro_batches[mb]
                else:
                    if local_prev:
                        stage.set_local_fwd_input(previous[mb], mb)
                    else:
                        _wait(_p2p(stage.get_fwd_recv_ops(mb)))
                    args = ()
                out = stage.forward_one_chunk(mb, args, save_forward_output=False)
                current.append(out)
                if not stage.is_last and not self._local(stage.stage_index + 1):
                    sends += _p2p(stage.get_fwd_send_ops(mb))
            previous = current
            if stage.is_last:
                outputs = [o if isinstance(o, tuple) else (o,) for o in current]
        _wait(sends)
        return outputs

    def backward(self, last_stage_losses: list[torch.Tensor] | None) -> None:
        """Backward every micro-batch; the last stage starts from `last_stage_losses` (one per micro-batch)."""
        sends = []
        later = None
        for stage in reversed(self.stages):
            local_next = later is not None and later.stage_index == stage.stage_index + 1
            for mb in range(self.micro_batches):
                loss = None
                if stage.is_last:
                    loss = last_stage_losses[mb]
                elif local_next:
                    stage.set_local_bwd_input(later.get_local_bwd_output(mb), mb)
                else:
                    _wait(_p2p(stage.get_bwd_recv_ops(mb)))
                stage.backward_one_chunk(mb, loss=loss, full_backward=True,
                                         last_backward=mb == self.micro_batches - 1)
                if not stage.is_first and not self._local(stage.stage_index - 1):
                    sends += _p2p(stage.get_bwd_send_ops(mb))
            later = stage
        _wait(sends)

    def _local(self, stage_index: int) -> bool:
        return any(s.stage_index == stage_index for s in self.stages)

    def _local_before(self, stage: PipelineStage) -> int:
        indices = [s.stage_index for s in self.stages if s.stage_index < stage.stage_index]
        return max(indices) if indices else -1
