"""This job's plan, the same on every rank: measured on the job's own devices, chosen on rank 0 (or given).

Every rank measures its share of the model's blocks and links (unless a plan was given, or the measurements
are cached), rank 0 plans, and every rank gets the same plan or the same error.

Once the job measured its own steps (`runtime.step_clock`), rank 0 reviews the plan (`review_step`) and every
rank learns at the same call whether the job switches to a faster layout (`agreed_switch`; the move itself is
`checkpoint.relayout`). It keeps its layout, and rank 0 names the faster one's arguments instead, where a switch
could not be exact or has nowhere to go through: PARTITA_SWITCH_LAYOUT=off; ranks on several nodes (no directory
is known to be shared); gradients held from an earlier call (accumulated over calls, which the switch would drop).
float16's loss scale goes through the checkpoint with the rest.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partita import settings
from partita.capture.export import CapturedGraph
from partita.capture.model_graph import model_graph
from partita.cluster import Cluster
from partita.errors import InternalError, PartitaError, PlanError, RankError
from partita.graph import ModelGraph, Profile
from partita.graph.profile import roofline_profile
from partita.launch import env
from partita.plan import Constraints, Plan, choose_plan
from partita.plan.explain import seconds
from partita.plan.plan import PRECISION_DTYPES
from partita.profile import OptimizerKind, Parallelize, device_spec, measure
from partita.runtime import agreement
from partita.runtime.optim import optimizer_state_factor
from partita.runtime.precision import DTYPES
from partita.runtime.same_graph import agreed_capture
from partita.runtime.state import local_part
from partita.runtime.step_clock import MEASURED_STEPS

log = logging.getLogger("partita")

OFF_BY = 0.15  # a measured step this far from the plan's estimate is reported, and the plan reviewed
# Another layout is switched to only if its estimate is at least this much below the measured step: estimates
# miss measured steps by 7 % (median, docs/results.md), so a smaller gain may be none, and the switch itself (a
# checkpoint round trip, seconds) pays for itself only over many steps.
SWITCH_GAIN = 0.10
# A switch is undone only if the steps after it are slower by more than this: two runs of the same layout's steps
# on 4 CPU ranks of a shared machine differ by as much, and switching back on noise (measured: a GPT switched
# from 2 stages to data parallelism and back at +4 %) costs another checkpoint round trip for nothing.
UNDO_LOSS = 0.05


@dataclass(frozen=True)
class Planned:
    """The plan, and on rank 0 what it was made from (None elsewhere, and when the plan was given)."""

    plan: Plan
    profile: Profile | None
    cluster: Cluster | None


@dataclass(frozen=True)
class PlanRequest:
    """What the plan must honour: the user's constraints, or a plan they gave."""

    constraints: Constraints
    given: Plan | str | Path | None
    optimizer_factor: float  # copies of the parameters the optimizer keeps as state
    optimizer: OptimizerKind | None = None  # the job's, whose step measuring times

    @classmethod
    def of(cls, constraints: Constraints, given: Plan | str | Path | None,
           optimizer: torch.optim.Optimizer | None) -> PlanRequest:
        return cls(constraints, given, optimizer_state_factor(optimizer), OptimizerKind.of(optimizer))


def agreed_plan(cap: CapturedGraph, graph: ModelGraph, rows: tuple[int, ...], request: PlanRequest,
                parallelize: Parallelize) -> Planned:
    """Collective. `rows`: every rank's local rows in this (first) call. `parallelize` is partita's own, to
    measure what its runtime costs."""
    world = env.world()
    profile = cluster = None
    if request.given is None:
        profile, cluster = _measure(cap, graph, max(rows), parallelize, request)
    result: list = [None]
    if world.rank == 0:
        try:
            # plans are for the steady state: full batches, of the largest rank's rows on every rank
            result[0] = _make_plan(graph, max(rows) * len(rows), profile, cluster, request).to_json()
        except Exception as e:  # noqa: BLE001 - every rank raises it, none waits for a plan that never comes
            result[0] = RankError.of(0, e if isinstance(e, PartitaError) else
                                      InternalError(f"rank 0 failed to plan: {type(e).__name__}: {e}"))
    if world.world_size > 1:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], RankError):
        raise result[0].error(named=False)
    return Planned(Plan.from_json(result[0]), profile, cluster)


def agreed_graph(cap: CapturedGraph, graph: ModelGraph) -> tuple[CapturedGraph, ModelGraph]:
    """Collective: the capture and graph every rank runs, rank 0's (`runtime.same_graph`), or the same
    CaptureError on every rank."""
    agreed = agreed_capture(cap, graph.digest)
    return (cap, graph) if agreed is cap else (agreed, model_graph(agreed))


def _device_memory(device: torch.device, local_world_size: int) -> int:
    """Memory one rank may plan for: the device's, or its share of host RAM, capped by PARTITA_MEMORY_LIMIT."""
    if device.type == "cuda":
        total = int(torch.cuda.mem_get_info(device)[1])
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_world_size)
    limit = settings.memory_limit()
    return int(total) if limit is None else min(int(total), limit)


