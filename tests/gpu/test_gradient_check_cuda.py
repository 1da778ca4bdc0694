"""``gradient_difference`` on a GPU: a float32 scan against autograd (cuDNN) must differ a little, not 0.

Autograd runs CUDA backward functions on its device threads; a reference switch those threads did not see
compared the scan with itself and reported exactly 0 (the H100 run of issue 27).
"""

from __future__ import annotations

import pytest
import torch

import lightning_bppsa.nn as bnn
from lightning_bppsa.gradcheck import gradient_difference

pytestmark = pytest.mark.cuda


def test_float32_scan_against_autograd_reports_a_small_nonzero_difference(cuda):
    torch.manual_seed(0)
    rnn = bnn.RNN(4, 16, batch_first=True, algorithm="linear", device=cuda)
    loss = rnn(torch.randn(8, 64, 4, device=cuda))[0].pow(2).sum()
    difference = gradient_difference(loss, rnn.parameters())
    assert rnn.last_stats["path"] == "scan"
    # float32 rounding differs between the scan and cuDNN's backward: nonzero, near float32's eps
    assert 0.0 < difference < 1e-4
