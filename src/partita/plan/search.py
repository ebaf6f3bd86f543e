"""The planner's search: the layout and stage boundaries with the shortest simulated step that fits memory.

Search space: the pipeline depth (ranks per pipeline, a divisor of the world size; uniform replicas fill
the rest), the schedule (GPipe, 1F1B, and the looped Interleaved1F1B and LoopedBFS with two stages per rank),
the number of micro-batches (a divisor of the rows each replica computes, within the schedule's rules),
contiguous block ranges per stage, and recomputation per stage. Objective: the step time the discrete-event
simulator predicts (pipeline makespan + gradient all-reduce + optimizer step), subject to every rank's
memory.

Exact within that space, by branch and bound. Layouts are visited in order of a lower bound on their step time,
in two rounds: each with a small budget first (good plans found anywhere early cut every layout's search), then
those not finished with the full one (their searches taken up again with the tables they made kept). In a
layout, stage boundaries are chosen stage by stage, depth first, and a branch is cut as soon as a lower bound on
every completion's simulated step reaches the best step found (`plan.bounds` says why the bounds hold: cutting
never loses the optimum). Looped layouts go rank by rank instead: where the second loop starts, then both stages
of rank 0, of rank 1, ... (a rank's two stages share its memory and its time); from the second rank on, the
ranks chosen are also simulated with the others at their least, and the ranks left must still fit their loads
block by block (`plan.rank_loads`: one table for a window of second-loop starts rules them all out where it can,
and the ranks after a partial plan are held to a limit lowered by what its stages take more than the table
counts). Two plans closer than PRUNE_TOLERANCE count as equally fast, so that float rounding between a bound and
the simulator cannot keep the search among equal plans. A node budget keeps the search to seconds on huge
instances; when it runs out the result says so, with the gap between the best plan and the lower bound.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import NamedTuple

from partita.cluster import Cluster
from partita.graph import ModelGraph, Profile
from partita.plan.bounds import gpipe, gradients_return, layout_bound, remainder, water_level
from partita.plan.constraints import Constraints
from partita.plan.cost import CostModel, Layout, StageCost
from partita.plan.explain import size
from partita.plan.partition import balance
from partita.plan.plan import FSDP_LEVELS, divisors
from partita.plan.rank_loads import RankLoads, stage_floors
from partita.schedule import check_sizes, orders
from partita.schedule.catalog import stages_per_rank
from partita.sim import StageCosts, Trace, simulate
from partita.sim.longest_path import StepGraph, step_graph

SEARCHED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
# Nodes (a stage, or a looped layout's pair of stages, tried): per layout, so that one hard layout leaves
# budget for the others; and for the whole search: layouts are searched best bound first, so when it runs out
# the layouts left are the least promising ones (and their bounds go into the reported gap). A node costs
# 20-100 us of Python (a simulation of a partial plan counts as the nodes its actions cost);
# bench/search_time.py shows what instances need.
NODE_BUDGET = 10_000
SEARCH_BUDGET = 25_000
PROBE_BUDGET = 500  # nodes per layout in the first round (see `search`)
ACTIONS_PER_NODE = 500  # a node costs about as much Python as walking this many actions of the step graph
PRUNE_TOLERANCE = 1e-9  # relative: a plan this much faster than the best found does not count as faster
CHECKS_PER_NODE = 16  # a node costs about as much as this many pairs of stages checked by RankLoads
LOADS_REFRESH = 0.002  # relative: a better best step than this makes the ranks' load table again
LOADS_STEP, LOADS_LEVELS = 0.005, 20  # relative, and how many: the lower limits of ranks' load tables
LOADS_KEPT = 4  # x's whose ranks' load tables are kept (a search taken up again goes over the same x's first)
LEAST_WINDOW = 8  # x's: a window of second-loop starts this narrow is not screened by a table of its own


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    stages: tuple[StageCost, ...]
    trace: Trace
    tail_s: tuple[float, ...]  # per rank of one pipeline: gradient all-reduce + optimizer step
    allreduce_s: tuple[float, ...]  # per stage

    @property
    def step_s(self) -> float:
        return self.trace.step_s


@dataclass
class SearchResult:
    best: Candidate | None
    proven_optimal: bool
    layouts_considered: int
    layouts_searched: int
    nodes: int
    simulations: int
    lower_bound_s: float
    rejected: list[tuple[Layout, str]] = field(default_factory=list)  # layouts with no feasible partition, why


def layouts(graph: ModelGraph, cluster: Cluster, global_batch: int, constraints: Constraints) -> list[Layout]:
    """Every layout of the search space that the constraints allow."""
    world = cluster.world_size
    schedules = [s for s in ((constraints.schedule,) if constraints.schedule else SEARCHED_SCHEDULES)
                 if constraints.allows_schedule(s)]
    out = []
    for schedule in schedules:
        per_rank = stages_per_rank(schedule)
        for depth in divisors(world):
            num_stages = depth * per_rank
            replicas = world // depth
            if num_stages > graph.num_blocks or global_batch % replicas:
                continue
            if constraints.stages is not None and num_stages != constraints.stages:
                continue
            if constraints.replicas is not None and replicas != constraints.replicas:
                continue
            if num_stages == 1 and schedule != "GPipe":
                continue  # one stage: no pipeline, every schedule is the same
            rows = global_batch // replicas
            counts = [constraints.micro_batches] if constraints.micro_batches else divisors(rows)
            for m in counts:
                if rows % m:
                    continue
                try:
                    check_sizes(schedule, num_stages, depth, m)
                except ValueError:
                    continue
                out.append(Layout(schedule, num_stages, depth, replicas, m, rows // m, constraints.sharding))
                if num_stages == 1 and m == 1 and replicas > 1 and constraints.sharding is None:
                    # data parallelism alone under FSDP's levels runs pipelined, not under DDP: layouts of
                    # their own (Layout.pipelined)
                    out.extend(Layout(schedule, 1, depth, replicas, 1, rows, level) for level in FSDP_LEVELS)
    return out


def search(graph: ModelGraph, profile: Profile, cluster: Cluster, *, global_batch: int, optimizer_factor: float,
           constraints: Constraints = Constraints(), node_budget: int = NODE_BUDGET,
           search_budget: int = SEARCH_BUDGET, faster_than_s: float = math.inf) -> SearchResult:
    """The best plan of the search space (see the module docstring); with `faster_than_s`, only a plan whose
    step is shorter counts (none found: `best` is None)."""
    candidates = layouts(graph, cluster, global_batch, constraints)
    result = SearchResult(None, True, len(candidates), 0, 0, 0, math.inf)
    models = [CostModel(graph, profile, cluster, optimizer_factor, lay) for lay in candidates]
    bounded = sorted(((layout_bound(m), i) for i, m in enumerate(models)), key=lambda x: x[0])
    for bound, i in bounded:
        if bound == math.inf:
            result.rejected.append((models[i].layout, _too_big(models[i])))
    best_s = _first_plans(result, models, bounded, constraints.recompute, faster_than_s)
    # two rounds: first every promising layout with a small budget, which finishes the easy ones and finds good
    # plans in the others (a layout's first plans are near its balanced boundaries, often far from its best);
    # then the layouts left, with the full budget and the best step of all of them to cut with
    refined: dict[int, float] = {}
    unfinished: list[tuple[float, int]] = []  # filled by the first round
    # the first round's searches of those layouts, taken up again in the second with what they have worked out
    # (ranks' load tables) kept, so that going over the first round's nodes again costs less of the budget
    probes: dict[int, PartitionSearch] = {}
    for round_budget, round_layouts in ((PROBE_BUDGET, bounded), (node_budget, unfinished)):
        for bound, i in round_layouts:
            model = models[i]
            if bound >= best_s * (1 - PRUNE_TOLERANCE):
                result.lower_bound_s = min(result.lower_bound_s, bound)
                continue
            if i not in refined:
                refined[i] = layout_bound(model, refined=True)
                if refined[i] == math.inf:
                    result.rejected.append((model.layout, _too_big(model)))
            if refined[i] >= best_s * (1 - PRUNE_TOLERANCE):
                result.lower_bound_s = min(result.lower_bound_s, max(bound, refined[i]))
                continue
            budget = min(round_budget, search_budget - result.nodes)
            if budget <= 0:
                result.proven_optimal = False
                result.lower_bound_s = min(result.lower_bound_s, max(bound, refined[i]))
                continue
            partitions = probes.pop(i, None) or PartitionSearch(model, best_s, constraints.recompute)
            nodes, simulations = partitions.nodes, partitions.simulations
            found = partitions.run(best_s, budget)
            result.nodes += partitions.nodes - nodes
            result.simulations += partitions.simulations - simulations
            if found is not None and found.step_s < best_s:
                best_s, result.best = found.step_s, found
            if not partitions.complete:
                if round_layouts is bounded:
                    unfinished.append((bound, i))
                    probes[i] = partitions
                    continue
                result.proven_optimal = False
                result.lower_bound_s = min(result.lower_bound_s, max(bound, refined[i]))
            result.layouts_searched += 1
            if found is None and partitions.complete and partitions.infeasible_reason:
                result.rejected.append((model.layout, partitions.infeasible_reason))
    if result.best is not None:
        result.lower_bound_s = min(result.lower_bound_s, result.best.step_s)
    return result


def _first_plans(result: SearchResult, models: list[CostModel], bounded: list[tuple[float, int]],
                 recompute: bool | None, best_s: float) -> float:
    """A good plan early makes the exact search cut most branches: each layout's work-balanced boundaries, in
    order of the layouts' bounds while a bound is below the best step so far. Returns that step."""
    for bound, i in bounded:
        if bound >= best_s:
            break
        quick = PartitionSearch(models[i], best_s, recompute).balanced()
        result.simulations += 1
        if quick is not None and quick.step_s < best_s:
            best_s, result.best = quick.step_s, quick
    return best_s


