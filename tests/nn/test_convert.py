"""convert(): replacements take over the hooks of the modules they replace; converting twice keeps them."""

import torch
from torch import nn

from lightning_bppsa import nn as bnn
from lightning_bppsa.nn import ConversionRecord, SparseChain, convert


def test_converting_twice_keeps_the_modules_and_reports_them_as_scanned():
    model = nn.Sequential(nn.GRU(3, 4), nn.Sequential(bnn.LSTM(4, 2)))  # one converted, one built directly
    convert(model)
    first = model[0]
    report: list[ConversionRecord] = []
    assert convert(model, report=report) is model and model[0] is first
    assert [(r.path, r.module_type, r.scanned, r.already_converted) for r in report] == [
        ("0", "GRU", True, True),
        ("1.0", "LSTM", True, True),
    ]
    assert all("already a BPPSA module" in r.reason for r in report)


def test_hooks_of_replaced_modules_keep_running_and_their_handles_keep_working():
    model = nn.Sequential(
        nn.GRU(3, 4),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Conv2d(2, 1, 3)),
    ).double()
    calls = []
    handles = [
        model[0].register_forward_pre_hook(lambda m, args: calls.append(("pre", type(m).__module__))),
        model[0].register_forward_hook(lambda m, args, out: calls.append(("post", type(m).__module__))),
        model[1].register_forward_hook(lambda m, args, out: out * 2),  # a hook that changes the output
        model[0].register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(("backward", None))),
    ]
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    image = torch.randn(2, 1, 7, 7, dtype=torch.float64, requires_grad=True)
    expected_image = model[1](image)
    convert(model)
    assert isinstance(model[0], bnn.GRU) and isinstance(model[1], SparseChain)

    model[0](x)[0].sum().backward()
    assert calls == [
        ("pre", "lightning_bppsa.nn.recurrent"),
        ("post", "lightning_bppsa.nn.recurrent"),
        ("backward", None),
    ]
    torch.testing.assert_close(model[1](image), expected_image, atol=0, rtol=0)
    for handle in handles:
        handle.remove()
    calls.clear()
    model[0](x)
    assert calls == []
    torch.testing.assert_close(model[1](image), expected_image / 2, atol=0, rtol=0)
