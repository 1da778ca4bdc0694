"""The compiled backward of a product with a thin side (kernels/thin_backward.c via lightning_bppsa.kernels.thin):
both gradients of ``[a | 1] @ [b ; bias]`` against torch's products in float64 on random inputs, over the
kernel's cases (a's width 1-16 in compiled and run-time copies, output widths around its vector tiles, row
counts around its 4-row groups and 32-row blocks, strided operands, either gradient alone, several threads),
what it declines, and its use by lightning_bppsa.gemm (torch's products under create_graph)."""

from __future__ import annotations

import pytest
import torch
from lightning_bppsa.kernels import _native, thin

from lightning_bppsa import gemm

needs_kernel = pytest.mark.skipif(
    not _native.build_expected(), reason="needs a C compiler (BPPSA_NATIVE not 0)"
)
F64 = torch.float64


def reference(grad, a, b):
    ones = torch.ones(a.shape[0], 1, dtype=a.dtype)
    return grad @ b.t(), torch.cat([a, ones], 1).t() @ grad


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("k", [1, 3, 8, 9, 16])
@pytest.mark.parametrize(("rows", "n"), [(1, 1), (3, 5), (35, 33), (100, 96), (70, 31), (5, 64)])
def test_both_gradients_equal_torchs_products(dtype, k, rows, n):
    assert thin.available()  # a compiler is here: the kernel must build, not fall back
    gen = torch.Generator().manual_seed(k * 1000 + rows + n)
    grad, a, b = (torch.randn(*s, dtype=dtype, generator=gen) for s in ((rows, n), (rows, k), (k, n)))
    got_a, got_b = thin.affine_backward(grad, a, b, True, True)
    want_a, want_b = reference(grad, a, b)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(got_a, want_a, **tol)
    torch.testing.assert_close(got_b, want_b, **tol)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_strided_operands_either_gradient_and_threads(threads):
    """The output gradient as a column slice of a wider buffer, ``a`` a column slice too, ``b`` a weight's
    transpose; each gradient alone; row ranges over up to three threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(threads)
    wide = torch.randn(203, 130, dtype=F64, generator=gen)
    grad, a = wide[:, 7:103], torch.randn(203, 12, dtype=F64, generator=gen)[:, 2:10]
    b = torch.randn(96, 8, dtype=F64, generator=gen).t()
    want_a, want_b = reference(grad, a, b)
    only_a, none_b = thin.affine_backward(grad, a, b, True, False)
    none_a, only_b = thin.affine_backward(grad, a, b, False, True)
    assert none_a is None and none_b is None
    torch.testing.assert_close(only_a, want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(only_b, want_b, rtol=1e-12, atol=1e-12)


def test_it_declines_what_it_does_not_take():
    grad, a, b = torch.randn(10, 6), torch.randn(10, 17), torch.randn(17, 6)
    assert thin.affine_backward(grad, a, b, True, True) is None  # a wider than MAX_INPUTS
    half = [t[:, :4].half() for t in (grad, a)] + [b[:4].half()]
    assert thin.affine_backward(*half, True, True) is None  # float16
    assert thin.affine_backward(grad, a[:, :4].double(), b[:4], True, True) is None  # mixed dtypes


@needs_kernel
def test_gemm_row_bias_backward_runs_the_kernel_and_torchs_products_under_create_graph(monkeypatch):
    """``gemm.addmm`` with a row bias: its backward is the kernel's (counted), and under create_graph torch's
    differentiable products, whose second derivatives equal torch's own addmm's."""
    calls = []
    real = thin.affine_backward
    monkeypatch.setattr(thin, "affine_backward", lambda *args: calls.append(1) or real(*args))
    a = torch.randn(40, 5, dtype=F64, requires_grad=True)
    w = torch.randn(7, 5, dtype=F64, requires_grad=True)
    bias = torch.randn(7, dtype=F64, requires_grad=True)
    cotangent = torch.randn(40, 7, dtype=F64)
    got = torch.autograd.grad(gemm.addmm(bias, a, w.t()), [a, w, bias], cotangent)
    want = torch.autograd.grad(torch.addmm(bias, a, w.t()), [a, w, bias], cotangent)
    assert calls == [1]
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    fixed_a, fixed_w = a.detach(), w.detach()  # inputs needing no gradient: the kernel skips their products
    for operands, wanted in (((fixed_a, fixed_w), [bias]), ((a, fixed_w), [a, bias]), ((fixed_a, w), [w])):
        got = torch.autograd.grad(gemm.addmm(bias, operands[0], operands[1].t()), wanted, cotangent)
        want = torch.autograd.grad(torch.addmm(bias, operands[0], operands[1].t()), wanted, cotangent)
        for g, h in zip(got, want, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-12)
    assert len(calls) == 4
    outer = []
    for product in (gemm.addmm, torch.addmm):
        before = len(calls)
        first = torch.autograd.grad((product(bias, a, w.t()) ** 2).sum(), [a, w], create_graph=True)
        assert len(calls) == before  # not under create_graph (the second derivative's backward may call it)
        outer.append(torch.autograd.grad(sum(g.square().sum() for g in first), [a, w, bias]))
    for g, h in zip(*outer, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-10)


@needs_kernel
def test_float32_sums_over_many_rows_are_as_accurate_as_torchs_gemm():
    """b's and the bias's gradients sum 16000 rows: in float32 the kernel's error against float64 is torch's
    GEMM's, within a margin (a running sum over every row read ~2e-6, torch's ~4e-7)."""
    gen = torch.Generator().manual_seed(3)
    grad, a, b = (torch.randn(*s, dtype=F64, generator=gen) for s in ((16000, 96), (16000, 8), (8, 96)))
    exact = reference(grad, a, b)
    ours = thin.affine_backward(grad.float(), a.float(), b.float(), True, True)
    torchs = reference(grad.float(), a.float(), b.float())
    for got, theirs, want in zip(ours, torchs, exact, strict=True):
        errors = [float((x.double() - want).norm() / want.norm()) for x in (got, theirs)]
        assert errors[0] <= 1.5 * errors[1] + 1e-8, errors
