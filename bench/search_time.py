"""How long the planner's search takes, and whether it proves its plan optimal, over model sizes and worlds.

    python bench/search_time.py            # the sweep: 12, 44, 100, 200 blocks x 4, 16, 64 ranks x two models
    python bench/search_time.py --quick    # 44 and 200 blocks only

Pure Python, no torch: the graphs and block costs are synthetic, shaped like real ones.
- gpt: an embedding, n-2 equal transformer layers, a final LayerNorm + LM head tied to the embedding
  (hidden 1024, 512 tokens, vocabulary 32k, float32 on A100-40GB-like costs). Memory per rank is set so
  that the whole model needs about 4 ranks (on 4 ranks) or 8: every world must pipeline.
- uneven: blocks of random sizes (seeded), parameters in a few heavy blocks, activations in others; memory
  lets the whole model fit one rank at 16 and 64 ranks, not at 4.
- demo: the demo's small GPT shape (44 blocks) on 4 CPU ranks sharing 2 cores, with the runtime's overheads
  as measured on this machine, and 32 MiB free per rank (examples/demo.py).
Each line: the search alone (search.search) and the whole choose_plan (which also looks for a shallower plan
within 5 % of the fastest), and whether the plan is proven optimal (the search ran to the end).
"""

from __future__ import annotations

import math
import random
import sys
import time

from partita.cluster import Cluster, Link
from partita.cluster.cluster import RuntimeOverheads
from partita.cluster.presets import DEVICES
from partita.errors import PlanError
from partita.graph import Block, BlockCost, Fit, ModelGraph, Profile
from partita.plan import choose_plan
from partita.plan.search import search

F32 = 4
ADAM = 2.0


def graph_of(name: str, sizes: list[tuple[float, float, float, tuple[str, ...]]],
             param_bytes: dict[str, int], boundary_per_row: list[float]) -> tuple[ModelGraph, Profile]:
    """From per-block (forward seconds per row, fixed seconds per call, activation bytes per row, parameters);
    a backward takes twice its forward."""
    blocks, costs = [], []
    for i, (fwd_row, call_s, act_row, params) in enumerate(sizes):
        blocks.append(Block(i, f"{name}.{i}", (i, i + 1), f"a{i}", f"z{i}", f"sig{i}", 10, Fit.line(0, 1),
                            Fit.line(0, 1), Fit.line(0, act_row), params))
        costs.append(BlockCost(Fit.line(call_s, fwd_row), Fit.line(2 * call_s, 2 * fwd_row), Fit.line(0, act_row)))
    graph = ModelGraph(tuple(blocks), param_bytes, tuple(Fit.line(0, b) for b in boundary_per_row[:-1]),
                       Fit.line(0, 8))
    return graph, Profile(f"synthetic {name}", tuple(costs))


def gpt(num_blocks: int, hidden: int = 1024, seq: int = 512, vocab: int = 32000, flops_s: float = 13.6e12):
    layer_params = 12 * hidden * hidden * F32
    layer_flops = 24 * seq * hidden * hidden + 4 * seq * seq * hidden  # per row, forward
    sizes = [(seq * hidden * 8 / 1.5e12, 3e-5, seq * hidden * F32, ("tok",))]
    sizes += [(layer_flops / flops_s, 2e-4, 34 * seq * hidden, (f"layer{i}",)) for i in range(num_blocks - 2)]
    sizes += [(2 * seq * hidden * vocab / flops_s, 5e-5, seq * vocab * F32 * 2, ("tok", "ln"))]
    params = {"tok": vocab * hidden * F32, "ln": 2 * hidden * F32}
    params |= {f"layer{i}": layer_params for i in range(num_blocks - 2)}
    return graph_of("gpt", sizes, params, [seq * hidden * F32] * num_blocks)


def uneven(num_blocks: int, seed: int = 0):
    rng = random.Random(seed)
    sizes, params = [], {}
    for i in range(num_blocks):
        heavy = rng.random() < 0.2
        params[f"p{i}"] = int(rng.choice([0, 1, 4]) * 2**20 if not heavy else rng.uniform(50, 200) * 2**20)
        sizes.append((rng.lognormvariate(-9, 1.0), rng.choice([2e-5, 1e-4]), rng.choice([1, 4, 16]) * 2**20 / 32,
                      (f"p{i}",)))
    return graph_of("uneven", sizes, params, [rng.choice([1, 8, 32]) * 2**16 for _ in range(num_blocks)])


