"""partita's schedule orders are the orders torch's schedule classes execute.

Each of torch's schedule classes runs here, one rank at a time, on stand-in stages that record the compute
calls torch makes (forward_one_chunk, backward_one_chunk, backward_weight_one_chunk) and have no
communication (every send/recv op list is empty). The recorded order must equal `partita.schedule.orders`.
This is what lets the simulator stand for the runtime: it simulates exactly what torch runs.
"""

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from partita.plan.plan import stage_to_pipeline_rank
from partita.schedule import Action, orders


class RecordingStage:
    """The part of `_PipelineStageBase` that torch's schedules call, recording compute calls into `log`."""

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int, log: list):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = group_rank, group_size
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.log = log
        self.submod, self.device = None, "cpu"
        self.has_backward = True
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.args_recv_info: dict = {0: ()}
        self.act_send_info: dict = {}
        self.output_chunks: list = []

    def forward_one_chunk(self, mb_index, *args, **kwargs):
        self.log.append(Action(self.stage_index, "F", mb_index))

    def backward_one_chunk(self, mb_index, loss=None, full_backward=True, last_backward=False):
        self.log.append(Action(self.stage_index, "B" if full_backward else "I", mb_index))

    def backward_weight_one_chunk(self, mb_index, last_backward=False):
        self.log.append(Action(self.stage_index, "W", mb_index))

    def no_communication(self, *args, **kwargs):
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = no_communication
    _get_init_p2p_neighbors_ops = no_communication

    def nothing(self, *args, **kwargs):
        return None

    clear_runtime_states = perform_reduce_grad = _prepare_forward_infra = _prepare_backward_infra = nothing
    set_local_fwd_input = set_local_bwd_input = get_local_bwd_output = nothing


def torch_orders(schedule: str, num_stages: int, pipeline_size: int, micro_batches: int) -> list[list[Action]]:
    """Run torch's class for `schedule` on every pipeline position and return the compute calls of each."""
    cls = get_schedule_class(schedule)
    recorded = []
    for rank in range(pipeline_size):
        log: list[Action] = []
        stages = [RecordingStage(s, num_stages, rank, pipeline_size, log) for s in range(num_stages)
                  if stage_to_pipeline_rank(schedule, s, pipeline_size) == rank]
        if issubclass(cls, PipelineScheduleSingle):
            runner = cls(stages[0], n_microbatches=micro_batches)
        else:
            runner = cls(stages, n_microbatches=micro_batches)
        runner._step_microbatches()
        recorded.append(log)
    return recorded


SINGLE = [(s, m) for s in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 7, 8, 12)]
CASES = (
    [("GPipe", s, s, m) for s, m in SINGLE]
    + [("1F1B", s, s, m) for s, m in SINGLE if m >= s]
    + [(name, per_rank * p, p, m)
       for name in ("LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble")
       for per_rank in (1, 2, 3) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 6, 8, 9, 10, 12)
       if name == "LoopedBFS" or m % max(1, m // p) == 0]
    + [("ZBVZeroBubble", 2 * p, p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 7, 8, 9, 12)]
    + [("DualPipeV", 2 * p, p, m) for p in (1, 2, 3, 4) for m in range(2 * p, 2 * p + 7)]
)


@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", CASES)
def test_orders_equal_what_torch_runs(schedule, num_stages, pipeline_size, micro_batches):
    expected = torch_orders(schedule, num_stages, pipeline_size, micro_batches)
    got = orders(schedule, num_stages, pipeline_size, micro_batches)
    for rank, (mine, torchs) in enumerate(zip(got, expected)):
        assert [str(a) for a in mine] == [str(a) for a in torchs], f"rank {rank}"


@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", [
    ("1F1B", 4, 4, 3), ("Interleaved1F1B", 8, 4, 9), ("InterleavedZeroBubble", 8, 4, 13),
    ("ZBVZeroBubble", 2, 2, 4), ("DualPipeV", 2, 2, 4), ("DualPipeV", 4, 2, 3),
])
def test_sizes_torch_rejects_are_rejected(schedule, num_stages, pipeline_size, micro_batches):
    with pytest.raises(ValueError):
        torch_orders(schedule, num_stages, pipeline_size, micro_batches)
    with pytest.raises(ValueError):
        orders(schedule, num_stages, pipeline_size, micro_batches)
