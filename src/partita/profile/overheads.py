"""Measure what partita's own runtime costs beyond the model's compute, on the job's real ranks.

A step of data parallelism (DDP plus the global-loss all-reduce) costs a fixed time. A pipeline step costs a
fixed time (routing rows, agreeing on shapes, summing the loss), a time per action on the rank that runs it
(one stage's forward or backward of one micro-batch: torch's stage machinery, posting its messages) and a
delay per message between stages (from the sender's action to the receiver's: the backend's latency, the
Python on both ends, and on a shared CPU a wait for a core after a long computation).

All are measured with partita itself, on a probe model that computes about as long per action as real
stages do (a message after a millisecond of compute costs more than one after none), trained under plans of
several shapes given by hand (so nothing is planned recursively). The probe arrives as a user's model does,
on the CPU, and partita places it on the job's devices; its inputs are on the rank's device, as a user's must
be (on a GPU, CPU inputs would be refused). The probe's blocks are measured like any model's, and the constants are fitted so that the planner's own cost model and simulator predict the probe's
measured steps: they then mean exactly what the planner uses them for, and nothing the cost model already
counts (the optimizer step, gradient traffic) is counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.distributed as dist

from partita.cluster import Cluster, RuntimeOverheads
from partita.graph import Profile
from partita.plan.plan import Plan

# partita.parallelize, as the caller gives it: (model, optimizer, *, loss_fn, plan) -> the parallelized model
Parallelize = Callable[..., torch.nn.Module]

STEPS = 36  # timed steps per configuration, in ROUNDS turns (the median of the turns is kept)
ROUNDS = 6
_WIDTH, _LAYERS, _ROWS = 512, 4, 32  # the probe; a layer's forward of _ROWS rows: ~17 MFLOP, ~0.3 ms on a core
# data parallelism is timed on probes of two depths (1 MB and 8 MB of gradients to all-reduce), which tells a
# fixed cost from one that grows with the all-reduce
DATA_PARALLEL_LAYERS = (1, 8)
MICRO_BATCHES = (2, 8)


def _probe_model(layers: int = _LAYERS) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(layers)])


def _shapes(world: int) -> list[tuple[int, str, int]]:
    """(stages, schedule, micro-batches) of the pipelines timed: one stage (no messages) and, where the world
    splits in two, two stages under GPipe (two messages on the critical path) and 1F1B (two per micro-batch)."""
    shapes = [(1, "GPipe", m) for m in MICRO_BATCHES]
    if world % 2 == 0:
        shapes += [(2, schedule, m) for schedule in ("GPipe", "1F1B") for m in MICRO_BATCHES]
    return shapes


def _hand_plan(graph, world: int, stages: int, micro_batches: int, schedule: str) -> Plan:
    """A plan for the probe made without measuring (the estimate path), so no recursion."""
    from partita.cluster import DEVICES
    from partita.graph.profile import roofline_profile
    from partita.plan import Constraints, choose_plan

    cluster = Cluster(DEVICES["cpu"], 1, world)
    global_batch = world // stages * micro_batches * _ROWS  # _ROWS rows per micro-batch
    return choose_plan(graph, roofline_profile(graph, DEVICES["cpu"]), cluster, global_batch=global_batch,
                       optimizer_factor=0.0,
                       constraints=Constraints(stages=stages, micro_batches=micro_batches, schedule=schedule))


def probe_inputs(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's inputs and targets for one rank: `rows` rows, on the rank's device."""
    return torch.randn(rows, _WIDTH, device=device), torch.randn(rows, _WIDTH, device=device)


