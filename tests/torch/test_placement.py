"""The model arrives on the CPU or the meta device; each rank moves or materializes only its own part on its
device (`env.world().device`), and a model already on another rank's GPU is an error, not a silent copy. Run
here in one process, with the meta device standing for a GPU, the one other device a CPU machine has."""

import torch
from torch import nn

from partita.runtime.materialize import check_devices, foreign_devices, materialize

CPU, META = torch.device("cpu"), torch.device("meta")


def test_a_model_arrives_on_the_cpu_the_meta_device_or_the_ranks_own_gpu():
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert foreign_devices([CPU, META, gpu0], gpu0) == []
    assert foreign_devices([CPU, gpu1, gpu1], gpu0) == ["cuda:1"]
    assert foreign_devices([gpu0], CPU) == ["cuda:0"]


def test_a_model_on_the_cpu_passes_the_check():
    check_devices(nn.Linear(2, 2), CPU)


def test_a_rank_moves_only_its_own_part_to_its_device():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    materialize(model, opt, {"0.weight", "0.bias"}, device=META)
    assert [p.device for p in model[0].parameters()] == [META, META]  # moved: its own part
    assert all(p.is_meta for p in model[1].parameters())  # another rank's: freed
    assert [p for g in opt.param_groups for p in g["params"]][:2] == list(model[0].parameters())


def test_a_rank_keeps_its_part_where_it_already_is():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    weight = model[1].weight
    materialize(model, None, {"1.weight", "1.bias"}, device=CPU)
    assert model[1].weight is weight and not weight.is_meta
    assert model[0].weight.is_meta

