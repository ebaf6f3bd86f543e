"""`choose_plan`: from a model's numbers, a device profile and a cluster to the Plan, with reasons."""

from __future__ import annotations

import time
from dataclasses import replace

from partita.cluster import Cluster
from partita.errors import BatchError, PlanError
from partita.graph import ModelGraph, Profile
from partita.plan.cost import CostModel, Layout, StageCost
from partita.plan.explain import size
from partita.plan.plan import FSDP_LEVELS, SHARDING_LEVELS, Estimate, Plan, StagePlan, check_batch, divisors
from partita.plan.constraints import Constraints
from partita.plan.search import (NODE_BUDGET, SEARCH_BUDGET, SEARCHED_SCHEDULES, Candidate, PartitionSearch,
                                  SearchResult, evaluate, layouts, search)
from partita.schedule import check_sizes
from partita.schedule.catalog import FORWARDS_FIRST_SCHEDULES, SCHEDULES, stages_per_rank


SIMPLER_WITHIN = 0.05  # plans this close to the fastest simulated step count as equally fast


def choose_plan(graph: ModelGraph, profile: Profile, cluster: Cluster, *, global_batch: int,
                optimizer_factor: float, constraints: Constraints = Constraints(),
                node_budget: int = NODE_BUDGET) -> Plan:
    """The plan with the shortest simulated step that fits memory; every constraint given is honoured.

    `global_batch` is the rows of one optimizer step over all ranks (world size x local batch).
    """
    _check_constraints(graph, cluster, global_batch, constraints)
    started = time.perf_counter()
    result = search(graph, profile, cluster, global_batch=global_batch, optimizer_factor=optimizer_factor,
                    constraints=constraints, node_budget=node_budget)
    if result.best is None:
        raise PlanError(_infeasible(graph, profile, cluster, global_batch, optimizer_factor, constraints, result))
    fastest = result.best
    simpler = _fewer_pipeline_ranks(graph, profile, cluster, global_batch, optimizer_factor, constraints, fastest,
                                    node_budget)
    chosen = simpler or fastest
    model = CostModel(graph, profile, cluster, optimizer_factor, chosen.layout)
    plan = to_plan(graph, model, chosen, result, global_batch, profile, time.perf_counter() - started)
    reasons = _reasons(model, chosen, constraints, result, plan, fastest if simpler is not None else None)
    return replace(plan, reasons=reasons, precision=constraints.precision).validate(cluster.world_size)


