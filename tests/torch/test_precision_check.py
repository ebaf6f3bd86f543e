"""Which precisions a device computes in: a clear error where torch.autocast cannot."""

from unittest import mock

import pytest
import torch

from partita.errors import PlanError
from partita.runtime.precision import check_precision


def test_precisions_this_cpu_computes_in():
    for precision in ("fp32", "bf16", "fp16"):
        check_precision(precision, torch.device("cpu"))


def test_a_device_without_float16_gets_an_error_naming_it():
    def refuse(*args, **kwargs):
        raise RuntimeError("CPU Autocast only supports dtype of torch.bfloat16 currently")

    with mock.patch("partita.runtime.precision.torch.autocast", refuse), \
            pytest.raises(PlanError, match=r"precision='fp16': this cpu device cannot compute in torch.float16 .*"
                                           r"Use precision='fp32' or bf16"):
        check_precision("fp16", torch.device("cpu"))


def test_unknown_precision():
    with pytest.raises(PlanError, match="unknown precision 'fp8'"):
        check_precision("fp8", torch.device("cpu"))