def a100(world: int, memory_bytes: int) -> Cluster:
    per_node = min(world, 8)
    return Cluster(DEVICES["A100-40GB"], world // per_node, per_node, memory_bytes=memory_bytes)


def static_bytes(graph: ModelGraph) -> int:
    return int(sum(graph.param_bytes.values()) * (3 + ADAM))


def demo_cluster() -> Cluster:
    """4 CPU ranks on 2 cores, links and overheads as partita measured them on this machine."""
    overhead = 510 * 2**20
    return Cluster(DEVICES["cpu"], 1, 4, p2p=Link(0.0, 1.08e9), allreduce=Link(5.8e-3, 4.5e8), allreduce_ranks=4,
                   memory_bytes=overhead + 32 * 2**20, fixed_overhead_bytes=overhead,
                   overheads=RuntimeOverheads(0.0, 9.0e-3, 1.6e-3, 0.0, 0.89), cores_per_node=2)


def demo_gpt():
    """The demo's GPT: vocabulary 128, d=128, 4 layers, 64 tokens, cut into 44 blocks as capture cuts it."""
    d, seq, vocab = 128, 64, 128
    rate = 50e9
    layer = [(seq * d * 5, 2 * seq * d, 2 * d), (6 * seq * d * d, 3 * seq * d, 3 * d * d + 3 * d)]  # norm, qkv
    layer += [(2 * seq * seq * d, seq * seq * 4, 0)] * 4  # attention
    layer += [(2 * seq * d * d, seq * d, d * d + d), (seq * d * 5, 2 * seq * d, 2 * d),  # out, norm
              (8 * seq * d * d, 4 * seq * d, 4 * d * d + 4 * d), (8 * seq * d * d, 4 * seq * d, 4 * d * d + d)]  # mlp
    sizes = [(seq * d * 2 / 7.8e9, 4e-5, seq * d * F32, ("tok", "pos"))]
    params = {"tok": vocab * d * F32, "pos": seq * d * F32, "ln": 2 * d * F32}
    for i in range(4):
        for part, (flops, act, p) in enumerate(layer):
            sizes.append((flops / rate, 4e-5, act * F32, (f"l{i}.{part}",) if p else ()))
            if p:
                params[f"l{i}.{part}"] = p * F32
    sizes.append((seq * d * 5 / rate, 4e-5, 2 * seq * d * F32, ("ln",)))
    sizes.append((seq * d / rate, 4e-5, seq * d * F32, ()))
    sizes.append((2 * seq * d * vocab / rate, 4e-5, seq * vocab * F32, ("tok",)))
    return graph_of("demo", sizes, params, [seq * d * F32] * len(sizes))


def cases(block_counts: list[int], worlds: list[int]):
    graph, profile = demo_gpt()
    yield "demo", graph, profile, demo_cluster(), 32
    for n in block_counts:
        for world in worlds:
            graph, profile = gpt(n)
            yield "gpt", graph, profile, a100(world, 2**30 + 2 * static_bytes(graph) // min(world, 8)), 8 * world
            graph, profile = uneven(n)
            memory = 2**30 + (static_bytes(graph) + 4 * 2**30 if world > 4 else static_bytes(graph) // 2)
            yield "uneven", graph, profile, a100(world, memory), 8 * world


def run_case(name, graph, profile, cluster, batch) -> str:
    start = time.perf_counter()
    result = search(graph, profile, cluster, global_batch=batch, optimizer_factor=ADAM)
    search_s = time.perf_counter() - start
    start = time.perf_counter()
    try:
        step_ms = choose_plan(graph, profile, cluster, global_batch=batch, optimizer_factor=ADAM).estimate.step_s * 1e3
    except PlanError:
        step_ms = math.nan
    choose_s = time.perf_counter() - start
    best = result.best
    what = (f"{best.layout.num_stages:3d} st x {best.layout.num_replicas:2d} rep {best.layout.schedule:15s} "
            f"M={best.layout.micro_batches:<3d}") if best else "no plan"
    gap = (best.step_s - result.lower_bound_s) / best.step_s if best else 0.0
    proven = "proven optimal" if result.proven_optimal else f"gap {100 * gap:.0f}%"
    return (f"{name:7s} {graph.num_blocks:4d} blocks {cluster.world_size:3d} ranks: search {search_s:6.3f} s "
            f"({result.layouts_searched:3d}/{result.layouts_considered:3d} layouts, {result.nodes:6d} nodes, "
            f"{result.simulations:5d} sims) {proven:14s} choose_plan {choose_s:6.3f} s  {what} {step_ms:8.2f} ms")


def main() -> None:
    quick = "--quick" in sys.argv
    blocks = [44, 200] if quick else [12, 44, 100, 200]
    for case in cases(blocks, [4, 16, 64]):
        print("search_time:", run_case(*case), flush=True)


if __name__ == "__main__":
    sys.exit(main())
