"""Measure what partita's own runtime costs beyond the model's compute, on the job's real ranks.

A step of data parallelism (DDP plus the global-loss all-reduce) costs a fixed time; a pipeline step costs a
fixed time (routing rows, agreeing on shapes, summing the loss) plus a time per action (one stage's forward
or backward of one micro-batch: torch's stage machinery and its point-to-point messages). Both are measured
by running partita itself on a model too small to matter, with plans given by hand (so nothing is profiled
or planned recursively), and fitted over three micro-batch counts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

STEPS = 24  # timed steps per configuration, in ROUNDS turns
ROUNDS = 4
_WIDTH = 8


@dataclass(frozen=True)
class Overheads:
    data_parallel_step_s: float
    pipeline_step_s: float
    action_s: float


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(4)])


def _hand_plan(model, stages: int, micro_batches: int, local_batch: int):
    """A plan for the tiny model made without measuring (the estimate path), so no recursion."""
    from partita.capture.blocks import model_graph
    from partita.capture.export import capture
    from partita.cluster import DEVICES, Cluster
    from partita.graph.profile import roofline_profile
    from partita.plan import choose_plan

    world = dist.get_world_size()
    graph = model_graph(capture(model, (torch.zeros(local_batch, _WIDTH),), {}))
    cluster = Cluster(DEVICES["cpu"], 1, world)
    return choose_plan(graph, roofline_profile(graph, DEVICES["cpu"]), cluster, global_batch=local_batch * world,
                       optimizer_factor=0.0, stages=stages, micro_batches=micro_batches, schedule="GPipe")


def _step_function(stages: int, micro_batches: int, local_batch: int):
    """One training step of the tiny model under a hand-made plan, ready to be timed."""
    import partita

    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    plan = _hand_plan(model, stages, micro_batches, local_batch)
    pm = partita.parallelize(model, opt, loss_fn=torch.nn.MSELoss(), plan=plan)
    x, y = torch.zeros(local_batch, _WIDTH), torch.zeros(local_batch, _WIDTH)

    def step():
        opt.zero_grad()
        pm(x, y).backward()
        opt.step()
    return step


def _timed_steps(step, count: int) -> float:
    """The median of `count` steps, each between barriers (every rank starts it together)."""
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_overheads() -> Overheads:
    """Collective: every rank must call it. Uses a 2-stage pipeline when the world size is even, else one
    stage with several micro-batches."""
    world = dist.get_world_size()
    stages = 2 if world % 2 == 0 else 1
    counts = [stages, 4 * stages, 8 * stages]
    local_batch = counts[-1]  # every micro-batch count divides the rows of a replica
    steps = [_step_function(1, 1, local_batch)] + [_step_function(stages, m, local_batch) for m in counts]
    for step in steps:  # the first call captures and sets up
        step()
    # the configurations take turns, so that a slower spell of a shared machine weighs on all of them alike
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(ROUNDS):
        for timings, step in zip(samples, steps):
            timings.append(_timed_steps(step, STEPS // ROUNDS))
    data_parallel, *ys = [statistics.median(t) for t in samples]
    # GPipe on S stages runs M + S - 1 forwards and as many backwards on its critical path: a step takes
    # fixed + 2 (M + S - 1) action seconds; fit both by least squares over the micro-batch counts
    xs = [2 * (m + stages - 1) for m in counts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    action = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
    pipeline = max(my - action * mx, 0.0)
    return Overheads(data_parallel_step_s=data_parallel, pipeline_step_s=pipeline, action_s=action)
