"""SparseChain gradients (input and parameters) equal autograd's; the converter's choices."""

import copy

import pytest
import torch
from torch import nn

from lightning_bppsa.nn import ConversionRecord, SparseChain, convert, reference_backward


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 3, (2, 3), stride=(1, 2), padding="valid"),
        nn.LeakyReLU(0.1),
        nn.AvgPool2d(2, 1, padding=1),
        nn.Conv2d(3, 3, 3, groups=3, dilation=2, padding="same", bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 3, 5),
        nn.Sigmoid(),
    ).double()


def grads(model, x, grad_out):
    params = [p for p in model.parameters()]
    return torch.autograd.grad(model(x), [x, *params], grad_out)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_chain_gradients_equal_autograd(algorithm, batch):
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference, algorithm=algorithm)
    x = torch.randn(batch, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    out = reference(x)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(chain(x), out, atol=0, rtol=0)
    for actual, expected in zip(grads(chain, x, grad_out), grads(reference, x, grad_out), strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=1e-9)


def test_dropout_and_batchnorm_eval_match_the_reference_backward():
    chain = SparseChain(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3).eval(), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(3, 2, 2)
    ).double()
    with torch.no_grad():
        chain[1].running_var.uniform_(0.5, 2)
        chain[1].weight.normal_()
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    out = chain(x)  # one forward, one dropout mask, differentiated twice
    grad_out = torch.randn_like(out)
    wrt = [x, *chain.parameters()]
    scanned = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    with reference_backward():
        expected = torch.autograd.grad(out, wrt, grad_out)
    for actual, exp in zip(scanned, expected, strict=True):
        torch.testing.assert_close(actual, exp, atol=1e-9, rtol=1e-9)


def test_input_without_grad_and_frozen_parameters():
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference)
    reference[0].weight.requires_grad_(False)
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64)
    trainable = [p for p in chain.parameters() if p.requires_grad]
    out = chain(x)
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad(reference(x), trainable, grad_out)
    for actual, exp in zip(torch.autograd.grad(out, trainable, grad_out), expected, strict=True):
        torch.testing.assert_close(actual, exp, atol=1e-9, rtol=1e-9)


def test_float32_gradients_are_close_to_float64():
    reference = small_cnn()
    chain = SparseChain.from_sequential(copy.deepcopy(reference)).float()
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, dtype=torch.float64)
    expected = grads(reference, x, grad_out)
    x32 = x.detach().float().requires_grad_()
    for actual, exp in zip(grads(chain, x32, grad_out.float()), expected, strict=True):
        torch.testing.assert_close(actual.double(), exp, atol=1e-5, rtol=1e-4)


def test_training_mode_batchnorm_falls_back_to_autograd():
    chain = SparseChain(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()).double().train()
    x = torch.randn(3, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    chain(x).sum().backward()
    assert chain._last_patterns is None and x.grad is not None


def test_flop_report_of_the_last_forward():
    chain = SparseChain.from_sequential(small_cnn())
    with pytest.raises(RuntimeError, match="forward"):
        chain.flop_report()
    chain(torch.randn(1, 2, 8, 10, dtype=torch.float64, requires_grad=True))
    bp = [r for r in chain.flop_report() if r.method == "bp"]
    assert len(bp) == len(chain)


def test_converter_wraps_conv_chains_and_keeps_parameters():
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2)),  # converted
        nn.Flatten(),
        nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)),  # dense: stays
        nn.Sequential(nn.GRU(2, 2)),  # not a chain of supported layers: recursed into
    )
    params = list(model.parameters())
    keys = list(model.state_dict())
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert isinstance(model[0], SparseChain)
    assert type(model[2]) is nn.Sequential and type(model[3]) is nn.Sequential
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert list(model.state_dict()) == keys
    rows = {r.path: r for r in report}
    assert rows["0"].scanned and not rows["2"].scanned and "Conv2d" in rows["2"].reason
    assert "3" not in rows


def test_converter_leaves_short_and_batchnorm_chains():
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()),
    )
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert all(type(m) is nn.Sequential for m in model)
    reasons = {r.path: r.reason for r in report}
    assert "MIN_LAYERS" in reasons["0"] and "BatchNorm2d" in reasons["1"]


def test_last_stats_say_what_the_last_forward_and_backward_did():
    chain = SparseChain.from_sequential(small_cnn(), algorithm="blelloch")
    assert chain.last_stats == {}
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    out = chain(x)
    stats = chain.last_stats
    assert stats["path"] == "scan" and stats["algorithm"] == "blelloch" and stats["layers"] == len(chain)
    assert stats["linearize_seconds"] > 0 and stats["scan_seconds"] == stats["param_seconds"] == 0
    out.sum().backward()
    assert stats["scan_seconds"] > 0 and stats["param_seconds"] > 0

    with torch.no_grad():
        chain(x)
    assert chain.last_stats["path"] == "autograd" and chain.last_stats["linearize_seconds"] == 0
    assert stats["path"] == "scan"  # a new forward gets a new dict; the old one keeps its numbers

    with reference_backward():
        chain(x).sum().backward()
    assert chain.last_stats["path"] == "scan" and chain.last_stats["scan_seconds"] == 0
