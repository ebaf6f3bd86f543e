"""The simulator: closed forms, hand-checked steps, transfers, deadlocks, and the pictures."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from partita.schedule import Action, orders
from partita.sim import StageCosts, simulate
from partita.sim.longest_path import step_graph
from partita.sim.timeline import draw_timeline

from test_schedule import TABLE, parse_orders

# Times are multiples of 1/8 so that sums in any order are exact in floating point.
FORWARD_S = (0.5, 1.25, 0.75, 1.0, 0.375)
BACKWARD_S = (1.0, 2.5, 1.5, 2.25, 0.875)


# ---- closed forms -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
@pytest.mark.parametrize("micro_batches", [1, 2, 7])
def test_gpipe_without_transfers_is_fill_drain(num_stages, micro_batches):
    f, b = FORWARD_S[:num_stages], BACKWARD_S[:num_stages]
    trace = simulate(orders("GPipe", num_stages, num_stages, micro_batches), StageCosts(f, b))
    m = micro_batches
    assert trace.makespan_s == sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)


@pytest.mark.parametrize("num_stages,micro_batches", [(1, 1), (2, 2), (4, 4), (4, 9), (8, 16)])
def test_1f1b_with_equal_stages(num_stages, micro_batches):
    trace = simulate(orders("1F1B", num_stages, num_stages, micro_batches),
                     StageCosts.uniform(num_stages, 0.75, 1.5))
    assert trace.makespan_s == (micro_batches + num_stages - 1) * (0.75 + 1.5)
    assert trace.bubble_fraction == pytest.approx((num_stages - 1) / (micro_batches + num_stages - 1))


# ---- hand-checked ---------------------------------------------------------------------------------------
def test_1f1b_two_stages_with_transfers_by_hand():
    trace = simulate(orders("1F1B", 2, 2, 2), StageCosts.uniform(2, 1.0, 2.0, send_s=0.5), tail_s=(0.25, 0.75))
    # rank 0: F0 [0,1] F1 [1,2]; gradient of micro-batch 0 arrives at 4.5 + 0.5 -> B0 [5,7]; of 1 at 8 -> B1 [8,10]
    # rank 1: F0 arrives 1.5 -> [1.5,2.5]; B0 [2.5,4.5]; F1 (arrived 2.5) [4.5,5.5]; B1 [5.5,7.5]
    assert trace.starts_s == ((0.0, 1.0, 5.0, 8.0), (1.5, 2.5, 4.5, 5.5))
    assert trace.ends_s == ((1.0, 2.0, 7.0, 10.0), (2.5, 4.5, 5.5, 7.5))
    assert trace.makespan_s == 10.0 and trace.step_s == 10.75
    assert trace.busy_s == (6.0, 6.0) and trace.bubble_fraction == 1 - 12 / 20
    sends = [e for e in trace.events if e.op.startswith("SEND")]
    assert [(e.rank, e.stage, e.op, e.micro_batch, e.start_s, e.end_s) for e in sends] == [
        (0, 0, "SEND_F", 0, 1.0, 1.5), (0, 0, "SEND_F", 1, 2.0, 2.5),
        (1, 1, "SEND_B", 0, 4.5, 5.0), (1, 1, "SEND_B", 1, 7.5, 8.0)]
    tails = [(e.rank, e.start_s, e.end_s) for e in trace.events if e.op == "TAIL"]
    assert tails == [(0, 10.0, 10.25), (1, 10.0, 10.75)]


def test_split_backward_costs_and_order():
    costs = StageCosts((1.0,), (4.0,), backward_input_s=(1.5,), backward_weight_s=(2.5,))
    trace = simulate(parse_orders("0F0 0F1 0I0 0I1 0W0 0W1"), costs)
    assert trace.starts_s == ((0.0, 1.0, 2.0, 3.5, 5.0, 7.5),)
    assert trace.makespan_s == 10.0 and trace.bubble_fraction == 0.0


def test_split_backward_defaults_to_halves():
    costs = StageCosts((1.0, 1.0), (3.0, 5.0))
    assert costs.backward_input_s == costs.backward_weight_s == (1.5, 2.5)


def test_the_gradient_waits_for_the_next_stages_input_backward_not_its_weight_backward():
    # stage 1's I sends the gradient; its W runs after and does not delay stage 0
    trace = simulate(parse_orders("0F0 0I0 0W0", "1F0 1I0 1W0"), StageCosts((1.0, 1.0), (2.0, 2.0)))
    assert trace.starts_s[0][1] == 3.0  # after 1F0 [1,2] and 1I0 [2,3]


def test_same_rank_neighbours_transfer_in_no_time():
    # ZBV on one rank: stage 0 and 1 share the rank, so the big send times must not appear anywhere
    costs = StageCosts.uniform(2, 1.0, 2.0, send_s=100.0)
    trace = simulate(orders("ZBVZeroBubble", 2, 1, 4), costs)
    assert trace.makespan_s == 4 * 2 * 3.0 and trace.bubble_fraction == 0.0
    assert not [e for e in trace.events if e.op.startswith("SEND")]


def test_v_shape_sends_only_between_ranks():
    trace = simulate(orders("DualPipeV", 4, 2, 4), StageCosts.uniform(4, 1.0, 2.0, send_s=0.5))
    assert {(e.rank, e.stage, e.op) for e in trace.events if e.op.startswith("SEND")} == {
        (0, 0, "SEND_F"), (1, 2, "SEND_F"), (1, 1, "SEND_B"), (0, 3, "SEND_B")}
    assert trace.send_activations_s == (0.5, 0.0, 0.5, 0.0) and trace.send_gradients_s == (0.0, 0.5, 0.0, 0.5)


def test_tail_starts_when_the_whole_pipeline_drained():
    trace = simulate(orders("1F1B", 2, 2, 2), StageCosts.uniform(2, 1.0, 1.0), tail_s=(3.0, 5.0))
    assert trace.step_s == trace.makespan_s + 5.0


# ---- every schedule runs -------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", TABLE)
def test_every_schedule_simulates_without_deadlock(schedule, num_stages, pipeline_size, micro_batches):
    f, b = FORWARD_S[:1] * num_stages, BACKWARD_S[:1] * num_stages
    costs = StageCosts(f, b, send_activations_s=(0.125,) * num_stages, send_gradients_s=(0.25,) * num_stages)
    result = orders(schedule, num_stages, pipeline_size, micro_batches)
    trace = simulate(result, costs)
    assert sum(trace.busy_s) == micro_batches * (sum(f) + sum(b))
    assert 0.0 <= trace.bubble_fraction < 1.0
    lower_bound = max(trace.busy_s)
    assert trace.makespan_s >= lower_bound
    for starts, ends in zip(trace.starts_s, trace.ends_s):  # one action at a time per rank
        assert all(end <= next_start for end, next_start in zip(ends, starts[1:]))


@pytest.mark.parametrize("schedule,num_stages,pipeline_size,micro_batches", TABLE)
def test_the_step_graph_gives_the_simulators_makespan(schedule, num_stages, pipeline_size, micro_batches):
    """Random costs, transfers and split backwards: the same number, to the last bit."""
    order = orders(schedule, num_stages, pipeline_size, micro_batches)
    graph = step_graph(order, num_stages)
    rng = random.Random(f"{schedule}{num_stages}{pipeline_size}{micro_batches}")
    for _ in range(5):
        costs = [[rng.uniform(0.1, 3.0) for _ in range(num_stages)] for _ in range(6)]
        f, b, sa, sg, i, w = costs
        if rng.random() < 0.5:
            i, w = (), ()  # the halves by default
        want = simulate(order, StageCosts(f, b, sa, sg, i, w)).makespan_s
        assert graph.makespan_s(f, b, sa, sg, i, w) == want


def test_deadlocked_orders_raise():
    with pytest.raises(ValueError, match=r"deadlock.*rank 1 at 1B0 \(position 0\)"):
        simulate(parse_orders("0F0 0B0", "1B0 1F0"), StageCosts.uniform(2, 1.0, 1.0))


# ---- inputs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,message", [
    ({"forward_s": (1.0, 1.0), "backward_s": (1.0,)}, r"backward_s has 1 entries; it needs one per stage \(2"),
    ({"forward_s": (1.0,), "backward_s": (-1.0,)}, "negative time"),
    ({"forward_s": (1.0,), "backward_s": (1.0,), "send_gradients_s": (0.0, 0.0)}, "send_gradients_s has 2"),
    ({"forward_s": (), "backward_s": ()}, "at least one stage"),
])
def test_stage_costs_reject_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StageCosts(**kwargs)


def test_simulate_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match=r"tail_s has 1 entries; it needs one per rank \(2\)"):
        simulate(orders("GPipe", 2, 2, 1), StageCosts.uniform(2, 1.0, 1.0), tail_s=(1.0,))
    with pytest.raises(ValueError, match="runs on ranks 0 and 1; a stage lives on one rank"):
        simulate(parse_orders("0F0 1F0", "1B0 0B0"), StageCosts.uniform(2, 1.0, 1.0))
    with pytest.raises(ValueError, match="rank 0 runs stage 2, but the costs have stages 0..1"):
        simulate([[Action(2, "F", 0)]], StageCosts.uniform(2, 1.0, 1.0))


# ---- pictures -------------------------------------------------------------------------------------------
@pytest.fixture
def trace():
    return simulate(orders("Interleaved1F1B", 4, 2, 4), StageCosts.uniform(4, 1e-3, 2e-3, send_s=2e-4),
                    tail_s=(1e-3, 1e-3))


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_timeline_files_are_written(trace, tmp_path, suffix):
    path = draw_timeline(trace, tmp_path / f"step{suffix}")
    assert path.stat().st_size > 1000
    if suffix == ".png":
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert path.read_text().count("<rect") > len(trace.events)  # every event, plus legend and background


def test_timeline_rejects_other_formats(trace, tmp_path):
    with pytest.raises(ValueError, match=r"writes .svg or .png files, not 'step.pdf'"):
        draw_timeline(trace, tmp_path / "step.pdf")


def test_chrome_trace_has_every_event(trace):
    events = json.loads(trace.to_chrome_trace())["traceEvents"]
    intervals = [e for e in events if e["ph"] == "X"]
    assert len(intervals) == len(trace.events)
    assert {e["tid"] for e in intervals} == {0, 1, 2}


def test_docstring_examples_run():
    import doctest
    import importlib

    for name in ("costs", "simulate", "trace", "timeline"):
        module = importlib.import_module(f"partita.sim.{name}")
        assert doctest.testmod(module).failed == 0, name


def test_simulator_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "from partita.schedule import orders; from partita.sim import StageCosts, simulate; "
            "print(simulate(orders('1F1B', 2, 2, 2), StageCosts.uniform(2, 1.0, 2.0)).makespan_s)")
    src = Path(__file__).resolve().parents[2] / "src"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(src)})
    assert out.returncode == 0 and out.stdout.strip() == "9.0", out.stderr
