"""The first automatic planner: fewest stages that fit memory, stages balanced by FLOPs.

Data parallelism alone when the whole model fits one device; otherwise the smallest pipeline depth whose
stages fit, with uniform replicas (world = pipeline ranks x replicas) and blocks split so that the largest
stage has the fewest forward FLOPs. Callers may fix any of stages, replicas, micro-batches and schedule.
"""

from __future__ import annotations

from dataclasses import replace

from partita.errors import BatchError, PlanError
from partita.graph import ModelGraph
from partita.plan.explain import size
from partita.plan.partition import balance
from partita.plan.plan import LOOPED_SCHEDULES, SCHEDULES, V_SCHEDULES, Plan, StagePlan, rank_layout


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in LOOPED_SCHEDULES + V_SCHEDULES else 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_microbatches(rows_per_replica: int, num_stages: int) -> int:
    """Enough micro-batches to keep a pipeline busy (2 per stage), never splitting a row."""
    if num_stages == 1:
        return 1
    candidates = _divisors(rows_per_replica)
    enough = [m for m in candidates if m >= 2 * num_stages]
    return min(enough) if enough else max(candidates)


def check_batch(rows_per_replica: int, num_microbatches: int, num_replicas: int, world_size: int) -> None:
    """Every micro-batch of every replica must get the same whole number of rows."""
    if rows_per_replica % num_microbatches:
        local = rows_per_replica * num_replicas // world_size
        raise BatchError(
            f"the global batch of {rows_per_replica * num_replicas} rows ({world_size} ranks x {local}) does "
            f"not split into {num_microbatches} micro-batches x {num_replicas} replicas: each replica gets "
            f"{rows_per_replica} rows. Use micro_batches from {_divisors(rows_per_replica)}, or a local "
            f"batch that makes {rows_per_replica // local if local else 1} x local batch a multiple of "
            f"{num_microbatches}."
        )


def stage_memory(graph: ModelGraph, blocks: tuple[int, int], optimizer_factor: float, rows_in_flight: int) -> int:
    """Parameters, gradients, optimizer state and held activations of one stage, in bytes."""
    params = graph.param_bytes_of(*blocks)
    acts = sum(b.activation_bytes.at(1) for b in graph.blocks[blocks[0]:blocks[1]])
    return int(params * (2 + optimizer_factor) + acts * rows_in_flight)


def _in_flight(schedule: str, position: int, pipeline_size: int, num_microbatches: int) -> int:
    if schedule == "1F1B":
        return min(num_microbatches, pipeline_size - position)
    return num_microbatches


