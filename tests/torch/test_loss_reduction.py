"""How partita combines a loss over micro-batches and ranks: by rows, as a mean or a sum. torch's loss modules say
which (`reduction`); a plain function says nothing, and the first training call's values show it (a summing one
taken for a mean would be off by the micro-batches times the replicas, silently)."""

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

from partita.errors import PlanError
from partita.runtime.batch import checked_loss, loss_of, rows_combination


def _summed(out, target):
    return F.mse_loss(out, target, reduction="sum")


def _averaged(out, target):
    return F.mse_loss(out, target)


def _batch(rows: int = 6, dim: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)


def combination(loss_fn, out, target):
    """rows_combination with the batch's loss computed first, as partita's runtimes do."""
    return rows_combination(loss_fn, out, target, loss_fn(out, target))


def test_a_loss_module_says_how_it_combines_rows(caplog):
    with caplog.at_level(logging.WARNING, logger="partita"):
        mse = loss_of(torch.nn.MSELoss())
        assert (mse.reduction, mse.declared, mse.checked) == ("mean", True, False)
        assert loss_of(torch.nn.CrossEntropyLoss(reduction="sum")).reduction == "sum"
    assert not caplog.records


def test_a_plain_function_is_taken_as_a_mean_until_its_values_show_otherwise():
    loss = loss_of(_summed)
    assert (loss.reduction, loss.declared, loss.checked) == ("mean", False, False)
    _summed.reduction = "sum"
    try:
        assert loss_of(_summed).declared and loss_of(_summed).reduction == "sum"
    finally:
        del _summed.reduction
    with pytest.raises(PlanError, match="reduction='none'"):
        loss_of(torch.nn.MSELoss(reduction="none"))


def test_the_values_of_a_batch_and_its_halves_show_a_mean_a_sum_or_neither():
    out, target = _batch()
    assert combination(torch.nn.MSELoss(), out, target) == "mean"
    assert combination(_summed, out, target) == "sum"
    assert combination(torch.nn.L1Loss(reduction="sum"), out, target) == "sum"
    # computed in bfloat16 (each value rounded to 8 bits of mantissa), still told apart
    assert combination(torch.nn.MSELoss(), out.bfloat16(), target.bfloat16()) == "mean"
    assert combination(_summed, out.bfloat16(), target.bfloat16()) == "sum"
    # a loss computed in bfloat16 and returned as float32: the outputs' dtype says how close the values are
    bf16_sum = lambda o, t: ((o - t) ** 2).sum().float()  # noqa: E731
    assert all(combination(bf16_sum, *(x.bfloat16() for x in _batch(6, 64 + seed))) == "sum" for seed in range(20))
    logits, labels = torch.randn(6, 5, 3), torch.randint(0, 3, (6, 5))
    # a language model's loss: a mean over tokens is a mean over rows while every row has as many tokens...
    lm = lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    assert combination(lm, logits, labels) == "mean"
    # ... and neither once padding (ignore_index) keeps more tokens in some rows than in others
    padded = labels.clone()
    padded[0, 1:] = -100
    assert combination(lm, logits, padded) == "neither"
    # class weights make a weighted mean
    weighted = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2]))
    assert combination(weighted, torch.randn(8, 3), torch.tensor([0, 1, 2, 0, 1, 2, 2, 2])) == "neither"


def test_judging_a_loss_that_trains_warns_of_nothing():
    """The runtimes pass the batch's own loss, which requires gradients (torch warns where such a tensor is
    read as a number: that would reach every rank's log)."""
    out, target = _batch()
    out.requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert combination(torch.nn.MSELoss(), out, target) == "mean"


def test_what_a_batch_cannot_tell_is_left_open():
    out, target = _batch()
    assert combination(torch.nn.MSELoss(), out[:1], target[:1]) is None  # one row
    assert combination(torch.nn.MSELoss(), out, out) is None  # a loss of 0: a mean and a sum alike
    # outputs whose dim 0 is not the rows
    assert combination(lambda o, t: F.mse_loss(o.t(), t), out.t().contiguous(), target) is None

    def whole_batches_only(o, t):
        if o.shape[0] != 6:
            raise ValueError("needs 6 rows")
        return F.mse_loss(o, t)

    assert combination(whole_batches_only, out, target) is None

    def noisy(o, t):  # draws random numbers: the check leaves the random streams as they were
        return F.mse_loss(o + 0.01 * torch.randn_like(o), t)

    torch.manual_seed(1)
    expected = torch.rand(())
    torch.manual_seed(1)
    rows_combination(noisy, out, target, F.mse_loss(out, target))
    assert torch.rand(()) == expected
    # a structured output (a dict of tensors, as Hugging Face models return) splits leaf by leaf
    assert combination(lambda o, t: _summed(o["logits"], t), {"logits": out}, target) == "sum"


def test_the_checked_loss_adopts_what_the_values_show_or_stops_a_contradiction(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="partita"):
        plain = checked_loss(loss_of(_summed), "sum", cpu)
    assert (plain.reduction, plain.checked) == ("sum", True)
    assert "its values on the first batch are a sum over rows" in caplog.text
    assert checked_loss(loss_of(torch.nn.MSELoss()), "mean", cpu).checked
    with pytest.raises(PlanError, match=r"reduction='mean', but its values are a sum .* Set loss_fn.reduction = 'sum'"):
        checked_loss(loss_of(torch.nn.MSELoss()), "sum", cpu)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="partita"):
        odd = checked_loss(loss_of(torch.nn.CrossEntropyLoss()), "neither", cpu)
        assert (odd.reduction, odd.checked) == ("mean", True)
        assert "is not a mean over the batch's rows" in caplog.text and "reduction='sum', divided by" in caplog.text
        caplog.clear()
        unknown = checked_loss(loss_of(_summed), None, cpu)
        assert unknown.reduction == "mean" and "could not tell" in caplog.text
        assert "loss_fn.reduction = 'sum'" in caplog.text
