"""The seed's cases, planned for the hardware in RaNNC's tutorial (no GPU needed), with the reasons.

    python bench/seed_cases.py

(local batch 64, hidden 512, 10 layers) on 2 x A100-40GB: RaNNC chose data parallelism only.
(local batch 64, hidden 5000, 100 layers) on 8 x A100-40GB with Adam: RaNNC chose 2 stages x 4 replicas.
Both are planned with SGD (no optimizer state) and with Adam (two copies of the parameters).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("tutorial_small", "2xA100-40GB", 2 * 64, "512"), ("tutorial_2p5b", "8xA100-40GB", 8 * 64, "5000")]


def main() -> None:
    from partita.capture.meta import meta_graph
    from partita.cluster import parse_cluster
    from partita.graph.profile import roofline_profile
    from partita.plan import Constraints, choose_plan

    os.environ.setdefault("PARTITA_CACHE_DIR", tempfile.mkdtemp())
    for factory, devices, batch, inp in CASES:
        graph, _ = meta_graph(f"{ROOT / 'examples' / 'seed_models.py'}:{factory}", [inp])
        cluster = parse_cluster(devices)
        profile = roofline_profile(graph, cluster.device)
        for name, factor in (("SGD", 0.0), ("Adam", 2.0)):
            plan = choose_plan(graph, profile, cluster, global_batch=batch, optimizer_factor=factor)
            e = plan.estimate
            print(f"seed_cases: {factory} on {devices}, {name}: {plan.explain().splitlines()[0]}; "
                  f"est. {e.step_s * 1e3:.1f} ms/step, peak {e.peak_memory_bytes / 2**30:.1f} GiB/rank")
            for reason in plan.reasons:
                print(f"seed_cases:     {reason}")
            if factory == "tutorial_2p5b":  # RaNNC's choice, for comparison
                rannc = choose_plan(graph, profile, cluster, global_batch=batch, optimizer_factor=factor,
                                    constraints=Constraints(stages=2, replicas=4))
                print(f"seed_cases:     RaNNC's 2 stages x 4 replicas ({rannc.schedule}, {rannc.micro_batches} "
                      f"micro-batches) would take {rannc.estimate.step_s * 1e3:.1f} ms/step "
                      f"({100 * (rannc.estimate.step_s / e.step_s - 1):+.0f}%): its gradient all-reduce "
                      f"({rannc.stages[0].allreduce_s * 1e3:.1f} ms) and optimizer step on 1.25 B parameters per "
                      f"rank cost more than this pipeline's bubble ({100 * e.bubble_fraction:.0f}%)")


if __name__ == "__main__":
    sys.exit(main())
