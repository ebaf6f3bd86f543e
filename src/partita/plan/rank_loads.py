"""Which partial plans of a looped layout can still step faster than a limit, from their ranks' loads alone.

In a looped layout of P ranks, rank r runs stage r (blocks [c_r, c_{r+1}) of the first loop, [0, x)) and stage
r + P (blocks [d_r, d_{r+1}) of the second, [x, n)). Three of the per-rank bounds hold for every plan (plan.bounds
and plan.search's _Warmup say why): the rank's makespan is at least the work of every block before its first
stage (micro-batch 0's way down, and its gradient's way back) plus M times its two stages' work; at least the
work of every block before its second stage plus M times that stage's work; and at least micro-batch 0's way down
to the end of its second stage and back from the stages after it, then all its work but its warm-up forwards,
then the gradient's way back from its last stage. With the step's least tail added, a plan faster than the limit
keeps all three within it on every rank.

Each only grows when a stage gains a block at its start (M is at least the forwards it subtracts), and so does a
stage's least memory: whether ranks r, r+1, ... can still keep within the limit from (c_r, d_r) therefore holds
at most for the d_r from a least one on, which `least_second_start(r, c_r)` computes (for the stages' least
costs, `StageFloors`) from that of rank r + 1, on demand and remembered. The search cuts every partial plan whose
second-loop position is below it: the table sees the rest of the pipeline block by block, where the other bounds
see averages (a rank takes whole blocks: with few of them per rank, the rank with the most work does much more
than the average) and forced recomputation rank by rank.
"""

from __future__ import annotations

import itertools
import math

from partita.plan.bounds import Remainder
from partita.plan.cost import CostModel, made_once
from partita.plan.plan import FSDP_LEVELS

Option = tuple[float, float, float]  # a way to run a stage, at least: (work, memory, forward per micro-batch)