def _fewer_pipeline_ranks(graph, profile, cluster, global_batch, optimizer_factor, constraints: Constraints,
                          fastest: Candidate, node_budget: int) -> Candidate | None:
    """The plan with the fewest ranks per pipeline (the most replicas) whose simulated step is within
    SIMPLER_WITHIN of the fastest, if it has fewer than the fastest and the caller fixed neither stages nor
    replicas. Steps that close are within the simulator's own error on measured runs
    (bench/simulator_accuracy.py), and a shallower pipeline sends fewer messages and has less to lose from an
    imbalance between stages that the measurements missed."""
    if constraints.stages is not None or constraints.replicas is not None:
        return None
    world = cluster.world_size
    # a plan inside the window is all this asks for, not the best one: a quarter of the search budget, over
    # all the shallower depths together (on a huge model none may come close, and each would spend it all)
    budget = SEARCH_BUDGET // 4
    for depth in divisors(world):
        if depth >= fastest.layout.pipeline_size or budget <= 0:
            return None
        result = search(graph, profile, cluster, global_batch=global_batch, optimizer_factor=optimizer_factor,
                        constraints=replace(constraints, replicas=world // depth), node_budget=node_budget,
                        search_budget=budget, faster_than_s=fastest.step_s * (1 + SIMPLER_WITHIN))
        if result.best is not None:
            return result.best
        budget -= result.nodes
    return None


def to_plan(graph: ModelGraph, model: CostModel, best: Candidate, result: SearchResult, global_batch: int,
            profile: Profile, search_s: float) -> Plan:
    lay = best.layout
    cluster = model.cluster
    position = [model.ranks[s][0] % lay.pipeline_size for s in range(lay.num_stages)]
    rank_total = [cluster.overhead_bytes] * lay.pipeline_size
    for s, c in enumerate(best.stages):
        rank_total[position[s]] += c.memory.total
    stages = []
    for s, c in enumerate(best.stages):
        a, b = c.blocks
        m = c.memory
        stages.append(StagePlan(
            index=s, blocks=(a, b), first_node=graph.blocks[a].first_node, last_node=graph.blocks[b - 1].last_node,
            ranks=tuple(model.ranks[s]), num_params=len(graph.params_of(a, b)), param_bytes=c.param_bytes,
            recompute=c.recompute, sharding=c.sharding, fwd_s=c.fwd_s, bwd_s=c.bwd_s, send_s=c.send_fwd_s,
            allreduce_s=c.allreduce_s,
            # "activations": what the rank holds beside its weights at its peak, the activations kept for the
            # backward with what FSDP's levels gather whole ("gathered") or, when larger, what the optimizer's
            # step allocates ("step")
            memory={"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
                    "activations": max(m.activations + m.gathered, m.step_transient), "step": m.step_transient,
                    "gathered": m.gathered, "buffers": m.buffers, "overhead": cluster.overhead_bytes},
            memory_bytes=rank_total[position[s]],
        ))
    trace = best.trace
    estimate = Estimate(
        step_s=trace.step_s, pipeline_s=trace.makespan_s, bubble_fraction=trace.bubble_fraction,
        samples_per_s=global_batch / trace.step_s if trace.step_s else 0.0, peak_memory_bytes=max(rank_total),
        memory_per_rank_bytes=cluster.memory_per_rank, global_batch=global_batch, cluster=cluster.describe(),
        profile=profile.source, proven_optimal=result.proven_optimal, lower_bound_s=result.lower_bound_s,
        layouts_searched=result.layouts_searched, layouts_considered=result.layouts_considered, search_s=search_s,
    )
    return Plan(
        world_size=cluster.world_size, micro_batches=lay.micro_batches, schedule=lay.schedule,
        stages=tuple(stages), fingerprint=graph.fingerprint, num_blocks=graph.num_blocks,
        local_batch=global_batch // cluster.world_size, device_memory_bytes=cluster.memory_per_rank,
        estimate=estimate,
    )


def simulate_plan(plan: Plan, graph: ModelGraph, profile: Profile, cluster: Cluster, optimizer_factor: float):
    """The simulated step (a Trace, for pictures) of a plan's exact layout, boundaries and recomputation."""
    global_batch = plan.estimate.global_batch if plan.estimate else plan.local_batch * plan.world_size
    rows = global_batch // plan.num_replicas // plan.micro_batches
    shardings = {s.sharding for s in plan.stages}
    layout = Layout(plan.schedule, plan.num_stages, plan.pipeline_size, plan.num_replicas, plan.micro_batches, rows,
                    shardings.pop() if len(shardings) == 1 else None)
    model = CostModel(graph, profile, cluster, optimizer_factor, layout)
    found = evaluate(model, [s.blocks for s in plan.stages], [s.recompute for s in plan.stages])
    if found is None:
        raise PlanError("the plan does not fit this cluster's memory")
    return found.trace


def _check_constraints(graph: ModelGraph, cluster: Cluster, global_batch: int, c: Constraints) -> None:
    """Clear errors for constraints that no layout can meet, before searching."""
    world = cluster.world_size
    if c.schedule is not None and c.schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {c.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if c.schedule is not None and c.schedule_problem(c.schedule):
        raise PlanError(c.schedule_problem(c.schedule))
    per_rank = stages_per_rank(c.schedule) if c.schedule else 1
    if c.stages is not None:
        if c.stages < 1 or c.stages % per_rank or world % (c.stages // per_rank):
            raise PlanError(
                f"{c.stages} stages do not fit {world} ranks: the world size must be a multiple of the ranks per "
                f"pipeline ({c.stages} stages / {per_rank} per rank). Choose stages from "
                f"{[d * per_rank for d in divisors(world)]}.")
        if c.stages > graph.num_blocks:
            raise PlanError(f"{c.stages} stages need at least that many blocks; the model has {graph.num_blocks}. "
                            f"Use at most {graph.num_blocks} stages.")
        if c.replicas is not None and (c.stages // per_rank) * c.replicas != world:
            raise PlanError(f"stages={c.stages} x replicas={c.replicas} needs {c.stages // per_rank * c.replicas} "
                            f"ranks, this job has {world}")
    if c.replicas is not None and (c.replicas < 1 or world % c.replicas):
        raise PlanError(f"{c.replicas} replicas do not divide the world size {world}; choose from {divisors(world)}")
    if c.micro_batches is not None:
        depth = (c.stages // per_rank) if c.stages else (world // c.replicas if c.replicas else None)
        if depth is not None:
            check_batch(global_batch // (world // depth), c.micro_batches, world // depth, world)
        else:
            _check_microbatch_split(graph, world, per_rank, global_batch, c.micro_batches)
    if not layouts(graph, cluster, global_batch, c):
        raise PlanError(f"no layout meets stages={c.stages}, replicas={c.replicas}, micro_batches={c.micro_batches}, "
                        f"schedule={c.schedule} with a global batch of {global_batch} on {world} ranks (for example "
                        f"1F1B needs at least as many micro-batches as stages); relax one of them")


def _check_microbatch_split(graph: ModelGraph, world: int, per_rank: int, global_batch: int,
                            micro_batches: int) -> None:
    """The batch error when no number of replicas leaves rows that split into `micro_batches`."""
    rows_of = {world // d: global_batch // (world // d) for d in divisors(world)
               if d * per_rank <= graph.num_blocks and global_batch % (world // d) == 0}
    if not rows_of or any(rows % micro_batches == 0 for rows in rows_of.values()):
        return
    each = " or ".join(f"{rows} rows ({replicas} replica{'s' if replicas > 1 else ''})"
                       for replicas, rows in sorted(rows_of.items(), reverse=True))
    valid = sorted(set().union(*(divisors(rows) for rows in rows_of.values())))
    raise BatchError(
        f"the global batch of {global_batch} rows ({world} ranks x {global_batch // world}) does not split into "
        f"{micro_batches} micro-batches whatever the layout: each replica gets {each}. Use micro_batches from "
        f"{valid}, or a local batch that is a multiple of {micro_batches}.")


def _data_parallel(graph, profile, cluster, global_batch, optimizer_factor,
                   sharding: str | None) -> tuple[float | None, int]:
    """Step time of data parallelism alone (None if it does not fit) and its memory per rank: the fastest of
    its layouts (under DDP, and pipelined under FSDP's levels) with `sharding` (None: any)."""
    world = cluster.world_size
    steps, memory = [], []
    for level in [sharding] if sharding is not None or world == 1 else [None, *FSDP_LEVELS]:
        layout = Layout("GPipe", 1, 1, world, 1, global_batch // world, level)
        model = CostModel(graph, profile, cluster, optimizer_factor, layout)
        found = PartitionSearch(model, recompute=False).balanced()
        cost = model.stage(0, 0, graph.num_blocks, False)
        steps += [found.step_s] if found else []
        memory.append(cost.memory.total + cluster.overhead_bytes if cost else _unconstrained_memory(model))
    return min(steps, default=None), min(memory)


def _unconstrained_memory(model: CostModel) -> int:
    """Memory of the whole model on one rank, even if it does not fit (for messages)."""
    g, lay = model.graph, model.layout
    params = g.param_bytes_of(0, g.num_blocks)
    acts = sum(model.profile.blocks[i].activation_bytes.at(lay.micro_batch_rows) for i in range(g.num_blocks))
    return int(params * (2 + model.optimizer_factor) + acts + model.cluster.overhead_bytes)


def _reasons(model: CostModel, chosen: Candidate, constraints: Constraints, result: SearchResult, plan: Plan,
             fastest_not_taken: Candidate | None = None) -> tuple[str, ...]:
    """Why the planner chose this plan, each reason with the figures of the search and simulations behind it."""
    out = []
    fixed = constraints.choices()
    if fixed:
        out.append("fixed by the caller: " + ", ".join(f"{k}={v}" for k, v in fixed.items()))
    if constraints.user_loss and constraints.schedule is None:
        out.append(f"schedules limited to {' and '.join(FORWARDS_FIRST_SCHEDULES)}: without loss_fn your code "
                   "computes the loss after the forward of every micro-batch")
    out.append(_search_reason(result, plan))
    if fastest_not_taken is not None:
        deeper = fastest_not_taken.layout.pipeline_size
        out.append(f"{plan.pipeline_size} rank(s) per pipeline rather than the {deeper} of the fastest simulated plan "
                   f"({fastest_not_taken.layout.describe()}, {fastest_not_taken.step_s:.4g} s per step): within "
                   f"{100 * SIMPLER_WITHIN:.0f}% of it, closer than the simulator can tell apart, and a shallower "
                   "pipeline sends fewer messages and depends less on how evenly its stages are balanced")
    if plan.num_stages == 1 and plan.micro_batches == 1:
        if fastest_not_taken is None:
            out.append("data parallel only: the whole model fits one device and nothing pipelined is faster")
    elif "stages" not in fixed:
        out.append(_data_parallel_reason(model, plan))
    if "micro_batches" not in fixed:
        out.extend(filter(None, [_one_micro_batch_reason(model, chosen, constraints)]))
    if any(s.recompute for s in plan.stages):
        out.append(f"recomputation on stage(s) {[s.index for s in plan.stages if s.recompute]} to fit memory")
    elif constraints.recompute is None:
        out.append(_no_recomputation_reason(model, chosen, plan))
    if constraints.sharding is None:
        out.extend(_sharding_reasons(model, chosen, plan))
    return tuple(out)


_SHARDED = {"optimizer": "optimizer state sharded over each stage's {} replicas (ZeRO-1)",
            "gradients": "gradients and optimizer state sharded over each stage's {} replicas (ZeRO-2, torch's "
                         "FSDP; the parameters gathered once per step)",
            "parameters": "parameters, gradients and optimizer state sharded over each stage's {} replicas "
                          "(ZeRO-3, torch's FSDP; each block's parameters gathered for each forward and backward)"}


_STAGES_DESCRIBED = 2  # stages whose sharding a reason details


def _sharding_reasons(model: CostModel, chosen: Candidate, plan: Plan) -> list[str]:
    """Why stages shard, one reason per level taken: what a replica holds, against the same stage unsharded;
    what it costs per step (collectives, and the step on the replica's share); and whether the stage would
    not fit sharding less, or shards because it is fastest so (stage_time_s)."""
    out = []
    for level in SHARDING_LEVELS[1:]:
        stages = [(i, c) for i, c in enumerate(chosen.stages) if c.sharding == level]
        if not stages:
            continue
        needs, faster, each = [], [], []
        less = [sh for sh in SHARDING_LEVELS[:SHARDING_LEVELS.index(level)]
                if sh != "optimizer" or model.optimizer_factor > 0]
        for i, c in stages:
            time_s = _time_as(model, c.sharding)
            lesser = [(cost, time_s(cost)) for cost in (_priced_as(model, i, c, sh) for sh in less)]
            (unsharded, unsharded_s), own_s = lesser[0], time_s(c)
            fitting = [(cost, t) for cost, t in lesser if cost.memory.total <= model.capacity]
            if fitting:
                best, best_s = min(fitting, key=lambda f: f[1])
                faster.append(f"{i} ({_ms(best_s - own_s)} ms less per step than {best.sharding!r})")
            else:
                needs.append(i)
            each.append(f"stage {i} holds {size(c.memory.total)} instead of {size(unsharded.memory.total)} "
                        f"({size(unsharded.memory.total - c.memory.total)} less) and takes "
                        f"{_more_or_less(own_s - unsharded_s)} per step" + _sharding_costs(c, unsharded))
        why = ([f"stage(s) {needs} would not fit with less sharding"] if needs else []) \
            + ([f"stage(s) {', '.join(faster)} are fastest with it"] if faster else [])
        if len(each) > _STAGES_DESCRIBED:  # a deep pipeline's stages are much alike: a few say what they all do
            each = each[:_STAGES_DESCRIBED] + [f"{len(each) - _STAGES_DESCRIBED} more stages alike"]
        out.append(f"{_SHARDED[level].format(plan.num_replicas)} on stage(s) {[i for i, _ in stages]}: "
                   f"{'; '.join(each)}; {'; '.join(why)}")
    return out


def _model_as(model: CostModel, sharding: str) -> CostModel:
    """The cost model under which a stage of `model`'s layout takes `sharding`: another for data parallelism
    alone, which FSDP's levels run pipelined and the others under DDP."""
    if sharding in model.shardings:
        return model
    return CostModel(model.graph, model.profile, model.cluster, model.optimizer_factor,
                     replace(model.layout, sharding=sharding))


def _priced_as(model: CostModel, stage: int, cost: StageCost, sharding: str) -> StageCost:
    """The chosen stage's blocks and recomputation under another sharding, fitting memory or not."""
    return _model_as(model, sharding).priced(stage, *cost.blocks, cost.recompute, sharding)


def _time_as(model: CostModel, sharding: str):
    """A stage's time per step under `sharding`, with the layout's own overhead per step (DDP's and a
    pipeline's differ), to compare levels with."""
    other = _model_as(model, sharding)
    return lambda cost: other.stage_time_s(cost) + other.step_overhead_s


def _sharding_costs(cost: StageCost, unsharded: StageCost) -> str:
    """What a sharded stage's step costs beside its compute, against the same stage unsharded."""
    parts = []
    if cost.collective_s:
        parts.append(f"collectives {_ms(cost.collective_s)} ms per micro-batch")
    if cost.gather_s:
        parts.append(f"an all-gather of the parameters {_ms(cost.gather_s)} ms per step")
    if cost.allreduce_s < unsharded.allreduce_s:
        parts.append(f"all-reduce {_ms(cost.allreduce_s)} ms instead of {_ms(unsharded.allreduce_s)}")
    parts.append(f"optimizer step {_ms(cost.optimizer_s)} ms instead of {_ms(unsharded.optimizer_s)}")
    return f" ({', '.join(parts)})"


def _more_or_less(seconds: float) -> str:
    return f"{_ms(abs(seconds))} ms {'more' if seconds >= 0 else 'less'}"


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g}"


def _search_reason(result: SearchResult, plan: Plan) -> str:
    est = plan.estimate
    if result.proven_optimal:
        return (f"fastest simulated step of {result.layouts_considered} layouts (stages x replicas x schedule x "
                f"micro-batches); {result.layouts_searched} needed a search of their stage boundaries, lower "
                "bounds ruled out the rest; proven optimal in this space")
    gap = (est.step_s - result.lower_bound_s) / est.step_s if est.step_s else 0.0
    return (f"best found among {result.layouts_considered} layouts before the search budget ran out: no plan "
            f"steps faster than {result.lower_bound_s:.4g} s (a lower bound), so this one is at most "
            f"{100 * gap:.0f}% slower than the best possible")


def _data_parallel_reason(model: CostModel, plan: Plan) -> str:
    cluster = model.cluster
    dp_step, dp_memory = _data_parallel(model.graph, model.profile, cluster, plan.estimate.global_batch,
                                        model.optimizer_factor, model.layout.sharding)
    if dp_step is None:
        return (f"data parallel alone does not fit: it needs {size(dp_memory)} per rank, "
                f"{size(cluster.memory_per_rank)} available")
    slower = 100 * (dp_step / plan.estimate.step_s - 1)
    return f"data parallel alone would take {dp_step:.4g} s per step ({slower:+.0f}%)"


def _one_micro_batch_reason(model: CostModel, chosen: Candidate, constraints: Constraints) -> str | None:
    """Why a pipeline runs its batch as one micro-batch: the same stages simulated with the batch split into
    more (each divisor of the rows, each schedule that runs these stages), the fastest of them."""
    lay = chosen.layout
    if lay.micro_batches != 1 or lay.num_stages == 1:
        return None
    rows = lay.micro_batch_rows
    if rows == 1:
        return "one micro-batch: each replica computes a single row, which does not split"
    ranges = [c.blocks for c in chosen.stages]
    split = [found for found in (_same_stages(model, chosen, schedule, m, ranges)
                                 for m in divisors(rows)[1:] for schedule in SEARCHED_SCHEDULES
                                 if stages_per_rank(schedule) == stages_per_rank(lay.schedule)
                                 and constraints.allows_schedule(schedule)
                                 and constraints.schedule in (None, schedule)) if found is not None]
    if not split:
        return "one micro-batch: with these stages, no split of the batch into more micro-batches fits memory"
    best = min(split, key=lambda c: c.step_s)
    more = best.layout

    def compute_s(c: Candidate) -> float:  # what the stages compute in a step, partita's runtime per action included
        return sum(s.work_s for s in c.stages) * c.layout.micro_batches

    return (f"one micro-batch: the fastest split of the same stages into more, {more.micro_batches} micro-batches of "
            f"{more.micro_batch_rows} rows ({more.schedule}), simulates {best.step_s:.4g} s per step "
            f"({100 * (best.step_s / chosen.step_s - 1):+.0f}%): its bubble shrinks from "
            f"{100 * chosen.trace.bubble_fraction:.0f}% to {100 * best.trace.bubble_fraction:.0f}%, but the stages' "
            f"compute grows from {compute_s(chosen):.4g} to {compute_s(best):.4g} s per step (each micro-batch pays "
            f"the blocks' fixed costs and {1e3 * model.action_s:.2g} ms of runtime per action again)")


def _same_stages(model: CostModel, chosen: Candidate, schedule: str, micro_batches: int,
                 ranges: list[tuple[int, int]]) -> Candidate | None:
    """The chosen stage boundaries under another schedule and micro-batch count, simulated (recomputing
    only where needed to fit); None where that layout is not valid or does not fit."""
    lay = chosen.layout
    try:
        check_sizes(schedule, lay.num_stages, lay.pipeline_size, micro_batches)
    except ValueError:
        return None
    layout = Layout(schedule, lay.num_stages, lay.pipeline_size, lay.num_replicas, micro_batches,
                    lay.micro_batch_rows // micro_batches, lay.sharding)
    other = CostModel(model.graph, model.profile, model.cluster, model.optimizer_factor, layout)
    return evaluate(other, ranges, [None] * len(ranges))


def _no_recomputation_reason(model: CostModel, chosen: Candidate, plan: Plan) -> str:
    """Why no stage recomputes: they all fit with their activations kept, and recomputing costs time (the same
    plan simulated with every stage recomputing)."""
    peak = size(plan.estimate.peak_memory_bytes)
    text = (f"no recomputation: every stage fits with its activations kept (peak {peak} of "
            f"{size(model.cluster.memory_per_rank)} per rank)")
    everywhere = evaluate(model, [c.blocks for c in chosen.stages], [True] * len(chosen.stages))
    if everywhere is not None:
        text += (f"; recomputing every stage would take {everywhere.step_s:.4g} s per step "
                 f"({100 * (everywhere.step_s / chosen.step_s - 1):+.0f}%)")
    return text


def _fitting_layout(graph, profile, cluster, global_batch, optimizer_factor, recompute) -> Layout | None:
    """A layout whose work-balanced boundaries fit memory, trying the deepest pipelines first (a quick check,
    for suggestions; not a search)."""
    candidates = sorted(layouts(graph, cluster, global_batch, Constraints(recompute=recompute)),
                        key=lambda lay: (-lay.pipeline_size, lay.micro_batch_rows))
    for layout in candidates[:24]:
        model = CostModel(graph, profile, cluster, optimizer_factor, layout)
        if PartitionSearch(model, recompute=recompute).balanced() is not None:
            return layout
    return None


def _infeasible(graph, profile, cluster, global_batch, optimizer_factor, constraints, result) -> str:
    lines = [f"no plan fits in {size(cluster.memory_per_rank)} per rank on {cluster.describe()}:"]
    if cluster.overhead_bytes >= cluster.memory_per_rank:
        lines.append(f"  the process itself already uses {size(cluster.overhead_bytes)} (libraries, device context, "
                     "the inputs): more than is available")
    for layout, why in result.rejected[:4]:
        lines.append(f"  {layout.describe()}: {why}")
    _, dp_memory = _data_parallel(graph, profile, cluster, global_batch, optimizer_factor, constraints.sharding)
    lines.append(f"  the whole model on one rank needs {size(dp_memory)}")
    changes = []
    for factor in (2, 4, 8, 16, 32, 64):
        bigger = replace(cluster, num_nodes=cluster.num_nodes * factor)
        fits = _fitting_layout(graph, profile, bigger, global_batch * factor, optimizer_factor, constraints.recompute)
        if fits is not None:
            changes.append(f"{bigger.world_size} devices (same local batch) would fit, e.g. as {fits.describe()}")
            break
    if constraints.recompute is False:
        changes.append("allow recomputation (recompute=None)")
    if constraints.stages or constraints.replicas:
        changes.append("let partita choose stages and replicas")
    if constraints.sharding not in (None, "parameters") and cluster.world_size > 1:
        changes.append('sharding="parameters" (ZeRO-3: each stage\'s replicas split its parameters, gradients '
                       'and optimizer state), or sharding=None (the planner\'s choice)')
    changes.append("a smaller local batch, weights in bfloat16 (half the bytes), or an optimizer with less state "
                   "(SGD keeps none)")
    lines.append("  smallest changes that would fit: " + "; ".join(changes))
    return "\n".join(lines)