def _too_big(model: CostModel) -> str:
    """Why no partition of this layout fits memory, when even the least the model needs does not."""
    need = remainder(model).memory(0) / model.layout.pipeline_size
    return (f"weights, gradients, optimizer state and one micro-batch's activations alone need at least "
            f"{size(need)} per rank, {size(model.capacity)} available after the process's own "
            f"{size(model.cluster.overhead_bytes)}")


@dataclass(frozen=True)
class _Path:
    """What the stages chosen so far imply for the bounds; extended one stage at a time."""

    stages: tuple[StageCost, ...] = ()
    fwd_prefix: float = 0.0  # forward + transfer time of the chosen stages (first micro-batch's way down)
    bwd_prefix: float = 0.0  # backward + transfer time of the chosen stages (last micro-batch's way up)
    max_fwd: float = 0.0
    max_bwd: float = 0.0
    rank_work: tuple[float, ...] = ()  # per pipeline position: forward + backward per micro-batch
    rank_start: tuple[float | None, ...] = ()  # per position: both prefixes at its first stage
    fwd_at: tuple[float, ...] = ()  # per stage chosen: the forward prefix where it starts
    bwd_at: tuple[float, ...] = ()  # per stage chosen: the backward prefix where it starts
    rank_memory: tuple[int, ...] = ()
    tails: tuple[float, ...] = ()  # per position: all-reduce + optimizer
    bound: float = 0.0  # a lower bound on the pipeline makespan of every completion
    back: float = 1.0  # 1: after a stage's last action its gradient goes back to stage 0 (0: zero-bubble W last)

    def extend(self, cost: StageCost, position: int, micro_batches: int, tail: float) -> "_Path":
        p = position
        prefix = self.fwd_prefix + self.back * self.bwd_prefix
        start = prefix if self.rank_start[p] is None else self.rank_start[p]
        rank_work = _put(self.rank_work, p, self.rank_work[p] + cost.work_s)
        return _Path(
            stages=self.stages + (cost,),
            fwd_prefix=self.fwd_prefix + cost.fwd_s + cost.send_fwd_s,
            bwd_prefix=self.bwd_prefix + cost.bwd_s + cost.send_fwd_s,
            max_fwd=max(self.max_fwd, cost.fwd_s), max_bwd=max(self.max_bwd, cost.bwd_s),
            rank_work=rank_work, rank_start=_put(self.rank_start, p, start),
            fwd_at=self.fwd_at + (self.fwd_prefix,), bwd_at=self.bwd_at + (self.bwd_prefix,),
            rank_memory=_put(self.rank_memory, p, self.rank_memory[p] + cost.memory.total),
            tails=_put(self.tails, p, self.tails[p] + tail),
            # a rank runs every micro-batch of its stages one action at a time, after the first micro-batch
            # reached its first stage, before the last one's gradient goes from there back to stage 0; so does
            # a stage, from its own place in the pipeline
            bound=max(self.bound, start + micro_batches * rank_work[p], prefix + micro_batches * cost.work_s),
            back=self.back,
        )


def _first(lowest: int, highest: int, holds) -> int:
    """The least i in [lowest, highest] for which `holds` (false below it, true from it on), else highest + 1."""
    lo, hi = lowest, highest + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _spread(micro_batches: int, stages: int) -> float:
    """W / this is the per-stage bound of work W split into `stages` stages (Remainder.chain). The stages
    after a rank's from their place (`_later_ranks_bound`) take at least the quick work of the rank's stage
    plus that of the blocks after it over this: a block moved from the rank's stage to those after adds at
    least as much as it takes away, so the stops' `too_short` may cut with it (it only grows as the stage
    shrinks)."""
    return 1.0 if micro_batches == 1 else 1.0 - ((micro_batches - 1) / micro_batches) ** stages


def _put(values: tuple, index: int, value) -> tuple:
    return values[:index] + (value,) + values[index + 1:]


