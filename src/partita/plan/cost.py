"""Time and memory of one stage under one layout: the planner's cost model (pure Python).

Memory of a rank = parameters + gradients (one copy: gradient accumulation over calls, which holds a second,
is not planned for) + optimizer state (copies of the parameters the user's optimizer keeps: SGD 0, SGD with
momentum 1, Adam 2) + the larger of what the backward holds (activations kept for it, per micro-batch, times
the micro-batches the schedule holds at once on that stage; with recomputation only the stage's inputs are
kept, plus one micro-batch's activations while it is recomputed; on the last stage, what the loss keeps of the
outputs (`loss_bytes`); and what a sharded stage gathers whole, below) and what the optimizer's step allocates
while it runs + communication buffers (torch's PipelineStage allocates
a receive buffer per micro-batch for activations and for gradients; the gradient all-reduce packs buckets) +
the process's fixed overhead.

Time of a stage per micro-batch = forward + backward (+ forward again when recomputed) + a sharded stage's
collectives (below); transfers to the neighbour stages; and, after the pipeline drains, the all-reduce of its
gradients over its replicas, putting them into .grad and the optimizer step, which partita's runtime does not
overlap with the pipeline.

Sharding: what the R replicas of a stage (parameters P bytes, optimizer state O x P) split among themselves
(plan.SHARDING_LEVELS). Each stage takes, among the levels that fit, the one with its shortest time (its
micro-batches' forwards and backwards and what it adds per step); ties go to the level that shards less.
- "none": every replica holds everything; gradients are all-reduced after the pipeline.
- "optimizer" (ZeRO-1, `runtime.sharding`): each replica keeps O x P / R of the state and steps only its share
  of the parameters, then broadcasts their new values to the others (an all-gather of P) after the step.
- "gradients" (ZeRO-2) and "parameters" (ZeRO-3) run under torch's FSDP2 over the stage's replicas, each block's
  own parameters one unit (U: the largest unit's bytes). A replica keeps P / R of the
  parameters, of the gradients and of O x P of the state, steps only its shard (no all-reduce, no gather after
  the step), and holds the reduce-scatter's input (U) among its buffers. "gradients" gathers the parameters
  once per step (an all-gather of P, counted with what the stage adds per step) and keeps them whole until its
  last backward, which holds them and one unit's whole gradient (P + U) beside its activations; every
  micro-batch's backward reduce-scatters the gradients (the time of an all-gather of P). "parameters" gathers
  each unit before each micro-batch's forward and again before its backward (a recomputed forward runs after
  the backward's gather), holding two units (the running one and the next, prefetched) and one unit's whole
  gradient (3 U) beside its activations: an all-gather of P per forward, an all-gather and a reduce-scatter of
  P per backward. The model does not overlap these collectives with compute (conservative: on CPUs they use
  the same cores). A parameter that more than one block reads (a tied weight) is not sharded: it stays whole,
  all-reduced after the pipeline and stepped whole (`runtime.fully_sharded`).
Under FSDP's levels data parallelism alone (one stage, one micro-batch) runs under partita's pipelined runtime
with one stage instead of torch's DDP, and is costed as such (`Layout.pipelined`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TypeVar

from partita.cluster import Cluster
from partita.graph import ModelGraph, Profile
from partita.plan.plan import FSDP_LEVELS, rank_layout
from partita.schedule import orders
from partita.schedule.inflight import micro_batches_in_flight
from partita.schedule.catalog import SPLIT_BACKWARD_SCHEDULES

GRAD_BUCKET_BYTES = 32 * 2**20  # partita.runtime.grads.BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 10**6  # torch's DistributedDataParallel's bucket_cap_mb


@dataclass(frozen=True)
class Layout:
    """Every choice of a plan except where the stage boundaries fall."""

    schedule: str
    num_stages: int
    pipeline_size: int
    num_replicas: int
    micro_batches: int
    micro_batch_rows: int
    sharding: str | None = None  # fixed for every stage (plan.SHARDING_LEVELS); None: each stage's own choice

    @property
    def data_parallel_only(self) -> bool:
        return self.num_stages == 1 and self.micro_batches == 1

    @property
    def pipelined(self) -> bool:
        """Whether partita's pipelined runtime runs it: every layout but data parallelism alone (torch's DDP),
        and that too where its sharding is one of FSDP's, which DDP does not run (`search.layouts` offers data
        parallelism alone with each of them fixed, and with the others)."""
        return not self.data_parallel_only or self.sharding in FSDP_LEVELS

    def describe(self) -> str:
        fixed = f", sharding {self.sharding}" if self.sharding is not None else ""
        return (f"{self.num_stages} stage(s) x {self.num_replicas} replica(s), {self.schedule}, "
                f"{self.micro_batches} micro-batch(es) of {self.micro_batch_rows} rows{fixed}")


@dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    # what the optimizer's step allocates while it runs, after the backward freed the activations
    step_transient: int = 0
    # what FSDP's levels hold whole beside the activations while computing: gathered parameters and one unit's
    # whole gradient
    gathered: int = 0

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.buffers
                + max(self.activations + self.gathered, self.step_transient))


@dataclass(frozen=True)
class StageCost:
    blocks: tuple[int, int]
    recompute: bool
    fwd_s: float  # includes the collectives of FSDP's levels (collective_s)
    bwd_s: float  # includes the recomputed forward and the collectives of FSDP's levels
    send_fwd_s: float  # its outputs to the next stage's rank, per micro-batch
    send_bwd_s: float  # its input gradients to the previous stage's rank, per micro-batch
    memory: Memory  # without the process's own memory (a rank-level cost)
    param_bytes: int
    allreduce_s: float  # summing its gradients over its replicas, after the pipeline (FSDP's levels: tied ones)
    optimizer_s: float  # the optimizer step on its parameters (on this replica's share, when sharded)
    # a pipeline holds a step's gradients aside until loss.backward() (so that the caller's gradient scales them):
    # packing them for the all-reduce, scaling them and putting them into .grad, after the pipeline
    apply_gradients_s: float = 0.0
    sharding: str = "none"  # what its replicas split among themselves (plan.SHARDING_LEVELS)
    # once per step, an all-gather of its parameters over its replicas: "optimizer", after the step, each
    # replica's share of new values sent to the others; "gradients", before its first forward
    gather_s: float = 0.0
    # per micro-batch, the all-gathers and reduce-scatters of FSDP's levels (in fwd_s and bwd_s)
    collective_s: float = 0.0

    @property
    def work_s(self) -> float:
        return self.fwd_s + self.bwd_s


class CostModel:
    """Costs of candidate stages for one layout; stage costs are cached by (stage, blocks)."""

    def __init__(self, graph: ModelGraph, profile: Profile, cluster: Cluster, optimizer_factor: float,
                 layout: Layout):
        self.graph, self.profile, self.cluster, self.layout = graph, profile, cluster, layout
        self.optimizer_factor = optimizer_factor
        self.stream_bps = profile.param_stream_bps or cluster.device.mem_bandwidth_bps
        rows = layout.micro_batch_rows
        self._fwd, self._bwd, self._act = _block_prefixes(profile, rows)
        self._boundary = [b.at(rows) for b in graph.boundary_bytes]
        self._outputs = graph.output_bytes.at(rows)  # the model's outputs, per micro-batch
        self._writes = [b.writes_buffers for b in graph.blocks]
        self.ranks = _rank_layout(layout.schedule, layout.num_stages, layout.num_replicas)  # [stage][replica]
        self._stage = lru_cache(maxsize=None)(self._compute_stage)
        self._floor = lru_cache(maxsize=None)(self._compute_floor)
        self._units = lru_cache(maxsize=None)(self._compute_units)
        # asked for again by the choice among levels, memory_needed and memory_floor
        self._memory = lru_cache(maxsize=None)(self._compute_memory)
        self._least_tail = lru_cache(maxsize=None)(self._compute_least_tail)  # the bounds ask for the same sizes
        self.pipelined = layout.pipelined
        self.shardings = _shardings(layout, optimizer_factor)
        # per parameter read by more than one block, those blocks in order (tied weights; FSDP's units)
        self._shared = _shared_params(graph)
        # the least bytes of weights + gradients + optimizer state per byte of parameters, over the shardings
        self.static_per_param_byte = min(self._kept_share(s) * (2 + optimizer_factor) if s in FSDP_LEVELS
                                         else 2 + self._optimizer_share(s) * optimizer_factor
                                         for s in self.shardings)
        self.capacity = cluster.memory_per_rank - cluster.overhead_bytes
        # ranks that share cores (CPU processes) slow each other down while they compute; a pipeline's ranks
        # compute only outside its bubble, estimated here by the classic (P-1) / (M*v + P-1)
        per_rank = layout.num_stages // layout.pipeline_size
        bubble = (layout.pipeline_size - 1) / (layout.micro_batches * per_rank + layout.pipeline_size - 1)
        self.compute_stretch = cluster.contention(1.0 - bubble)
        self.step_stretch = cluster.contention(1.0)  # every rank steps its optimizer at the same time
        self.action_s = cluster.action_overhead_s if self.pipelined else 0.0  # partita's runtime per action
        self.step_overhead_s = cluster.step_overhead_s(self.pipelined)  # per step, on every rank
        # the collectives over a stage's replicas differ between stages only by how many ranks and nodes take
        # part: one stage of each kind, for bounds
        groups = {(len(ranks), len({cluster.node_of(r) for r in ranks})): s for s, ranks in enumerate(self.ranks)}
        self.replica_group_stages = tuple(groups.values())

    @cached_property
    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the micro-batches whose activations it holds at once (from the schedule's orders: only
        layouts whose stages are costed need them, not those the bounds rule out unsearched)."""
        lay = self.layout
        return _in_flight(lay.schedule, lay.num_stages, lay.pipeline_size, lay.micro_batches)

    def param_bytes(self, start: int, stop: int) -> int:
        return self.graph.param_bytes_of(start, stop)

    @property
    def num_blocks(self) -> int:
        return self.graph.num_blocks

    def work(self, start: int, stop: int) -> float:
        """Forward + backward compute seconds of blocks [start, stop) per micro-batch, without recomputation
        (a lower bound of what a stage of them costs)."""
        return (self._fwd[stop] - self._fwd[start] + self._bwd[stop] - self._bwd[start]) * self.compute_stretch

    def boundary_bytes(self, cut: int) -> float:
        """Bytes live at `cut` (after block cut-1), per micro-batch."""
        return self._boundary[cut - 1] if 0 < cut < self.num_blocks else 0.0

    def boundary_s(self, stage: int, cut: int) -> float:
        """Seconds to move the tensors live at `cut` (after block cut-1) from `stage` to `stage + 1`."""
        if cut <= 0 or cut >= self.num_blocks:
            return 0.0
        a, b = self.ranks[stage][0], self.ranks[stage + 1][0]
        return 0.0 if a == b else self.cluster.link(a, b).seconds(self._boundary[cut - 1])

    def stage(self, stage: int, start: int, stop: int, recompute: bool | None = None) -> StageCost | None:
        """The cheapest feasible way to run blocks [start, stop) as `stage`: without recomputation if it fits
        in memory, else with it (never for a stage that updates buffers, e.g. BatchNorm statistics, which a
        recomputation would update twice). None if neither fits."""
        return self._stage(stage, start, stop, recompute)

    def memory_needed(self, stage: int, start: int, stop: int) -> int:
        """The least memory blocks [start, stop) need as `stage`, feasible or not (for messages)."""
        return min(self._memory(stage, start, stop, rc, sharding=sh).total
                   for rc in (False, True) for sh in self.shardings)

    def memory_floor(self, stage: int, start: int, stop: int) -> int:
        """A lower bound of the memory of blocks [start, stop) as `stage` that only grows with `stop` (the
        buffers for the stage's outputs are left out: a longer stage may end at a smaller boundary)."""
        return self._floor(stage, start, stop)

    def first_too_big(self, stage: int, recompute: bool) -> list[int]:
        """Per start (of those before the first with none), the first stop from which blocks [start, stop) as
        `stage` do not fit the rank unsharded by an upper bound of their memory (`_compute_memory`'s, from prefix
        sums: each block's parameters counted whole, a tied one once per block that reads it; the stage's inputs
        and outputs at the largest boundary), which only grows with the stop and shrinks with the start, so that
        every stage that does not fit unsharded ends at or after its start's first stop too big."""
        n, m, factor = self.num_blocks, self.layout.micro_batches, self.optimizer_factor
        params, acts = self._block_param_bytes, self._act
        largest = max(self._boundary, default=0.0)
        held = self.in_flight[stage]
        bucket = GRAD_BUCKET_BYTES if self.pipelined else math.inf
        loss = self.loss_bytes(held)

        def cap(start: int, stop: int) -> float:
            p = params[stop] - params[start]
            a = acts[stop] - acts[start]
            kept = (largest * held + a if recompute else a * held) + (loss if stop == n else 0.0)
            return p * (2 + factor) + 2 * m * largest + min(p, bucket) + max(kept, p if factor >= 2 else 0.0)

        stops, stop = [], 1
        for start in range(n):
            stop = max(stop, start + 1)
            while stop <= n and cap(start, stop) <= self.capacity:
                stop += 1
            if stop > n:
                break  # no later start has a stage too big either
            stops.append(stop)
        return stops

    @cached_property
    def _block_param_bytes(self) -> list[float]:
        """Prefix sums over the blocks of the bytes of every parameter each reads."""
        sizes = self.graph.param_bytes
        return _prefix([sum(sizes[name] for name in set(b.params)) for b in self.graph.blocks])

    def _compute_floor(self, stage: int, start: int, stop: int) -> int:
        return min(self._memory(stage, start, stop, rc, outputs=False, sharding=sh, floor=True).total
                   for rc in (False, True) for sh in self.shardings)

    def activation_bytes(self, start: int, stop: int) -> float:
        """Activations of blocks [start, stop) for one micro-batch: the least any stage of them keeps."""
        return self._act[stop] - self._act[start]

    def _optimizer_share(self, sharding: str) -> float:
        """The part of a stage's optimizer state each replica keeps (FSDP's levels: of the sharded parameters)."""
        return 1.0 if sharding == "none" else 1.0 / self.layout.num_replicas

    def _kept_share(self, sharding: str) -> float:
        """The part of a stage's sharded parameters (all but the tied ones) and of their gradients each replica
        keeps between steps."""
        return 1.0 / self.layout.num_replicas if sharding in FSDP_LEVELS else 1.0

    def units(self, start: int, stop: int) -> tuple[int, int]:
        """(bytes of the parameters of blocks [start, stop) that more than one block reads, which FSDP's levels
        keep whole; bytes of their largest FSDP unit: a block's own parameters)."""
        return self._units(start, stop)

    def _compute_units(self, start: int, stop: int) -> tuple[int, int]:
        sizes = self.graph.param_bytes
        whole = sum(sizes[name] for name, blocks in self._shared.items() if _any_within(blocks, start, stop))
        return whole, max(self._own_bytes[start:stop], default=0)

    @cached_property
    def _own_bytes(self) -> list[int]:
        """Per block, the bytes of the parameters it alone reads (its FSDP unit)."""
        sizes = self.graph.param_bytes
        return [sum(sizes[q] for q in set(b.params) if q not in self._shared) for b in self.graph.blocks]

    def _compute_memory(self, stage: int, start: int, stop: int, recompute: bool, outputs: bool = True,
                sharding: str = "none", floor: bool = False) -> Memory:
        """`floor`: a lower bound that only grows with `stop`, for `memory_floor`: with FSDP's levels, as if no
        parameter were tied (keeping one whole costs a replica more than it saves it, with two or more
        replicas)."""
        params = self.param_bytes(start, stop)
        acts = self._act[stop] - self._act[start]
        in_bytes = self._boundary[start - 1] if start > 0 else 0.0
        out_bytes = self._boundary[stop - 1] if stop < self.num_blocks and outputs else 0.0
        held = self.in_flight[stage]
        kept = (in_bytes * held + acts) if recompute else acts * held
        if stop == self.num_blocks:
            kept += self.loss_bytes(held)
        received = self.layout.micro_batches * (in_bytes + out_bytes)  # PipelineStage's receive buffers
        # torch's multi-tensor Adam-like steps (two or more copies of state) take the square root of the second
        # moment into a new tensor of the parameters' size, of the parameters the replica steps
        adam = self.optimizer_factor >= 2
        if sharding in FSDP_LEVELS:
            whole, unit = self.units(start, stop)
            if floor:
                whole = 0
            sharded = params - whole
            local = whole + sharded * self._kept_share(sharding)  # parameters, gradients, state: per byte
            # gathered whole while computing: "gradients" all of them, "parameters" the running unit and the
            # next (prefetched); with one unit's whole gradient
            gathered = (sharded if sharding == "gradients" else min(2 * unit, sharded)) + unit
            if floor:
                # with one replica a tied parameter kept whole costs nothing more: only a unit is sure to be
                # gathered; less the bytes that rounding each part down may shift between them
                gathered = max(0, (gathered if self.layout.num_replicas > 1 else unit) - 4)
            # the tied parameters' all-reduce bucket, and the reduce-scatter's input
            buffers = received + min(whole, GRAD_BUCKET_BYTES) + unit
            return Memory(int(local), int(local), int(local * self.optimizer_factor), int(kept), int(buffers),
                          int(local) if adam else 0, int(gathered))
        # a pipeline's fresh gradients become .grad in place; only accumulating over calls (.grad already set)
        # holds a second copy, which the runtime logs (runtime.grads)
        grads = params
        # a pipeline sums gradients one bucket at a time; torch's DDP keeps a bucket for every gradient
        buffers = received + min(params, GRAD_BUCKET_BYTES) if self.pipelined else params
        share = self._optimizer_share(sharding)
        optimizer = params * self.optimizer_factor * share
        transient = params * share if adam else 0
        return Memory(int(params), int(grads), int(optimizer), int(kept), int(buffers), int(transient))

    def loss_bytes(self, held: int) -> float:
        """What computing the loss from the model's outputs adds to the last stage, `held` micro-batches at once:
        the loss function keeps a copy of each one's outputs for its backward (cross entropy: the
        log-probabilities), a pipeline also keeps the outputs themselves until the micro-batch's backward, and
        the backward makes the gradient of one micro-batch's outputs. Block profiles stop at the outputs."""
        return ((2 if self.pipelined else 1) * held + 1) * self._outputs

    def forward_s(self, start: int, stop: int) -> float:
        """Seconds of one micro-batch's forward through blocks [start, stop) as one stage."""
        return (self._fwd[stop] - self._fwd[start]) * self.compute_stretch + self.action_s

    def backward_s(self, start: int, stop: int, param_bytes: float) -> float:
        """Seconds of one micro-batch's backward through blocks [start, stop) as one stage whose parameters
        take `param_bytes`, without recomputation."""
        return (self._bwd[stop] - self._bwd[start] + self.gradient_traffic_s(param_bytes)) * self.compute_stretch \
            + self.action_s

    def collectives_s(self, stage: int, sharded_bytes: float, sharding: str, units: int = 1) -> tuple[float, float]:
        """Seconds of FSDP's collectives over the stage's replicas per micro-batch, in its (forward, backward):
        each backward reduce-scatters the gradients; "parameters" also gathers the parameters before each
        forward and each backward. One collective per unit, each paying the latency (`units` of equal size
        cost what units of any sizes do under latency + bytes / bandwidth)."""
        if sharding not in FSDP_LEVELS:
            return 0.0, 0.0
        reduce = self.fsdp_collective_s(self.cluster.reduce_scatter_s, stage, sharded_bytes, units)
        if sharding == "gradients":
            return 0.0, reduce
        gather = self.fsdp_collective_s(self.cluster.allgather_s, stage, sharded_bytes, units)
        return gather, gather + reduce

    def fsdp_collective_s(self, collective_s, stage: int, sharded_bytes: float, units: int) -> float:
        """One collective per unit over the stage's replicas. FSDP runs them while its units compute (it
        prefetches gathers, reduces a unit's gradients as the backward goes on): like DDP's all-reduce they
        cost (1 + the measured interference) times their time alone where both compete for the same cores
        (measured on 4 CPU ranks: ZeRO-2 and ZeRO-3 added 2.4 times what their collectives take alone)."""
        units = max(units, 1)
        alone = units * collective_s(sharded_bytes / units, self.ranks[stage])
        return alone * (1.0 + self.cluster.allreduce_interference)

    def unit_count(self, start: int, stop: int) -> int:
        """FSDP units of blocks [start, stop): the blocks with parameters of their own."""
        return self._units_before[stop] - self._units_before[start]

    @cached_property
    def _units_before(self) -> list[int]:
        return [0, *itertools.accumulate(1 if b else 0 for b in self._own_bytes)]

    def _compute_stage(self, stage: int, start: int, stop: int, recompute: bool | None) -> StageCost | None:
        """Without recomputation before with it; for each, the sharding with the stage's shortest time among
        those that fit (`stage_time_s`; ties: the one that shards less)."""
        writes = any(self._writes[start:stop])
        options = [False, True] if recompute is None else [recompute]
        for rc in options:
            if rc and writes:
                continue
            fitting = [self.priced(stage, start, stop, rc, sh) for sh in self.shardings
                       if self._memory(stage, start, stop, rc, sharding=sh).total <= self.capacity]
            if fitting:
                return min(fitting, key=self.stage_time_s)  # the first of equals: the one that shards less
        return None

    def priced(self, stage: int, start: int, stop: int, recompute: bool, sharding: str) -> StageCost:
        """Blocks [start, stop) as `stage` with this recomputation and sharding, fitting memory or not."""
        params = self.param_bytes(start, stop)
        fwd, bwd = self.forward_s(start, stop), self.backward_s(start, stop, params)
        whole = self.units(start, stop)[0] if sharding in FSDP_LEVELS else 0
        units = self.unit_count(start, stop)
        coll_fwd, coll_bwd = self.collectives_s(stage, params - whole, sharding, units)
        allreduce, apply, optimizer, gather = self.per_step(stage, params, whole, sharding, units)
        return StageCost(
            blocks=(start, stop), recompute=recompute, fwd_s=fwd + coll_fwd,
            bwd_s=bwd + (fwd if recompute else 0.0) + coll_bwd,  # a recomputed forward runs after the gathers
            send_fwd_s=self.boundary_s(stage, stop), send_bwd_s=self.boundary_s(stage - 1, start) if stage else 0.0,
            memory=self._memory(stage, start, stop, recompute, sharding=sharding), param_bytes=int(params),
            allreduce_s=allreduce, optimizer_s=optimizer, apply_gradients_s=apply, sharding=sharding,
            gather_s=gather, collective_s=coll_fwd + coll_bwd)

    def stage_time_s(self, cost: StageCost) -> float:
        """What a stage costs its rank per step: its micro-batches' forwards and backwards, and its tail."""
        return self.layout.micro_batches * cost.work_s + self.tail_s(cost)

    def tail_s(self, cost: StageCost) -> float:
        """What a stage adds to its rank's work after the pipeline drains: the part of the all-reduce of its
        gradients that outlasts its last backward (`exposed_allreduce_s`), putting them into .grad, and the
        optimizer step; and the once-per-step all-gather of its parameters where its sharding has one
        (`gather_s`)."""
        exposed = self.exposed_allreduce_s(cost.allreduce_s, cost.bwd_s, cost.param_bytes)
        if not self.pipelined:  # DDP sums into .grad while its backward runs
            return exposed + cost.optimizer_s + cost.gather_s
        return exposed + cost.apply_gradients_s + cost.optimizer_s + cost.gather_s

    @property
    def bucket_bytes(self) -> int:
        """The gradient bucket the layout's runtime sums at once: partita's under a pipeline, DDP's otherwise."""
        return GRAD_BUCKET_BYTES if self.pipelined else DDP_BUCKET_BYTES

    def exposed_allreduce_s(self, allreduce_s: float, last_backward_s: float, param_bytes: float) -> float:
        """The part of a stage's gradient all-reduce that outlasts its last backward. DDP's buckets and
        partita's (runtime.grads) start as the backward finishes their gradients, so only what outlasts that
        backward shows, and at least the last bucket's sum; it costs more where the sums and the backward
        compete for the same cores (the measured interference). `last_backward_s`: one micro-batch's
        backward under a pipeline, the whole batch's under DDP."""
        exposed = max(allreduce_s - last_backward_s, allreduce_s * min(1.0, self.bucket_bytes / max(param_bytes, 1)))
        return exposed * (1.0 + self.cluster.allreduce_interference)

    def gradient_traffic_s(self, param_bytes: float) -> float:
        """Writing a backward's parameter gradients: a pipeline adds each micro-batch's into .grad (read both,
        write one); DDP copies them into its buckets (read one, write one). Block profiles miss it: they take
        gradients with autograd.grad, which accumulates nothing."""
        return param_bytes * (3 if self.pipelined else 2) / self.stream_bps

    def apply_gradients_s(self, param_bytes: float, shard_bytes: float = 0.0) -> float:
        """After a pipelined step: with replicas, the gradients are copied into all-reduce buckets (read one, write
        one); then scaled (read one, write one). FSDP's levels scale only the replica's `shard_bytes` of the
        sharded gradients (they are reduced already). DDP does none of this outside its backward."""
        if not self.pipelined:
            return 0.0
        passes = 2 + (2 if self.layout.num_replicas > 1 else 0)
        return (param_bytes * passes + shard_bytes * 2) / self.stream_bps * self.step_stretch

    def per_step(self, stage: int, param_bytes: int, whole: int, sharding: str,
                 units: int = 1) -> tuple[float, float, float, float]:
        """Per step, (all-reduce, gradients into .grad, optimizer step, all-gather) seconds of a stage's
        parameters, `whole` bytes of which FSDP's levels keep whole (the rest they shard, in `units`)."""
        ranks, replicas = self.ranks[stage], self.layout.num_replicas
        if sharding in FSDP_LEVELS:
            shard = (param_bytes - whole) / replicas
            gather = self.fsdp_collective_s(self.cluster.allgather_s, stage, param_bytes - whole, units) \
                if sharding == "gradients" else 0.0
            return (self.cluster.allreduce_s(whole, ranks), self.apply_gradients_s(whole, shard),
                    self.optimizer_s(whole + shard), gather)
        gather = self.cluster.allgather_s(param_bytes, ranks) if sharding == "optimizer" else 0.0
        return (self.cluster.allreduce_s(param_bytes, ranks), self.apply_gradients_s(param_bytes),
                self.optimizer_s(param_bytes) * self._optimizer_share(sharding), gather)

    def least_tail_s(self, param_bytes: int) -> float:
        """The least `tail_s` of any stage whose parameters take `param_bytes`, under any sharding allowed (for
        bounds: sharing no parameter with another stage is cheapest). Of the all-reduce it counts the volume
        term of at most one bucket, which no backward hides (`exposed_allreduce_s`): a bound that grows with
        the bytes and is no more for a sum than for its parts, as the bounds need."""
        return self._least_tail(param_bytes)

    def _compute_least_tail(self, param_bytes: int) -> float:
        bucket = self.bucket_bytes
        tails = []
        for s in self.replica_group_stages:
            ranks = self.ranks[s]
            per_byte = (self.cluster.allreduce_s(2 * bucket, ranks) - self.cluster.allreduce_s(bucket, ranks)) / bucket
            for sharding in self.shardings:
                _, apply, optimizer, gather = self.per_step(s, param_bytes, 0, sharding)
                summed = 0.0 if sharding in FSDP_LEVELS else per_byte * min(param_bytes, bucket)
                tails.append(summed * (1.0 + self.cluster.allreduce_interference)
                             + (apply if self.pipelined else 0.0) + optimizer + gather)
        return min(tails)

    @cached_property
    def least_per_step_s_per_byte(self) -> float:
        """The least seconds per byte of its parameters that a stage's sharding costs it per step, over the
        levels and replica groups: its micro-batches' collectives and its tail, less the all-reduce (the
        backward may hide all of it but a bucket: `exposed_allreduce_s`). Each of those is a latency plus bytes
        times a rate, so every stage's cost is at least this times its bytes (for bounds; a parameter kept whole
        costs at least "none"'s rate)."""
        big = float(2**40)

        def cost_s(stage: int, sharding: str, nbytes: float) -> float:
            _, apply, optimizer, gather = self.per_step(stage, int(nbytes), 0, sharding)
            collectives = self.layout.micro_batches * sum(self.collectives_s(stage, nbytes, sharding))
            return collectives + (apply if self.pipelined else 0.0) + optimizer + gather

        # FSDP's levels keep a tied parameter whole: at "none"'s rate, which may be the lesser
        levels = set(self.shardings) | ({"none"} if set(self.shardings) & set(FSDP_LEVELS) else set())
        # the rate, from two sizes past any latency; less a rounding margin
        return min((cost_s(s, sh, 2 * big) - cost_s(s, sh, big)) / big
                   for s in self.replica_group_stages for sh in sorted(levels)) * (1 - 1e-9)

    def optimizer_s(self, param_bytes: float) -> float:
        """The optimizer step at the rate measured for the job's own optimizer; else modelled as memory-bound:
        read weights, gradients and state, write weights and state."""
        if self.profile.optimizer_bps:
            return param_bytes / self.profile.optimizer_bps * self.step_stretch
        return param_bytes * (3 + 2 * self.optimizer_factor) / self.stream_bps * self.step_stretch


