"""Chains of step Jacobians as the scans see them, and the CPU denormal guard they run under.

A chain holds the row-form step Jacobians ``J_t`` (``g_t = g_{t+1} J_t``) along a leading, time-major
step axis and applies them from the right to row blocks. Gradients inside the algorithms are
time-major too, ``(n + 1, B, d)``, so that one step is one contiguous ``(B, d)`` slice. Shared by the
dense/factored scan (:mod:`lightning_bppsa.scan`), the kernels' dispatch (:mod:`lightning_bppsa.ops`),
the distributed scan and the sparse scan (:func:`flush_denormals`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import torch
from torch import Tensor

from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["Chain", "DenseChain", "FactoredChain", "flush_denormals", "time_major_chain"]


class DenseChain:
    """Step Jacobians stored densely: ``jac[t]`` is the ``(B, d, d)`` row-form ``J`` of step ``t``."""

    def __init__(self, jac: Tensor) -> None:
        self.jac = jac
        self.steps, self.d = jac.shape[0], jac.shape[-1]

    def head(self, steps: int) -> DenseChain:
        """The first ``steps`` steps."""
        return DenseChain(self.jac[:steps])

    def dense(self, index: slice) -> Tensor:
        """``J`` of the steps ``index``, ``(steps, B, d, d)`` (a view: never write to it)."""
        return self.jac[index]

    def apply(self, index: int | slice, x: Tensor) -> Tensor:
        """``x @ J`` for the steps ``index`` and row blocks ``x`` of shape ``(*steps, B, r, d)``."""
        return x @ self.jac[index]

    def transposed_batch_major(self) -> Tensor:
        """The ``(B, n, d, d)`` transposed Jacobians ``Jᵀ`` (a view; the layout of ``backprop_scan``)."""
        return self.jac.mT.transpose(0, 1)

    def step_into(self, t: int, x: Tensor, out: Tensor, add: Tensor | None) -> None:
        """``out = x @ J_t (+ add)`` for one step, ``x`` ``(B, d)``: the linear scan's inner loop."""
        if add is None:
            torch.bmm(x.unsqueeze(1), self.jac[t], out=out.unsqueeze(1))
        else:
            torch.baddbmm(add.unsqueeze(1), x.unsqueeze(1), self.jac[t], out=out.unsqueeze(1))


class FactoredChain:
    """Step Jacobians ``J = diag(u) + [diag(s^1)..diag(s^k)] W`` with ``W`` shared by every step;
    ``scales`` ``(n, B, k d)`` and ``diagonal`` ``(n, B, d)`` or ``None``."""

    def __init__(self, weight: Tensor, scales: Tensor, diagonal: Tensor | None) -> None:
        self.weight, self.scales, self.diagonal = weight, scales, diagonal
        self.steps, self.d = scales.shape[0], weight.shape[1]
        self.tiles = weight.shape[0] // self.d
        self._per_step: tuple | None = None

    def head(self, steps: int) -> FactoredChain:
        """The first ``steps`` steps."""
        diagonal = None if self.diagonal is None else self.diagonal[:steps]
        return FactoredChain(self.weight, self.scales[:steps], diagonal)

    def dense(self, index: slice) -> Tensor:
        """``J`` of the steps ``index``, ``(steps, B, d, d)``: ``I @ J``."""
        return self.apply(index, _identity(self.d, self.weight, *self.scales[index].shape[:2]))

    def apply(self, index: int | slice, x: Tensor) -> Tensor:
        """``x @ J`` for the steps ``index`` and row blocks ``x`` of shape ``(*steps, B, r, d)``:
        one GEMM with the shared ``W``."""
        scales = self.scales[index].unsqueeze(-2)
        if self.tiles != 1:  # (.., r, k, d) * (.., 1, k, d): every tile of the row scaled by its own s^k (k = 0 too)
            scaled = (x.unsqueeze(-2) * scales.unflatten(-1, (self.tiles, self.d))).flatten(-2)
        else:
            scaled = x * scales
        out = scaled @ self.weight
        if self.diagonal is not None:
            out.addcmul_(x, self.diagonal[index].unsqueeze(-2))
        return out

    def step_into(self, t: int, x: Tensor, out: Tensor, add: Tensor | None) -> None:
        """``out = x @ J_t (+ add)`` for one step, ``x`` ``(B, d)``: two torch ops, no allocation.

        A diagonal term joins the GEMM as one more tile: ``x J = [x u, x s^1, ..] @ [I; W]``.
        """
        if self._per_step is None:  # made once: Python indexing and a third op would cost ~1 µs each
            self._per_step = self._step_factors(x)
        scales, weight, tmp, rows = self._per_step
        if rows is None:  # one tile: no broadcast (a broadcasting mul costs ~1 µs more)
            torch.mul(x, scales[t], out=tmp)
        else:
            torch.mul(x.unsqueeze(1), scales[t], out=tmp)
        if add is None:
            torch.mm(rows if rows is not None else tmp, weight, out=out)
        else:
            torch.addmm(add, rows if rows is not None else tmp, weight, out=out)

    def augmented(self) -> tuple[Tensor, Tensor]:
        """``(scales, weight)`` with a diagonal term folded in as one more tile: ``[u, s] @ [I; W]``."""
        if self.diagonal is None:
            return self.scales, self.weight
        eye = torch.eye(self.d, dtype=self.weight.dtype, device=self.weight.device)
        return torch.cat([self.diagonal, self.scales], -1), torch.cat([eye, self.weight])

    def _step_factors(self, like: Tensor) -> tuple:
        """Per-step scales, the (augmented) weight, a scratch block and its ``(B, k d)`` view or ``None``."""
        steps, batch = self.scales.shape[:2]
        scales, weight = self.augmented()
        if scales.shape[-1] == self.d:
            return scales.contiguous().unbind(0), weight, like.new_empty(batch, self.d), None
        tiled = scales.reshape(steps, batch, -1, self.d)
        tmp = like.new_empty(tiled.shape[1:])
        return tiled.unbind(0), weight, tmp, tmp.view(batch, -1)


Chain = Union[DenseChain, FactoredChain]


def _identity(d: int, like: Tensor, *shape: int) -> Tensor:
    """``I_d`` broadcast to ``(*shape, d, d)`` in ``like``'s dtype and device (a view)."""
    return torch.eye(d, dtype=like.dtype, device=like.device).expand(*shape, d, d)


def time_major_chain(jac: Tensor | FactoredJacobians, dtype: torch.dtype) -> Chain:
    """``jac`` (``(B, n, d, d)`` transposed Jacobians or factored) as a chain of time-major views in ``dtype``."""
    if isinstance(jac, FactoredJacobians):
        # the linear steps copy these views once into the layout they need
        jac = jac.to(dtype)
        diagonal = None if jac.diagonal is None else jac.diagonal.transpose(0, 1)
        return FactoredChain(jac.weight, jac.scales.transpose(0, 1), diagonal)
    return DenseChain(jac.to(dtype).transpose(0, 1).mT)


@contextmanager
def flush_denormals() -> Iterator[None]:
    """Long products of contracting Jacobians underflow into denormals, ~10-100x slower on x86."""
    probe = torch.tensor(1e-39, dtype=torch.float32)
    was_on = bool((probe * 1.0).item() == 0.0)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was_on)
