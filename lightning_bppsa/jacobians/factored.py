"""Factored transposed Jacobians of recurrent cells: ``J_t = diag(u_t) + [diag(s_t^1) ... diag(s_t^k)] W``.

A recurrent step ``h_t = f(W h_{t-1} + ...)`` has ``J_t = ∂h_t/∂h_{t-1}`` made of a few diagonal
scalings of one weight matrix that every step shares:

- Elman RNN (Sec. 4.1):  ``J_t = diag(f'(a_t)) W_hh``                       (k = 1, no ``u``)
- GRU (Appendix E, Eq. 11): ``J_t = diag(z_t) + [diag(.) diag(.) diag(.)] W_hh`` (k = 3, ``W_hh`` is 3H x H)

Keeping the factors (``W`` once, ``s_t`` and ``u_t`` per step) instead of ``(B, n, d, d)`` matrices saves
memory and turns each scan step into one large GEMM with the shared ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FactoredJacobians"]


@dataclass(frozen=True)
class FactoredJacobians:
    """A chain of ``n`` step Jacobians in factored form, batched over ``B``.

    Step ``i = 1..n`` has the Jacobian ``J_i = ∂x_i/∂x_{i-1}`` (``d x d``)::

        J_i = diag(diagonal[:, i-1]) + [diag(s^1) ... diag(s^k)] @ weight,   s = scales[:, i-1] split in k

    so that a row gradient ``g`` (``(d,)``) maps to ``g J_i = g * diagonal + (tile(g, k) * scales) @ weight``.
    Its transpose ``J_iᵀ`` is what ``backprop_scan`` calls ``jacobians_t[:, i-1]``.

    Args:
        weight: ``(m, d)`` shared matrix with ``m = k * d`` (``W_hh`` as torch stores it).
        scales: ``(B, n, m)`` per-step scalings of the rows of ``weight``.
        diagonal: ``(B, n, d)`` per-step diagonal term, or ``None`` for zero.

    Example:
        >>> W = torch.randn(4, 4); s = torch.rand(2, 5, 4)
        >>> FactoredJacobians(W, s).dense().shape  # (B, n, d, d), transposed Jacobians
        torch.Size([2, 5, 4, 4])
    """

    weight: Tensor
    scales: Tensor
    diagonal: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.scales.shape[0]

    @property
    def length(self) -> int:
        return self.scales.shape[1]

    @property
    def state_size(self) -> int:
        return self.weight.shape[1]

    @property
    def width(self) -> int:
        """The rows of ``weight`` (``k d``): the scan's products' inner size."""
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.scales.device

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def to(self, dtype: torch.dtype) -> FactoredJacobians:
        """The same chain with every factor in ``dtype`` (``self`` when nothing changes)."""
        parts = [self.weight, self.scales] + ([self.diagonal] if self.diagonal is not None else [])
        if all(t.dtype == dtype for t in parts):
            return self
        diagonal = None if self.diagonal is None else self.diagonal.to(dtype)
        return FactoredJacobians(self.weight.to(dtype), self.scales.to(dtype), diagonal)

    def dense(self) -> Tensor:
        """Materialise the ``(B, n, d, d)`` transposed Jacobians (for tests and small problems)."""
        d = self.state_size
        k = self.weight.shape[0] // d
        # J = diag(u) + S W with S = [diag(s^1) ... diag(s^k)]; build S W row by row.
        s = self.scales.unflatten(-1, (k, d))  # (B, n, k, d)
        w = self.weight.unflatten(0, (k, d))  # (k, d, d)
        jac = torch.einsum("bnkr,krc->bnrc", s, w)
        if self.diagonal is not None:
            jac = jac + torch.diag_embed(self.diagonal)
        return jac.mT