def _step_function(parallelize: Parallelize, plan: Plan, device: torch.device,
                   layers: int = _LAYERS) -> tuple[Callable[[], None], torch.nn.Module]:
    """One training step of the probe under `plan`, ready to be timed, and the parallelized probe."""
    model = _probe_model(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pm = parallelize(model, opt, loss_fn=torch.nn.MSELoss(), plan=plan)
    x, y = probe_inputs(plan.local_batch, device)

    def step():
        opt.zero_grad()
        pm(x, y).backward()
        opt.step()
    return step, pm


def _timed_steps(step, count: int) -> float:
    """Seconds per step of `count` consecutive steps, as training runs them: the mean, slow ones included
    (the median of single steps would miss a step's occasional hiccups, which training pays)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / count


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No log lines while the probe trains: its plans are partita's own business, not the user's."""
    logger = logging.getLogger("partita")
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def _probe_graphs(device: torch.device, at_once: int) -> tuple[dict, dict | None]:
    """The graphs of the probes by depth, and the measured costs of their blocks (one signature after the
    first: they are the same layers) as a Profile per depth, on rank 0 (None elsewhere). Collective."""
    from partita.capture.model_graph import model_graph
    from partita.capture.export import capture
    from partita.profile.block_times import measure_blocks, stream_bandwidth

    depths = sorted({_LAYERS, *DATA_PARALLEL_LAYERS})
    caps = {d: capture(_probe_model(d), (torch.zeros(_ROWS, _WIDTH, device=device),), {}) for d in depths}
    graphs = {d: model_graph(cap) for d, cap in caps.items()}
    deepest = depths[-1]  # its blocks are every probe's blocks
    costs = measure_blocks(caps[deepest], graphs[deepest], _ROWS, device, show_progress=False, at_once=at_once)
    if dist.get_rank() != 0:
        return graphs, None
    profiles = {d: Profile("probe", tuple(costs[b.signature] for b in g.blocks),
                           stream_bandwidth(sum(g.param_bytes.values()), device)) for d, g in graphs.items()}
    return graphs, profiles


def measure_overheads(cluster: Cluster | None, device: torch.device, parallelize: Parallelize,
                      at_once: int = 0) -> RuntimeOverheads | None:
    """Collective: every rank must call it. Rank 0 passes the job's cluster (links measured, no overheads yet)
    and gets the fitted overheads; the other ranks pass and get None. `parallelize` is partita's own (given by
    the caller: the profiler sits below the API it measures)."""
    world = dist.get_world_size()
    graphs, profiles = _probe_graphs(device, at_once)
    runs = [(d, _hand_plan(graphs[d], world, 1, 1, "GPipe")) for d in DATA_PARALLEL_LAYERS]
    runs += [(_LAYERS, _hand_plan(graphs[_LAYERS], world, stages, m, schedule))
             for stages, schedule, m in _shapes(world)]
    with _quiet():
        probes = [_step_function(parallelize, plan, device, layers) for layers, plan in runs]
        for step, _ in probes:  # the first call captures and sets up
            step()
        # the configurations take turns, so that a slower spell of a shared machine weighs on all of them alike
        samples: list[list[float]] = [[] for _ in probes]
        for _ in range(ROUNDS):
            for timings, (step, _) in zip(samples, probes):
                timings.append(_timed_steps(step, STEPS // ROUNDS))
        for _, probe in probes:  # their process groups go with them
            probe.runtime.close()
    if cluster is None:
        return None
    measured = [statistics.median(t) for t in samples]

    def predict(i: int, overheads: RuntimeOverheads) -> float:
        from partita.plan.choose import simulate_plan

        layers, plan = runs[i]
        return simulate_plan(plan, graphs[layers], profiles[layers], replace(cluster, overheads=overheads), 0.0).step_s

    k = len(DATA_PARALLEL_LAYERS)
    return fit_overheads(predict, list(range(k)), measured[:k], list(range(k, len(runs))), measured[k:],
                         [runs[i][1].num_stages > 1 for i in range(k, len(runs))])


def fit_overheads(predict: Callable[[object, RuntimeOverheads], float], data_parallel: list,
                  data_parallel_s: list[float], pipelined: list, pipelined_s: list[float],
                  has_messages: list[bool]) -> RuntimeOverheads:
    """The overheads under which `predict(run, overheads)` comes closest to the measured steps (least squares).

    Data parallelism: its fixed cost adds to a step, its all-reduce interference adds in proportion to the
    all-reduce, so both follow from a straight-line fit over the probes. Pipelines: a step's fixed cost only
    adds to it, so for given per-action and per-message costs the best fixed cost is the mean difference;
    those two are found by a coarse grid, then a pattern search around its best point. Without runs with
    messages (one stage only) there is no message cost to fit (0)."""
    zero = RuntimeOverheads(0.0, 0.0, 0.0, 0.0, 0.0)
    base = [predict(run, zero) for run in data_parallel]
    allreduce = [predict(run, replace(zero, allreduce_interference=1.0)) - b for run, b in zip(data_parallel, base)]
    fixed_dp, interference = _line(allreduce, [y - b for y, b in zip(data_parallel_s, base)])
    with_messages = any(has_messages)

    def fitted(action_s: float, message_s: float) -> tuple[float, RuntimeOverheads]:
        o = RuntimeOverheads(fixed_dp, 0.0, action_s, message_s, interference)
        gaps = [y - predict(run, o) for run, y in zip(pipelined, pipelined_s)]
        fixed = max(0.0, sum(gaps) / len(gaps))
        return sum((g - fixed) ** 2 for g in gaps), replace(o, pipeline_step_s=fixed)

    grid = [0.0] + [1e-5 * 1.6 ** k for k in range(18)]  # 10 us .. 30 ms
    point = min(((a, m) for a in grid for m in (grid if with_messages else [0.0])), key=lambda x: fitted(*x)[0])
    # pattern search: a step up and down in each cost; halve the step when none improves
    best, step = fitted(*point)[0], max(max(point), 1e-5) / 2
    while step > 1e-6:
        moves = [(point[0] + da, point[1] + dm) for da, dm in ((step, 0), (-step, 0), (0, step), (0, -step))
                 if point[0] + da >= 0 and point[1] + dm >= 0 and (with_messages or dm == 0)]
        error, move = min((fitted(*m)[0], m) for m in moves)
        if error < best:
            best, point = error, move
        else:
            step /= 2
    return fitted(*point)[1]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope, both kept at zero or above: where the best line would cross below
    zero, the best line through the origin; where it would fall, the mean (a single point: the mean)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0.0:
        return max(my, 0.0), 0.0
    if my - slope * mx >= 0.0:
        return my - slope * mx, slope
    through_origin = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return 0.0, max(through_origin, 0.0)
