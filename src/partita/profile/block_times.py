"""Measure each block of a captured graph on this rank's device: forward and backward seconds, and the bytes
autograd keeps for the backward, at two micro-batch sizes, so that each is a line in the rows. Each block runs
on the values that a forward of the call's own inputs (their rows repeated to the size measured) gives it.

Blocks with the same signature (the layers of a transformer) are measured once. Ranks measure disjoint
blocks at the same time and rank 0 collects the results. Measuring never changes the model: gradients are
taken with `torch.autograd.grad` (nothing accumulates into `.grad`), buffers a block writes (BatchNorm
statistics) are restored, and the random number generators are forked.

A model built on the meta device (or bigger than one device) is measured block by block, as RaNNC does: a
meta parameter or buffer gets a stand-in of its shape (random values of the scale weights are initialized
at) only while the operation or block that reads it runs, so that no more than one block's weights exist at
a time. Timing needs real memory and values of the right magnitude, not the model's own values. A model on
the CPU measured on a GPU (it arrives on the CPU; only after planning does each rank move its part to its
GPU) is measured the same way, with a copy of each weight on the GPU while its block runs.

On a GPU, times are taken between CUDA events around the calls, the kernels' own time, not the host's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.nn.utils.stateless import _reparametrize_module

from partita.capture.export import CapturedGraph
from partita.capture.split import StageGraph, split
from partita.errors import RankError, first_error
from partita.graph import Block, BlockCost, Fit, ModelGraph

REPEATS = 5  # timed samples per measurement; the median is kept
COLD_REPEATS = 15  # single calls timed after evicting the cache: noisier, so more of them
ROUNDS = 3  # passes over all measurements, interleaved; the median of each is kept
SAMPLE_S = 2e-3  # a sample repeats the call until it lasts this long: a sub-millisecond call timed once is noise
STAND_IN_SCALE = 0.02  # the spread of a stand-in weight: about what weights are initialized at


def profile_rows(local_batch: int) -> tuple[int, int]:
    """The two micro-batch sizes to measure at (two rows at least: BatchNorm needs more than one)."""
    return 2, max(8, local_batch)


def _block_module(cap: CapturedGraph, graph: ModelGraph, block: Block):
    """The block alone as a module, cut out with the splitter, with the names of the values it reads."""
    a, b = block.units
    n = graph.num_units
    before, inside = int(a > 0), 1
    stage_of_unit = [0] * a + [before] * (b - a) + [before + inside] * (n - b)
    num_stages = before + inside + int(b < n)
    return split(cap, stage_of_unit, num_stages)[before]


def stand_in(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor shaped like the meta tensor `t`, on `device`: small random values (zeros for integers),
    drawn from a generator of its own, so that measuring leaves the random stream where it was."""
    if not (t.is_floating_point() or t.is_complex()):
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    values = torch.empty(t.shape, dtype=t.dtype, device=device)
    return values.uniform_(-STAND_IN_SCALE, STAND_IN_SCALE, generator=torch.Generator(device).manual_seed(0))


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` as measuring uses it on `device`: itself if there, a stand-in if meta, else a copy on `device`."""
    if t.device == device:
        return t
    return stand_in(t, device) if t.is_meta else t.to(device)


def _real(value, device: torch.device):
    """`value` (any structure of tensors) with each tensor on `device` (`on_device`)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: on_device(t, device), value)


def _standing_in(module: nn.Module, device: torch.device):
    """`module`'s parameters and buffers that are not on `device` (meta, or on the CPU while measuring on a
    GPU) replaced by tensors there (`on_device`) for the duration of the block."""
    values = {name: nn.Parameter(on_device(t, device), t.requires_grad) if isinstance(t, nn.Parameter)
              else on_device(t, device)
              for name, t in [*module.named_parameters(), *module.named_buffers()] if t.device != device}
    return _reparametrize_module(module, values)


def _tiled(t: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """`rows` rows made of `t`'s own rows, repeated as often as needed: real values at any micro-batch size."""
    repeats = -(-rows // t.shape[0])
    return t.detach().to(device).repeat(repeats, *[1] * (t.dim() - 1))[:rows]


class _Enough(Exception):
    """Every block's inputs are taken: the rest of the graph need not run."""


class _InputTaker(fx.Interpreter):
    """Runs the captured graph and copies each wanted block's inputs just before the block's first op: the
    values a pipeline stage starting there would receive (after any in-place write by an earlier op)."""

    def __init__(self, cap: CapturedGraph, inputs_at: dict[str, list[str]], device: torch.device):
        super().__init__(cap.gm)
        self.cap = cap
        self.device = device
        self.inputs_at = inputs_at  # first node of a block -> the names of the values it reads
        self.taken: dict[str, list[torch.Tensor]] = {}
        # the interpreter frees a value after its last reader, but a block may take a value it never reads (a
        # stage that reads nothing from before still receives one input to start on)
        wanted = {name for names in inputs_at.values() for name in names}
        for node, dying in self.user_to_last_uses.items():
            self.user_to_last_uses[node] = [d for d in dying if d.name not in wanted]

    def run_node(self, n: fx.Node):
        if n.name in self.inputs_at:
            self.taken[n.name] = [self._copy(name) for name in self.inputs_at[n.name]]
            if len(self.taken) == len(self.inputs_at):
                raise _Enough
        return super().run_node(n)

    def fetch_args_kwargs_from_env(self, n: fx.Node):
        # a meta weight exists only while the operation that reads it runs
        return _real(super().fetch_args_kwargs_from_env(n), self.device)

    def _copy(self, name: str) -> torch.Tensor:
        value = torch.clone(self.env[self.cap.node(name)].detach(), memory_format=torch.contiguous_format)
        return value.requires_grad_(value.is_floating_point() and self.cap.requires_grad.get(name, False))


def block_inputs(cap: CapturedGraph, inputs_at: dict[str, list[str]], rows: int,
                 device: torch.device) -> dict[str, list[torch.Tensor]]:
    """For each block (by its first node), the values it reads, from one forward of the captured graph on the
    call's own inputs at `rows` rows. Made-up values are no substitute: a mixture of experts indexes tokens
    and weights with the routing the forward computes, and made-up indices are out of bounds.

    The graph writes into buffers in place (BatchNorm statistics), so it runs on copies of them."""
    if not inputs_at:
        return {}
    examples = iter(cap.examples)
    args = []
    for node in cap.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in cap.parameters:
            args.append(cap.tensor(node.name))
        elif cap.holds(node.name):
            args.append(cap.tensor(node.name).detach().clone())
        else:
            args.append(_tiled(next(examples), rows, device))
    taker = _InputTaker(cap, inputs_at, device)
    with torch.no_grad():
        try:
            taker.run(*args)
        except _Enough:
            pass
    return taker.taken


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds that `calls` calls of `fn` take on `device`: between CUDA events recorded on its stream before
    and after them on a GPU (kernels run after the host returns, so a clock around the calls would time their
    launch), by the clock on the CPU. Waits for the work queued before, so that it is not counted."""
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - started


WARM_UP_S = 0.5  # of matrix products before measuring on a GPU


def warm_up(device: torch.device) -> None:
    """Load an idle GPU before timing on it. On the H200, partita's first measurements on a freshly started
    machine priced a bf16 GPT-2 step at 57.8 ms that trained at 38.8 ms (+49 %), against +6 % when other work had
    run just before; the likely cause: an idle GPU runs at a fraction of its clocks (there, 345 MHz idle, 1980
    MHz under load) until loaded. Nothing to do on a CPU."""
    if device.type != "cuda":
        return
    a = torch.full((4096, 4096), 1e-3, device=device)  # no random numbers: the user's streams stay as they are
    started = time.perf_counter()
    while time.perf_counter() - started < WARM_UP_S:
        for _ in range(8):
            torch.mm(a, a)
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call: the median of REPEATS samples, each of as many calls as last SAMPLE_S together."""
    first = seconds(fn, 1, device)  # warm-up, and a first estimate
    calls = max(1, min(1000, int(SAMPLE_S / max(first, 1e-7))))
    return statistics.median(seconds(fn, calls, device) / calls for _ in range(REPEATS))


STREAM_BYTES_RANGE = (64 * 2**10, 512 * 2**20)  # measured at the parameters' size, within this range
_LAST_LEVEL_CACHE_BYTES = 64 * 2**20  # more than a CPU's last-level cache: writing this much evicts it


def cold_median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = COLD_REPEATS) -> float:
    """Seconds per call: the median of `repeats` calls, each after writing more than a CPU's last-level cache
    (so each starts with the caches holding none of fn's data, as in a training step, where a forward and a
    backward ran since)."""
    evict = torch.zeros(_LAST_LEVEL_CACHE_BYTES // 4, device=device)
    times = []
    for i in range(repeats + 1):
        evict.fill_(float(i))
        times.append(seconds(fn, 1, device))
    return statistics.median(times[1:])


def stream_bandwidth(param_bytes: int, device: torch.device) -> float:
    """Bytes per second of `a += b` over float32 buffers the size of the parameters (read two, write one),
    each pass starting with both out of cache, as in a training step, where the forward and backward between
    two passes over the gradients have filled the cache with activations: what adding a micro-batch's
    gradients into .grad, and an optimizer step, run at for this model."""
    low, high = STREAM_BYTES_RANGE
    numel = min(max(int(param_bytes), low), high) // 4
    total, delta = torch.zeros(numel, device=device), torch.ones(numel, device=device)
    if device.type != "cpu":
        return 3 * 4 * numel / median_seconds(lambda: total.add_(delta), device)
    return 3 * 4 * numel / cold_median_seconds(lambda: total.add_(delta), device)


def backward_launch_seconds(device: torch.device) -> float:
    """The cost of starting a backward pass at all (the autograd engine), which a stage pays once per
    micro-batch but a block measured alone would pay once per block."""
    x = torch.ones(8, device=device, requires_grad=True)

    def tiny():
        y = x * 2.0
        torch.autograd.grad([y], [x], [torch.ones_like(y)])

    with torch.enable_grad():
        return median_seconds(tiny, device)


def measure_block(cap: CapturedGraph, graph: ModelGraph, block: Block, rows: int,
                  device: torch.device, launch_s: float = 0.0) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, bytes kept for the backward) of one block at `rows` rows."""
    stage = _block_module(cap, graph, block)
    inputs = block_inputs(cap, {block.first_node: stage.inputs}, rows, device)[block.first_node]
    with _standing_in(stage.module, device):
        return _measure_stage(stage, inputs, device, launch_s)


def _computing_in(device: torch.device, dtype: torch.dtype | None):
    """The forward's context when the job computes in lower precision under autocast (runtime.precision)."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _measure_stage(stage: StageGraph, inputs: list[torch.Tensor], device: torch.device,
                   launch_s: float, compute_dtype: torch.dtype | None = None) -> tuple[float, float, float]:
    """measure_block's numbers for a block cut out as `stage`, run on `inputs` (under autocast to
    `compute_dtype` if given)."""
    module = stage.module
    params = [p for p in module.parameters() if p.requires_grad]
    kept = {t.untyped_storage().data_ptr() for t in list(module.parameters()) + list(module.buffers())}
    written = [getattr(module, name) for name in stage.written_buffers]
    saved_before = [b.detach().clone() for b in written]

    def forward():
        with _computing_in(device, compute_dtype):
            return [o for o in module(*inputs) if isinstance(o, torch.Tensor)]

    def forward_backward():
        outs = [o for o in forward() if o.requires_grad]
        wrt = [t for t in inputs if t.requires_grad] + params
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)

    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in kept:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        fwd = median_seconds(forward, device)
        both = median_seconds(forward_backward, device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    with torch.no_grad():
        for buf, value in zip(written, saved_before):
            buf.copy_(value)
    return fwd, max(both - fwd - launch_s, 0.0), float(sum(saved.values()))


def measure_blocks(cap: CapturedGraph, graph: ModelGraph, local_batch: int, device: torch.device,
                   show_progress: bool = True, at_once: int = 0,
                   compute_dtype: torch.dtype | None = None) -> dict[str, BlockCost]:
    """Costs by block signature. Every rank measures its share of the distinct blocks; rank 0 gets them all
    (other ranks get an empty dict).

    `at_once` > 0 (ranks that share a CPU's cores): only that many ranks of a node measure at a time, the
    others wait their turn, so that no measurement is slowed by another; the planner models the sharing."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    first_of: dict[str, Block] = {}
    for b in graph.blocks:
        first_of.setdefault(b.signature, b)
    signatures = sorted(first_of)
    mine = signatures[rank::world]
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    turns = -(-local_world // at_once) if at_once else 1
    results: dict | RankError = {}
    failure = None
    for turn in range(turns):
        if not at_once or local_rank // at_once == turn:
            try:
                results = _measure_share(cap, graph, first_of, mine, local_batch, device,
                                         show_progress and rank == 0, turns, compute_dtype)
            except Exception as e:  # noqa: BLE001 - the other ranks must hear of it, not wait for this rank
                failure, results = e, RankError.of(rank, e)
        if turns > 1 and world > 1:
            dist.barrier()
    every: list = [None] * world
    if world > 1:
        dist.all_gather_object(every, results)
    else:
        every = [results]
    error = first_error([part for part in every if isinstance(part, RankError)], world,
                        failed_while="measuring the model's blocks on the inputs of this call")
    if error is not None:
        raise error from failure
    if rank != 0:
        return {}
    merged = {}
    for part in every:
        merged.update(part)
    return {sig: BlockCost(fwd, bwd, act) for sig, (fwd, bwd, act) in merged.items()}


def _measure_share(cap: CapturedGraph, graph: ModelGraph, first_of: dict[str, Block], mine: list[str],
                   local_batch: int, device: torch.device, show_progress: bool,
                   turns: int, compute_dtype: torch.dtype | None) -> dict[str, tuple[Fit, Fit, Fit]]:
    """This rank's blocks (signatures `mine`): forward, backward and saved bytes, each a line in the rows.
    `turns`: how many groups of ranks measure one after the other (for the time left that progress shows)."""
    set_up = time.perf_counter()
    r1, r2 = profile_rows(local_batch)
    stages = {sig: _block_module(cap, graph, first_of[sig]) for sig in mine}
    inputs_at = {first_of[sig].first_node: stages[sig].inputs for sig in mine}
    inputs = {rows: block_inputs(cap, inputs_at, rows, device) for rows in (r1, r2)}
    launch = backward_launch_seconds(device)
    # ROUNDS passes over every measurement: a slow spell of a shared machine then spoils one sample of
    # each, not every sample of one, and the medians drop it
    samples: dict = {}
    started = time.perf_counter()
    for round_ in range(ROUNDS):
        for i, sig in enumerate(mine):
            with _standing_in(stages[sig].module, device):
                for rows in (r1, r2):
                    samples.setdefault((sig, rows), []).append(_measure_stage(
                        stages[sig], inputs[rows][first_of[sig].first_node], device, launch, compute_dtype))
            if show_progress:
                _progress(round_ * len(mine) + i + 1, ROUNDS * len(mine), turns, started - set_up,
                          time.perf_counter() - started)
    m = {key: [statistics.median(v) for v in zip(*values)] for key, values in samples.items()}
    results = {}
    for sig in mine:
        (f1, b1, a1), (f2, b2, a2) = m[sig, r1], m[sig, r2]
        results[sig] = (Fit.timed(r1, f1, r2, f2), Fit.timed(r1, b1, r2, b2), Fit.through(r1, a1, r2, a2))
    return results


def _progress(done: int, share: int, turns: int, set_up_s: float, measuring_s: float) -> None:
    """Rank 0's progress through its `share` of the measurements (`done` of them took `measuring_s`, after
    `set_up_s` of preparing the blocks and their inputs), with the time left, which counts the ranks that wait
    for their turn (they do as much after it): a bar on a terminal; in a log file (launchers show logs line by
    line) one line with the estimate after the first measurement."""
    total_s = turns * (set_up_s + measuring_s / done * share)
    left_s = total_s - set_up_s - measuring_s
    if not sys.stderr.isatty():
        if done == 1:
            logging.getLogger("partita").info("measuring the blocks will take %s", _about(total_s))
        return
    width = 24
    bar = "#" * (width * done // share) + "." * (width - width * done // share)
    if done < share:
        after = f", {_about(left_s)} left"
    else:
        after = f", the other ranks' turn: {_about(left_s)}" if turns > 1 else ""
    end = "\n" if done == share else ""
    sys.stderr.write(f"\rpartita: measuring blocks [{bar}] {100 * done // share:3d}%{after}   {end}")
    sys.stderr.flush()


def _about(seconds: float) -> str:
    """A rough duration: 'under a second', 'about 3 s', 'about 40 s', 'about 4 min'."""
    if seconds < 1:
        return "under a second"
    if seconds < 60:
        return f"about {round(seconds) if seconds < 10 else round(seconds, -1):.0f} s"
    return f"about {round(seconds / 60)} min"
