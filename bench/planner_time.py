"""How long planning takes: cold (build on meta, capture, count, search) and from the cache (search only).

    python bench/planner_time.py

Cases from the issue: RaNNC's tutorial model at 2.5 B parameters (hidden 5000, 100 layers, local batch 64)
for 8 x A100-40GB with Adam (RaNNC: about 300 s), and the shape of GPT-3 175B (96 layers, hidden 12288) for
1024 x A100-80GB in bfloat16, and in float32 (which fits only with the optimizer's state sharded). Goals: 1 s
and 10 s.

bench/search_time.py times the search alone over a sweep of model sizes and worlds, on synthetic models.

Each case runs in a fresh Python process, as `partita plan` does. Its first torch.export pays a one-time
start-up (importing torch._dynamo and friends, about as long as `import torch`) that any torch.export user
pays once per process; it is timed on its own, on a one-layer model, and reported apart from the planning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # factory, devices, global batch, input, optimizer state copies, dtype, goal in seconds
    ("tutorial_2p5b", "8xA100-40GB", 512, "5000", 2.0, "float32", 1.0),
    ("gpt3_175b", "1024xA100-80GB", 1536, "2048:int64", 2.0, "bfloat16", 10.0),
    # float32 weights with Adam: no plan fits without sharding the optimizer's state
    ("gpt3_175b", "1024xA100-80GB", 1536, "2048:int64", 2.0, "float32", 10.0),
]


def plan_once(factory: str, devices: str, batch: int, inp: str, factor: float, dtype: str):
    from partita.capture.meta import meta_graph
    from partita.cluster import parse_cluster
    from partita.graph.profile import roofline_profile
    from partita.plan import choose_plan

    start = time.perf_counter()
    graph, cached = meta_graph(f"{ROOT / 'examples' / 'seed_models.py'}:{factory}", [inp], dtype)
    counted = time.perf_counter()
    cluster = parse_cluster(devices)
    plan = choose_plan(graph, roofline_profile(graph, cluster.device, dtype), cluster, global_batch=batch,
                       optimizer_factor=factor)
    return counted - start, time.perf_counter() - counted, cached, plan


def export_start_up_s() -> float:
    """The first torch.export of a process, on a one-layer model: torch.export's own start-up."""
    import torch

    start = time.perf_counter()
    torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(2, 2),))
    return time.perf_counter() - start


def case(index: int) -> None:
    """One case in this (fresh) process; prints its timings as JSON."""
    factory, devices, batch, inp, factor, dtype, _ = CASES[index]
    start_up_s = export_start_up_s()
    capture_s, search_s, cached, plan = plan_once(factory, devices, batch, inp, factor, dtype)
    capture2_s, search2_s, cached2, plan2 = plan_once(factory, devices, batch, inp, factor, dtype)
    assert not cached and cached2 and (plan2.stages, plan2.schedule) == (plan.stages, plan.schedule)
    e = plan.estimate
    print(json.dumps({"start_up_s": start_up_s, "capture_s": capture_s, "search_s": search_s,
                      "cached_s": capture2_s + search2_s, "plan": plan.explain().splitlines()[0],
                      "step_ms": e.step_s * 1e3, "samples_per_s": e.samples_per_s,
                      "proven_optimal": e.proven_optimal}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        return case(int(sys.argv[2]))
    for index, (factory, devices, batch, _, _, dtype, goal) in enumerate(CASES):
        with tempfile.TemporaryDirectory() as cache:
            out = subprocess.run([sys.executable, __file__, "--case", str(index)], check=True, capture_output=True,
                                 text=True, env=dict(os.environ, PARTITA_CACHE_DIR=cache)).stdout
        r = json.loads(out.strip().splitlines()[-1])
        cold = r["capture_s"] + r["search_s"]
        print(f"planner_time: {factory} on {devices} ({dtype}, global batch {batch}): cold {cold:.2f} s "
              f"(build+capture+count {r['capture_s']:.2f} s, search {r['search_s']:.2f} s), after torch.export's "
              f"start-up of {r['start_up_s']:.2f} s; from cache {r['cached_s']:.2f} s; goal {goal:.0f} s")
        print(f"planner_time:   -> {r['plan']}; est. {r['step_ms']:.1f} ms/step, {r['samples_per_s']:,.0f} "
              f"samples/s, {'proven optimal' if r['proven_optimal'] else 'budget-limited'}")


if __name__ == "__main__":
    sys.exit(main())
