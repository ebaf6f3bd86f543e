"""How long one simulated step takes: the planner calls the simulator inside its search loop.

Prints, per case, the best of several runs of `orders` + `simulate` (pure Python). Targets: S=8, M=16
1F1B under 1 ms; S=64, M=256 1F1B under 60 ms.
"""

import time

from partita.schedule import orders
from partita.sim import StageCosts, simulate

CASES = [  # schedule, stages, pipeline size, micro-batches, target seconds (None: no target)
    ("1F1B", 8, 8, 16, 1e-3),
    ("1F1B", 64, 64, 256, 60e-3),
    ("GPipe", 64, 64, 256, None),
    ("Interleaved1F1B", 64, 32, 256, None),
    ("ZBVZeroBubble", 64, 32, 256, None),
]


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    print(f"{'schedule':<16} {'S':>3} {'P':>3} {'M':>4} {'actions':>8} {'orders':>9} {'simulate':>9}  target")
    for schedule, num_stages, pipeline_size, micro_batches, target_s in CASES:
        costs = StageCosts.uniform(num_stages, 1e-3, 2e-3, send_s=1e-4)
        order = orders(schedule, num_stages, pipeline_size, micro_batches)
        repeats = 200 if micro_batches < 64 else 10
        orders_s = best_of(lambda: orders(schedule, num_stages, pipeline_size, micro_batches), repeats)
        simulate_s = best_of(lambda: simulate(order, costs), repeats)
        verdict = "" if target_s is None else f"< {target_s * 1e3:g} ms: {'ok' if simulate_s < target_s else 'MISSED'}"
        print(f"{schedule:<16} {num_stages:>3} {pipeline_size:>3} {micro_batches:>4} "
              f"{sum(map(len, order)):>8} {orders_s * 1e3:>7.2f}ms {simulate_s * 1e3:>7.2f}ms  {verdict}")


if __name__ == "__main__":
    main()
