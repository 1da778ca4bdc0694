"""Matrix products of many rows with a thin side, in the orientation torch's CPU GEMM runs fastest.

Torch's float32 CPU ``mm`` is several times slower for an output with few columns than for the same product
transposed: ``(16000, 96) @ (96, 8)`` 1.99 ms against ``((96, 8)ᵀ @ (16000, 96)ᵀ)ᵀ`` 1.10 ms, and the
weight gradient ``(96, 16000) @ (16000, 8)`` 2.76 ms against 0.63 ms (one thread, AMD EPYC, torch 2.13,
2026-11-24; the gap closes at 16 columns, and float64 shows no consistent order). Such products are the
backward of an input projection over all ``B T`` rows of a narrow input (:class:`~lightning_bppsa.nn.Recurrence`).
With a bias of one row (the projection ``[a | 1] @ [b ; bias]``) and at most 16 columns of ``a``, the backward's
two products are one pass of a compiled kernel on the CPU (:mod:`lightning_bppsa.kernels.thin`: ~0.6 ms of
the GEMMs' ~1.3 ms at 16000 rows, 96 outputs, 8 inputs, one thread), torch's elsewhere and under ``create_graph``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa.kernels import thin

__all__ = ["addmm", "matmul", "mm"]

#: the output widths (columns) for which the transposed product measured faster (float32, CPU)
_THIN = range(2, 13)


#: below this many elements of ``a`` the transposed product measured slower ((64, 64) @ (64, 8): 8 vs 10 µs)
_SMALL = 16384


def _thin(a: Tensor, b: Tensor) -> bool:
    """Whether ``a @ b`` runs faster transposed: a float32 CPU output of 2-12 columns and more rows, from an
    ``a`` that is not tiny (measured 1.9-5.4x faster from (32, 16000) @ (16000, 8) to (16000, 32) @ (32, 8))."""
    columns = b.shape[1]
    return (
        columns in _THIN and a.shape[0] > columns and a.numel() >= _SMALL and a.dtype == torch.float32
        and a.device.type == "cpu"
    )


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D ``a``, ``b``; computed as ``(bᵀ aᵀ)ᵀ`` (a transposed view) where that runs faster."""
    return (b.t() @ a.t()).t() if _thin(a, b) else a @ b


class _AddMM(torch.autograd.Function):
    """``bias + a @ b`` (``bias`` may be ``None``) whose products go through :func:`matmul`.

    A bias of one row is one product ``[a | 1] @ [b ; bias]``: the output written once (``torch.addmm`` first
    fills it with the bias), and the backward takes the bias's gradient, the sum of the output gradient's rows,
    from the product that makes ``b``'s: one pass over the ``(B T, n)`` gradient, not a product and a sum (the
    sum ~0.4 ms of ``Recurrence``'s WideFirst ~10 ms backward, H=32 B=16 T=1000, one thread)."""

    @staticmethod
    def forward(ctx, bias: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.row = _row(bias)
        if bias is None:
            return matmul(a, b)
        if ctx.row:
            return matmul(_with_ones(a), torch.cat([b, bias.reshape(1, -1)]))
        return bias + matmul(a, b) if _thin(a, b) else torch.addmm(bias, a, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        need_bias, need_a, need_b = ctx.needs_input_grad
        # a thin a: both products in one pass of the compiled kernel (not under create_graph: not differentiable)
        want_rows = need_b or need_bias  # [a | 1]ᵀ grad: b's rows, then the bias's
        fused = (
            thin.affine_backward(grad, a, b, need_a, want_rows)
            if ctx.row and (need_a or want_rows) and not torch.is_grad_enabled()
            else None
        )
        if fused is not None:
            grad_a, both = fused
            grad_b = both[:-1] if need_b else None
            grad_bias = both[-1].reshape(ctx.bias_shape) if need_bias else None
            return grad_bias, grad_a, grad_b
        grad_a = matmul(grad, b.t()) if need_a else None
        grad_bias = grad_b = None
        if need_b and ctx.row:
            # (gradᵀ [a | 1])ᵀ's rows: b's gradient, the bias's last ([a | 1] made again, not kept: a double
            # backward reaches a through it)
            both = matmul(grad.t(), _with_ones(a))
            grad_b = both[:, :-1].t()
            grad_bias = both[:, -1].reshape(ctx.bias_shape) if need_bias else None
            return grad_bias, grad_a, grad_b
        if need_bias:
            grad_bias = grad.sum_to_size(ctx.bias_shape)
        # (gradᵀ a)ᵀ: b's gradient with b's columns as rows, as torch computes it for a transposed weight,
        # unless that output is the thin one
        grad_b = matmul(grad.t(), a).t() if need_b else None
        return grad_bias, grad_a, grad_b


def _row(bias: Tensor | None) -> bool:
    """Whether ``bias`` is one row of the output (``(n,)`` or ``(1, n)``)."""
    return bias is not None and (bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == 1))


def _with_ones(a: Tensor) -> Tensor:
    """``[a | 1]``: the 2-D ``a`` and a column of ones."""
    return torch.cat([a, a.new_ones(a.shape[0], 1)], 1)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``torch.mm`` with the products of its backward in the faster orientation (:func:`matmul`)."""
    return _AddMM.apply(None, a, b)


def addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta: float = 1, alpha: float = 1) -> Tensor:
    """``torch.addmm`` (``beta * bias + alpha * a @ b``) through :func:`mm`'s products."""
    if beta != 1 or alpha != 1:
        return beta * bias + alpha * mm(a, b)
    return _AddMM.apply(bias, a, b)