@lru_cache(maxsize=1024)
def _in_flight(schedule: str, num_stages: int, pipeline_size: int, micro_batches: int) -> tuple[int, ...]:
    return micro_batches_in_flight(orders(schedule, num_stages, pipeline_size, micro_batches), num_stages)


@lru_cache(maxsize=256)
def _block_prefixes(profile: Profile, rows: int) -> tuple[list[float], list[float], list[float]]:
    """Prefix sums over the blocks of forward seconds, backward seconds and activation bytes at `rows` rows
    (shared by every layout with micro-batches of that size)."""
    blocks = profile.blocks
    return (_prefix([b.fwd_s.at(rows) for b in blocks]), _prefix([b.bwd_s.at(rows) for b in blocks]),
            _prefix([b.activation_bytes.at(rows) for b in blocks]))


@lru_cache(maxsize=1024)
def _rank_layout(schedule: str, num_stages: int, num_replicas: int) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, rank_layout(schedule, num_stages, num_replicas)))


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _shardings(layout: Layout, optimizer_factor: float) -> tuple[str, ...]:
    """The sharding levels a stage may take, least sharded first: the one fixed, else, where there are replicas
    to share among, the optimizer's state (where there is state to share) and FSDP's levels (where DDP does
    not run the layout)."""
    if layout.sharding is not None:
        return (layout.sharding,)
    if layout.num_replicas == 1:
        return ("none",)
    fsdp = layout.pipelined and layout.schedule not in SPLIT_BACKWARD_SCHEDULES
    return ("none",) + (("optimizer",) if optimizer_factor > 0 else ()) + (FSDP_LEVELS if fsdp else ())


def _any_within(ascending: list[int], start: int, stop: int) -> bool:
    """Whether some element of `ascending` lies in [start, stop)."""
    i = bisect.bisect_left(ascending, start)
    return i < len(ascending) and ascending[i] < stop


def _shared_params(graph: ModelGraph) -> dict[str, list[int]]:
    """Per parameter that more than one block reads, those blocks in order."""
    readers: dict[str, list[int]] = {}
    for i, block in enumerate(graph.blocks):
        for name in block.params:
            readers.setdefault(name, []).append(i)
    return {name: blocks for name, blocks in readers.items() if len(blocks) > 1}


T = TypeVar("T")


def made_once(make: Callable[[CostModel], T]) -> Callable[[CostModel], T]:
    """`make`, made once per cost model and kept while the model lives: a layout's bounds, its first plans and
    each round of its search ask for the same tables, which take the model's blocks several passes to make."""
    made: weakref.WeakKeyDictionary[CostModel, T] = weakref.WeakKeyDictionary()

    def once(model: CostModel) -> T:
        if model not in made:
            made[model] = make(model)
        return made[model]

    return once
