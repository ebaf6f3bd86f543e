"""How partita combines a loss over micro-batches and ranks: by its `reduction`, as torch's loss modules say; a
plain function has none, is taken as a mean, and the log says so (a summing one would otherwise be off by the
micro-batches times the replicas, silently)."""

import logging

import torch

from partita.runtime.batch import loss_of


def test_a_loss_module_says_how_it_combines_rows(caplog):
    with caplog.at_level(logging.WARNING, logger="partita"):
        assert loss_of(torch.nn.MSELoss()).reduction == "mean"
        assert loss_of(torch.nn.CrossEntropyLoss(reduction="sum")).reduction == "sum"
    assert not caplog.records


def test_a_plain_function_is_taken_as_a_mean_and_the_log_says_how_to_say_sum(caplog):
    def summed(out, target):
        return torch.nn.functional.mse_loss(out, target, reduction="sum")

    with caplog.at_level(logging.WARNING, logger="partita"):
        assert loss_of(summed).reduction == "mean"
    assert "loss_fn summed has no `reduction`" in caplog.text and "loss_fn.reduction = 'sum'" in caplog.text
    summed.reduction = "sum"
    assert loss_of(summed).reduction == "sum"