def make_plan(graph: ModelGraph, world_size: int, num_stages: int, schedule: str, num_microbatches: int,
              local_batch: int, optimizer_factor: float, device_memory_bytes: int,
              reasons: tuple[str, ...] = ()) -> Plan:
    """A plan with the given shape, blocks balanced by FLOPs."""
    per_rank = stages_per_rank(schedule)
    pipeline_size = num_stages // per_rank
    replicas = world_size // pipeline_size
    costs = [b.fwd_flops.at(max(local_batch, 1)) for b in graph.blocks]
    ranges = balance(costs, num_stages)
    mb_rows = max(1, pipeline_size * max(local_batch, 1) // num_microbatches)
    layout = rank_layout(schedule, num_stages, replicas)
    stages = []
    for s, (start, stop) in enumerate(ranges):
        position = layout[s][0] % pipeline_size
        rows = mb_rows * _in_flight(schedule, position, pipeline_size, num_microbatches)
        params = graph.params_of(start, stop)
        stages.append(StagePlan(
            index=s, blocks=(start, stop), first_node=graph.blocks[start].first_node,
            last_node=graph.blocks[stop - 1].last_node, ranks=tuple(layout[s]),
            num_params=len(params), param_bytes=graph.param_bytes_of(start, stop),
            fwd_flops_per_sample=sum(b.fwd_flops.at(1) for b in graph.blocks[start:stop]),
            memory_bytes=stage_memory(graph, (start, stop), optimizer_factor, rows),
        ))
    return Plan(
        world_size=world_size, num_microbatches=num_microbatches, schedule=schedule, stages=tuple(stages),
        fingerprint=graph.fingerprint, num_blocks=graph.num_blocks, local_batch=local_batch,
        device_memory_bytes=device_memory_bytes, reasons=reasons,
    )


def auto_plan(graph: ModelGraph, *, world_size: int, local_batch: int, device_memory_bytes: int,
              optimizer_factor: float, stages: int | None = None, replicas: int | None = None,
              micro_batches: int | None = None, schedule: str | None = None) -> Plan:
    """Choose stages, replicas, micro-batches and schedule; honour every argument that is given."""
    if schedule is not None and schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    per_rank = stages_per_rank(schedule) if schedule else 1
    if stages is not None and replicas is not None and (stages // per_rank) * replicas != world_size:
        raise PlanError(
            f"stages={stages} x replicas={replicas} needs {stages // per_rank * replicas} ranks, "
            f"this job has {world_size}" + (f" ({schedule} puts {per_rank} stages on each rank)" if per_rank > 1 else "")
        )
    if stages is not None:
        if stages < 1 or stages % per_rank or world_size % (stages // per_rank):
            raise PlanError(
                f"{stages} stages do not fit {world_size} ranks: the world size must be a multiple of the "
                f"ranks per pipeline ({stages} stages / {per_rank} per rank). Choose stages from "
                f"{[d * per_rank for d in _divisors(world_size)]}."
            )
        depths = [stages // per_rank]
    elif replicas is not None:
        if replicas < 1 or world_size % replicas:
            raise PlanError(f"{replicas} replicas do not divide the world size {world_size}; choose from "
                            f"{_divisors(world_size)}")
        depths = [world_size // replicas]
    else:
        depths = _divisors(world_size)
    if max(depths) * per_rank > graph.num_blocks:
        if stages is not None or replicas is not None:
            raise PlanError(f"{max(depths) * per_rank} stages need at least that many blocks; the model "
                            f"has {graph.num_blocks}. Use at most {graph.num_blocks} stages.")
        depths = [d for d in depths if d * per_rank <= graph.num_blocks]

    tried = []
    for depth in depths:
        num_stages = depth * per_rank
        rows = depth * max(local_batch, 1)
        mbs = micro_batches or default_microbatches(rows, num_stages)
        sched = schedule or ("1F1B" if 1 < num_stages <= mbs else "GPipe")
        if local_batch:
            check_batch(rows, mbs, world_size // depth, world_size)
        plan = make_plan(graph, world_size, num_stages, sched, mbs, local_batch, optimizer_factor,
                         device_memory_bytes)
        peak = max(s.memory_bytes for s in plan.stages)
        tried.append((num_stages, peak))
        fits = not device_memory_bytes or peak <= device_memory_bytes
        if fits or len(depths) == 1:
            fixed = stages is not None or replicas is not None
            why = _reasons(plan, peak, device_memory_bytes, fixed=fixed, tried=tried[:-1])
            return replace(plan, reasons=why).validate(world_size)
    raise PlanError(
        "no plan fits in memory: " + ", ".join(f"{s} stages need {size(p)} per rank" for s, p in tried)
        + f", each rank has {size(device_memory_bytes)}. Use more ranks, a smaller local batch, "
        "or an optimizer with less state (SGD)."
    )


def _reasons(plan: Plan, peak: int, memory: int, fixed: bool, tried: list) -> tuple[str, ...]:
    out = []
    if fixed:
        out.append("stage count fixed by the caller")
    for s, p in tried:
        out.append(f"{s} stage{'s' if s > 1 else ''} would need {size(p)} per rank, more than the {size(memory)} "
                   "available")
    if plan.num_stages == 1:
        out.append("the whole model fits one device: data parallel only")
    else:
        out.append(f"{plan.num_stages} stages balanced by forward FLOPs; "
                   f"{plan.num_replicas} replica(s) of each stage")
    if memory:
        out.append(f"estimated peak {size(peak)} per rank of {size(memory)}")
    return tuple(out)
