"""A CPU rank's heap as the plan sets it (runtime/host_heap.py): under FSDP's levels a freed big tensor leaves
the rank's resident memory; otherwise the heap keeps it for the next step's tensors. Each case runs in a fresh
process: the setting is the process's own."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from partita.plan.plan import Plan, StagePlan
    from partita.runtime.host_heap import set_for

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    stage = StagePlan(0, (0, 1), "a", "z", (0, 1), sharding=sys.argv[1])
    set_for(Plan(world_size=2, micro_batches=1, schedule="GPipe", stages=(stage,), fingerprint="f", num_blocks=1,
                 local_batch=1, device_memory_bytes=2**30), torch.device("cpu"))
    torch.ones(8).add_(1.0)  # torch's own first-use allocations, before measuring
    before = resident()
    t = torch.ones(2**22)  # 16 MiB, touched
    del t
    print((resident() - before) / 2**20)
""")


def _kept_mib(sharding: str) -> float:
    done = subprocess.run([sys.executable, "-c", SCRIPT, sharding], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"})
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.parametrize("sharding", ["gradients", "parameters"])
def test_under_fsdp_a_freed_big_tensor_leaves_resident_memory(sharding):
    assert _kept_mib(sharding) < 4


@pytest.mark.parametrize("sharding", ["none", "optimizer"])
def test_otherwise_the_heap_keeps_it_for_the_next_tensors(sharding):
    assert _kept_mib(sharding) > 14