def _measure(cap: CapturedGraph, graph: ModelGraph, local_batch: int, parallelize: Parallelize,
             request: PlanRequest):
    """(profile, cluster) on rank 0, (None, None) elsewhere: measured on this job's devices, or estimated
    from the device preset when PARTITA_PROFILE=estimate (faster, less exact); in the job's precision."""
    precision = request.constraints.precision
    world = env.world()
    memory = _device_memory(world.device, world.local_world_size)
    if settings.profile_mode() == "estimate":
        if world.rank != 0:
            return None, None
        spec = device_spec(world.device)
        per_node = max(1, min(world.local_world_size, world.world_size))
        cluster = Cluster(spec, max(1, world.world_size // per_node), per_node, memory_bytes=memory)
        return roofline_profile(graph, spec, PRECISION_DTYPES[precision]), cluster
    return measure(cap, graph, local_batch, world.device, world.local_world_size, memory, parallelize,
                   compute_dtype=DTYPES.get(precision), optimizer=request.optimizer)


def _make_plan(graph: ModelGraph, global_batch: int, profile: Profile | None, cluster: Cluster | None,
               request: PlanRequest) -> Plan:
    if request.given is None:
        return choose_plan(graph, profile, cluster, global_batch=global_batch,
                           optimizer_factor=request.optimizer_factor, constraints=request.constraints)
    plan = request.given if isinstance(request.given, Plan) else Plan.load(request.given)
    if plan.fingerprint and plan.fingerprint != graph.fingerprint:
        raise PlanError(
            f"the plan was made for another model (graph {plan.fingerprint}, this model's graph is "
            f"{graph.fingerprint}, {graph.num_blocks} blocks). Make a new plan for this model, or drop plan=... "
            "to let partita plan.")
    if request.constraints.schedule_problem(plan.schedule):
        raise PlanError(f"the plan given runs {plan.schedule}. {request.constraints.schedule_problem(plan.schedule)}")
    if plan.precision != request.constraints.precision:
        raise PlanError(f"the plan given computes in {plan.precision}, but parallelize was asked for "
                        f"precision={request.constraints.precision!r}: pass precision={plan.precision!r} with this "
                        "plan, or drop plan=... to let partita plan in the precision you want.")
    return plan.validate(env.world().world_size)


@dataclass(frozen=True)
class Review:
    """What rank 0 says about a measured step (`review_step`), and a layout worth switching to, if any."""

    level: int  # logging's
    text: str
    faster: Planned | None = None  # planned again from the refitted measurements, at least SWITCH_GAIN faster


def review_step(planned: Planned, graph: ModelGraph, request: PlanRequest, measured_s: float) -> Review:
    """Rank 0's review of a step measured against the plan's estimate. Beyond `OFF_BY`, the planner plans once
    more, with partita's fixed cost per step refitted so that this plan's estimate is the measured step (everything
    else as measured before), and says whether another layout would then be faster; one estimated at least
    `SWITCH_GAIN` faster than the measured step is the review's `faster`, for the job to switch to."""
    plan = planned.plan
    text = (f"a training step takes {seconds(measured_s)} (the median of {MEASURED_STEPS}, from a call of the model to "
            f"the end of its backward or optimizer step)")
    if plan.estimate is None:  # a plan made or edited by hand
        return Review(logging.INFO, f"{text}; the plan given holds no estimate to compare it with")
    estimate_s = plan.estimate.step_s
    off = measured_s / estimate_s - 1
    text = f"{text}; the plan estimated {seconds(estimate_s)} ({off:+.0%})"
    if abs(off) <= OFF_BY:
        return Review(logging.INFO, text)
    if planned.profile is None or planned.cluster is None:
        return Review(logging.WARNING, f"{text}. The plan was given, so partita has no measurements to plan again "
                                       "with; without plan=..., it plans from this job's own.")
    cluster = planned.cluster.with_step_overhead(not plan.runs_under_ddp, measured_s - estimate_s)
    again = choose_plan(graph, planned.profile, cluster, global_batch=plan.estimate.global_batch,
                        optimizer_factor=request.optimizer_factor, constraints=request.constraints)
    if again.layout == plan.layout:
        return Review(logging.WARNING, f"{text}. Planned again with partita's cost per step refitted to the measured "
                                       "step: this layout stays the fastest.")
    gain = 1 - again.estimate.step_s / measured_s
    text = (f"{text}. Planned again with partita's cost per step refitted to the measured step, another layout is "
            f"faster: {_choices(again)}, estimated {seconds(again.estimate.step_s)} per step, {gain:.0%} less "
            f"(this one: {_choices(plan)})")
    if gain < SWITCH_GAIN:
        return Review(logging.WARNING, f"{text}: too little to pay for switching. This job keeps its layout; to train "
                                       "under the other, pass those to parallelize.")
    return Review(logging.WARNING, text, Planned(again, planned.profile, cluster))


def review_switch(before: Planned, before_s: float, now: Plan, measured_s: float) -> Review:
    """Rank 0's review of the steps measured after a switch from `before` (whose steps took `before_s`) to
    `now`: a switch is an estimate, and one that made the steps slower (by more than `UNDO_LOSS`) is undone
    (`faster` is `before`), once: the job then keeps that layout."""
    change = measured_s / before_s - 1
    text = (f"after switching layouts a training step takes {seconds(measured_s)}, {seconds(before_s)} before "
            f"({change:+.0%})")
    if measured_s < before_s:
        return Review(logging.INFO, f"{text}: this job keeps the layout it switched to ({_choices(now)})")
    if change <= UNDO_LOSS:
        return Review(logging.INFO, f"{text}, as fast as before within the measurements' noise ({UNDO_LOSS:.0%}): this "
                                    f"job keeps the layout it switched to ({_choices(now)})")
    return Review(logging.WARNING, f"{text}: the layout before is faster ({_choices(before.plan)})", before)


def _choices(plan: Plan) -> str:
    """The arguments of parallelize that lead to `plan`'s layout."""
    levels = {s.sharding for s in plan.stages}
    sharding = f", sharding={levels.pop()!r}" if len(levels) == 1 else ""
    return (f"stages={plan.num_stages}, micro_batches={plan.micro_batches}, schedule={plan.schedule!r}"
            f"{sharding}")


def agreed_switch(review: Callable[[], Review], module: nn.Module, plan: Plan, sizes: tuple,
                  sizes_varied: bool) -> Planned | None:
    """Collective, at the call where every rank's step clock completed: rank 0 reviews the measured step with
    `review` and says what it found. The plan to switch to (on rank 0 with what it was made from), the same on
    every rank, or None to keep `plan`. Rank 0's failure to review raises on every rank. `sizes`: this call's
    inputs' sizes beyond the batch (`runtime.batch.sizes_beyond_batch`); `sizes_varied`: whether they varied
    over this rank's calls so far."""
    world = env.world()
    said = problem = None
    if world.rank == 0:
        try:
            said = review()
        except Exception as e:  # noqa: BLE001 - every rank raises it, none waits for a decision that never comes
            problem = RankError.of(0, e if isinstance(e, PartitaError) else
                                   InternalError(f"rank 0 failed to review the measured step: {type(e).__name__}: {e}"))
    faster = said.faster.plan.to_json() if said is not None and said.faster is not None else None
    enabled = settings.switch_layout_enabled() if world.rank == 0 else None  # rank 0's setting holds for all
    mine = (faster, enabled, problem, _holds_gradients(module), sizes, sizes_varied)
    every = [mine]
    if world.world_size > 1:
        every = [None] * world.world_size
        dist.all_gather_object(every, mine)
    faster, enabled, problem, _, first_sizes, _ = every[0]
    if problem is not None:
        raise problem.error(named=False)
    varied = [r for r, m in enumerate(every) if m[5] or m[4] != first_sizes]
    why = None if faster is None else _why_kept(enabled, world, plan, Plan.from_json(faster),
                                                [r for r, m in enumerate(every) if m[3]], varied)
    if world.rank == 0:
        env.log_to_stderr()
        ending = "" if faster is None else (". Switching to it" if why is None else
                                            f". This job keeps its layout ({why}); to train under the other, pass "
                                            "those to parallelize")
        log.log(said.level, "%s", said.text + ending)
    if faster is None or why is not None:
        return None
    return said.faster if world.rank == 0 else Planned(Plan.from_json(faster), None, None)


def _holds_gradients(module: nn.Module) -> bool:
    """Whether this rank holds a gradient other than zeros: one accumulated over calls, which a switch would drop."""
    return any(p.grad is not None and bool(local_part(p.grad).ne(0).any()) for p in module.parameters())


def _why_kept(enabled: bool, world: env.World, plan: Plan, faster: Plan, holding_gradients: list[int],
              sizes_varied: list[int]) -> str | None:
    """Why the job cannot switch from `plan` to `faster` at this call; None if it can. `sizes_varied`: the ranks
    whose inputs' sizes beyond the batch varied over their calls or differ from rank 0's at this one."""
    if not enabled:
        return "PARTITA_SWITCH_LAYOUT=off"
    if world.num_nodes > 1:
        return (f"its ranks are on {world.num_nodes} nodes, and partita knows of no directory they all see to move "
                "the model through")
    if holding_gradients:
        ranks = ", ".join(map(str, holding_gradients))
        return (f"rank{'s' if len(holding_gradients) > 1 else ''} {ranks} hold gradients from an earlier call "
                "(accumulated over calls, or zeroed only after the call), which a switch would drop")
    if sizes_varied and plan.runs_under_ddp and not faster.runs_under_ddp:
        ranks = ", ".join(map(str, sizes_varied))
        return (f"the inputs' sizes beyond the batch vary (on rank{'s' if len(sizes_varied) > 1 else ''} {ranks}, "
                "over calls or between ranks): data parallelism lets every rank pass its own, partita's pipelined "
                "runtime needs them alike on every rank in each call")
    return None
