"""torch's PipelineStage where torch 2.11 and 2.13 differ in what partita uses (pyproject allows 2.11 to 2.13: the
GPU machines carry 2.11, CI 2.13). Everything version-specific about pipeline stages is here.

- Preparing a stage for the shapes it was built with: 2.13 is told to take them as static (`InferenceMode`);
  2.11 takes them by itself (`prepare_static`).
- 2.11 marks every tensor a stage receives as requiring gradients, integer ones too (a GPT's position ids
  crossing stages), which torch refuses; it refuses a missing gradient (an integer input's) handed back
  between two stages of one rank, and refuses to send one back to another rank, where the sender waits for
  every gradient (2.13 sends zeros); it checks each output's strides against the contiguous shapes the stage
  was built with (BERT returns an expanded mask); and its input half of a split backward (zero-bubble
  schedules) gives gradients for the inputs that require them only, where 2.13 gives one per input. 2.13 does
  none of these (`VersionedStage`).
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage

try:  # torch 2.13: a stage takes its metadata as given (static) or exchanges it (dynamic), as it is told
    from torch.distributed.pipelining._utils import InferenceMode

    STATIC_METADATA = InferenceMode.STATIC
except ImportError:  # torch 2.11: a stage given its shapes exchanges nothing by itself
    STATIC_METADATA = None


def prepare_static(stage: PipelineStage, micro_batches: int, has_backward: bool) -> None:
    """Prepare `stage` to run `micro_batches` micro-batches of the shapes it was built with: no metadata
    exchange, receive buffers sized from those shapes. torch's own schedules do this inside their private
    initialisation, differently in 2.11 and 2.13 (`STATIC_METADATA`); partita runs its stages itself."""
    if STATIC_METADATA is None:
        stage.has_backward = False  # else 2.11 marks integer receive buffers too; the floating ones are below
        stage._prepare_forward_infra(micro_batches, (), {})
        stage.has_backward = has_backward
        if has_backward:
            for infos in stage.args_recv_info.values():
                for info in infos:
                    buffer = getattr(info, "buffer", None)  # a first stage's placeholders hold none
                    if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
                        buffer.requires_grad_(True)
    else:
        stage.has_backward = has_backward
        stage._inference_mode = STATIC_METADATA
        stage._prepare_forward_infra(micro_batches, (), {}, has_backward)
    if has_backward:
        stage._prepare_backward_infra(micro_batches)


class VersionedStage(PipelineStage):
    """A PipelineStage that behaves as 2.13's on 2.11 where partita needs it to."""

    def _validate_fwd_outputs(self, outputs) -> None:
        """2.11's stride check, which 2.13 dropped: the shapes are partita's own, and sends make an output
        contiguous."""

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        if STATIC_METADATA is not None:
            return super().set_local_fwd_input(prev_stage_outputs, mb_index)
        outputs = prev_stage_outputs if isinstance(prev_stage_outputs, (tuple, list)) else (prev_stage_outputs,)
        for info, tensor in zip(self.args_recv_info[mb_index], outputs, strict=True):
            info.buffer = tensor.detach().requires_grad_(tensor.is_floating_point())
        return None

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
        if STATIC_METADATA is not None:
            return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs, strict=True):
            if grad is not None:
                info.buffer = grad
            elif info.buffer is not None:
                info.buffer.zero_()
        return None

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        if STATIC_METADATA is None and self.has_backward and not self.is_first and bwd_chunk_id in self.bwd_cache:
            inputs = self.args_recv_info[bwd_chunk_id]
            self.bwd_cache[bwd_chunk_id] = tuple(
                torch.zeros_like(info.buffer) if grad is None and getattr(info, "buffer", None) is not None else grad
                for grad, info in zip(self._input_grads(bwd_chunk_id), inputs, strict=True))
        return super().get_bwd_send_ops(bwd_chunk_id)

    def get_local_bwd_output(self, mb_index: int):
        if STATIC_METADATA is None and mb_index in self.bwd_cache:
            self.bwd_cache[mb_index] = self._input_grads(mb_index)
        return super().get_local_bwd_output(mb_index)

    def _input_grads(self, mb_index: int) -> tuple:
        """One gradient (or None) per input: 2.11's input half (zero-bubble schedules) gives them for the inputs
        that require gradients only, in order."""
        grads, inputs = tuple(self.bwd_cache[mb_index]), self.args_recv_info[mb_index]
        if len(grads) == len(inputs):
            return grads
        given = iter(grads)
        return tuple(next(given) if getattr(getattr(info, "buffer", None), "requires_grad", False) else None
                     for info in inputs)
