"""Measuring on the job's device: a model arrives on the CPU (or meta) and is measured on the rank's device with
its weights placed there only while their block runs; on a GPU, times come from CUDA events (the CPU path,
tested here, times by the clock); the process's fixed memory is what it uses less what its tensors hold, on
either device, so that the plan, which counts the tensors, counts them once."""

import time

import torch
from torch import nn

from partita.profile import _process_bytes, fixed_overhead_bytes
from partita.profile.block_times import _standing_in, on_device, seconds


def test_a_tensor_is_measured_on_the_device_measured():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    t = torch.ones(3, 2)
    assert on_device(t, cpu) is t
    stand_in = on_device(torch.empty(3, 2, device="meta"), cpu)
    assert stand_in.device == cpu and stand_in.shape == (3, 2) and stand_in.abs().max() <= 0.02
    # another device than the tensor's (a CPU weight measured on a GPU): a copy there, meta being the one other
    # device a CPU machine has
    copy = on_device(t, meta)
    assert copy.device == meta and copy.shape == t.shape


def test_a_cpu_models_block_runs_with_its_weights_on_the_device_measured():
    layer = nn.Linear(4, 2)
    weight = layer.weight
    with _standing_in(layer, torch.device("meta")):
        assert layer.weight.device.type == layer.bias.device.type == "meta"
        assert isinstance(layer.weight, nn.Parameter) and layer.weight.requires_grad
        assert layer(torch.ones(5, 4, device="meta")).shape == (5, 2)
    assert layer.weight is weight  # the model is left as it was


def test_seconds_times_every_call_by_the_clock_on_the_cpu():
    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.01)

    took = seconds(nap, 3, torch.device("cpu"))
    assert len(calls) == 3
    assert 0.03 <= took < 0.5


def test_the_fixed_overhead_leaves_out_what_tensors_hold_on_a_gpu(monkeypatch):
    """On CUDA the device's used memory includes all that torch's allocator reserved: the weights if the model
    was already there, and the blocks measuring freed, which the allocator keeps. Neither is overhead."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))  # 20 GiB used
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 19 * gib)
    assert _process_bytes(torch.device("cuda", 0), nn.Linear(4, 4)) == gib
    assert fixed_overhead_bytes(gib, 2 * gib) == 0


def test_the_fixed_overhead_leaves_out_the_models_tensors_on_the_cpu():
    small, big = nn.Linear(4, 4), nn.Linear(4, 4)
    big.weight = nn.Parameter(torch.ones(4096, 4096))  # 64 MiB, resident once written
    assert _process_bytes(torch.device("cpu"), big) <= _process_bytes(torch.device("cpu"), small) - 60 * 2**20


def test_the_optimizers_own_step_is_timed():
    """Adam's step costs more per byte than SGD's (torch makes more passes over memory); AdamW, whose defaults
    hold a field its constructor does not take, is made again all the same; an optimizer that cannot be made
    from its defaults is not timed (0: the planner models it)."""
    from partita.profile.optimizer_rate import OptimizerKind, optimizer_rate

    class Needs(torch.optim.SGD):
        def __init__(self, params, schedule):  # a constructor that takes what its defaults do not hold
            super().__init__(params, lr=0.1)

    cpu, p = torch.device("cpu"), [nn.Parameter(torch.zeros(1))]
    rate = {name: optimizer_rate(OptimizerKind.of(opt), 8 * 2**20, 8, cpu)
            for name, opt in [("sgd", torch.optim.SGD(p, lr=0.1)), ("adam", torch.optim.Adam(p)),
                              ("adamw", torch.optim.AdamW(p)), ("custom", Needs(p, None))]}
    assert rate["sgd"] > 1.5 * rate["adam"] > 0 and rate["adamw"] > 0, rate
    assert rate["custom"] == 0.0
    assert OptimizerKind.of(None) is None
