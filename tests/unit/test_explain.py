"""explain(): the plan table's memory columns add up to memory/rank, the process's own memory included."""

import re
from dataclasses import replace

import pytest

from partita.cluster import Cluster, DeviceSpec, Link
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan import Constraints, choose_plan
from partita.plan.explain import rank_memory

MB = 10**6
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
COLUMNS = ("params+grads+optim", "activations", "buffers", "process")


def plan_of(constraints, overhead=300 * MB, blocks=8):
    graph = ModelGraph(
        tuple(Block(i, f"layers.{i}", (i, i + 1), f"a{i}", f"z{i}", "sig", 1, Fit.line(0, 1), Fit.line(0, 1),
                    Fit.line(0, 0.1 * MB), (f"p{i}",)) for i in range(blocks)),
        {f"p{i}": MB for i in range(blocks)}, tuple(Fit.line(0, 1e3) for _ in range(blocks - 1)), Fit.line(0, 1e3))
    profile = Profile("test", tuple(BlockCost(Fit.line(5e-5, 1e-3 / 3), Fit.line(1e-4, 2e-3 / 3),
                                              Fit.line(0, 0.1 * MB)) for _ in range(blocks)))
    device = DeviceSpec("test", 10**10, {"float32": 1e12}, 1e11, 1.0, 0.0, 0, 1e-5, 1e-4, 1e-4,
                        Link(1e-6, 1e10), Link(1e-5, 1e9), 4, "test")
    cluster = Cluster(device, 1, 4, fixed_overhead_bytes=overhead)
    return choose_plan(graph, profile, cluster, global_batch=16, optimizer_factor=2, constraints=constraints)


def parse_bytes(text):
    number, unit = text.split()
    return float(number) * UNITS[unit], 0.05 * UNITS[unit]  # the value and how far its rounding may be off


def table(text):
    """The stage rows of explain()'s table as dicts by column name."""
    lines = text.splitlines()[1:]
    header = re.split(r" {2,}", lines[0])
    rows = []
    for line in lines[1:]:
        if not re.match(r"\d+ ", line):
            break
        rows.append(dict(zip(header, re.split(r" {2,}", line))))
    return rows


@pytest.mark.parametrize("constraints", [
    Constraints(stages=2, schedule="1F1B"),
    Constraints(stages=1),
    Constraints(stages=4, schedule="Interleaved1F1B"),  # two stages on each rank
    Constraints(stages=4, schedule="ZBVZeroBubble"),  # V-shaped: stages 0 and 3 on the same ranks
])
def test_the_printed_columns_add_up_to_memory_per_rank(constraints):
    plan = plan_of(constraints)
    rows = table(plan.explain())
    assert [int(r["stage"]) for r in rows] == [s.index for s in plan.stages]
    by_ranks: dict[str, list[dict]] = {}
    for r in rows:
        by_ranks.setdefault(r["ranks"], []).append(r)
    for ranks, together in by_ranks.items():
        total, slack = parse_bytes(together[0]["memory/rank"])
        assert all(r["memory/rank"] == together[0]["memory/rank"] for r in together)
        assert sum(1 for r in together if not r["process"].startswith("in stage")) == 1  # the process once
        parts = [parse_bytes(r[c]) for r in together for c in COLUMNS if not r[c].startswith("in stage")]
        assert abs(sum(v for v, _ in parts) - total) <= slack + sum(s for _, s in parts), (ranks, together)
        process, _ = parse_bytes(together[0]["process"])
        assert abs(process - 300 * MB) < 0.05 * 2**20
    if any(len(t) > 1 for t in by_ranks.values()):
        assert "memory/rank is the sum of their rows, with the process counted once" in plan.explain()


@pytest.mark.parametrize("constraints", [Constraints(stages=2, schedule="1F1B"),
                                         Constraints(stages=4, schedule="Interleaved1F1B")])
def test_rank_memory_adds_up_exactly(constraints):
    plan = plan_of(constraints)
    sums: dict[tuple, int] = {}
    for s, (weights, acts, buffers, process, total) in zip(plan.stages, rank_memory(plan)):
        assert total == s.memory_bytes
        sums[s.ranks] = sums.get(s.ranks, 0) + weights + acts + buffers + (process or 0)
    for s in plan.stages:
        assert sums[s.ranks] == s.memory_bytes


def test_plans_without_a_recorded_overhead_show_what_the_rank_total_leaves_over():
    plan = plan_of(Constraints(stages=2, schedule="1F1B"))
    old = replace(plan, stages=tuple(replace(s, memory={k: v for k, v in s.memory.items() if k != "overhead"})
                                     for s in plan.stages))
    assert [m[3] for m in rank_memory(old)] == [300 * MB] * 2
    no_memory = replace(plan, stages=tuple(replace(s, memory={}) for s in plan.stages))
    assert rank_memory(no_memory) == [None, None]
    assert [r["process"] for r in table(no_memory.explain())] == ["-", "-"]
