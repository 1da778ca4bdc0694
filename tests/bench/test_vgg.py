"""The VGG-11 benchmark case."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bppsa.bench.vgg import build_case


def test_pruned_case_keeps_three_percent_of_the_conv_weights_and_is_seeded() -> None:
    model, x, grad = build_case("pruned 97%", batch=2, width=16)
    weights = torch.cat([m.weight.reshape(-1) for m in model if isinstance(m, nn.Conv2d)])
    assert len(model) == 21 and x.shape == (2, 3, 32, 32) and grad.shape == (2, 32, 1, 1)
    assert (weights != 0).float().mean().item() == pytest.approx(0.03, abs=0.005)
    again, _, _ = build_case("pruned 97%", batch=2, width=16)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


def test_unknown_weights_are_named() -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        build_case("sparse", batch=1)