class StageFloors:
    """Lower bounds of a stage's work (forward + backward per micro-batch) and memory, one pair per way to run it
    (recomputation or not; its sharding: unsharded, ZeRO-1, or each of FSDP's levels that the layout allows),
    each a sum over its blocks and so growing with every block it gains: what `CostModel.stage` costs at least,
    whichever way it chooses, for the stage or any longer one.

    `CostModel.stage` shards a stage only where unsharded it does not fit its rank alone, or sharded it steps
    faster. Where no stage steps faster at a sharding level than unsharded (`shards_only_when_too_big`), every
    stage it runs at that level holds blocks that do not fit unsharded, and so costs at least the least that any
    such stage costs at that level (`least_too_big`): the level's bounds are raised to it. Without this, a stage
    that the search runs unsharded would count ZeRO-1's or FSDP's memory, and pairs of stages would pass that do
    not fit together."""

    def __init__(self, model: CostModel):
        self.model = model
        self.n, self.m = model.num_blocks, model.layout.micro_batches
        self.writes = [0, *itertools.accumulate(1 if b.writes_buffers else 0 for b in model.graph.blocks)]
        # every cut inside the model moves at least the least boundary, per micro-batch
        self.least_boundary = min((model.boundary_bytes(c) for c in range(1, self.n)), default=0.0)
        self.in_flight = model.in_flight
        self._ways: dict[int, list[tuple[str, float, float, float, float]]] = {}
        self._least_blocks: dict[tuple[int, bool | None], tuple[list[float], list[float]]] = {}
        self._options: dict[tuple[int, int, int, bool | None], list[Option]] = {}
        self._least_too_big: dict[tuple, dict[str, tuple[float, float, float]]] = {}
        self._only_when_too_big: dict[tuple[int, str], bool] = {}
        self._raises: dict[tuple[int, bool], list[tuple[str, float, float, float, float, tuple | None]]] = {}
        self._too_big_ranges: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self._range_sums: dict[tuple[int, int], tuple[float, float, float, float, float]] = {}
        self._rows: dict[tuple[int, bool, bool], set[tuple[float, float, float, float, float]]] = {}

    def ways(self, stage: int) -> list[tuple[str, float, float, float, float]]:
        """Per sharding `stage` may take: (the sharding, static bytes per parameter byte, static bytes saved per
        exclusive byte, per-micro-batch collective seconds per exclusive byte in the forward, in the backward)."""
        if stage not in self._ways:
            model, lay = self.model, self.model.layout
            factor = model.optimizer_factor
            out = []
            big = float(2**40)

            def rate(collective) -> float:
                one = model.fsdp_collective_s(collective, stage, big, 1)
                return (model.fsdp_collective_s(collective, stage, 2 * big, 1) - one) / big * (1 - 1e-9)

            for sharding in model.shardings:
                if sharding not in FSDP_LEVELS:
                    share = 1.0 / lay.num_replicas if sharding == "optimizer" else 1.0
                    out.append((sharding, 2 + factor * share, 0.0, 0.0, 0.0))
                    continue
                gather, reduce = rate(model.cluster.allgather_s), rate(model.cluster.reduce_scatter_s)
                saved = (2 + factor) * (1 - 1 / lay.num_replicas)
                out.append((sharding, 2 + factor, saved, gather if sharding == "parameters" else 0.0,
                            reduce + (gather if sharding == "parameters" else 0.0)))
            self._ways[stage] = out
        return self._ways[stage]

    def shards_only_when_too_big(self, stage: int, sharding: str) -> bool:
        """Whether `CostModel.stage` runs no stage as `stage` at this sharding level where unsharded it fits: the
        level's stage time (`stage_time_s`) is above the unsharded one's by more than rounding for every stage,
        whatever its parameters. Its excess over the unsharded stage time is affine in the parameters' bytes
        (latencies plus bytes times rates), so checking at 1 byte and at more than any model holds covers every
        size. A stage without parameters (or, under FSDP, with only tied ones) costs the same at every level:
        the unsharded way, listed first, wins the tie."""
        key = (stage, sharding)
        if key not in self._only_when_too_big:
            margin = 1e-9  # seconds: far above the rounding of any stage time
            self._only_when_too_big[key] = sharding != "none" and "none" in self.model.shardings and all(
                self._least_excess_s(stage, sharding, float(nbytes)) > margin for nbytes in (1, 2**50))
        return self._only_when_too_big[key]

    def _least_excess_s(self, stage: int, sharding: str, nbytes: float) -> float:
        """At least how much longer a stage of `nbytes` of parameters that the level shards (ZeRO-1: all of them;
        FSDP: all but the tied ones) steps at `sharding` than unsharded. ZeRO-1 computes the same and only its
        step differs: a share of the optimizer's step, then an all-gather. FSDP's levels add their collectives
        to every micro-batch and save at most, after the pipeline: the sharded bytes' all-reduce (what of it
        outlasts the last backward, which now takes those collectives longer too), their copy into .grad and
        their optimizer step."""
        model, lay = self.model, self.model.layout
        if sharding == "optimizer":
            _, _, step_none, gather_none = model.per_step(stage, int(nbytes), 0, "none")
            _, _, step, gather = model.per_step(stage, int(nbytes), 0, "optimizer")
            return step + gather - step_none - gather_none
        interference = 1.0 + model.cluster.allreduce_interference
        if lay.micro_batches < interference:
            return -math.inf  # the backward's collectives may hide as much as they add: no bound here
        # one unit: more units each pay the latency again, and so cost more
        fwd, bwd = model.collectives_s(stage, nbytes, sharding, 1)
        saved = (interference * model.cluster.allreduce_s(nbytes, model.ranks[stage])
                 + model.apply_gradients_s(nbytes) + model.optimizer_s(nbytes))
        return lay.micro_batches * fwd + (lay.micro_batches - interference) * bwd - saved

    def least_block(self, stage: int, start: int, recompute: bool | None) -> tuple[float, float]:
        """The least work and the least memory (each on its own) of any one block from `start` on as `stage`."""
        key = (stage, recompute)
        if key not in self._least_blocks:
            work, memory = [math.inf] * (self.n + 1), [math.inf] * (self.n + 1)
            for b in range(self.n - 1, -1, -1):
                options = self.options(stage, b, b + 1, recompute)
                work[b] = min([work[b + 1], *(o[0] for o in options)])
                memory[b] = min([memory[b + 1], *(o[1] for o in options)])
            self._least_blocks[key] = (work, memory)
        work, memory = self._least_blocks[key]
        return work[start], memory[start]

    def options(self, stage: int, start: int, stop: int, recompute: bool | None) -> list[Option]:
        """(work, memory, forward) at least of blocks [start, stop) as `stage`, or of any longer stage that holds
        them, per way to run it (`recompute` None: with recomputation and without); none dominated by another."""
        key = (stage, start, stop, recompute)
        found = self._options.get(key)
        if found is None:
            found = self._options[key] = _undominated(self._compute_options(stage, start, stop, recompute))
        return found

    def _compute_options(self, stage: int, start: int, stop: int, recompute: bool | None) -> list[Option]:
        model = self.model
        params = model.param_bytes(start, stop)
        exclusive = params - model.units(start, stop)[0]  # what FSDP's levels shard: all but the tied ones
        fwd = model.forward_s(start, stop)
        work = fwd + model.backward_s(start, stop, params)
        held = self.in_flight[stage]
        acts = model.activation_bytes(start, stop)
        # PipelineStage's receive buffers, and what recomputation keeps of a stage's inputs
        inputs = self.least_boundary if stage > 0 else 0.0
        outputs = self.least_boundary if stop < self.n else 0.0
        fixed = self.m * (inputs + outputs) - 8 + (model.loss_bytes(held) if stop == self.n else 0.0)
        # (recomputed, the forward run again, the activations kept)
        kept = [(False, 0.0, acts * held)] if recompute is not True else []
        if recompute is not False and self.writes[stop] == self.writes[start]:
            kept.append((True, fwd, acts + inputs * held))
        out = []
        for rc, redo, keep in kept:
            unsharded = math.inf  # the unsharded way's memory (listed first)
            for sharding, per_byte, saved, coll_fwd, coll_bwd, least in self._raised(stage, rc):
                if least is not None and (not least or unsharded <= least[1]):
                    # (empty: no stage is too big to run unsharded, so none runs this way; else the unsharded
                    # way takes no more work, memory or work less forward than this one raised)
                    continue
                memory = fixed + params * per_byte - exclusive * saved + keep
                way_work, way_fwd = work + exclusive * (coll_fwd + coll_bwd) + redo, fwd + exclusive * coll_fwd
                if least:
                    raised = max(way_work, least[0])
                    out.append((raised, max(memory, least[1]), raised - max(way_work - way_fwd, least[2])))
                    continue
                if sharding == "none":
                    unsharded = memory
                out.append((way_work, memory, way_fwd))
        return out

    def _raised(self, stage: int, recompute: bool) -> list[tuple[str, float, float, float, float, tuple | None]]:
        """`ways(stage)`, each with what its bounds with this recomputation are raised to (`least_too_big`;
        empty: it never runs so), or None where they are not."""
        key = (stage, recompute)
        if key not in self._raises:
            self._raises[key] = [(*way, (self.least_too_big(stage, recompute, way[0]) or ())
                                  if self.shards_only_when_too_big(stage, way[0]) else None)
                                 for way in self.ways(stage)]
        return self._raises[key]

    def least_too_big(self, stage: int, recompute: bool, sharding: str) -> tuple[float, float, float] | None:
        """The least work, memory and work less forward (each on its own) of `sharding`'s way to run any stage
        as `stage` that does not fit its rank unsharded (None: none is that big). Such a stage [a, b) ends at
        least at the first stop from a on where an upper bound of its unsharded memory exceeds the rank's room
        (`CostModel.first_too_big`), and the way's bounds only grow with the stop, and shrink as the start grows
        (at the last block as the stop, where a stage's outputs need no buffers, only the last start counts). The
        least depends on the stage only through the micro-batches it holds, whether it has inputs, and its
        collectives' rates."""
        key = (self.in_flight[stage], stage > 0, tuple(self.ways(stage)), recompute)
        if key not in self._least_too_big:
            rows = self._too_big_rows(stage, recompute)
            least = {}
            for level, per_byte, saved, coll_fwd, coll_bwd in self.ways(stage) if rows else ():
                least[level] = (min(f + b + e * (coll_fwd + coll_bwd) for f, b, _, e, _ in rows),
                                min(rest + p * per_byte - e * saved for _, _, p, e, rest in rows),
                                min(b + e * coll_bwd for _, b, _, e, _ in rows))
            self._least_too_big[key] = least
        return self._least_too_big[key].get(sharding)

    def _too_big_rows(self, stage: int, recompute: bool) -> set[tuple[float, float, float, float, float]]:
        """Per stage of `_too_big`: (forward, backward, parameter bytes, those FSDP shards, memory but the
        parameters'), each once."""
        key = (self.in_flight[stage], stage > 0, recompute)
        if key not in self._rows:
            model, held = self.model, self.in_flight[stage]
            inputs = self.least_boundary if stage > 0 else 0.0
            rows = set()
            for start, stop in self._too_big(stage, recompute):
                fwd, bwd, params, exclusive, acts = self._sums(start, stop)
                outputs = self.least_boundary if stop < self.n else 0.0
                fixed = self.m * (inputs + outputs) - 8 + (model.loss_bytes(held) if stop == self.n else 0.0)
                keep = acts + inputs * held if recompute else acts * held
                rows.add((fwd, bwd + (fwd if recompute else 0.0), params, exclusive, fixed + keep))
            self._rows[key] = rows
        return self._rows[key]

    def _too_big(self, stage: int, recompute: bool) -> list[tuple[int, int]]:
        """Stages that every stage too big to run unsharded costs at least as much as, whichever way: per start,
        its first stop too big (`CostModel.first_too_big`); and the last of those starts with the last block as
        the stop. They depend on the stage only through the micro-batches it holds."""
        key = (self.in_flight[stage], recompute)
        if key not in self._too_big_ranges:
            stops = self.model.first_too_big(stage, recompute)
            self._too_big_ranges[key] = [*enumerate(stops), *([(len(stops) - 1, self.n)] if stops else [])]
        return self._too_big_ranges[key]

    def _sums(self, start: int, stop: int) -> tuple[float, float, float, float, float]:
        """(forward, backward, parameter bytes, those FSDP shards, activations) of blocks [start, stop), as
        `_compute_options` counts them."""
        if (start, stop) not in self._range_sums:
            model = self.model
            params = model.param_bytes(start, stop)
            self._range_sums[start, stop] = (model.forward_s(start, stop), model.backward_s(start, stop, params),
                                             params, params - model.units(start, stop)[0],
                                             model.activation_bytes(start, stop))
        return self._range_sums[start, stop]


