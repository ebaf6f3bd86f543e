"""A rank's GPU: local rank r computes on the r-th visible GPU, and a node with more ranks than visible GPUs is
partita's LaunchError on every one of its ranks (both numbers, CUDA_VISIBLE_DEVICES, the fix), before CUDA is
touched, not CUDA's "invalid device ordinal" or NCCL's refusal of two ranks on one GPU."""

import pytest
import torch

from partita.errors import LaunchError
from partita.launch import env
from partita.launch.gpus import gpu_of


def test_a_rank_computes_on_the_gpu_of_its_local_rank():
    assert [gpu_of(r, 4, 4, None) for r in range(4)] == [0, 1, 2, 3]
    assert gpu_of(1, 2, 8, "0,1,2,3,4,5,6,7") == 1


@pytest.mark.parametrize("local_rank", [0, 1])
def test_more_ranks_than_gpus_stops_every_rank_of_the_node(local_rank):
    # rank 0 has a GPU of its own, yet would share it with nobody only if the others stopped: it stops too
    with pytest.raises(LaunchError) as e:
        gpu_of(local_rank, 2, 1, "3")
    text = str(e.value)
    assert "2 ranks" in text and "only 1 GPU is visible" in text
    assert "CUDA_VISIBLE_DEVICES '3'" in text
    assert "partita run -n 1" in text and "make 2 GPUs visible" in text


def test_under_slurms_gpus_per_task_a_rank_computes_on_the_gpu_it_sees():
    """--gpus-per-task binds each task's GPUs to it: each rank sees its own, first at index 0. With
    --gpu-bind=none every task sees the node's GPUs, and local rank r takes the r-th as usual."""
    assert [gpu_of(r, 4, 1, str(r), gpus_per_task="1") for r in range(4)] == [0, 0, 0, 0]
    assert [gpu_of(r, 4, 4, None, gpus_per_task="1") for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(LaunchError, match="--gpus-per-task"):
        gpu_of(1, 2, 1, "0")  # without it, two ranks on one GPU


def test_the_error_says_when_cuda_visible_devices_is_unset():
    with pytest.raises(LaunchError, match="CUDA_VISIBLE_DEVICES unset"):
        gpu_of(0, 8, 4, None)


def test_init_stops_before_touching_the_gpu(monkeypatch):
    """env.init() on a CUDA node with 2 ranks and 1 GPU: the LaunchError, before set_device or any rendezvous."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def touched(device):
        raise AssertionError(f"set_device({device}) was called")

    monkeypatch.setattr(torch.cuda, "set_device", touched)
    with pytest.raises(LaunchError, match=r"2 ranks but only 1 GPU is visible \(CUDA_VISIBLE_DEVICES '0'\)"):
        env.init()


def test_a_group_the_script_made_keeps_the_gpu_the_script_chose(monkeypatch):
    """A script that made the process group itself (torch.multiprocessing.spawn, no launcher's variables)
    chose each rank's GPU with set_device: partita adopts the group and computes there, not on cuda:0."""
    import torch.distributed as dist

    single = env.detect({})  # what a process that no launcher started finds
    monkeypatch.setattr(env, "detect", lambda environ: single)
    monkeypatch.setattr(env, "_world", None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    world = env.init()
    assert (world.rank, world.world_size, world.device) == (1, 2, torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)]


def test_a_gpu_job_has_a_backend_for_cpu_tensors_too():
    """partita's own small collectives (the ranks' agreement on each call) sum CPU tensors in every job; a group
    of NCCL alone has no backend for them ("No backend type associated with device type cpu"), so a job of
    2 GPUs or more would fail at its first call. torch's own parsing of the backends says which serves what."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    def served(device):
        return {d: str(b) for d, b in BackendConfig(Backend(env.backend_for(device))).get_device_backend_map().items()}

    assert served(torch.device("cuda", 1)) == {"cpu": "gloo", "cuda": "nccl"}
    assert served(torch.device("cpu"))["cpu"] == "gloo"


@pytest.mark.parametrize("name,memory_gib,preset", [
    ("NVIDIA H100 80GB HBM3", 79.6, "H100-80GB"),
    ("NVIDIA H200", 139.8, "H200-141GB"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80GB"),
])
def test_a_gpu_gets_its_familys_preset_by_name_and_memory(name, memory_gib, preset):
    from partita.cluster.presets import DEVICES
    from partita.profile import gpu_preset

    assert gpu_preset(name, int(memory_gib * 2**30)) is DEVICES[preset]


def test_a_grace_hopper_superchip_is_not_taken_for_an_h200():
    """"GH200" contains "H200": families match whole words only."""
    from partita.cluster.presets import DEVICES
    from partita.profile import gpu_preset

    assert gpu_preset("NVIDIA GH200 480GB", 95 * 2**30) is not DEVICES["H200-141GB"]
