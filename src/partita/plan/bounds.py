"""Lower bounds on the simulated step of a layout's plans, for the search to cut with (pure Python).

A step is the pipeline's makespan plus the longest tail (a rank's gradient all-reduce, gradient copies and
optimizer step, after the pipeline drains), so lower bounds of the two add up. What the makespan bounds
use of a schedule (those of plan/search.py's stage-by-stage and rank-by-rank searches as well; all are
checked against brute force and the simulator in tests/unit/test_search.py):
- A rank runs its actions one at a time, and a stage runs 2M of them (M micro-batches, forward and backward).
- A stage's first action waits for micro-batch 0 to come through the stages before it, and after its last
  action the gradient still goes back through them. So the makespan is at least prefix_s + M w_s for every
  stage s (w: forward + backward per micro-batch; prefix: w and transfers of the stages before it), and
  prefix_r + M (the w of all its stages) for every rank r, from its first stage (whose prefix holds a block
  per stage before it, at least: the smallest ones, or the least of the blocks left). Zero-bubble schedules end
  with weight gradients (W), which send nothing back: for them only the way down counts.
- A rank's first backward waits for its warm-up forwards and for micro-batch 0's round trip through the
  later stages; everything else the rank runs comes after it. Likewise the backward of its last forward
  waits for that micro-batch's round trip, while the rank runs only the backwards ordered before it.
- GPipe's makespan is sum(f) + sum(b) + transfers + (M-1)(max f + max b), exactly: each phase is a flow
  shop whose longest path turns once, at its slowest stage. LoopedBFS's is the same per phase, or a path
  through stages 0..r and r+P..S-1 (rank r runs all of its first stage before its second) turning in both.
- The simulated makespan is the longest path through a graph that the schedule's orders fix, weighted by the
  durations (an action starts when its rank is free and its input has arrived): it only grows with each
  duration. So a partial plan simulated with every stage not yet chosen at the least it can take (its
  smallest block, no transfers) bounds every completion.
Blocks not yet placed (`Remainder`) cost at least, whatever stages they are split into: their compute, two
action overheads per stage, the gradient traffic of the parameters they use, the cheapest transfers between
their stages, the forwards that memory forces them to recompute (a rank keeps the activations only of its
own blocks, whose work M times over is at most the makespan: `layout_bound`, and only in the room that its
stages' receive buffers and the kept blocks' weights and optimizer state leave); one of the stages holds their
largest block, and one as many blocks as the average; and every rank has room for what lands on it.
"""

from __future__ import annotations

import bisect
import math

from partita.plan.cost import CostModel, made_once
from partita.schedule import orders
from partita.schedule.catalog import stages_per_rank


