"""The runtime's overheads are fitted so that the planner's prediction meets the measured steps."""

from types import SimpleNamespace

import pytest
import torch

from partita.cluster import RuntimeOverheads
from partita.profile.overheads import _step_function, fit_overheads, probe_inputs

# stand-ins for the probe's runs: data parallelism with its all-reduce seconds; pipelines with the actions
# and messages each puts on its critical path
DATA_PARALLEL = [SimpleNamespace(compute_s=0.003, allreduce_s=0.001),
                 SimpleNamespace(compute_s=0.02, allreduce_s=0.008)]
PIPELINED = [SimpleNamespace(stages=s, actions=a, messages=m)
             for s, a, m in [(1, 4, 0), (1, 16, 0), (2, 6, 2), (2, 18, 2), (2, 6, 4), (2, 18, 16)]]


def _predict(run, o: RuntimeOverheads) -> float:
    """A made-up model in which each constant matters."""
    if hasattr(run, "allreduce_s"):
        return run.compute_s + run.allreduce_s * (1 + o.allreduce_interference) + o.data_parallel_step_s
    return (0.001 + o.action_s) * run.actions + run.messages * o.message_s + o.pipeline_step_s


def _fit(truth: RuntimeOverheads, pipelined=PIPELINED) -> RuntimeOverheads:
    return fit_overheads(_predict, DATA_PARALLEL, [_predict(r, truth) for r in DATA_PARALLEL], pipelined,
                         [_predict(r, truth) for r in pipelined], [r.stages > 1 for r in pipelined])


@pytest.mark.parametrize("truth", [RuntimeOverheads(0.002, 0.003, 0.0004, 0.0011, 0.9),
                                   RuntimeOverheads(0.0, 0.0005, 0.00002, 0.0, 0.0),
                                   RuntimeOverheads(0.001, 0.002, 0.0007, 0.0002, 0.2)])
def test_fit_recovers_the_overheads_behind_the_measurements(truth):
    fitted = _fit(truth)
    for name in ("data_parallel_step_s", "pipeline_step_s", "action_s", "message_s", "allreduce_interference"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.01, abs=1e-6), name


def test_without_two_stage_plans_no_message_cost_is_fitted():
    truth = RuntimeOverheads(0.001, 0.002, 0.0003, 0.0, 0.0)
    fitted = _fit(truth, [r for r in PIPELINED if r.stages == 1])
    assert fitted.message_s == 0.0 and fitted.action_s == pytest.approx(0.0003, rel=0.01)


def test_a_data_parallel_cost_that_would_be_negative_is_fitted_through_zero():
    """Measured steps faster than the model without any overhead: no negative fixed cost, and the
    interference still follows the larger probe."""
    measured = [_predict(r, RuntimeOverheads(0.0, 0.0, 0.0, 0.0, 1.0)) - 0.0005 for r in DATA_PARALLEL]
    fitted = fit_overheads(_predict, DATA_PARALLEL, measured, PIPELINED[:2], [0.01, 0.03], [False, False])
    assert fitted.data_parallel_step_s == 0.0
    for run, y in zip(DATA_PARALLEL, measured):
        assert _predict(run, fitted) == pytest.approx(y, rel=0.1)


def test_the_probe_trains_on_inputs_on_the_ranks_device():
    """On a GPU job, CPU inputs would be refused ("input tensor #0 ... is on cpu"): the probe's inputs are made
    on the device measured (here meta, the one other device a CPU machine has), its model stays on the CPU for
    partita to place, as a user's does."""
    called = []

    def parallelize(model, optimizer, *, loss_fn, plan):
        called.append(next(model.parameters()).device)
        return lambda x, y: called.append((x.device, y.device)) or torch.zeros((), requires_grad=True)

    step, _ = _step_function(parallelize, SimpleNamespace(local_batch=4), torch.device("meta"))
    step()
    meta = torch.device("meta")
    assert called == [torch.device("cpu"), (meta, meta)]
    assert [t.shape for t in probe_inputs(4, meta)] == [(4, 512), (4, 512)]
