"""partita runs on torch 2.11 to 2.13 (pyproject's range): the GPU machines carry 2.11, CI 2.13. What differs
between them in what partita uses: how a pipeline stage is prepared for the shapes it was given (2.13 tells it
to take them as static, `InferenceMode`, which 2.11 does not have; 2.11 takes them by itself)."""

import re
from pathlib import Path

import pytest
import torch

from partita.runtime import pipeline

ROOT = Path(__file__).resolve().parents[2]


class Stage:
    """Notes how it was prepared."""

    def __init__(self):
        self.calls = []

    def _prepare_forward_infra(self, *args):
        self.calls.append(("forward", args, getattr(self, "_inference_mode", None)))

    def _prepare_backward_infra(self, *args):
        self.calls.append(("backward", args))


@pytest.mark.parametrize("has_backward", [True, False])
def test_a_stage_on_torch_2_11_is_prepared_without_inference_mode(monkeypatch, has_backward):
    monkeypatch.setattr(pipeline, "STATIC_METADATA", None)
    stage = Stage()
    pipeline.prepare_static(stage, 4, has_backward)
    assert stage.has_backward is has_backward
    assert stage.calls == [("forward", (4, (), {}), None)] + ([("backward", (4,))] if has_backward else [])


def test_a_stage_on_torch_2_13_is_told_its_metadata_is_static(monkeypatch):
    monkeypatch.setattr(pipeline, "STATIC_METADATA", "static")
    stage = Stage()
    pipeline.prepare_static(stage, 2, True)
    assert stage.calls == [("forward", (2, (), {}, True), "static"), ("backward", (2,))]


def test_this_torch_is_in_the_range_partita_supports():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))
    if version in ((2, 11), (2, 13)):  # the two read; 2.12 has one way or the other
        assert (pipeline.STATIC_METADATA is None) == (version == (2, 11))