class Remainder:
    """What blocks [start, stop) (stop: the model's end unless given) cost at least when split into `stages`
    more stages of one layout."""

    def __init__(self, model: CostModel):
        self.model = model
        lay, n = model.layout, model.num_blocks
        self.n, self.m = n, lay.micro_batches
        stretch, graph = model.compute_stretch, model.graph
        block_fwd = [model.forward_s(i, i + 1) - model.action_s for i in range(n)]
        block_bwd = [model.backward_s(i, i + 1, 0) - model.action_s for i in range(n)]
        block_bytes = [graph.param_bytes_of(i, i + 1) for i in range(n)]
        self._fwd = _suffix_sums(block_fwd)
        self._bwd = _suffix_sums(block_bwd)
        # a parameter counts once, at the first block that uses it: these bytes add up over ranges, and a
        # range's own bytes are never more than its parameters' (for quick bounds that need no set union)
        seen: set[str] = set()
        own = []
        for block in graph.blocks:
            own.append(sum(graph.param_bytes[q] for q in block.params if q not in seen))
            seen.update(block.params)
        self._own = _suffix_sums(own)
        # a backward's least cost that adds up over blocks: its compute and its own parameters' traffic
        self._bwd_own = _suffix_sums([b + model.gradient_traffic_s(o) * stretch for b, o in zip(block_bwd, own)])
        self._windows: dict[tuple[int, int, int, bool], float] = {}
        acts = [model.activation_bytes(i, i + 1) for i in range(n)]
        self._act = _suffix_sums(acts)
        # for recomputation: what each block's activations take, its static bytes, its forward; the blocks
        # whose recomputation saves the least forward time per byte first
        self._blocks = sorted(((a, o * model.static_per_param_byte, f, i)
                               for i, (a, o, f) in enumerate(zip(acts, own, block_fwd))),
                              key=lambda b: (b[2] / b[0] if b[0] else math.inf, b[3]))
        # (activations, forward + backward, block): the most activations per second of work first (a rank whose
        # work is bounded holds at most the activations of such a prefix)
        self._by_activations = sorted(((a, f + b, i) for i, (a, f, b) in enumerate(zip(acts, block_fwd, block_bwd))),
                                      key=lambda b: (-b[0] / b[1] if b[1] else -math.inf, b[2]))
        # (bytes a rank needs for the block, forward): for `keepable`, of the blocks with activations to keep
        self._keepable = [(o * model.static_per_param_byte, a, f) for a, o, f in zip(acts, own, block_fwd) if a > 0]
        self._fwd_kept = _suffix_sums([f if a > 0 else 0.0 for a, f in zip(acts, block_fwd)])
        self._keep_orders: dict[int, tuple[list[float], list[float], list[tuple[float, float]]]] = {}
        work_ordered = sorted(((f + b, f) for a, f, b in zip(acts, block_fwd, block_bwd) if a > 0),
                              key=lambda w: -w[1] / w[0] if w[0] else -math.inf)
        self._by_work = _cumulative(work_ordered)
        # PipelineStage's receive buffers: per stage, M micro-batches of its input and of its output
        least_cut = min((model.boundary_bytes(c) for c in range(1, n)), default=0.0)
        self._buffers = [0.0] * lay.pipeline_size
        for k in range(lay.num_stages):
            ends = (k > 0) + (k < lay.num_stages - 1)
            self._buffers[model.ranks[k][0] % lay.pipeline_size] += lay.micro_batches * least_cut * ends
        # one stage holds the largest block: its forward, its backward with its parameters' gradient traffic
        block_bwd_traffic = [b + model.gradient_traffic_s(p) * stretch for b, p in zip(block_bwd, block_bytes)]
        self._max_fwd = _RangeBest(block_fwd, max)
        self._max_bwd = _RangeBest(block_bwd_traffic, max)
        self._max_bytes = _RangeBest(block_bytes, max)
        # every stage holds at least one block: its forward and backward are at least the smallest block's
        self._min_fwd = _RangeBest(block_fwd, min)
        self._min_bwd = _RangeBest(block_bwd_traffic, min)
        self._send = _suffix_min(self._cut_send_floor())
        self._stretch = stretch
        # the blocks' forward + backward, least first, summed: what the first k stages take at least
        self._smallest_work = [0.0]
        for work in sorted(f + b for f, b in zip(block_fwd, block_bwd)):
            self._smallest_work.append(self._smallest_work[-1] + work)

    def _cut_send_floor(self) -> list[float]:
        """Per cut c (after block c-1, 1 <= c < n; index 0 and n unused): the least transfer across it."""
        model, lay = self.model, self.model.layout
        pairs = {(model.ranks[s][0], model.ranks[s + 1][0]) for s in range(lay.num_stages - 1)}
        links = list({model.cluster.link(a, b) for a, b in pairs if a != b})
        same_rank = any(a == b for a, b in pairs) or not links
        out = [math.inf] * (self.n + 1)
        for c in range(1, self.n):
            nbytes = model.boundary_bytes(c)
            out[c] = 0.0 if same_rank else min(link.seconds(nbytes) for link in links)
        return out

    def param_bytes(self, start: int, stop: int | None = None) -> int:
        return self.model.param_bytes(start, self.n if stop is None else stop)

    def fwd(self, start: int, stages: int, stop: int | None = None) -> float:
        """Sum of the forwards of the stages (per micro-batch)."""
        return self._fwd[start] - self._fwd[self.n if stop is None else stop] + stages * self.model.action_s

    def bwd(self, start: int, stages: int, stop: int | None = None) -> float:
        """Sum of the backwards of the stages (per micro-batch): every parameter they use is in one of them."""
        stop = self.n if stop is None else stop
        return (self._bwd[start] - self._bwd[stop]
                + self.model.gradient_traffic_s(self.param_bytes(start, stop)) * self._stretch
                + stages * self.model.action_s)

    def work(self, start: int, stages: int, stop: int | None = None) -> float:
        return self.fwd(start, stages, stop) + self.bwd(start, stages, stop)

    def sends(self, start: int, stages: int, stop: int | None = None) -> float:
        """One way's transfers between the stages (stages - 1 cuts after `start`)."""
        return (stages - 1) * self._send[start + 1] if stages > 1 else 0.0

    def max_fwd(self, start: int, stages: int, stop: int | None = None) -> float:
        """The slowest stage's forward, at least: the average, the largest block's, and the least of any
        ceil(blocks / stages) consecutive blocks (some stage has that many)."""
        stop = self.n if stop is None else stop
        return max((self._fwd[start] - self._fwd[stop]) / stages, self._max_fwd(start, stop),
                   self._least_window(start, stop, stages, False)) + self.model.action_s

    def max_bwd(self, start: int, stages: int, stop: int | None = None) -> float:
        stop = self.n if stop is None else stop
        total = self.bwd(start, stages, stop) - stages * self.model.action_s
        return max(total / stages, self._max_bwd(start, stop),
                   self._least_window(start, stop, stages, True)) + self.model.action_s

    def least_fwd(self, start: int, stop: int) -> float:
        """The least forward of any one stage of blocks in [start, stop) (per micro-batch)."""
        return self._min_fwd(start, stop) + self.model.action_s

    def least_bwd(self, start: int, stop: int) -> float:
        """The least backward of any one stage of blocks in [start, stop): its smallest block's, with the
        gradient traffic of that block's parameters (the stage uses them all)."""
        return self._min_bwd(start, stop) + self.model.action_s

    def least_stages_work(self, stages: int) -> float:
        """The least forward + backward (per micro-batch) of any `stages` stages of the model: each holds a block
        at least, so together at least the `stages` smallest blocks."""
        return self._smallest_work[stages] + 2 * stages * self.model.action_s

    def _least_window(self, start: int, stop: int, stages: int, backward: bool) -> float:
        key = (start, stop, stages, backward)
        if key not in self._windows:
            sums = self._bwd_own if backward else self._fwd
            k = -(-(stop - start) // stages)
            self._windows[key] = min(sums[i] - sums[i + k] for i in range(start, stop - k + 1))
        return self._windows[key]

    def chain(self, start: int, stages: int, stop: int | None = None) -> float:
        """Least max over the stages of (work of the stages before it + M x its own work): the per-stage bound
        of the blocks alone. Over real-valued splits of the work W it is least when every term is equal:
        w_s = T/M ((M-1)/M)^s, which sums to W for T = W / (1 - ((M-1)/M)^stages)."""
        work, m = self.work(start, stages, stop), self.m
        return work if m == 1 else work / (1.0 - ((m - 1) / m) ** stages)

    def quick_work(self, start: int, stop: int, stages: int) -> float:
        """A lower bound of `work(start, stages, stop)` from sums alone (fast)."""
        own = self._own[start] - self._own[stop]
        return (self._fwd[start] - self._fwd[stop] + self._bwd[start] - self._bwd[stop]
                + self.model.gradient_traffic_s(own) * self._stretch + 2 * stages * self.model.action_s)

    def quick_memory(self, start: int, stop: int) -> float:
        """A lower bound of `memory(start, stop)` from sums alone (fast)."""
        own = self._own[start] - self._own[stop]
        return own * self.model.static_per_param_byte + self._act[start] - self._act[stop] - 5 * (stop - start)

    def room(self, position: int) -> float:
        """What a rank at this pipeline position has for its blocks at most: its memory less the receive
        buffers of its stages (each stage end at the model's smallest cut)."""
        return self.model.capacity - self._buffers[position]

    def recomputed(self, ranges: list[tuple[int, int]], rooms: list[float], held: list[int],
                   rank_work: float = math.inf) -> float:
        """The least forward time per micro-batch that must be recomputed among the blocks of `ranges` when
        they go to ranks with `rooms` bytes for them, the ranks' stages holding `held` micro-batches at once (one
        number per rank: the least of its stages'), each rank's blocks at most `rank_work` of forward +
        backward per micro-batch, as a relaxation (inf: they cannot fit at all). The larger of two bounds:

        - A recomputed block keeps one micro-batch's activations, any other `held` of them, on a rank that
          holds at most its room of them, and at most those of the blocks it runs (`most_activations`): so
          keeping costs (held - 1) x its activations more, out of the room left when everything is recomputed.
          The blocks whose forward saves most per byte are kept first, on the ranks where keeping costs least,
          in part where a rank's share or the room runs out; the rest is recomputed.
        - A rank keeps no more forward than fits its room with the weights, gradients and optimizer state of
          the blocks it keeps beside their `held` micro-batches (`keepable`), nor more than its work allows; a
          block not kept on any rank is recomputed."""
        inside = _mask(self.n, ranges)
        slack = sum(rooms) - sum(self.quick_memory(a, b) for a, b in ranges)  # with everything recomputed
        if slack < 0:
            return math.inf
        most_work = _fill(self._by_work, rank_work)
        kept_most = sum(min(self.keepable(h, room), most_work) for h, room in zip(held, rooms))
        keeping = sum(self._fwd_kept[a] - self._fwd_kept[b] for a, b in ranges)
        most = self.most_activations(ranges, rank_work) if rank_work < math.inf else math.inf
        return max(keeping - kept_most, self._kept_by_room(inside, slack, rooms, held, most))

    def keepable(self, held: int, room: float) -> float:
        """The most forward (per micro-batch) of blocks whose activations one rank may keep for `held`
        micro-batches at once in `room` bytes, each with its weights, gradients and optimizer state, taking
        blocks in part (a fractional knapsack of all the model's blocks: the most forward per byte first)."""
        if held not in self._keep_orders:
            self._keep_orders[held] = _cumulative(sorted(
                ((s + held * a, f) for s, a, f in self._keepable), key=lambda b: -b[1] / b[0] if b[0] else -math.inf))
        return _fill(self._keep_orders[held], room)

    def _kept_by_room(self, inside: bytearray, slack: float, rooms: list[float], held: list[int],
                      most: float) -> float:
        """The first bound of `recomputed`."""
        # (extra bytes per byte kept, bytes it can keep)
        slots = sorted((h - 1, min(room / h, most)) for h, room in zip(held, rooms))
        slot, kept_here = 0, 0.0
        forward = 0.0
        for acts, _, fwd, i in reversed(self._blocks):  # the most forward per byte first
            if not inside[i]:
                continue
            keep = acts
            while keep > 0 and slot < len(slots):
                extra, cap = slots[slot]
                amount = min(keep, cap - kept_here, slack / extra if extra else math.inf)
                keep -= amount
                kept_here += amount
                slack -= amount * extra
                if kept_here >= cap:
                    slot, kept_here = slot + 1, 0.0
                elif amount <= 0 or slack <= 0:
                    break
            if keep > 0:
                forward += fwd * keep / acts
        return forward

    def most_activations(self, ranges: list[tuple[int, int]], work: float) -> float:
        """The most activations (one micro-batch's) of any blocks of `ranges` whose forward + backward add up to
        at most `work` per micro-batch, taking blocks in part (a fractional knapsack: the most activations per
        second of work first)."""
        most = 0.0
        inside = _mask(self.n, ranges)
        for acts, cost, i in self._by_activations:
            if not inside[i]:
                continue
            if cost > work:
                return most + acts * work / cost
            most += acts
            work -= cost
        return most

    def stage_tail(self, param_bytes: float) -> float:
        """The least tail of a stage whose parameters take `param_bytes`."""
        return self.model.least_tail_s(param_bytes)

    def largest_block_bytes(self, start: int, stop: int | None = None) -> int:
        return self._max_bytes(start, self.n if stop is None else stop)

    def largest_stage_tail(self, start: int, stages: int, stop: int | None = None) -> float:
        """The least tail of the stage with the most parameters."""
        return self.stage_tail(max(self.param_bytes(start, stop) / stages, self.largest_block_bytes(start, stop)))

    def tail_total(self, start: int, stop: int | None = None) -> float:
        """The least sum of the stages' tails (a collective of a sum takes no longer than the sum of two)."""
        return self.stage_tail(self.param_bytes(start, stop))

    def fits(self, start: int, rooms: list[float], stop: int | None = None) -> bool:
        """Whether the blocks might split into len(rooms) stages in order, each within its room by the least
        memory it needs (`stage_memory`). Greedy, each stage as long as fits: if any split fits, every greedy
        stage ends at or after that split's (its start is no later, and a stage that starts later needs no
        more), so the greedy one reaches the end too."""
        a, stop = start, self.n if stop is None else stop
        for room in rooms:
            if a == stop:
                return True
            lo, hi = a, stop  # the longest stage from a that fits: stage_memory(a, e) <= room for e <= lo
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.stage_memory(a, mid) <= room:
                    lo = mid
                else:
                    hi = mid - 1
            a = lo
        return a == stop

    def stage_memory(self, start: int, stop: int) -> float:
        """The least memory of a stage of blocks [start, stop), less with fewer blocks at either end."""
        return self.model.param_bytes(start, stop) * self.model.static_per_param_byte \
            + self.model.activation_bytes(start, stop) - 5

    def memory(self, start: int, stop: int | None = None) -> float:
        """The least memory the stages need together: weights, gradients and optimizer state of every parameter
        they use, and each block's activations for one micro-batch (what recomputation keeps)."""
        stop = self.n if stop is None else stop
        need = self.model.param_bytes(start, stop) * self.model.static_per_param_byte \
            + self.model.activation_bytes(start, stop)
        return need - 5 * (stop - start)  # a stage's memory rounds each of its five parts down to bytes


remainder = made_once(Remainder)  # the model's Remainder, made once


def layout_bound(model: CostModel, refined: bool = False) -> float:
    """No plan of this layout steps faster (math.inf: none fits memory). `refined`: also count the forwards
    that memory forces to recompute (this needs the schedule's orders, so it is left for the layouts that the
    quick bound does not rule out).

    What memory forces depends on how the blocks spread over the ranks: a rank that holds few micro-batches
    at once could keep every activation, were it not that its blocks' work, M times over, is at most the
    makespan. So for a makespan T, each rank's blocks do at most T / M of forward + backward: makespan(T), the
    bound with what that forces to recompute, grows as T shrinks, and every plan's makespan is at least T or
    at least makespan(T). The largest T with makespan(T) >= T (found by bisection) bounds every plan."""
    lay = model.layout
    rest = remainder(model)
    s, p, m = lay.num_stages, lay.pipeline_size, lay.micro_batches
    if rest.memory(0) > p * model.capacity:
        return math.inf
    position = [model.ranks[k][0] % p for k in range(s)]

    def makespan_bound(forced: float) -> float:
        work = rest.work(0, s) + forced
        makespan = m * work / p
        if gradients_return(lay.schedule):
            makespan = max(makespan, work if m == 1 else work / (1.0 - ((m - 1) / m) ** s))
            # rank r starts after micro-batch 0 went through the stages before its first one, k_r of them, and
            # runs its M (forward + backward) from there: at least k_r blocks' work, then its share of M x work
            firsts = [position.index(r) for r in range(p)]
            makespan = max(makespan, water_level([rest.least_stages_work(k) for k in firsts], m * work))
        if lay.schedule in ("GPipe", "LoopedBFS"):
            makespan = max(makespan, gpipe(rest.fwd(0, s) + rest.bwd(0, s) + forced + 2 * rest.sends(0, s), m,
                                           rest.max_fwd(0, s),
                                           max(rest.max_bwd(0, s), (rest.bwd(0, s) + forced) / s)))
        return makespan

    forced, makespan = 0.0, makespan_bound(0.0)
    if refined:
        held = [min(model.in_flight[k] for k in range(s) if position[k] == r) for r in range(p)]
        everything = [(0, model.num_blocks)]
        rooms = [rest.room(r) for r in range(p)]
        forced = rest.recomputed(everything, rooms, held)
        if forced == math.inf:
            return math.inf
        makespan = makespan_bound(forced)
        bounded = lambda t: makespan_bound(rest.recomputed(everything, rooms, held, t / m))  # noqa: E731
        makespan = max(makespan, _crossing(bounded, makespan))
    if stages_per_rank(lay.schedule) == 1:
        tail = rest.largest_stage_tail(0, s)
    else:
        tail = max(rest.stage_tail(rest.largest_block_bytes(0)), rest.tail_total(0) / p)
    # a rank's step is at least its actions, the collectives of its stages' sharding and its tail: on average
    # over the ranks, at least every stage's work and the least rate a sharding costs each byte
    busy = (m * (rest.work(0, s) + forced) + model.least_per_step_s_per_byte * rest.param_bytes(0)) / p
    return max(makespan + tail, busy) + model.step_overhead_s


def _crossing(bounded, lowest: float, steps: int = 24) -> float:
    """For `bounded`, a lower bound of the makespan given that it is below its argument (non-increasing in it):
    the largest t (within 2^-steps of the range, rounded down) with bounded(t) >= t, from `lowest`, where
    bounded(lowest) >= lowest holds. Every makespan is at least it: were one below, it would be below t and
    so at least bounded(t) >= t."""
    lo, hi = lowest, bounded(lowest)
    for _ in range(steps):
        if hi <= lo:
            break
        mid = (lo + hi) / 2
        if bounded(mid) >= mid:
            lo = mid
        else:
            hi = mid
    return lo


def gradients_return(schedule: str) -> bool:
    """Whether each stage's last action is a backward whose gradient then goes back through the stages before
    it, as the per-stage and per-rank bounds count. Zero-bubble schedules end with weight gradients (W),
    which send nothing: for them those bounds count only the way down."""
    if schedule in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"):
        return True
    return all(op != "W" for order in orders(schedule, 4, 2, 4) for _, op, _ in order)


def gpipe(total: float, micro_batches: int, max_fwd: float, max_bwd: float) -> float:
    """GPipe's makespan: every stage's forward, backward and transfers once, and the slowest stage's
    forward and backward once more for each further micro-batch."""
    return total + (micro_batches - 1) * (max_fwd + max_bwd)


def water_level(floors: list[float], volume: float) -> float:
    """The least possible max of floor_i + x_i over x_i >= 0 that sum to `volume` (pouring it into the
    lowest first)."""
    ordered = sorted(floors)
    for i in range(1, len(ordered)):
        room = (ordered[i] - ordered[i - 1]) * i  # to raise the i lowest to the next one
        if volume <= room:
            return ordered[i - 1] + volume / i
        volume -= room
    return ordered[-1] + volume / len(ordered)


def _mask(n: int, ranges: list[tuple[int, int]]) -> bytearray:
    """Per block of n: 1 if in one of the ranges."""
    inside = bytearray(n)
    for a, b in ranges:
        inside[a:b] = b"\x01" * (b - a)
    return inside


def _suffix_sums(values: list[float]) -> list[float]:
    out = [0.0] * (len(values) + 1)
    for i in range(len(values) - 1, -1, -1):
        out[i] = out[i + 1] + values[i]
    return out


class _RangeBest:
    """The largest (best=max) or smallest (best=min) of values[start:stop] in constant time (a sparse table);
    0 for an empty range."""

    def __init__(self, values: list[float], best):
        self._best = best
        self._levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self._levels[-1]
            self._levels.append([best(below[i], below[i + width]) for i in range(len(below) - width)])
            width *= 2

    def __call__(self, start: int, stop: int) -> float:
        if stop <= start:
            return 0.0
        level = (stop - start).bit_length() - 1
        row = self._levels[level]
        return self._best(row[start], row[stop - (1 << level)])


def _suffix_min(values: list[float]) -> list[float]:
    out = list(values) + [math.inf]
    for i in range(len(values) - 1, -1, -1):
        out[i] = min(out[i + 1], values[i])
    return out


def _cumulative(items: list[tuple[float, float]]) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    """For `_fill`: (size, value) items in the order to take them, with their running sums."""
    sizes, values = [0.0], [0.0]
    for size, value in items:
        sizes.append(sizes[-1] + size)
        values.append(values[-1] + value)
    return sizes, values, items


def _fill(ordered: tuple[list[float], list[float], list[tuple[float, float]]], capacity: float) -> float:
    """The value of the items (`_cumulative`) taken in order while they fit `capacity`, the next one in part."""
    sizes, values, items = ordered
    if capacity >= sizes[-1]:
        return values[-1]
    k = bisect.bisect_right(sizes, capacity) - 1  # items [0, k) fit whole
    size, value = items[k]
    return values[k] + value * (capacity - sizes[k]) / size
