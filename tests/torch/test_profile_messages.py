"""What rank 0 says while it measures: what is measured, about how long it takes, and that the results are
cached (PARTITA_CACHE_DIR), in words a user understands."""


import pytest
import torch

from partita.capture.export import capture
from partita.capture.model_graph import model_graph
from partita.profile import _announce
from partita.profile.block_times import _about, _progress, measure_blocks
from support.logs import partita_log


@pytest.fixture
def said():
    """The lines partita logs, whatever handlers earlier tests left on its logger."""
    with partita_log() as lines:
        yield lines


def graph_of(layers=3, width=16, rows=4):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    cap = capture(model, (torch.zeros(rows, width),), {})
    return cap, model_graph(cap)


def test_before_measuring_it_says_what_is_measured_and_where_it_is_cached(said, monkeypatch, tmp_path):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path))
    _, graph = graph_of()
    distinct = len({b.signature for b in graph.blocks})
    _announce(graph, 8, 4, blocks_cached=False, links_cached=False)
    assert f"this model's blocks and the links between ranks before planning; this happens once: the results go " \
           f"to {tmp_path} (PARTITA_CACHE_DIR)" in said[0]
    assert (f"timing the forward and backward of {distinct} distinct block" in said[1]
            and f"(of {graph.num_blocks}: repeated layers are measured once)" in said[1]
            and "at micro-batches of 2 and 8 rows, shared among 4 ranks" in said[1]), said
    said.clear()
    _announce(graph, 8, 4, blocks_cached=True, links_cached=True)
    assert said == [f"block costs and links measured by an earlier run: read from {tmp_path} (PARTITA_CACHE_DIR); "
                    "delete them there to measure again"]
    said.clear()
    _announce(graph, 8, 1, blocks_cached=False, links_cached=False)
    assert "links" not in said[0] and "shared among 1 rank" in said[1]


def test_in_a_log_file_the_estimate_comes_after_the_first_measurement(said, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    # 2 s to prepare, 2 s for the first of 9 measurements on rank 0, then as much on the ranks that wait their turn
    _progress(1, 9, 2, 2.0, 2.0)
    _progress(2, 9, 2, 2.0, 4.0)
    _progress(9, 9, 2, 2.0, 18.0)
    assert said == ["measuring the blocks will take about 40 s"]


@pytest.mark.parametrize("seconds,words", [(0.3, "under a second"), (4.4, "about 4 s"), (36, "about 40 s"),
                                           (200, "about 3 min")])
def test_durations_are_rounded_for_people(seconds, words):
    assert _about(seconds) == words


def test_measuring_blocks_says_how_long_it_will_take(said):
    cap, graph = graph_of()
    costs = measure_blocks(cap, graph, 4, torch.device("cpu"), show_progress=True)
    assert set(costs) == {b.signature for b in graph.blocks}
    assert len(said) == 1 and said[0].startswith("measuring the blocks will take "), said
    said.clear()
    measure_blocks(cap, graph, 4, torch.device("cpu"), show_progress=False)
    assert said == []


def test_on_a_terminal_a_bar_shows_the_time_left(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    _progress(3, 9, 1, 1.0, 6.0)
    _progress(9, 9, 2, 1.0, 18.0)
    shown = capsys.readouterr().err
    first, last = shown.split("\r")[1:]
    assert first.startswith("partita: measuring blocks [") and "33%, about 10 s left" in first, shown
    assert "100%, the other ranks' turn: about 20 s" in last and last.endswith("\n"), shown
