"""A CPU rank's heap as its plan sets it (runtime/host_heap.py): under FSDP's levels or where the plan fills the
rank's memory, a freed big tensor leaves the rank's resident memory; otherwise the heap keeps it for the next
step's tensors. Each case runs in a fresh process: the setting is the process's own."""

import os
import subprocess
import sys
import textwrap


from partita.plan.plan import Plan, StagePlan
from partita.runtime.host_heap import HEAP_ROOM, uses_heap

GIB = 2**30

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from partita.plan.plan import Plan, StagePlan
    from partita.runtime.host_heap import set_for

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    stage = StagePlan(0, (0, 1), "a", "z", (0, 1), memory_bytes=int(sys.argv[1]))
    set_for(Plan(world_size=2, micro_batches=1, schedule="GPipe", stages=(stage,), fingerprint="f", num_blocks=1,
                 local_batch=1, device_memory_bytes=2**30), torch.device("cpu"))
    torch.ones(8).add_(1.0)  # torch's own first-use allocations, before measuring
    before = resident()
    t = torch.ones(2**22)  # 16 MiB, touched
    del t
    print((resident() - before) / 2**20)
""")


def _plan(peak: int, sharding: str = "none") -> Plan:
    stage = StagePlan(0, (0, 1), "a", "z", (0, 1), memory_bytes=peak, sharding=sharding)
    return Plan(world_size=2, micro_batches=1, schedule="GPipe", stages=(stage,), fingerprint="f", num_blocks=1,
                local_batch=1, device_memory_bytes=GIB)


def _kept_mib(peak: int) -> float:
    """MiB of resident memory a freed 16 MiB tensor leaves behind, under a plan of `peak` bytes per rank of 1 GiB."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(peak)], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"})
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_the_heap_where_the_plan_leaves_room_for_what_it_keeps():
    assert uses_heap(_plan(int(GIB / HEAP_ROOM)))
    assert not uses_heap(_plan(int(GIB / HEAP_ROOM) + 1))
    assert uses_heap(_plan(0))  # a plan made by hand, without estimates
    assert uses_heap(_plan(GIB // 2, "optimizer"))
    assert not uses_heap(_plan(GIB // 2, "gradients")) and not uses_heap(_plan(0, "parameters"))
    assert uses_heap(Plan(world_size=1, micro_batches=1, schedule="GPipe", stages=(_plan(GIB).stages[0],),
                          fingerprint="f", num_blocks=1, local_batch=1))  # nothing known of the rank's memory


def test_a_plan_that_fills_the_rank_returns_a_freed_big_tensor_to_the_system():
    assert _kept_mib(int(0.9 * GIB)) < 4


def test_a_plan_with_room_keeps_it_in_the_heap_for_the_next_tensors():
    assert _kept_mib(int(0.5 * GIB)) > 14