stage_floors = made_once(StageFloors)  # the model's StageFloors, made once


class RankLoads:
    """For one looped layout and one start x of its second loop: the least second-loop position from which the
    ranks can still finish below `limit_s` (a step time), by rank and first-loop position.

    With a window of x's (lowest, highest), the same for all of them at once, a relaxation: the last rank's first
    stage ends anywhere in the window, and rank r's second stage starts at least max(lowest, e_r + left) + r
    (d_r >= x + r, and x >= e_r + left: the `left` ranks after it take a first-loop block each). Every partial
    plan that one x's table lets through is one of these, with the same bounds (none of them depends on x
    otherwise), so the window's least second-loop positions are never above any of its x's: since a plan's
    rank 0 starts its second stage at x, one table rules out every x of the window below
    `least_second_start(0, 0)`. For a single x the window's table is that x's."""

    def __init__(self, floors: StageFloors, rest: Remainder, x: int | tuple[int, int], limit_s: float,
                 capacity: float, recompute: bool | None, warmups: list[tuple[int, int, bool] | None],
                 looser: "RankLoads | None" = None):
        model = floors.model
        # rest: the least work of the blocks before and after a rank's stages, in sums
        self.floors, self.rest, self.x, self.capacity, self.recompute = floors, rest, x, capacity, recompute
        # per rank, for the bound of its first backward (plan.search's _Warmup): how many forwards of its first
        # and of its second stage it runs before that backward (of its second stage), and whether its last
        # action is of its first stage; None where its first backward is of its first stage
        self.warmups = warmups
        self.p, self.n, self.m = model.layout.pipeline_size, floors.n, floors.m
        self.limit_s = limit_s  # for the makespan: the limit less the least tail
        # a table for a limit at least as high, of the same x's or of a window that holds them: every plan within
        # this table's limit is one within its limit too, which it never cuts, so none starts a second stage below
        # its least ones (what it has worked out seeds this table's)
        self.looser = looser
        self._least: dict[tuple[int, int], int] = {}
        self.checks = 0  # stages and pairs of stages tried so far: what the table has cost
        self.exhausted = False
        self._check_limit = math.inf

    def feasible(self, r: int, c: int, d: int, most_checks: float = math.inf) -> bool:
        """Whether ranks r, r+1, ... may finish below the limit with their stages from blocks c and d on; true
        (and `exhausted` set) when answering would take more than `most_checks` pairs of stages."""
        self._check_limit = self.checks + most_checks
        self.exhausted = False
        try:
            return d >= self.least_second_start(r, c)
        except _OutOfChecks:
            self.exhausted = True
            return True

    def least_second_start(self, r: int, c: int) -> int:
        """The least d_r from which ranks r.. can finish below the limit with c_r = c (n + 1: none)."""
        key = (r, c)
        if key not in self._least:
            self._least[key] = self._compute(r, c)
        return self._least[key]

    def _compute(self, r: int, c: int) -> int:
        p, n, x, m, floors = self.p, self.n, self.x, self.m, self.floors
        left = p - r - 1
        none = n + 1
        lowest_x, highest_x = x if isinstance(x, tuple) else (x, x)
        if c > highest_x - (left + 1):
            return none
        known = self.looser.known_second_start(r, c) if self.looser is not None else 0
        if known >= none:
            return none
        limit = self.limit_s
        rank_start = self.rest.quick_work(0, c, r)
        best = none
        # the first loop ends at x (the last rank's first stage)
        for e in range(c + 1, highest_x - left + 1) if left else range(max(c + 1, lowest_x), highest_x + 1):
            # d_r >= x + r (see the class docstring for a window), and no lower than the looser table allows
            lowest_d = max(max(lowest_x, e + left) + r, known)
            if best <= lowest_d:
                break  # the later e's allow no earlier second stage
            self._count()
            firsts = [o for o in floors.options(r, c, e, self.recompute) if o[1] <= self.capacity]
            if not firsts:
                break  # a longer first stage needs more memory
            least_first = min(o[0] for o in firsts)
            if rank_start + m * least_first > limit:
                break  # and more work
            if left:
                end = self.least_second_start(r + 1, e)
                if end > n - left:
                    continue
            else:
                end = n
            d = self._least_second(r, c, e, end, firsts, rank_start, lowest_d, min(best, end) - 1)
            if d > n and end < best and self._one_block_fits(r, end, firsts, rank_start):
                # the stage may also start at or after `end` (and end later): at least then
                d = end
            best = min(best, d)
        return max(best, known)

    def known_second_start(self, r: int, c: int) -> int:
        """`least_second_start(r, c)` where this table (or a looser one it was seeded from) has worked it out,
        else 0: a least second-loop start that costs nothing more."""
        if (r, c) in self._least:
            return self._least[(r, c)]
        return self.looser.known_second_start(r, c) if self.looser is not None else 0

    def _least_second(self, r: int, c: int, e: int, end: int, firsts, rank_start: float, lowest: int,
                      highest: int) -> int:
        """The least d in [lowest, highest] for which rank r's stages [c, e) and [d, end) fit (n + 1: none);
        fitting only gets easier as d grows."""
        if lowest > highest or not self._pair_fits(r, c, e, highest, end, firsts, rank_start):
            return self.n + 1
        lo, hi = lowest, highest
        while lo < hi:
            mid = (lo + hi) // 2
            if self._pair_fits(r, c, e, mid, end, firsts, rank_start):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _one_block_fits(self, r: int, start: int, firsts, rank_start: float) -> bool:
        """Whether rank r's first stage (`firsts`) might go with a second stage of one block from `start` on, as
        cheap in work and in memory as the least of those blocks (every longer stage costs more)."""
        work, memory = self.floors.least_block(self.p + r, start, self.recompute)
        return any(m1 + memory <= self.capacity and rank_start + self.m * (w1 + work) <= self.limit_s
                   for w1, m1, _ in firsts)

    def _count(self) -> None:
        self.checks += 1
        if self.checks > self._check_limit:
            raise _OutOfChecks  # what was computed to the end so far stays, the rest is left

    def _pair_fits(self, r: int, c: int, e: int, d: int, end: int, firsts, rank_start: float) -> bool:
        self._count()
        floors, m, limit, capacity, p = self.floors, self.m, self.limit_s, self.capacity, self.p
        rest = self.rest
        second_start = rest.quick_work(0, d, p + r)
        warm = self.warmups[r]
        if warm is not None:
            # micro-batch 0's way down to the end of the second stage, and back from the stages after it
            count_first, count_second, last_first = warm
            wait = rest.fwd(0, p + r + 1, end) + rest.quick_work(end, self.n, p - r - 1)
            # and the gradient's way back from its last stage: the backwards of the stages before it
            wait += rank_start - rest.fwd(0, r, c) if last_first else second_start - rest.fwd(0, p + r, d)
        for w2, m2, f2 in floors.options(p + r, d, end, self.recompute):
            if second_start + m * w2 > limit:
                continue
            for w1, m1, f1 in firsts:
                if m1 + m2 > capacity or rank_start + m * (w1 + w2) > limit:
                    continue
                if warm is None or wait + m * (w1 + w2) - count_first * f1 - count_second * f2 <= limit:
                    return True
        return False


class _OutOfChecks(Exception):
    pass


def _undominated(options: list[Option]) -> list[Option]:
    """The options that no other beats in work, memory and work less forward (what RankLoads compares: M x work
    less up to M forwards), least work first."""
    out: list[Option] = []
    for option in sorted(options):
        work, memory, fwd = option
        if not any(w <= work and mm <= memory and w - f <= work - fwd for w, mm, f in out):
            out.append(option)
    return out
