"""Devices, links and clusters: numbers only, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Link:
    """A connection's cost: `latency_s + bytes / bandwidth_bps` seconds per message (an alpha-beta model)."""

    latency_s: float
    bandwidth_bps: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bps if nbytes > 0 else 0.0


@dataclass(frozen=True)
class RuntimeOverheads:
    """What partita's own runtime costs beyond the model's compute, measured on a job's real ranks."""

    data_parallel_step_s: float  # per data-parallel step: DDP and the global-loss all-reduce
    pipeline_step_s: float  # per pipeline step: routing rows, agreeing on shapes, summing the loss
    action_s: float  # per pipeline action, on the rank that runs it (torch's stage machinery, posting messages)
    # per message between stages, from the end of the sender's action to the start of the receiver's: it
    # delays the receiver without occupying either rank (0: not measured; the link's latency stands)
    message_s: float = 0.0
    # data parallelism (DDP) all-reduces gradients while the backward still runs; where that costs more than
    # the all-reduce alone (on CPUs whose cores the ranks share, both compete for them), the all-reduce counts
    # (1 + this) times its time alone
    allreduce_interference: float = 0.0


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    flops: dict[str, float]  # peak dense FLOP/s by dtype name ("float32", "bfloat16", "float16")
    mem_bandwidth_bps: float
    matmul_efficiency: float  # fraction of peak that large matmuls reach
    op_overhead_s: float  # fixed cost of launching one op
    fixed_overhead_bytes: int  # memory a process uses before the model (CUDA context, allocator, libraries)
    action_overhead_s: float  # partita's runtime per pipeline action (a stage's forward or backward of a micro-batch)
    pipeline_step_overhead_s: float  # per pipeline step: routing rows, agreeing on shapes, summing the loss
    data_parallel_step_overhead_s: float  # per data-parallel step: DDP and the global-loss all-reduce
    intra_node: Link  # between devices of one node
    inter_node: Link  # between nodes, per device
    devices_per_node: int
    source: str

    def peak_flops(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["float32"])


@dataclass(frozen=True)
class Cluster:
    """`num_nodes` nodes of `devices_per_node` devices; rank r is device r % devices_per_node of node r // that."""

    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    # measured links replace the device's nominal ones (a real run measures its own backend)
    p2p: Link | None = None
    allreduce: Link | None = None  # measured all-reduce of `allreduce_ranks` ranks
    allreduce_ranks: int = 0  # the ranks every measured collective ran over
    reduce_scatter: Link | None = None  # measured, by the whole tensor's bytes
    allgather: Link | None = None  # measured, by the whole tensor's bytes
    memory_bytes: int = 0  # per rank, when less than the device's (shared host RAM, a user limit)
    fixed_overhead_bytes: int = -1  # measured; -1: the device preset's
    overheads: RuntimeOverheads | None = None  # measured; None: the device preset's typical values
    cores_per_node: int = 0  # CPU cores shared by a node's ranks; 0: every rank has a device of its own
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def memory_per_rank(self) -> int:
        return self.memory_bytes or self.device.memory_bytes

    @property
    def overhead_bytes(self) -> int:
        return self.fixed_overhead_bytes if self.fixed_overhead_bytes >= 0 else self.device.fixed_overhead_bytes

    @property
    def allreduce_interference(self) -> float:
        return self.overheads.allreduce_interference if self.overheads else 0.0

    @property
    def action_overhead_s(self) -> float:
        return self.overheads.action_s if self.overheads else self.device.action_overhead_s

    def with_step_overhead(self, pipelined: bool, extra_s: float) -> Cluster:
        """This cluster with partita's fixed cost per step of the kind (pipelined, or data parallelism under
        DDP) `extra_s` higher (never below nothing): the constant refitted to a step measured by a job."""
        base = self.overheads or RuntimeOverheads(self.device.data_parallel_step_overhead_s,
                                                  self.device.pipeline_step_overhead_s, self.device.action_overhead_s)
        kind = "pipeline_step_s" if pipelined else "data_parallel_step_s"
        return replace(self, overheads=replace(base, **{kind: max(0.0, getattr(base, kind) + extra_s)}))

    def step_overhead_s(self, pipelined: bool) -> float:
        if self.overheads:
            return self.overheads.pipeline_step_s if pipelined else self.overheads.data_parallel_step_s
        return self.device.pipeline_step_overhead_s if pipelined else self.device.data_parallel_step_overhead_s

    def contention(self, busy_fraction: float) -> float:
        """How much slower compute runs when a node's ranks share fewer cores than there are ranks, if each rank
        computes `busy_fraction` of the time (1: no sharing, or every rank has its own device)."""
        if not self.cores_per_node:
            return 1.0
        return max(1.0, self.devices_per_node * busy_fraction / self.cores_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        """What a message from rank a to rank b costs: the measured link, with the runtime's measured delay
        per message as its latency where there is one, else the device's nominal link."""
        if self.p2p is None:
            return self.device.intra_node if self.node_of(a) == self.node_of(b) else self.device.inter_node
        if self.overheads and self.overheads.message_s:
            return Link(self.overheads.message_s, self.p2p.bandwidth_bps)
        return self.p2p

    def allreduce_s(self, nbytes: float, ranks: tuple[int, ...] | list[int]) -> float:
        """Seconds to sum `nbytes` over `ranks` with a ring: 2(n-1) steps of nbytes/n on the slowest link."""
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.allreduce is not None and self.allreduce_ranks > 1:
            return self._rescaled(self.allreduce, nbytes, n)
        # a node's ranks are consecutive: the group spans nodes if its first and last rank are on different ones
        spans = self.node_of(min(ranks)) != self.node_of(max(ranks))
        link = self.device.inter_node if spans else self.device.intra_node
        return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_bps

    def allgather_s(self, nbytes: float, ranks: tuple[int, ...] | list[int]) -> float:
        """Seconds for every rank of `ranks` to get every other's share of `nbytes`: as measured, else a ring
        all-gather, the second half of a ring all-reduce."""
        return self._half_of_allreduce(self.allgather, nbytes, ranks)

    def reduce_scatter_s(self, nbytes: float, ranks: tuple[int, ...] | list[int]) -> float:
        """Seconds for every rank of `ranks` to get its share of the sum of `nbytes`: as measured, else a ring
        reduce-scatter, the first half of a ring all-reduce."""
        return self._half_of_allreduce(self.reduce_scatter, nbytes, ranks)

    def _half_of_allreduce(self, measured: Link | None, nbytes: float, ranks: tuple[int, ...] | list[int]) -> float:
        if measured is None or self.allreduce_ranks < 2:
            return self.allreduce_s(nbytes, ranks) / 2
        return self._rescaled(measured, nbytes, len(ranks)) if len(ranks) > 1 and nbytes > 0 else 0.0

    def _rescaled(self, measured: Link, nbytes: float, n: int) -> float:
        """A collective measured over `allreduce_ranks` ranks, rescaled to n ranks by a ring's step count and
        volume."""
        w = self.allreduce_ranks
        return measured.latency_s * (n - 1) / (w - 1) + nbytes / measured.bandwidth_bps * ((n - 1) / n) / ((w - 1) / w)

    def describe(self) -> str:
        return f"{self.num_nodes} x {self.devices_per_node} x {self.device.name}"
