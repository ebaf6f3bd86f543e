"""The planner's search: the layout and stage boundaries with the shortest simulated step that fits memory.

Search space: the pipeline depth (ranks per pipeline, a divisor of the world size; uniform replicas fill
the rest), the schedule (GPipe, 1F1B, and the looped Interleaved1F1B and LoopedBFS with two stages per rank),
the number of micro-batches (a divisor of the rows each replica computes, within the schedule's rules),
contiguous block ranges per stage, and recomputation per stage. Objective: the step time the discrete-event
simulator predicts (pipeline makespan + gradient all-reduce + optimizer step), subject to every rank's
memory.

Exact within that space, by branch and bound. Layouts are visited in order of a lower bound on their step
time; in a layout, stage boundaries are chosen stage by stage, depth first, and a branch is cut as soon as a
lower bound on every completion's simulated step reaches the best step found. The bounds hold for any
schedule in which a rank runs one action at a time (see `_Bounds`), so cutting never loses the optimum. A
node budget keeps the search to seconds on huge instances; when it runs out the result says so, with the gap
between the best plan and the lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from partita.cluster import Cluster
from partita.errors import PlanError
from partita.graph import ModelGraph, Profile
from partita.plan.constraints import Constraints
from partita.plan.cost import CostModel, Layout, StageCost
from partita.schedule.catalog import stages_per_rank
from partita.plan.explain import size
from partita.plan.partition import balance
from partita.schedule import check_sizes, orders
from partita.sim import StageCosts, Trace, simulate

SEARCHED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
NODE_BUDGET = 4_000  # per layout: small instances finish far below it; see SearchResult.proven_optimal
# for the whole search: layouts are searched best bound first, so when it runs out the layouts left are the
# least promising ones (and their bounds go into the reported gap); about a second of Python at most
SEARCH_BUDGET = 12_000
# Looped layouts have only weak bounds (no closed form is known for them), so a deep search there rarely
# pays off; they get a quarter of the budget.
LOOPED_SHARE = 4


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(graph: ModelGraph, cluster: Cluster, global_batch: int, constraints: Constraints) -> list[Layout]:
    """Every layout of the search space that the constraints allow."""
    world = cluster.world_size
    schedules = [s for s in ((constraints.schedule,) if constraints.schedule else SEARCHED_SCHEDULES)
                 if constraints.allows_schedule(s)]
    out = []
    for schedule in schedules:
        per_rank = stages_per_rank(schedule)
        for depth in _divisors(world):
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
            counts = [constraints.micro_batches] if constraints.micro_batches else _divisors(rows)
            for m in counts:
                if rows % m:
                    continue
                try:
                    check_sizes(schedule, num_stages, depth, m)
                except ValueError:
                    continue
                out.append(Layout(schedule, num_stages, depth, replicas, m, rows // m))
    return out


def search(graph: ModelGraph, profile: Profile, cluster: Cluster, *, global_batch: int, optimizer_factor: float,
           constraints: Constraints = Constraints(), node_budget: int = NODE_BUDGET,
           search_budget: int = SEARCH_BUDGET, faster_than_s: float = math.inf) -> SearchResult:
    """The best plan of the search space (see the module docstring); with `faster_than_s`, only a plan whose
    step is shorter counts (none found: `best` is None)."""
    candidates = layouts(graph, cluster, global_batch, constraints)
    result = SearchResult(None, True, len(candidates), 0, 0, 0, math.inf)
    models = [CostModel(graph, profile, cluster, optimizer_factor, lay) for lay in candidates]
    bounded = sorted(((_layout_bound(m), i) for i, m in enumerate(models)), key=lambda x: x[0])
    # a good plan early makes the exact search cut most branches: each layout's work-balanced boundaries
    best_s = faster_than_s
    for bound, i in bounded:
        if bound >= best_s:
            break
        if _too_big(models[i]):
            continue
        quick = _PartitionSearch(models[i], best_s, constraints.recompute, 0).balanced()
        result.simulations += 1
        if quick is not None and quick.step_s < best_s:
            best_s, result.best = quick.step_s, quick
    for bound, i in bounded:
        if bound >= best_s:
            result.lower_bound_s = min(result.lower_bound_s, bound)
            continue
        model = models[i]
        too_big = _too_big(model)
        if too_big:
            result.rejected.append((model.layout, too_big))
            continue
        budget = node_budget // LOOPED_SHARE if stages_per_rank(model.layout.schedule) > 1 else node_budget
        budget = min(budget, search_budget - result.nodes)
        if budget <= 0:
            result.proven_optimal = False
            result.lower_bound_s = min(result.lower_bound_s, bound)
            continue
        search = _PartitionSearch(model, best_s, constraints.recompute, budget)
        found = search.run()
        result.layouts_searched += 1
        result.nodes += search.nodes
        result.simulations += search.simulations
        if not search.complete:
            result.proven_optimal = False
            result.lower_bound_s = min(result.lower_bound_s, bound)
        if found is not None and found.step_s < best_s:
            best_s, result.best = found.step_s, found
        elif found is None and search.complete and search.infeasible_reason:
            result.rejected.append((model.layout, search.infeasible_reason))
    if result.best is not None:
        result.lower_bound_s = min(result.lower_bound_s, result.best.step_s)
    return result


def _too_big(model: CostModel) -> str:
    """Why no partition of this layout can fit (empty if one might): the average rank's weights, gradients and
    optimizer state alone exceed its memory."""
    need = model.static_bytes_lower_bound(0, model.num_blocks, model.layout.pipeline_size)
    if need <= model.capacity:
        return ""
    return (f"weights, gradients and optimizer state alone need at least {size(need)} per rank, "
            f"{size(model.capacity)} available after the process's own {size(model.cluster.overhead_bytes)}")


def _layout_bound(model: CostModel) -> float:
    """No partition of this layout steps faster: some rank does at least the average work, and one
    micro-batch crosses every block forward and back; some rank steps at least the average optimizer work.

    With one stage per rank (GPipe, 1F1B), stage s cannot start before micro-batch 0 has passed the stages
    before it, nor finish before the last gradient has gone back through them: the pipeline takes at least
    prefix_s + M w_s for every stage s (prefix_s: the work of the stages before it, w_s its own). The least
    that maximum can be over all splits of the work W, whole blocks or not, is when every term is equal:
    w_s = T/M ((M-1)/M)^s, which sums to W for T = W / (1 - ((M-1)/M)^P). It is never below the bounds above
    (and checked against the simulator on random stages)."""
    lay = model.layout
    work = model.work(0, model.num_blocks)
    params = model.graph.param_bytes_of(0, model.num_blocks)
    m, p = lay.micro_batches, lay.pipeline_size
    pipeline = max(m * work / p, work)
    if stages_per_rank(lay.schedule) == 1 and m > 1:
        pipeline = max(pipeline, work / (1.0 - ((m - 1) / m) ** p))
    return pipeline + model.optimizer_s(params) / p


@dataclass(frozen=True)
class _Path:
    """What the stages chosen so far imply for the bounds; extended one stage at a time."""

    stages: tuple[StageCost, ...] = ()
    fwd_prefix: float = 0.0  # forward + transfer time of the chosen stages (first micro-batch's way down)
    bwd_prefix: float = 0.0  # backward + transfer time of the chosen stages (last micro-batch's way up)
    max_fwd: float = 0.0
    max_bwd: float = 0.0
    rank_work: tuple[float, ...] = ()  # per pipeline position: forward + backward per micro-batch
    rank_start: tuple[tuple[float, float] | None, ...] = ()  # per position: prefixes at its first stage
    rank_memory: tuple[int, ...] = ()
    tails: tuple[float, ...] = ()  # per position: all-reduce + optimizer
    bound: float = 0.0  # a lower bound on the pipeline makespan of every completion

    def extend(self, cost: StageCost, position: int, micro_batches: int, tail: float) -> "_Path":
        p = position
        start = self.rank_start[p] or (self.fwd_prefix, self.bwd_prefix)
        rank_work = _put(self.rank_work, p, self.rank_work[p] + cost.work_s)
        return _Path(
            stages=self.stages + (cost,),
            fwd_prefix=self.fwd_prefix + cost.fwd_s + cost.send_fwd_s,
            bwd_prefix=self.bwd_prefix + cost.bwd_s + cost.send_fwd_s,
            max_fwd=max(self.max_fwd, cost.fwd_s), max_bwd=max(self.max_bwd, cost.bwd_s),
            rank_work=rank_work, rank_start=_put(self.rank_start, p, start),
            rank_memory=_put(self.rank_memory, p, self.rank_memory[p] + cost.memory.total),
            tails=_put(self.tails, p, self.tails[p] + tail),
            # a rank runs every micro-batch of its stages one action at a time, after the first micro-batch
            # reached its first stage, before the last one's gradient goes from there back to stage 0
            bound=max(self.bound, start[0] + micro_batches * rank_work[p] + start[1]),
        )


def _put(values: tuple, index: int, value) -> tuple:
    return values[:index] + (value,) + values[index + 1:]


class _PartitionSearch:
    """Branch and bound over stage boundaries for one layout."""

    def __init__(self, model: CostModel, best_s: float, recompute: bool | None, budget: int):
        self.model, self.best_s, self.recompute, self.budget = model, best_s, recompute, budget
        lay = model.layout
        self.orders = orders(lay.schedule, lay.num_stages, lay.pipeline_size, lay.micro_batches)
        self.position = [model.ranks[s][0] % lay.pipeline_size for s in range(lay.num_stages)]
        self.warmup = _warmups(self.orders, lay.num_stages)
        self.fwd_total = model.fwd_total()
        self.capacity = model.cluster.memory_per_rank - model.cluster.overhead_bytes
        whole = model.stage(0, 0, model.num_blocks, False)
        # recomputation only helps when memory is short: if two stages as big as the whole model fit on one
        # rank, no stage ever needs it (so the search need not try it)
        self.memory_is_short = whole is None or 2 * whole.memory.total > self.capacity
        self.best: Candidate | None = None
        self.nodes = self.simulations = 0
        self.complete = True
        self.infeasible_reason = ""
        self.smallest_memory: int | None = None

    def _root(self) -> _Path:
        p = self.model.layout.pipeline_size
        step = self.model.cluster.step_overhead_s(self.model.pipelined)
        return _Path(rank_work=(0.0,) * p, rank_start=(None,) * p, rank_memory=(0,) * p, tails=(step,) * p)

    def balanced(self) -> Candidate | None:
        """The plan with boundaries that balance forward + backward work (no branching), if it fits."""
        model, lay = self.model, self.model.layout
        ranges = balance([model.work(i, i + 1) for i in range(model.num_blocks)], lay.num_stages)
        path = self._root()
        for s, (a, b) in enumerate(ranges):
            cost = model.stage(s, a, b, self.recompute)
            if cost is None or path.rank_memory[self.position[s]] + cost.memory.total > self.capacity:
                return None
            path = path.extend(cost, self.position[s], lay.micro_batches, self._tail(cost))
        self._evaluate(path)
        return self.best

    def run(self) -> Candidate | None:
        self._descend(0, 0, self._root())
        if self.best is None and not self.infeasible_reason:
            cluster = self.model.cluster
            need = size(self.smallest_memory) if self.smallest_memory else "more than the model"
            self.infeasible_reason = (
                f"no stage boundaries fit: the smallest stage that did not fit needs {need} besides the "
                f"{size(cluster.overhead_bytes)} the process itself uses, {size(cluster.memory_per_rank)} per rank")
        return self.best

    def _tail(self, cost: StageCost) -> float:
        if self.model.layout.data_parallel_only:
            # DDP reduces buckets while the backward runs: only what outlasts the backward shows, and that
            # costs more where the two compete for the same cores (the measured interference)
            exposed = max(cost.allreduce_s - cost.bwd_s, cost.allreduce_s * min(1.0, 25e6 / max(cost.param_bytes, 1)))
            return exposed * (1.0 + self.model.cluster.allreduce_interference) + cost.optimizer_s
        return cost.allreduce_s + cost.apply_gradients_s + cost.optimizer_s

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
                self._try(stage, stop, path, cost)
                if not self.complete:
                    return

    def _options(self, stage: int, start: int, stop: int) -> list[StageCost]:
        """The ways to run a stage worth trying. With one stage per rank, the cheapest that fits is best;
        when stages share a rank, recomputing one may make room for the other, so both are tried."""
        model = self.model
        if self.recompute is not None or stages_per_rank(model.layout.schedule) == 1 or not self.memory_is_short:
            cost = model.stage(stage, start, stop, self.recompute)
            if cost is None:
                self._note_memory(stage, start, stop)
            return [cost] if cost is not None else []
        options = [c for c in (model.stage(stage, start, stop, False), model.stage(stage, start, stop, True))
                   if c is not None]
        if not options:
            self._note_memory(stage, start, stop)
        return options

    def _try(self, stage: int, stop: int, path: _Path, cost: StageCost) -> None:
        model, lay = self.model, self.model.layout
        n, m = model.num_blocks, lay.micro_batches
        left = lay.num_stages - stage
        position = self.position[stage]
        if path.rank_memory[position] + cost.memory.total > self.capacity:
            return  # two stages on one rank (looped schedules) must fit together
        child = path.extend(cost, position, m, self._tail(cost))
        bound = max(child.bound, self._schedule_bound(stage, stop, path, cost))
        if left > 1:
            # the rest: some later stage takes at least its share of the remaining work
            bound = max(bound, child.fwd_prefix + m * model.work(stop, n) / (left - 1) + child.bwd_prefix)
        if bound + max(child.tails) >= self.best_s:
            return
        self._descend(stage + 1, stop, _replace_bound(child, bound))

    def _stops(self, stage: int, start: int, path: _Path):
        """Candidate ends of this stage, from the balanced one outwards. Each direction stops where a bound
        that only grows in that direction reaches the best step: the stage's own work going up, the share
        of the work left for the later stages going down."""
        model, lay = self.model, self.model.layout
        n, m, left = model.num_blocks, lay.micro_batches, lay.num_stages - stage
        if left == 1:
            yield n
            return
        lowest, highest = start + 1, n - left + 1
        target = model.work(start, n) / left
        balanced = min(range(lowest, highest + 1), key=lambda b: (abs(model.work(start, b) - target), b))
        prefixes = path.fwd_prefix + path.bwd_prefix
        up, down = balanced, balanced - 1
        while up <= highest or down >= lowest:
            if up <= highest:
                # a longer stage only takes more time, and more memory: past one that cannot fit, none can
                if prefixes + m * model.work(start, up) >= self.best_s or model.stage(stage, start, up) is None:
                    up = highest + 1
                else:
                    yield up
                    up += 1
            if down >= lowest:
                # a shorter stage leaves more work, and more weights, to the later stages
                if (prefixes + m * model.work(down, n) / (left - 1) >= self.best_s
                        or model.static_bytes_lower_bound(down, n, left - 1) > self.capacity):
                    down = lowest - 1
                else:
                    yield down
                    down -= 1

    def _schedule_bound(self, stage: int, stop: int, path: _Path, cost: StageCost) -> float:
        """Tighter bounds of the schedules whose structure is known (both checked against the simulator on
        random instances: never above it, median 1-4 % below).

        GPipe: its makespan without transfers is sum(f) + (M-1) max(f) + sum(b) + (M-1) max(b), and
        transfers only add. 1F1B: a stage's first backward waits for the first micro-batch's round trip
        through all later stages, while it runs only its warm-up forwards."""
        model, lay = self.model, self.model.layout
        m, left = lay.micro_batches, lay.num_stages - stage - 1
        rem_work = model.work(stop, model.num_blocks)
        if lay.schedule == "GPipe":
            rem_fwd = self.fwd_total - model.fwd_until(stop)
            rem_bwd = rem_work - rem_fwd
            sum_f = sum(c.fwd_s for c in path.stages) + cost.fwd_s + rem_fwd
            sum_b = sum(c.bwd_s for c in path.stages) + cost.bwd_s + rem_bwd
            max_f = max(path.max_fwd, cost.fwd_s, rem_fwd / left if left else 0.0)
            max_b = max(path.max_bwd, cost.bwd_s, rem_bwd / left if left else 0.0)
            return sum_f + (m - 1) * max_f + sum_b + (m - 1) * max_b
        if lay.schedule == "1F1B":
            w = self.warmup[stage]
            f, b = cost.fwd_s, cost.bwd_s
            return path.fwd_prefix + f + max((w - 1) * f, rem_work) + m * b + (m - w) * f + path.bwd_prefix
        return 0.0

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


def _replace_bound(path: _Path, bound: float) -> _Path:
    return replace(path, bound=bound)


def evaluate(model: CostModel, ranges: list[tuple[int, int]], recompute: list[bool]) -> Candidate | None:
    """Simulate given stage boundaries and recomputation under the model's layout (None if they don't fit)."""
    search = _PartitionSearch(model, math.inf, None, 0)
    path = search._root()
    for stage, ((start, stop), rc) in enumerate(zip(ranges, recompute)):
        cost = model.stage(stage, start, stop, rc)
        position = search.position[stage]
        if cost is None or path.rank_memory[position] + cost.memory.total > search.capacity:
            return None
        path = path.extend(cost, position, model.layout.micro_batches, search._tail(cost))
    search._evaluate(path)
    return search.best


def _warmups(rank_orders, num_stages: int) -> list[int]:
    """Per stage, how many forwards it runs before its first backward."""
    warm = [0] * num_stages
    started = set()
    for order in rank_orders:
        for stage, op, _ in order:
            if op != "F":
                started.add(stage)
            elif stage not in started:
                warm[stage] += 1
    return warm
