"""lightning_bppsa.gemm: products and their gradients equal torch's, in either orientation."""

from __future__ import annotations

import pytest
import torch

from lightning_bppsa import gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(200, 5, 8), (200, 8, 96), (300, 96, 8), (7, 3, 2), (100, 12, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_and_gradients_equal_torchs(dtype, shape, bias):
    torch.manual_seed(0)
    rows, inner, cols = shape
    a = torch.randn(rows, inner, dtype=dtype, requires_grad=True)
    w = torch.randn(cols, inner, dtype=dtype, requires_grad=True)  # used transposed, as a traced Linear is
    b = torch.randn(cols, dtype=dtype, requires_grad=True)
    ours = gemm.addmm(b, a, w.t()) if bias else gemm.mm(a, w.t())
    theirs = torch.addmm(b, a, w.t()) if bias else torch.mm(a, w.t())
    cotangent = torch.randn_like(theirs)
    leaves = [a, w, b] if bias else [a, w]
    got = torch.autograd.grad(ours, leaves, cotangent)
    want = torch.autograd.grad(theirs, leaves, cotangent)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(ours, theirs, **tol)
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h, **tol)


def test_thin_float32_products_run_transposed():
    a, b = torch.randn(1000, 96), torch.randn(96, 8)
    out = gemm.matmul(a, b)
    assert out.stride() == (1, 1000)  # computed as (bᵀ aᵀ)ᵀ
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-4)
    assert gemm.matmul(a, torch.randn(96, 32)).is_contiguous()  # wide: torch's own order
    assert gemm.matmul(a.double(), b.double()).is_contiguous()  # float64: torch's own order


def test_scaled_addmm_equals_torchs():
    a, w, b = (
        torch.randn(50, 4, dtype=torch.float64),
        torch.randn(4, 6, dtype=torch.float64),
        torch.randn(6, dtype=torch.float64),
    )
    torch.testing.assert_close(
        gemm.addmm(b, a, w, beta=0.5, alpha=2.0), torch.addmm(b, a, w, beta=0.5, alpha=2.0)
    )
