"""The traced input part's ``addmm`` over all ``B T`` rows (``gemm._AddMM``): one product
``[a | 1] @ [b ; bias]``, and a backward that takes the bias's gradient from the product making ``b``'s. Its values
and gradients (any of bias, a, b requiring grad; a bias of shape ``(n,)`` or ``(1, n)``; thin and wide outputs,
whose products :mod:`lightning_bppsa.gemm` orients differently) equal ``torch.addmm``'s in float64, its double
backward too, and a compiled loop's input projection runs through it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_bppsa import gemm
from lightning_bppsa.nn import Recurrence

F64 = torch.float64


def _operands(width: int, bias_shape: tuple[int, ...], needs: tuple[bool, bool, bool]):
    torch.manual_seed(0)
    bias = torch.randn(bias_shape, dtype=F64).requires_grad_(needs[0])
    a = torch.randn(40, 3, dtype=F64).requires_grad_(needs[1])
    b = torch.randn(width, 3, dtype=F64).t().requires_grad_(needs[2])  # a transposed weight, as a Linear's
    return bias, a, b


@pytest.mark.parametrize("needs", [n for n in itertools.product([False, True], repeat=3) if any(n)])
@pytest.mark.parametrize("bias_shape", [(1,), (1, 1)], ids=["row", "matrix"])
@pytest.mark.parametrize("width", [4, 20], ids=["thin", "wide"])
def test_values_and_gradients_equal_addmm(width, bias_shape, needs):
    bias_shape = (width,) if len(bias_shape) == 1 else (1, width)
    leaves = _operands(width, bias_shape, needs)
    wanted = [t for t in leaves if t.requires_grad]
    weights = torch.linspace(0.5, 1.5, 40 * width, dtype=F64).view(40, width)
    ours = gemm.addmm(*leaves)
    theirs = torch.addmm(*leaves)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), wanted),
        torch.autograd.grad((theirs * weights).sum(), wanted),
        strict=True,
    ):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("width", [4, 20], ids=["thin", "wide"])
def test_double_backward(width):
    leaves = _operands(width, (width,), (True, True, True))
    assert torch.autograd.gradgradcheck(gemm._AddMM.apply, leaves)


class _Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.state_size = 4
        self.ih, self.hh = nn.Linear(3, 4), nn.Linear(4, 4, bias=False)

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.hh(h))


def test_a_compiled_loops_input_projection_runs_through_it(monkeypatch):
    calls = []
    apply = gemm._AddMM.apply
    # mm goes through it too (no bias): only a call with a bias is the input projection's
    monkeypatch.setattr(gemm._AddMM, "apply", lambda *args: calls.append(args[0] is not None) or apply(*args))
    torch.manual_seed(0)
    cell = _Projected().to(F64)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    module = Recurrence(cell, algorithm="linear")
    out = module(x)[0]
    assert module.last_stats["path"] == "scan"
    assert any(calls)
    leaves = [x, *cell.parameters()]
    ours = torch.autograd.grad(out.pow(2).sum(), leaves)
    h, steps = x.new_zeros(2, 4), []
    for x_t in x:
        h = cell(x_t, h)
        steps.append(h)
    theirs = torch.autograd.grad(torch.stack(steps).pow(2).sum(), leaves)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
