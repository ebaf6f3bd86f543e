"""DDP's saving idiom, `torch.save(model.module.state_dict(), path)`, on a model whose rank holds only its part:
refused with what to call instead, rather than a file that fails when loaded. (Two ranks, a 2-stage plan and
ZeRO-3: the bad-input catalogue.)"""

import pytest
import torch
from torch import nn

import partita
from partita.errors import PartitaError


def test_the_state_of_a_model_not_made_yet_is_refused_and_whole_once_it_is():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = partita.parallelize(net, loss_fn=nn.MSELoss())
    with pytest.raises(PartitaError, match=r"model\.module\.state_dict\(\) on rank 0: this rank holds only its part "
                                           r"of the model \(4 of its tensors are on the meta device.*Call "
                                           r"model\.state_dict\(\) on every rank instead"):
        model.module.state_dict()
    model(torch.randn(4, 8), torch.randn(4, 1)).backward()
    state = model.module.state_dict()
    assert not any(t.is_meta for t in state.values())
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())
    partita.shutdown()  # later tests in this process start outside any job
