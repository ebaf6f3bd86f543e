"""Time and memory of one stage under one layout: the planner's cost model (pure Python).

Memory of a rank = parameters + gradients (one copy: gradient accumulation over calls, which holds a second,
is not planned for) + optimizer state + the larger of the activations and what the optimizer's step allocates
while it runs (copies of the parameters the user's optimizer
keeps: SGD 0, SGD with momentum 1, Adam 2) + activations kept for the backward (per micro-batch, times the
micro-batches the schedule holds at once on that stage; with recomputation only the stage's inputs are kept,
plus one micro-batch's activations while it is recomputed) + communication buffers (torch's PipelineStage
allocates a receive buffer per micro-batch for activations and for gradients; the gradient all-reduce packs
buckets) + the process's fixed overhead.

Time of a stage per micro-batch = forward + backward (+ forward again when recomputed); transfers to the
neighbour stages; and, after the pipeline drains, the all-reduce of its gradients over its replicas, putting
them into .grad and the optimizer step, which partita's runtime does not overlap with the pipeline.

Sharding (ZeRO-1, "optimizer"): each replica of a stage keeps 1/replicas of its optimizer state and steps only
those parameters, then broadcasts their new values to the other replicas (an all-gather's volume) after the
step. A stage takes it where it is what fits, or where it makes the step shorter (`runtime.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from partita.cluster import Cluster
from partita.graph import ModelGraph, Profile
from partita.plan.plan import rank_layout
from partita.schedule import orders
from partita.schedule.inflight import micro_batches_in_flight
from partita.schedule.catalog import stages_per_rank

GRAD_BUCKET_BYTES = 32 * 2**20  # partita.runtime.grads.BUCKET_BYTES


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

    def describe(self) -> str:
        return (f"{self.num_stages} stage(s) x {self.num_replicas} replica(s), {self.schedule}, "
                f"{self.micro_batches} micro-batch(es) of {self.micro_batch_rows} rows")


@dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    # what the optimizer's step allocates while it runs, after the backward freed the activations
    step_transient: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + max(self.activations, self.step_transient)


@dataclass(frozen=True)
class StageCost:
    blocks: tuple[int, int]
    recompute: bool
    fwd_s: float
    bwd_s: float  # includes the recomputed forward
    send_fwd_s: float  # its outputs to the next stage's rank, per micro-batch
    send_bwd_s: float  # its input gradients to the previous stage's rank, per micro-batch
    memory: Memory  # without the process's own memory (a rank-level cost)
    param_bytes: int
    allreduce_s: float  # summing its gradients over its replicas, after the pipeline
    optimizer_s: float  # the optimizer step on its parameters (on this replica's share, when sharded)
    # a pipeline holds a step's gradients aside until loss.backward() (so that the caller's gradient scales them):
    # packing them for the all-reduce, scaling them and putting them into .grad, after the pipeline
    apply_gradients_s: float = 0.0
    sharding: str = "none"  # what its replicas split among themselves (plan.SHARDING_LEVELS)
    gather_s: float = 0.0  # after the optimizer step, each replica's share of new values sent to the others

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
        self._writes = [b.writes_buffers for b in graph.blocks]
        self.ranks = _rank_layout(layout.schedule, layout.num_stages, layout.num_replicas)  # [stage][replica]
        self._stage = lru_cache(maxsize=None)(self._compute_stage)
        self._floor = lru_cache(maxsize=None)(self._compute_floor)
        self.pipelined = not layout.data_parallel_only
        self.shardings = _shardings(layout, optimizer_factor)
        # the least bytes of weights + gradients + optimizer state per byte of parameters, over the shardings
        self.static_per_param_byte = 2 + min(self._optimizer_share(s) for s in self.shardings) * optimizer_factor
        self.capacity = cluster.memory_per_rank - cluster.overhead_bytes
        # ranks that share cores (CPU processes) slow each other down while they compute; a pipeline's ranks
        # compute only outside its bubble, estimated here by the classic (P-1) / (M*v + P-1)
        per_rank = layout.num_stages // layout.pipeline_size
        bubble = (layout.pipeline_size - 1) / (layout.micro_batches * per_rank + layout.pipeline_size - 1)
        self.compute_stretch = cluster.contention(1.0 - bubble)
        self.step_stretch = cluster.contention(1.0)  # every rank steps its optimizer at the same time
        self.action_s = cluster.action_overhead_s if self.pipelined else 0.0  # partita's runtime per action
        self.step_overhead_s = cluster.step_overhead_s(self.pipelined)  # per step, on every rank

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

    def _compute_floor(self, stage: int, start: int, stop: int) -> int:
        return min(self._memory(stage, start, stop, rc, outputs=False, sharding=sh).total
                   for rc in (False, True) for sh in self.shardings)

    def activation_bytes(self, start: int, stop: int) -> float:
        """Activations of blocks [start, stop) for one micro-batch: the least any stage of them keeps."""
        return self._act[stop] - self._act[start]

    def _optimizer_share(self, sharding: str) -> float:
        """The part of a stage's optimizer state each replica keeps."""
        return 1.0 / self.layout.num_replicas if sharding == "optimizer" else 1.0

    def _memory(self, stage: int, start: int, stop: int, recompute: bool, outputs: bool = True,
                sharding: str = "none") -> Memory:
        params = self.param_bytes(start, stop)
        acts = self._act[stop] - self._act[start]
        in_bytes = self._boundary[start - 1] if start > 0 else 0.0
        out_bytes = self._boundary[stop - 1] if stop < self.num_blocks and outputs else 0.0
        held = self.in_flight[stage]
        # a pipeline's fresh gradients become .grad in place; only accumulating over calls (.grad already set)
        # holds a second copy, which the runtime logs (runtime.grads)
        grads = params
        # a pipeline sums gradients one bucket at a time; torch's DDP keeps a bucket for every gradient
        buffers = (self.layout.micro_batches * (in_bytes + out_bytes) + min(params, GRAD_BUCKET_BYTES)
                   if self.pipelined else params)
        kept = (in_bytes * held + acts) if recompute else acts * held
        share = self._optimizer_share(sharding)
        optimizer = params * self.optimizer_factor * share
        # torch's multi-tensor Adam-like steps (two or more copies of state) take the square root of the second
        # moment into a new tensor of the parameters' size, of the parameters the replica steps
        transient = params * share if self.optimizer_factor >= 2 else 0
        return Memory(int(params), int(grads), int(optimizer), int(kept), int(buffers), int(transient))

    def forward_s(self, start: int, stop: int) -> float:
        """Seconds of one micro-batch's forward through blocks [start, stop) as one stage."""
        return (self._fwd[stop] - self._fwd[start]) * self.compute_stretch + self.action_s

    def backward_s(self, start: int, stop: int, param_bytes: float) -> float:
        """Seconds of one micro-batch's backward through blocks [start, stop) as one stage whose parameters
        take `param_bytes`, without recomputation."""
        return (self._bwd[stop] - self._bwd[start] + self.gradient_traffic_s(param_bytes)) * self.compute_stretch \
            + self.action_s

    def _compute_stage(self, stage: int, start: int, stop: int, recompute: bool | None) -> StageCost | None:
        """Without recomputation before with it; for each, the sharding with the shortest step after the
        pipeline among those that fit (it changes nothing else of the stage's time)."""
        params = self.param_bytes(start, stop)
        fwd, bwd = self.forward_s(start, stop), self.backward_s(start, stop, params)
        writes = any(self._writes[start:stop])
        options = [False, True] if recompute is None else [recompute]
        for rc in options:
            if rc and writes:
                continue
            fitting = [(self.step_s(int(params), sh), sh, memory) for sh in self.shardings
                       for memory in [self._memory(stage, start, stop, rc, sharding=sh)]
                       if memory.total <= self.capacity]
            if fitting:
                _, sharding, memory = min(fitting, key=lambda f: f[0])
                return StageCost(
                    blocks=(start, stop), recompute=rc, fwd_s=fwd, bwd_s=bwd + (fwd if rc else 0.0),
                    send_fwd_s=self.boundary_s(stage, stop), send_bwd_s=self.boundary_s(stage - 1, start) if stage else 0.0,
                    memory=memory, param_bytes=int(params), allreduce_s=self.allreduce_s(stage, int(params)),
                    optimizer_s=self.optimizer_s(int(params)) * self._optimizer_share(sharding),
                    apply_gradients_s=self.apply_gradients_s(params), sharding=sharding,
                    gather_s=self.gather_s(int(params), sharding))
        return None

    def tail_s(self, cost: StageCost) -> float:
        """What a stage adds to its rank's work after the pipeline drains: the all-reduce of its gradients (with
        DDP only the part that outlasts the backward), putting them into .grad, and the optimizer step."""
        if self.layout.data_parallel_only:
            # DDP reduces buckets while the backward runs: only what outlasts the backward shows, and that
            # costs more where the two compete for the same cores (the measured interference)
            exposed = max(cost.allreduce_s - cost.bwd_s, cost.allreduce_s * min(1.0, 25e6 / max(cost.param_bytes, 1)))
            return exposed * (1.0 + self.cluster.allreduce_interference) + cost.optimizer_s + cost.gather_s
        return cost.allreduce_s + cost.apply_gradients_s + cost.optimizer_s + cost.gather_s

    def gradient_traffic_s(self, param_bytes: float) -> float:
        """Writing a backward's parameter gradients: a pipeline adds each micro-batch's into .grad (read both,
        write one); DDP copies them into its buckets (read one, write one). Block profiles miss it: they take
        gradients with autograd.grad, which accumulates nothing."""
        return param_bytes * (3 if self.pipelined else 2) / self.stream_bps

    def apply_gradients_s(self, param_bytes: float) -> float:
        """After a pipelined step: with replicas, the gradients are copied into all-reduce buckets (read one, write
        one); then scaled (read one, write one). DDP does none of this outside its backward."""
        if not self.pipelined:
            return 0.0
        passes = 2 + (2 if self.layout.num_replicas > 1 else 0)
        return param_bytes * passes / self.stream_bps * self.step_stretch

    def allreduce_s(self, stage: int, param_bytes: int) -> float:
        return self.cluster.allreduce_s(param_bytes, self.ranks[stage])

    def step_s(self, param_bytes: int, sharding: str) -> float:
        """The optimizer's step on a stage's parameters and, sharded, sending the new values out."""
        return self.optimizer_s(param_bytes) * self._optimizer_share(sharding) + self.gather_s(param_bytes, sharding)

    def least_step_s(self, param_bytes: int) -> float:
        """step_s under the cheapest sharding allowed (for bounds)."""
        return min(self.step_s(param_bytes, sh) for sh in self.shardings)

    def gather_s(self, param_bytes: int, sharding: str) -> float:
        """Each replica broadcasts the parameters it stepped to the others: an all-gather's volume."""
        if sharding == "none":
            return 0.0
        return self.cluster.allgather_s(param_bytes, self.ranks[0])

    def optimizer_s(self, param_bytes: int) -> float:
        """The optimizer step is memory-bound: read weights, gradients and state, write weights and state."""
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
    """The sharding levels a stage may take: the one fixed, else sharding the optimizer's state where there are
    replicas to share it and state to share."""
    if layout.sharding is not None:
        return (layout.sharding,)
    if layout.num_replicas > 1 and optimizer_factor > 0:
        return ("none", "optimizer")
    return ("none",)
