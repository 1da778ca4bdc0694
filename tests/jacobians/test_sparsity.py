"""The pattern's sparsity follows the paper's Table 1 formulas (guaranteed zeros only)."""

import pytest
import torch
from torch import nn

from lightning_bppsa.jacobians import linearize


def sparsity(module, sample_shape):
    _, jac = linearize(module, torch.randn(1, *sample_shape))
    return 1 - jac.pattern.density


def test_vgg11_first_layers_match_table_1():
    """Table 1's VGG-11 examples on 32×32: 0.99157, 0.99998, 0.99994."""
    assert sparsity(nn.Conv2d(3, 64, 3, padding=1), (3, 32, 32)) == pytest.approx(0.99157, abs=5e-6)
    assert sparsity(nn.ReLU(), (64, 32, 32)) == pytest.approx(0.99998, abs=5e-6)
    assert sparsity(nn.MaxPool2d(2, 2), (64, 32, 32)) == pytest.approx(0.99994, abs=5e-6)


@pytest.mark.parametrize("hw", [(8, 8), (6, 10)], ids=str)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_unpadded_formulas_are_exact(hw, k):
    """Without padding every window lies inside the image, so Table 1 holds exactly."""
    c, (h, w) = 3, hw
    conv = nn.Conv2d(c, 4, k, stride=k)  # non-overlapping windows tile the image
    conv_sparsity = 1 - k * k / (h * w)  # nnz = co·ho·wo·ci·k² of ci·hi·wi·co·ho·wo entries
    assert sparsity(conv, (c, h, w)) == pytest.approx(conv_sparsity, abs=1e-12)
    assert sparsity(nn.ReLU(), (c, h, w)) == pytest.approx(1 - 1 / (c * h * w), abs=1e-12)
    pool_sparsity = 1 - k * k / (c * h * w)
    assert sparsity(nn.MaxPool2d(k), (c, h, w)) == pytest.approx(pool_sparsity, abs=1e-12)


def test_padding_only_removes_entries():
    """With padding Table 1's conv formula is an upper bound on the density (‡: padding ≪ image)."""
    dense = sparsity(nn.Conv2d(3, 8, 3, padding=1), (3, 16, 16))
    assert 1 - 9 / 256 <= dense < 1 - 9 / 256 * 0.85