class PartitionSearch:
    """Branch and bound over the stage boundaries (and recomputation) of one layout."""

    def __init__(self, model: CostModel, best_s: float = math.inf, recompute: bool | None = None, budget: int = 0):
        self.model, self.best_s, self.recompute, self.budget = model, best_s, recompute, budget
        lay = model.layout
        self.orders = orders(lay.schedule, lay.num_stages, lay.pipeline_size, lay.micro_batches)
        self.position = [model.ranks[s][0] % lay.pipeline_size for s in range(lay.num_stages)]
        # per stage: the positions of the ranks of the stages after it
        self.later = [sorted(set(self.position[s + 1:])) for s in range(lay.num_stages)]
        self.looped = stages_per_rank(lay.schedule) > 1
        self.back = 1.0 if gradients_return(lay.schedule) else 0.0
        # rank by rank where rank r runs stages r and r + P (not V-shaped) and every gradient goes back
        self.pairs = self.looped and self.back and all(q == s % lay.pipeline_size for s, q in enumerate(self.position))
        self.warmups = [_Warmup.of(order) for order in self.orders]
        # a simulation costs as much time as this many nodes: it counts as many against the budget
        self.simulation_nodes = max(1, sum(map(len, self.orders)) // ACTIONS_PER_NODE)
        self.last_stage = {p: s for s, p in enumerate(self.position)}  # per position: its last stage
        self.rest = remainder(model)
        self.capacity = model.capacity
        self._work_prefix = [model.work(0, i) for i in range(model.num_blocks + 1)]
        whole = model.stage(0, 0, model.num_blocks, False)
        # recomputation only helps when memory is short: if two stages as big as the whole model fit on one
        # rank, no stage ever needs it (so the search need not try it)
        self.memory_is_short = whole is None or 2 * whole.memory.total > self.capacity
        self.best: Candidate | None = None
        self.nodes = self.simulations = 0
        self.complete = True
        self.infeasible_reason = ""
        self.smallest_memory: int | None = None
        # ranks' load tables by start x of the second loop and by level (`_rank_loads`), for the last LOADS_KEPT x's
        self.loads: dict[int, dict[int, RankLoads]] = {}
        self.loads_limit = math.inf
        self.windows: dict[tuple[int, int], RankLoads] = {}  # ranks' load tables of windows of x's
        # second-loop starts whose plans an earlier run has searched to the end: none of them but those found can
        # step faster than the best step then, which is at least the best step now, so a later run skips them
        self.searched: set[int] = set()

    @property
    def cutoff(self) -> float:
        """A completion is worth searching only if its lower bound is below this."""
        return self.best_s * (1 - PRUNE_TOLERANCE)

    def _root(self) -> _Path:
        p = self.model.layout.pipeline_size
        return _Path(rank_work=(0.0,) * p, rank_start=(None,) * p, rank_memory=(0,) * p,
                     tails=(self.model.step_overhead_s,) * p, back=self.back)

    def balanced(self) -> Candidate | None:
        """The plan with boundaries that balance forward + backward work (no branching), if it fits."""
        model = self.model
        ranges = balance([model.work(i, i + 1) for i in range(model.num_blocks)], model.layout.num_stages)
        return self.simulate(ranges, [self.recompute] * len(ranges))

    def simulate(self, ranges: list[tuple[int, int]], recompute: list[bool | None]) -> Candidate | None:
        """The plan of these stage boundaries and recomputation (None: the cheapest that fits), simulated;
        None if it does not fit memory (or is not faster than `best_s`)."""
        path = self._root()
        for stage, ((start, stop), rc) in enumerate(zip(ranges, recompute)):
            cost = self.model.stage(stage, start, stop, rc)
            position = self.position[stage]
            if cost is None or path.rank_memory[position] + cost.memory.total > self.capacity:
                return None
            path = path.extend(cost, position, self.model.layout.micro_batches, self.model.tail_s(cost))
        self._evaluate(path)
        return self.best

    def run(self, best_s: float = math.inf, budget: int | None = None) -> Candidate | None:
        """The best plan of the layout faster than `best_s` and the best found before, searched from the start
        within `budget` more nodes (by default the one given); again after running out, with what the earlier
        run worked out kept."""
        self.best_s = min(self.best_s, best_s)
        self.budget = self.nodes + (self.budget if budget is None else budget)
        self.complete = True
        if self.pairs:
            self._search_pairs()
        else:
            self._descend(0, 0, self._root())
        if self.best is None and not self.infeasible_reason:
            cluster = self.model.cluster
            need = size(self.smallest_memory) if self.smallest_memory else "more than the model"
            self.infeasible_reason = (
                f"no stage boundaries fit: the smallest stage that did not fit needs {need} besides the "
                f"{size(cluster.overhead_bytes)} the process itself uses, {size(cluster.memory_per_rank)} per rank")
        return self.best

    def _descend(self, stage: int, start: int, path: _Path) -> None:
        if stage == self.model.layout.num_stages:
            self._evaluate(path)
            return
        for stop in self._stops(stage, start, path):
            for cost in self._options(stage, start, stop):
                self.nodes += 1
                if self.nodes > self.budget:
                    self.complete = False
                    return
                child = self._child(stage, stop, path, cost)
                if child is not None:
                    self._descend(stage + 1, stop, child)
                if not self.complete:
                    return

    def _options(self, stage: int, start: int, stop: int) -> list[StageCost]:
        """The ways to run a stage worth trying. With one stage per rank, the cheapest that fits is best;
        when stages share a rank, recomputing one may make room for the other, so both are tried."""
        model = self.model
        if self.recompute is not None or not self.looped or not self.memory_is_short:
            cost = model.stage(stage, start, stop, self.recompute)
            if cost is None:
                self._note_memory(stage, start, stop)
            return [cost] if cost is not None else []
        options = [c for c in (model.stage(stage, start, stop, False), model.stage(stage, start, stop, True))
                   if c is not None]
        if not options:
            self._note_memory(stage, start, stop)
        return options

    def _child(self, stage: int, stop: int, path: _Path, cost: StageCost) -> _Path | None:
        """The path with `cost` as the next stage, if it fits memory and its bound is below the cutoff."""
        lay = self.model.layout
        position = self.position[stage]
        if path.rank_memory[position] + cost.memory.total > self.capacity:
            return None  # two stages on one rank (looped schedules) must fit together
        child = path.extend(cost, position, lay.micro_batches, self.model.tail_s(cost))
        left = lay.num_stages - stage - 1
        if left and not self._rest_fits(stage, stop, child):
            return None
        makespan = max(child.bound, self._schedule_bound(stage, stop, child, cost),
                       self._rest_bound(stage, stop, child))
        if makespan + self._tail_bound(stage, stop, child) >= self.cutoff:
            return None
        return replace(child, bound=makespan)

    def _rest_fits(self, stage: int, stop: int, child: _Path) -> bool:
        """Whether the blocks after `stop` might fit the room left on the ranks of the stages after `stage`:
        all of them together, and stage by stage (each within its rank's room, as if alone there)."""
        capacity, memory = self.capacity, child.rank_memory
        if self.rest.memory(stop) > sum(capacity - memory[p] for p in self.later[stage]):
            return False
        return self.rest.fits(stop, [capacity - memory[p] for p in self.position[stage + 1:]])

    def _stops(self, stage: int, start: int, path: _Path):
        """Candidate ends of this stage, from the balanced one outwards. Each direction stops where a bound
        that only grows in that direction reaches the cutoff: the stage's own work (and memory) going up, the
        work (and memory) left for the later stages going down."""
        model, lay = self.model, self.model.layout
        n, m, left = model.num_blocks, lay.micro_batches, lay.num_stages - stage
        if left == 1:
            yield n
            return
        lowest, highest = start + 1, n - left + 1
        prefix = self._work_prefix
        target = prefix[start] + (prefix[n] - prefix[start]) / left
        balanced = min(max(bisect.bisect_left(prefix, target, lowest, highest), lowest), highest)
        if balanced > lowest and target - prefix[balanced - 1] <= prefix[balanced] - target:
            balanced -= 1
        prefixes = path.fwd_prefix + path.back * path.bwd_prefix
        limit = self.cutoff - max(path.tails)
        room = self.capacity - path.rank_memory[self.position[stage]]
        later_room = sum(self.capacity - path.rank_memory[p] for p in self.later[stage])
        up, down = balanced, balanced - 1
        while up <= highest or down >= lowest:
            if up <= highest:
                # a longer stage only takes more time, and more memory
                work = model.forward_s(start, up) + model.backward_s(start, up, model.param_bytes(start, up))
                if prefixes + m * work >= limit:
                    up = highest + 1
                elif model.memory_floor(stage, start, up) > room:
                    self._note_memory(stage, start, up)
                    up = highest + 1
                else:
                    yield up
                    up += 1
            if down >= lowest:
                # a shorter stage leaves more work, and more weights, to the later stages
                if prefixes + self._chain(down, left - 1) >= limit or self.rest.memory(down) > later_room:
                    down = lowest - 1
                else:
                    yield down
                    down -= 1

    def _schedule_bound(self, stage: int, stop: int, child: _Path, cost: StageCost) -> float:
        """Bounds from the schedule's orders (see plan.bounds): GPipe's makespan (exact once every stage is
        chosen), which LoopedBFS's is at least; and once a rank's stages are all chosen, its warm-up."""
        lay, rest = self.model.layout, self.rest
        m, left = lay.micro_batches, lay.num_stages - stage - 1
        bound = 0.0
        if lay.schedule in ("GPipe", "LoopedBFS"):
            if not left:
                bound = gpipe(child.fwd_prefix + child.bwd_prefix, m, child.max_fwd, child.max_bwd)
            else:
                total = child.fwd_prefix + child.bwd_prefix + rest.work(stop, left) + 2 * rest.sends(stop, left)
                bound = gpipe(total, m, max(child.max_fwd, rest.max_fwd(stop, left)),
                              max(child.max_bwd, rest.max_bwd(stop, left)))
        position = self.position[stage]
        if stage == self.last_stage[position] and self.back:
            bound = max(bound, self._warmup_bound(position, stop, child))
        return bound

    def _warmup_bound(self, position: int, stop: int, child: _Path) -> float:
        """A rank's first backward (of stage k) waits both for its warm-up forwards and for micro-batch 0's
        round trip from stage k through the later stages; the backward of its last forward waits for that
        micro-batch's round trip in the same way; and after its last action the gradient still goes back to
        stage 0 (`_Warmup.bound`). (For 1F1B: warm-up w, the first backward waits for max((w - 1) f, round
        trip) after the first forward.) Not for zero-bubble schedules, whose round trip needs only the
        input-gradient half of each backward."""
        lay, rest, stages = self.model.layout, self.rest, child.stages
        left = lay.num_stages - len(stages)
        later = rest.work(stop, left) + 2 * rest.sends(stop, left) if left else 0.0

        def round_trip(k: int) -> float:
            """From the end of F(k, i) to the start of B(k, i): the chosen stages after k, then the others."""
            return (child.fwd_prefix - child.fwd_at[k] - stages[k].fwd_s
                    + child.bwd_prefix - child.bwd_at[k] - stages[k].bwd_s + later)

        first = min(s for s, p in enumerate(self.position) if p == position)
        return self.warmups[position].bound(
            [c.fwd_s for c in stages], [c.bwd_s for c in stages], child.fwd_at, child.bwd_at, round_trip,
            child.fwd_at[first], lay.micro_batches * child.rank_work[position])

    def _rest_bound(self, stage: int, stop: int, child: _Path) -> float:
        """What the stages after `stage` add to the per-stage and per-rank bounds, whatever their split."""
        lay, rest = self.model.layout, self.rest
        m, left = lay.micro_batches, lay.num_stages - stage - 1
        if not left:
            return 0.0
        prefix = child.fwd_prefix + child.back * child.bwd_prefix
        bound = prefix + self._chain(stop, left)
        if self.looped:
            floors = [prefix if child.rank_start[p] is None else child.rank_start[p] + m * child.rank_work[p]
                      for p in self.later[stage]]
            bound = max(bound, water_level(floors, m * rest.work(stop, left)))
        return bound

    def _chain(self, start: int, stages: int) -> float:
        """The per-stage bound of blocks [start, n) split into `stages` stages (see Remainder.chain), counting
        only the way down when gradients need not come back (zero-bubble schedules)."""
        if self.back:
            return self.rest.chain(start, stages)
        return self.model.layout.micro_batches * self.rest.work(start, stages) / stages

    def _tail_bound(self, stage: int, stop: int, child: _Path) -> float:
        """The longest tail of every completion is at least this."""
        current = max(child.tails)
        left = self.model.layout.num_stages - stage - 1
        if not left:
            return current
        rest = self.rest
        if not self.looped:
            return max(current, self.model.step_overhead_s + rest.largest_stage_tail(stop, left))
        floors = [child.tails[p] for p in self.later[stage]]
        return max(current, water_level(floors, rest.tail_total(stop)),
                   min(floors) + rest.stage_tail(rest.largest_block_bytes(stop)))

    # ---- looped layouts: rank by rank --------------------------------------------------------------
    # A rank of a looped layout runs stage r of the first loop and stage r + P of the second. Chosen in
    # stage order, a rank's second stage comes long after its first, and so do its memory (the two share
    # it) and its work: the bounds learn little until the second loop. So the search first fixes where the
    # second loop starts (x), then both stages of rank 0, of rank 1, ...: each step completes a rank.

    def _search_pairs(self) -> None:
        lay, n = self.model.layout, self.model.num_blocks
        p = lay.pipeline_size
        prefix = self._work_prefix
        splits = sorted(range(p, n - p + 1), key=lambda x: (abs(2 * prefix[x] - prefix[n]), x))
        root = self._pair_root()
        self.floors = stage_floors(self.model)
        self.pair_warmups = [self.warmups[r].pair(r, r + p) for r in range(p)]
        for x in splits:
            if x in self.searched:
                continue
            if self._split_bound(x) < self.cutoff and self._windows_allow(x) and self._loads_allow(x, 0, 0, x):
                self._pair(0, 0, x, x, root)
            if not self.complete:
                return
            self.searched.add(x)

    def _windows_allow(self, x: int) -> bool:
        """Whether the tables of ranks' loads of the windows of x's that hold x may allow it (`RankLoads` of a
        window: it rules out every x of the window below the least second-loop start of rank 0). The windows halve
        [P, n - P] down to LEAST_WINDOW x's; each one's table is made once (again when the best step has improved
        by more than LOADS_REFRESH), so that where most x's are ruled out they cost no table of their own."""
        p, n = self.model.layout.pipeline_size, self.model.num_blocks
        lowest, highest = p, n - p
        limit = self.cutoff - self.least_tail_s
        outer = None  # the table of the window that holds this one: a looser table of it (see `_table`)
        while highest - lowest >= LEAST_WINDOW:
            window = (lowest, highest)
            loads = self.windows.get(window)
            if loads is None or limit < loads.limit_s * (1 - LOADS_REFRESH):
                loads = self._table(window, limit, outer)
                self._loads_allow(window, 0, 0, highest, loads)
                if not self.complete:
                    return False
                self.windows[window] = loads
            if x < loads.least_second_start(0, 0):
                return False
            outer = loads
            middle = (lowest + highest) // 2
            lowest, highest = (lowest, middle) if x <= middle else (middle + 1, highest)
        return True

    @cached_property
    def least_tail_s(self) -> float:
        """Every plan of a looped layout has its longest tail at least this (as in plan.bounds.layout_bound)."""
        rest = self.rest
        return self.model.step_overhead_s + max(rest.stage_tail(rest.largest_block_bytes(0)),
                                                rest.tail_total(0) / self.model.layout.pipeline_size)

    def loads_shift(self, state: "_Pairs", r: int, e: int, first: StageCost) -> float:
        """How much lower than the best step less the least tail the makespan of every completion of `state` with
        `first` as rank r's first stage ([c, e)) must keep for the ranks after r, in the terms of their table of
        loads. That table's bounds count the blocks before those ranks at their least (`Remainder.quick_work`,
        which adds up over ranges): ranks 0..r's first-loop stages take this much more, on micro-batch 0's way
        down and back to every later rank, in every one of those bounds. And the step's tail is at least the
        longest of the chosen ranks' tails."""
        excess = state.fwd1 + state.bwd1 + first.work_s + 2 * first.send_fwd_s - self.rest.quick_work(0, e, r + 1)
        tail = max(*state.tails, state.tails[r] + self.model.tail_s(first))
        return excess + max(tail - self.least_tail_s, 0.0)

    def _loads_allow(self, x: int | tuple[int, int], r: int, c: int, d: int, loads: RankLoads | None = None,
                     shift: float = 0.0) -> bool:
        """Whether ranks r.. may still finish below the best step from blocks c and d on (`RankLoads`, of x or
        of a window of x's; `loads`: that table, else one kept for x, for the makespan's limit lowered by
        `shift`); what the table costs counts against the budget."""
        loads = self._rank_loads(x, shift) if loads is None else loads
        before = loads.checks
        allowed = loads.feasible(r, c, d, (self.budget - self.nodes) * CHECKS_PER_NODE)
        self.nodes += (loads.checks - before) // CHECKS_PER_NODE
        if self.nodes > self.budget or loads.exhausted:
            self.complete = False
        return allowed and self.complete

    def _rank_loads(self, x: int, shift: float = 0.0) -> RankLoads:
        """A table of ranks' loads for the second loop starting at x, for the best step found so far (the tables
        are made again when that has improved by more than LOADS_REFRESH since) less at most `shift`: of the
        limits lower by LOADS_STEP of it at a time, the lowest within `shift` (a table for a higher limit than a
        partial plan needs holds for it too; the steps keep the tables few)."""
        limit = self.cutoff - self.least_tail_s
        if limit < self.loads_limit * (1 - LOADS_REFRESH):
            self.loads, self.loads_limit = {}, limit
        if x not in self.loads:
            self.loads[x] = {}
            if len(self.loads) > LOADS_KEPT:
                del self.loads[next(iter(self.loads))]  # the x left longest ago
        tables = self.loads[x]
        level = min(int(shift / (self.loads_limit * LOADS_STEP)), LOADS_LEVELS)
        if level not in tables:
            limit = self.loads_limit * (1 - level * LOADS_STEP)
            looser = max((known for known in tables if known < level), default=None)
            seed = tables[looser] if looser is not None else self._window_table(x, limit)
            tables[level] = self._table(x, limit, seed)
        return tables[level]

    def _window_table(self, x: int, limit: float) -> RankLoads | None:
        """The table of the narrowest window of x's that holds x, if it is for a limit at least `limit`."""
        held = [loads for (lowest, highest), loads in self.windows.items()
                if lowest <= x <= highest and loads.limit_s >= limit]
        return min(held, key=lambda loads: loads.x[1] - loads.x[0], default=None)

    def _table(self, x: int | tuple[int, int], limit: float | None = None,
               looser: RankLoads | None = None) -> RankLoads:
        """A new table of ranks' loads for x (or a window of x's), for the makespan's `limit` (by default the best
        step found so far less the least tail), seeded from a `looser` one: for a limit at least as high, of x or of
        a window that holds x (or this window): it never cuts a plan that this one must let through."""
        limit = self.cutoff - self.least_tail_s if limit is None else limit
        return RankLoads(self.floors, self.rest, x, limit, self.capacity, self.recompute, self.pair_warmups, looser)

    def _pair_root(self) -> "_Pairs":
        lay = self.model.layout
        return _Pairs(stages=(None,) * lay.num_stages, tails=(self.model.step_overhead_s,) * lay.pipeline_size)

    def _split_bound(self, x: int) -> float:
        """A lower bound of the step of every plan whose second loop starts at block x (inf: none fits)."""
        lay, rest = self.model.layout, self.rest
        p, m, n = lay.pipeline_size, lay.micro_batches, self.model.num_blocks
        cap = [self.capacity] * p
        if not (rest.fits(0, cap, x) and rest.fits(x, cap, n)) or rest.memory(0) > p * self.capacity:
            return math.inf
        first = rest.work(0, p, x) + 2 * rest.sends(0, p, x) + 2 * self.model.boundary_s(p - 1, x)
        makespan = max(m * (first + rest.work(x, p)) / p, rest.chain(0, p, x), first + rest.chain(x, p))
        tail = max(rest.tail_total(0, x) + rest.tail_total(x), 0.0) / p
        return makespan + self.model.step_overhead_s + tail

    def _pair(self, r: int, c: int, d: int, x: int, state: "_Pairs") -> None:
        """Choose both stages of rank r: [c, e) in the first loop, [d, g) in the second."""
        p = self.model.layout.pipeline_size
        if r == p:
            self._finish_pairs(state)
            return
        for e in self._first_stops(r, c, d, x, state):
            firsts = self._options(r, c, e)
            for first in firsts:
                for g in self._second_stops(r, d, e, x, state, first):
                    seconds = self._options(r + p, d, g)
                    for second in seconds:
                        self.nodes += 1
                        if self.nodes > self.budget:
                            self.complete = False
                            return
                        if first.memory.total + second.memory.total > self.capacity:
                            continue  # the rank's stages do not fit together (as _pair_child checks)
                        if pair_dominated(self.model, (first, second), firsts, seconds):
                            continue
                        child = self._pair_child(r, e, g, x, state, first, second)
                        if child is not None:
                            self._pair(r + 1, e, g, x, child)
                        if not self.complete:
                            return

    def _first_stops(self, r: int, c: int, d: int, x: int, state: "_Pairs"):
        """Ends of rank r's first-loop stage, from the balanced one outwards. Going up, the rank's own work
        and memory grow; going down, the work left to the later ranks (in both loops) grows."""
        model, rest = self.model, self.rest
        m, p, n = self.model.layout.micro_batches, self.model.layout.pipeline_size, model.num_blocks
        left = p - r - 1
        if not left:
            yield x
            return
        limit = self.cutoff - max(state.tails)
        rank_start = state.fwd1 + state.bwd1
        second_least = 2 * model.action_s  # the rank's second stage, at least
        later_least = rest.quick_work(n - left, n, left)  # the second loop's stages after this rank's, at least
        capacity = self.capacity

        def too_long(e: int) -> bool:
            if rank_start + m * (rest.quick_work(c, e, 1) + second_least) >= limit:
                return True
            if model.memory_floor(r, c, e) > capacity:
                self._note_memory(r, c, e)
                return True
            return False

        spread = _spread(m, left)

        def too_short(e: int) -> bool:
            return (rank_start + m * (rest.quick_work(e, x, left) + later_least) / left >= limit
                    or rank_start + rest.quick_work(c, e, 1) + rest.quick_work(e, x, left) / spread >= limit
                    or rest.quick_memory(e, x) > left * capacity)

        yield from self._outwards(c, c + 1, x - left, x, left + 1, too_long, too_short)

    def _second_stops(self, r: int, d: int, e: int, x: int, state: "_Pairs", first: StageCost):
        """Ends of rank r's second-loop stage, next to `first` on its rank, from the balanced one outwards."""
        model, rest = self.model, self.rest
        m, p, n = self.model.layout.micro_batches, self.model.layout.pipeline_size, model.num_blocks
        u, left = r + p, p - r - 1
        if not left:
            yield n
            return
        # the ranks after this one must still keep within the best step from (e, g) on, by their table of loads
        # for a limit lower by what the stages chosen take more than the table counts (`loads_shift`)
        shift = self.loads_shift(state, r, e, first)
        if not self._loads_allow(x, r + 1, e, n - left, shift=shift):
            return
        least = self._rank_loads(x, shift).least_second_start(r + 1, e)
        limit = self.cutoff - max(state.tails)
        rank_start = state.fwd1 + state.bwd1
        first_rest = rest.quick_work(e, x, left)
        # where stage u starts, at least: the whole first loop, then the second loop's stages before it
        before = rank_start + first.work_s + first_rest + state.fwd2 + state.bwd2
        later = rank_start + first.work_s  # where the next rank starts, at least
        room = self.capacity - first.memory.total
        room_after = left * self.capacity - rest.quick_memory(e, x)

        def too_long(g: int) -> bool:
            work = rest.quick_work(d, g, 1)
            if max(rank_start + m * (first.work_s + work), before + m * work) >= limit:
                return True
            # (the stage's floors over the ways the search runs it: the memory that sharding saves only where
            # unsharded it does not fit its rank alone, `StageFloors`)
            least_memory = min((o[1] for o in self.floors.options(u, d, g, self.recompute)), default=math.inf)
            if max(model.memory_floor(u, d, g), least_memory) > room:
                self._note_memory(u, d, g)
                return True
            return False

        spread = _spread(m, left)

        def too_short(g: int) -> bool:
            return (later + m * (first_rest + rest.quick_work(g, n, left)) / left >= limit
                    or before + rest.quick_work(d, g, 1) + rest.quick_work(g, n, left) / spread >= limit
                    or rest.quick_memory(g, n) > room_after)

        yield from self._outwards(d, max(d + 1, least), n - left, n, left + 1, too_long, too_short)

    def _outwards(self, start: int, lowest: int, highest: int, stop: int, stages: int, too_long, too_short):
        """Ends of a stage from `start` in [lowest, highest] that are neither `too_long` (a condition that
        only grows with the end) nor `too_short` (only shrinks), from the one that gives the stage an equal
        share of the work up to `stop` among `stages` stages outwards."""
        lowest = _first(lowest, highest, lambda e: not too_short(e))
        highest = _first(lowest, highest, too_long) - 1
        if lowest > highest:
            return
        prefix = self._work_prefix
        target = prefix[start] + (prefix[stop] - prefix[start]) / stages
        balanced = min(max(bisect.bisect_left(prefix, target, lowest, highest), lowest), highest)
        if balanced > lowest and target - prefix[balanced - 1] <= prefix[balanced] - target:
            balanced -= 1
        up, down = balanced, balanced - 1
        while up <= highest or down >= lowest:
            if up <= highest:
                yield up
                up += 1
            if down >= lowest:
                yield down
                down -= 1

    def _pair_child(self, r: int, e: int, g: int, x: int, state: "_Pairs", first: StageCost,
                    second: StageCost) -> "_Pairs | None":
        """The state with rank r's stages chosen, if they fit its memory and the bound is below the cutoff."""
        p = self.model.layout.pipeline_size
        step = _Step(r, r + p, e, g, x, p - r - 1, first, second)
        if first.memory.total + second.memory.total > self.capacity or not self._later_ranks_fit(step):
            return None
        ends = self._ends_of_loops(state, step)
        bounds = self._rank_bounds(state, step, ends)
        later = self._later_ranks_bound(state, step, ends)
        if later is None:
            return None
        jumps = self._looped_bfs_paths(state, step, ends)
        tails = _put(state.tails, r, state.tails[r] + self.model.tail_s(first) + self.model.tail_s(second))
        makespan = max(state.bound, later, jumps[-1], *bounds)
        tail = self._pair_tail(tails, step)
        if makespan + tail >= self.cutoff:
            return None
        stages = _put(_put(state.stages, r, first), step.u, second)
        if step.left and (r or step.left == 1):
            # with one rank chosen and several left the simulation says little more than its rank bound; with
            # every rank chosen, the plan is simulated anyway
            makespan = max(makespan, self._simulated_bound(stages, step))
            if makespan + tail >= self.cutoff:
                return None
        return _Pairs(
            stages=stages, fwd1=state.fwd1 + first.fwd_s + first.send_fwd_s,
            bwd1=state.bwd1 + first.bwd_s + first.send_fwd_s, fwd2=state.fwd2 + second.fwd_s + second.send_fwd_s,
            bwd2=state.bwd2 + second.bwd_s + second.send_fwd_s, max_fwd=max(state.max_fwd, first.fwd_s, second.fwd_s),
            max_bwd=max(state.max_bwd, first.bwd_s, second.bwd_s), max_fwd1=jumps[0], max_bwd1=jumps[1],
            jump_f=jumps[2], jump_b=jumps[3], tails=tails, bound=makespan)

    def _simulated_bound(self, stages: tuple[StageCost | None, ...], step: "_Step") -> float:
        """The simulated makespan with every stage not chosen yet at the least it can take (its loop's smallest
        block left, no transfers). The simulator's makespan is the longest path through a graph that the
        schedule's orders fix, weighted by the durations: it only grows with each of them, so every
        completion takes at least this. It sees what the other bounds miss: how the chosen ranks wait on each
        other when their two stages differ in size. With one rank left, its stages are known but for their
        recomputation: they take at least their cheapest way that fits (inf: none does)."""
        model, rest, p, n = self.model, self.rest, self.model.layout.pipeline_size, self.model.num_blocks
        self.nodes += self.simulation_nodes
        if step.left == 1:
            last = (model.stage(p - 1, step.e, step.x, self.recompute),
                    model.stage(2 * p - 1, step.g, n, self.recompute))
            if None in last:
                return math.inf
            stages = _put(_put(stages, p - 1, last[0]), 2 * p - 1, last[1])
        least = ((rest.least_fwd(step.e, step.x), rest.least_bwd(step.e, step.x)),
                 (rest.least_fwd(step.g, n), rest.least_bwd(step.g, n)))
        fwd, bwd, send_f, send_b = [], [], [], []
        for stage, cost in enumerate(stages):
            if cost is None:
                f, b = least[stage >= p]
                fwd.append(f)
                bwd.append(b)
                send_f.append(0.0)
                send_b.append(0.0)
            else:
                fwd.append(cost.fwd_s)
                bwd.append(cost.bwd_s)
                send_f.append(cost.send_fwd_s)
                send_b.append(cost.send_bwd_s)
        return self.step_graph.makespan_s(fwd, bwd, send_f, send_b)

    @cached_property
    def step_graph(self) -> StepGraph:
        """The layout's schedule as a graph, laid out once: the search simulates hundreds of partial plans."""
        return step_graph(self.orders, self.model.layout.num_stages)

    def _later_ranks_fit(self, step: "_Step") -> bool:
        """Whether the blocks left in both loops might fit the ranks after this one."""
        rest, left, cap = self.rest, step.left, self.capacity
        return not left or (rest.memory(step.e, step.x) + rest.memory(step.g) <= left * cap
                            and rest.fits(step.e, [cap] * left, step.x) and rest.fits(step.g, [cap] * left))

    def _ends_of_loops(self, state: "_Pairs", step: "_Step") -> tuple[float, float, float, float]:
        """Forward and backward prefixes where stage u starts, and of the whole pipeline, at least."""
        model, rest = self.model, self.rest
        first, second, left, e, g, x = step.first, step.second, step.left, step.e, step.g, step.x
        # from the first loop's last stage to the second loop's first
        cut = model.boundary_s(model.layout.pipeline_size - 1, x) if left else 0.0
        fwd_u = (state.fwd1 + first.fwd_s + first.send_fwd_s + state.fwd2
                 + (rest.fwd(e, left, x) + rest.sends(e, left, x) + cut if left else 0.0))
        bwd_u = (state.bwd1 + first.bwd_s + first.send_fwd_s + state.bwd2
                 + (rest.bwd(e, left, x) + rest.sends(e, left, x) + cut if left else 0.0))
        total_f = fwd_u + second.fwd_s + (second.send_fwd_s + rest.fwd(g, left) + rest.sends(g, left) if left else 0.0)
        total_b = bwd_u + second.bwd_s + (second.send_fwd_s + rest.bwd(g, left) + rest.sends(g, left) if left else 0.0)
        return fwd_u, bwd_u, total_f, total_b

    def _rank_bounds(self, state: "_Pairs", step: "_Step", ends: tuple[float, ...]) -> list[float]:
        """The rank from its first stage; its second stage from its place; its warm-up (see `_warmup_bound`)."""
        m = self.model.layout.micro_batches
        r, u, first, second = step.r, step.u, step.first, step.second
        f1, b1 = state.fwd1, state.bwd1
        fwd_u, bwd_u, total_f, total_b = ends
        fwd_at, bwd_at = {r: f1, u: fwd_u}, {r: b1, u: bwd_u}
        fwd, bwd = {r: first.fwd_s, u: second.fwd_s}, {r: first.bwd_s, u: second.bwd_s}
        round_trip = lambda k: total_f - fwd_at[k] - fwd[k] + total_b - bwd_at[k] - bwd[k]  # noqa: E731
        rank_work = first.work_s + second.work_s
        return [f1 + b1 + m * rank_work, fwd_u + bwd_u + m * second.work_s,
                self.warmups[r].bound(fwd, bwd, fwd_at, bwd_at, round_trip, f1, m * rank_work)]

    def _later_ranks_bound(self, state: "_Pairs", step: "_Step", ends: tuple[float, ...]) -> float | None:
        """What the ranks after this one add, whatever the split of the blocks left (None: they cannot fit):
        they share its work, and what their memory forces them to recompute; and the stages left of each loop
        from their place."""
        model, rest, lay = self.model, self.rest, self.model.layout
        m, p, n = lay.micro_batches, lay.pipeline_size, model.num_blocks
        left, e, g, x, first, second = step.left, step.e, step.g, step.x, step.first, step.second
        if not left:
            return 0.0
        flight = model.in_flight
        forced = rest.recomputed([(e, x), (g, n)], [rest.room(q) for q in range(step.r + 1, p)],
                                 [min(flight[q], flight[q + p]) for q in range(step.r + 1, p)])
        if forced == math.inf:
            return None
        fwd_u, bwd_u, _, _ = ends
        later = state.fwd1 + state.bwd1 + first.work_s + 2 * first.send_fwd_s  # where the next rank starts
        # and each one after it a first-loop stage later, of a block of [e, x) at least
        stage_least = rest.least_fwd(e, x) + rest.least_bwd(e, x)
        return max(water_level([later + j * stage_least for j in range(left)],
                               m * (rest.work(e, left, x) + rest.work(g, left) + forced)),
                   later + rest.chain(e, left, x),
                   fwd_u + bwd_u + second.work_s + 2 * second.send_fwd_s + rest.chain(g, left))

    def _looped_bfs_paths(self, state: "_Pairs", step: "_Step",
                          ends: tuple[float, ...]) -> tuple[float, float, float, float, float]:
        """LoopedBFS's makespan is the longest forward path plus the longest backward one, each a flow shop
        that turns at its slowest stage, or (a rank runs all its first stage's micro-batches before its
        second's) at the slowest of stages 0..r and again at the slowest of r+P..S-1 (checked against the
        simulator in tests/unit/test_search.py). Returns the first loop's slowest forward and backward so far,
        the longest jumping paths so far, and the bound (0 for other schedules)."""
        lay, rest = self.model.layout, self.rest
        m, left, e, g, x, first, second = lay.micro_batches, step.left, step.e, step.g, step.x, step.first, step.second
        max_f1, max_b1 = max(state.max_fwd1, first.fwd_s), max(state.max_bwd1, first.bwd_s)
        if lay.schedule != "LoopedBFS":
            return max_f1, max_b1, 0.0, 0.0, 0.0
        _, _, total_f, total_b = ends
        after_f = second.send_fwd_s + rest.fwd(g, left) + rest.sends(g, left) if left else 0.0
        after_b = second.send_fwd_s + rest.bwd(g, left) + rest.sends(g, left) if left else 0.0
        later_f = max(second.fwd_s, rest.max_fwd(g, left)) if left else second.fwd_s
        later_b = max(second.bwd_s, rest.max_bwd(g, left)) if left else second.bwd_s
        jump_f = max(state.jump_f, state.fwd1 + first.fwd_s + (m - 1) * max_f1 + second.fwd_s + after_f
                     + (m - 1) * later_f)
        jump_b = max(state.jump_b, state.bwd1 + first.bwd_s + (m - 1) * max_b1 + second.bwd_s + after_b
                     + (m - 1) * later_b)
        max_f = max(state.max_fwd, first.fwd_s, second.fwd_s)
        max_b = max(state.max_bwd, first.bwd_s, second.bwd_s)
        if left:
            max_f = max(max_f, rest.max_fwd(e, left, x), rest.max_fwd(g, left))
            max_b = max(max_b, rest.max_bwd(e, left, x), rest.max_bwd(g, left))
        bound = max(total_f + (m - 1) * max_f, jump_f) + max(total_b + (m - 1) * max_b, jump_b)
        return max_f1, max_b1, jump_f, jump_b, bound

    def _pair_tail(self, tails: tuple[float, ...], step: "_Step") -> float:
        """The longest tail, at least: the ranks chosen so far, and the ranks after them sharing the rest."""
        rest, left = self.rest, step.left
        tail = max(tails)
        if left:
            e, g, x, base = step.e, step.g, step.x, self.model.step_overhead_s
            tail = max(tail, base + (rest.tail_total(e, x) + rest.tail_total(g)) / left,
                       base + rest.stage_tail(max(rest.largest_block_bytes(e, x), rest.largest_block_bytes(g))))
        return tail

    def _finish_pairs(self, state: "_Pairs") -> None:
        """Every stage chosen: simulate them."""
        path, m = self._root(), self.model.layout.micro_batches
        for stage, cost in enumerate(state.stages):
            path = path.extend(cost, self.position[stage], m, self.model.tail_s(cost))
        self._evaluate(path)

    def _evaluate(self, path: _Path) -> None:
        lay, stages = self.model.layout, path.stages
        costs = StageCosts(
            forward_s=tuple(c.fwd_s for c in stages), backward_s=tuple(c.bwd_s for c in stages),
            send_activations_s=tuple(c.send_fwd_s for c in stages),
            send_gradients_s=tuple(c.send_bwd_s for c in stages),
        )
        trace = simulate(self.orders, costs, path.tails)
        self.simulations += 1
        if trace.step_s < self.best_s:
            self.best_s = trace.step_s
            self.best = Candidate(lay, tuple(stages), trace, path.tails, tuple(c.allreduce_s for c in stages))

    def _note_memory(self, stage: int, start: int, stop: int) -> None:
        """Remember the smallest refused stage, for the infeasibility message."""
        need = self.model.memory_needed(stage, start, stop)
        self.smallest_memory = need if self.smallest_memory is None else min(self.smallest_memory, need)


def evaluate(model: CostModel, ranges: list[tuple[int, int]], recompute: list[bool | None]) -> Candidate | None:
    """Simulate given stage boundaries and recomputation (None: the cheapest that fits) under the model's layout
    (None if they don't fit)."""
    return PartitionSearch(model).simulate(ranges, recompute)


def pair_dominated(model: CostModel, pair: tuple[StageCost, StageCost], firsts: list[StageCost],
                   seconds: list[StageCost]) -> bool:
    """Whether another way to run a looped rank's two stages over the same blocks (one of `firsts` with one of
    `seconds`, together within the rank's memory) makes no completion slower than `pair` does, so that the
    search need not try `pair`: its forwards, backwards and transfers take no longer, and its tail (the sum of
    its stages') is no longer. The simulated makespan is the longest path through a graph the schedule fixes,
    weighted by the durations, and the step adds the longest tail: neither grows when durations and tails
    shrink. The ranks after this one see neither its memory nor its sharding, so every completion of `pair` is
    one of the other way too, at least as fast: an optimum is kept. Of ways that take exactly as long, the
    first in the options' order is kept."""
    def times(way: tuple[StageCost, StageCost]) -> tuple[float, ...]:
        durations = tuple(t for c in way for t in (c.fwd_s, c.bwd_s, c.send_fwd_s, c.send_bwd_s))
        return (*durations, model.tail_s(way[0]) + model.tail_s(way[1]))

    ways = list(itertools.product(firsts, seconds))
    mine, index = times(pair), ways.index(pair)
    for other, way in enumerate(ways):
        if other == index or way[0].memory.total + way[1].memory.total > model.capacity:
            continue
        theirs = times(way)
        # a strict order (no two ways rule each other out): no slower anywhere, and faster somewhere or first
        if all(a <= b for a, b in zip(theirs, mine)) and (theirs != mine or other < index):
            return True
    return False


class _Step(NamedTuple):
    """Rank r's two stages under consideration: [c, e) of the first loop, [d, g) of the second."""

    r: int
    u: int  # its second stage, r + P
    e: int
    g: int
    x: int  # where the second loop starts
    left: int  # ranks after it
    first: StageCost
    second: StageCost


@dataclass(frozen=True)
class _Pairs:
    """A looped layout's stages chosen rank by rank: what the bounds need of them."""

    stages: tuple[StageCost | None, ...]  # by stage; None: not chosen yet
    fwd1: float = 0.0  # forward + transfers of the first loop's stages chosen
    bwd1: float = 0.0
    fwd2: float = 0.0  # forward + transfers of the second loop's stages chosen
    bwd2: float = 0.0
    max_fwd: float = 0.0
    max_bwd: float = 0.0
    max_fwd1: float = 0.0  # of the first loop's stages chosen
    max_bwd1: float = 0.0
    jump_f: float = 0.0  # LoopedBFS: the longest forward (backward) path through a rank's two stages so far
    jump_b: float = 0.0
    tails: tuple[float, ...] = ()  # per position
    bound: float = 0.0  # a lower bound of the makespan of every completion


@dataclass(frozen=True)
class _Warmup:
    """How a rank starts and ends its part of a schedule."""

    forwards: tuple[tuple[int, int], ...]  # (stage, how many) of the forwards it runs before its first backward
    first_backward: int  # the stage of its first backward
    last: int  # the stage of its last action
    # the stage of its last forward, when that comes after its first backward (else None), and (stage, how many)
    # of the backwards after it: those before that micro-batch's own backward there, and the rest
    last_forward: int | None = None
    cooldown_before: tuple[tuple[int, int], ...] = ()
    cooldown: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, order) -> "_Warmup":
        counts: dict[int, int] = {}
        first = next((stage for stage, op, _ in order if op != "F"), order[-1][0])
        for stage, op, _ in order:
            if op != "F":
                break
            counts[stage] = counts.get(stage, 0) + 1
        last_forward = max(i for i, (_, op, _) in enumerate(order) if op == "F")
        stage, _, micro_batch = order[last_forward]
        after = order[last_forward + 1:]
        # every forward before the first backward (GPipe), or backwards split in two (zero-bubble schedules, for
        # which the bounds use none of this)
        if last_forward < sum(counts.values()) or (stage, "B", micro_batch) not in after:
            return cls(tuple(counts.items()), first, order[-1][0])
        own = after.index((stage, "B", micro_batch))
        return cls(tuple(counts.items()), first, order[-1][0], stage, _counts(after[:own]), _counts(after[own:]))

    def pair(self, first: int, second: int) -> tuple[int, int, bool] | None:
        """For RankLoads, of a rank running stages `first` and `second`: the forwards of each before its first
        backward, and whether its last action is of `first`; None unless that backward is of `second`."""
        if self.first_backward != second or self.last not in (first, second):
            return None
        counts = dict(self.forwards)
        return counts.get(first, 0), counts.get(second, 0), self.last == first

    def bound(self, fwd, bwd, fwd_at, bwd_at, round_trip, start: float, work: float) -> float:
        """The rank's makespan at least, from its stages' forward and backward (fwd[s], bwd[s]), the prefixes
        where they start (fwd_at[s], bwd_at[s]), micro-batch 0's round trip from the end of a stage's forward
        to the start of its backward there (round_trip(s)), where its first action may start, and all its
        actions' time. Its first backward waits for its warm-up forwards and for that micro-batch's round trip
        through the later stages; the actions up to its last forward follow one by one; that forward's own
        backward waits for the same round trip (the backwards in between run meanwhile), the last ones follow,
        and after the last the gradient still goes back to stage 0."""
        warm = sum(count * fwd[s] for s, count in self.forwards)
        k = self.first_backward
        first = max(start + warm, fwd_at[k] + fwd[k] + round_trip(k))
        if self.last_forward is None:
            return first + work - warm + bwd_at[self.last]
        before = sum(count * bwd[s] for s, count in self.cooldown_before)
        after = sum(count * bwd[s] for s, count in self.cooldown)
        ending = max(before, round_trip(self.last_forward)) + after
        return first + work - warm - before - after + ending + bwd_at[self.last]


def _counts(actions) -> tuple[tuple[int, int], ...]:
    """(stage, how many) of these actions, by stage."""
    counts: dict[int, int] = {}
    for stage, _, _ in actions:
        counts[stage] = counts.get(stage, 0) + 1
    return tuple(counts.items())
