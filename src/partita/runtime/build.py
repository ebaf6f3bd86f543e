"""`build_runtime`: this rank's part of the model under a plan, applied in one place and a fixed order.

1. ownership: the stage of every operation, the parameters of every stage, the owner of every tensor;
2. materialization: this rank keeps only the tensors of its stages, on its device, with their initial values:
   rank 0's (as DDP does, whatever each rank's seed was), initialized from the meta device, or read from
   `weights`; every other tensor is freed;
3. the pipeline split: the stages this rank runs, their process groups and gradient groups, and the
   optimizer's state kept where its parameters train; or, for one stage and one micro-batch, the whole
   module under torch's DistributedDataParallel;
4. sharding: where the plan says so, each replica of a stage keeps its share of the optimizer's state
   (ZeRO-1, `sharding.py`), or of the parameters, gradients and optimizer state under torch's FSDP2 (ZeRO-2
   and ZeRO-3, `fully_sharded.py`: applied before the pipeline split's runtime, which cuts its stages into
   FSDP's units);
5. precision: float16's loss scale takes over the optimizer's step (`precision.py`; autocast itself wraps
   each stage's forward);
6. the check that every rank starts from the same software, plan, stage boundaries and initial weights
   (`same_start.py`).

Later parallelisms take their place in this order (tensor parallelism and recomputation before sharding,
precision after it, each applied to the stages of step 3), so that each lands here and nowhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from partita.capture.export import CapturedGraph
from partita.graph import ModelGraph
from partita.plan.plan import FSDP_LEVELS, Plan
from partita.runtime.batch import Call, Loss
from partita.runtime.data_parallel import DataParallel
from partita.runtime.fully_sharded import ShardedUnits, shard_stages
from partita.runtime.groups import MadeGroups, stage_groups
from partita.runtime.host_heap import set_for as set_heap_for
from partita.runtime.materialize import Initial, materialize
from partita.runtime.ownership import named_state, ownership
from partita.runtime.pipeline_parallel import PipelineParallel
from partita.runtime.precision import SCALED
from partita.runtime.run import Runtime
from partita.runtime.same_start import check_same_start


def build_runtime(module: nn.Module, cap: CapturedGraph, graph: ModelGraph, plan: Plan, first_call: Call, *,
                  loss: Loss | None, optimizer: torch.optim.Optimizer | None, rank: int, world_size: int,
                  device: torch.device, initial: Initial = Initial()) -> Runtime:
    """Collective: every rank calls it with the same plan, at its first call (`first_call`)."""
    owners = ownership(module, cap, graph, plan)
    fsdp = any(s.sharding in FSDP_LEVELS for s in plan.stages)
    data_parallel = plan.runs_under_ddp
    # torch's DDP wants every parameter on every rank
    keep = set(named_state(module)) if data_parallel else owners.kept_by(rank, module)
    set_heap_for(plan, device)
    materialize(module, optimizer, keep, device=device, initial=initial)
    # groups over each stage's replicas, where something is kept equal or split among them (every process group
    # costs each of its ranks a transport thread for the job's life)
    shared = any(True for _ in module.buffers()) or any(s.sharding != "none" for s in plan.stages)
    made = MadeGroups()
    groups = stage_groups(plan, made) if shared else {}
    sharded = shard_stages(module, optimizer, plan, graph, groups, rank, device) if fsdp else ShardedUnits()
    if data_parallel:
        runtime = DataParallel(module, cap, plan, owners, loss=loss, rank=rank, world_size=world_size,
                               device=device, made=made)
        runtime.settle_buckets(first_call)
    else:
        runtime = PipelineParallel(module, cap, plan, owners, loss=loss, optimizer=optimizer, rank=rank,
                                   world_size=world_size, device=device, signature_key=first_call.signature.key,
                                   stage_groups=groups, sharded=sharded, made=made)
    if optimizer is not None and any(s.sharding == "optimizer" for s in plan.stages):
        runtime.shard_optimizer_state(optimizer, groups)
    if optimizer is not None and plan.precision in SCALED:
        runtime.scale_loss(optimizer)
    check_same_start(module, plan.to_json(), runtime.stage_boundaries())
    return runtime
