"""How long planning takes, cold (build on meta, capture, count, search) and from the cache (search only).

    python bench/planner_time.py

Cases from the issue: RaNNC's tutorial model at 2.5 B parameters (hidden 5000, 100 layers, local batch 64)
for 8 x A100-40GB with Adam (RaNNC: about 300 s), and the shape of GPT-3 175B (96 layers, hidden 12288) for
1024 x A100-80GB in bfloat16. Goals: 1 s and 10 s.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # factory, devices, global batch, input, optimizer state copies, dtype, goal in seconds
    ("tutorial_2p5b", "8xA100-40GB", 512, "5000", 2.0, "float32", 1.0),
    ("gpt3_175b", "1024xA100-80GB", 1536, "2048:int64", 2.0, "bfloat16", 10.0),
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


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PARTITA_CACHE_DIR"] = cache
        for factory, devices, batch, inp, factor, dtype, goal in CASES:
            capture_s, search_s, cached, plan = plan_once(factory, devices, batch, inp, factor, dtype)
            capture2_s, search2_s, cached2, plan2 = plan_once(factory, devices, batch, inp, factor, dtype)
            assert not cached and cached2 and (plan2.stages, plan2.schedule) == (plan.stages, plan.schedule)
            e = plan.estimate
            print(f"planner_time: {factory} on {devices} ({dtype}, global batch {batch}): cold "
                  f"{capture_s + search_s:.2f} s (build+capture+count {capture_s:.2f} s, search {search_s:.2f} s); "
                  f"from cache {capture2_s + search2_s:.2f} s; goal {goal:.0f} s")
            print(f"planner_time:   -> {plan.explain().splitlines()[0]}; est. {e.step_s * 1e3:.1f} ms/step, "
                  f"{e.samples_per_s:,.0f} samples/s, {'proven optimal' if e.proven_optimal else 'budget-limited'}")


if __name__ == "__main__":
    sys.exit(main())
