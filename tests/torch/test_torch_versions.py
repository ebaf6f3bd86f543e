"""partita runs on torch 2.11 to 2.13 (pyproject's range): the GPU machines carry 2.11, CI 2.13. What differs
between them in what partita uses: pipeline stages (`runtime.torch_stage` says how; here, how a stage is prepared
for the shapes it was given: 2.13 tells it to take them as static, `InferenceMode`, which 2.11 does not have;
2.11 takes them by itself), and how long `partita run`'s agent waits for ranks it sent SIGTERM (2.11's
LaunchConfig has no `shutdown_timeout`). The whole suite passes on either (run it with a 2.11 environment)."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from partita.runtime import torch_stage

ROOT = Path(__file__).resolve().parents[2]


class Stage:
    """Notes how it was prepared; receives a float and an integer tensor, as torch 2.11 makes them."""

    def __init__(self):
        self.calls = []
        self.args_recv_info = {}

    def _prepare_forward_infra(self, micro_batches, *args):
        self.calls.append(("forward", (micro_batches, *args), getattr(self, "_inference_mode", None)))
        for mb in range(micro_batches):
            self.args_recv_info[mb] = (SimpleNamespace(buffer=torch.zeros(2)),
                                       SimpleNamespace(buffer=torch.zeros(2, dtype=torch.long)))
            if self.has_backward and getattr(self, "_inference_mode", None) is None:  # what 2.11 does
                for info in self.args_recv_info[mb]:
                    info.buffer.requires_grad_(True)

    def _prepare_backward_infra(self, *args):
        self.calls.append(("backward", args))


@pytest.mark.parametrize("has_backward", [True, False])
def test_a_stage_on_torch_2_11_is_prepared_without_inference_mode(monkeypatch, has_backward):
    """Its floating receive buffers require gradients when it has a backward; its integer ones never (which
    torch 2.11 itself would ask for, and fail)."""
    monkeypatch.setattr(torch_stage, "STATIC_METADATA", None)
    stage = Stage()
    torch_stage.prepare_static(stage, 4, has_backward)
    assert stage.has_backward is has_backward
    assert stage.calls == [("forward", (4, (), {}), None)] + ([("backward", (4,))] if has_backward else [])
    assert [[i.buffer.requires_grad for i in infos] for infos in stage.args_recv_info.values()] == \
        [[has_backward, False]] * 4


def test_a_stage_on_torch_2_13_is_told_its_metadata_is_static(monkeypatch):
    monkeypatch.setattr(torch_stage, "STATIC_METADATA", "static")
    stage = Stage()
    torch_stage.prepare_static(stage, 2, True)
    assert stage.calls == [("forward", (2, (), {}, True), "static"), ("backward", (2,))]


def test_this_torch_is_in_the_range_partita_supports():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))
    if version in ((2, 11), (2, 13)):  # the two read; 2.12 has one way or the other
        assert (torch_stage.STATIC_METADATA is None) == (version == (2, 11))


def test_the_wait_after_sigterm_is_the_stop_timeout_on_either_torch():
    """torch 2.13's launcher takes it in its configuration; 2.11's has no such field, and partita's agent waits
    that long itself."""
    from torch.distributed.launcher.api import LaunchConfig

    from partita.launch import agent

    fields = agent.config_fields(7)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **fields)
    with agent.installed(7):
        waited = agent.Agent.stop_timeout_s
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version >= (2, 13):
        assert config.shutdown_timeout == 7 and waited == 30  # 30: torch's own, after one rank failed
    else:
        assert fields == {} and waited == 7
