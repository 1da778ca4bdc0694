"""Batched CSR transposed Jacobians with an input-independent, shared sparsity pattern (BPPSA Sec. 3.3).

The positions of *guaranteed* zeros of an operator's Jacobian depend only on the architecture (layer
configuration and input shape), not on the input: a convolution's pattern follows its receptive fields,
ReLU's is the diagonal, max-pooling's is its windows. So the pattern (``crow``/``col``) is built once
per layer and shape (:class:`CSRPattern`, cached by the generators) and only the values are filled per
step: possibly-zero entries (a ReLU mask, the non-argmax entries of a pooling window) stay in the
pattern as explicit zeros.

A :class:`BatchedCSR` holds one pattern and values ``(V, nnz)`` with ``V = B`` (one matrix per sample)
or ``V = 1`` (one matrix shared by every sample, e.g. a convolution, whose Jacobian depends only on
its weight).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BatchedCSR", "CSRPattern"]

_keys = itertools.count()


class CSRPattern:
    """The sparsity pattern of a ``(rows, cols)`` CSR matrix.

    Attributes:
        crow: ``(rows + 1,)`` int64 row pointers.
        col: ``(nnz,)`` int64 column of every entry, sorted within each row.
        row: ``(nnz,)`` int64 row of every entry (the COO form, used to reduce per row), built lazily.
        shape: ``(rows, cols)``.
        key: an integer unique to this object; the scan caches its symbolic products by it.
    """

    __slots__ = ("_row", "col", "crow", "key", "shape")

    def __init__(self, crow: Tensor, col: Tensor, shape: tuple[int, int]) -> None:
        self.crow, self.col, self.shape = crow, col, (int(shape[0]), int(shape[1]))
        self._row: Tensor | None = None
        self.key = next(_keys)

    @property
    def row(self) -> Tensor:
        """``(nnz,)`` row of every entry, built on first use (large patterns often never need it)."""
        if self._row is None:
            counts = self.crow[1:] - self.crow[:-1]
            self._row = torch.repeat_interleave(torch.arange(self.shape[0], device=self.crow.device), counts)
        return self._row

    @property
    def nnz(self) -> int:
        return int(self.col.numel())

    @property
    def density(self) -> float:
        """Fraction of entries that are not guaranteed zeros (``1 - sparsity`` in Table 1)."""
        rows, cols = self.shape
        return self.nnz / (rows * cols) if rows * cols else 0.0

    @classmethod
    def from_coo(cls, row: Tensor, col: Tensor, shape: tuple[int, int]) -> tuple[CSRPattern, Tensor]:
        """Pattern of the (unique) entries ``(row[k], col[k])``, and the order that sorts them into CSR.

        Returns:
            ``(pattern, order)``: entry ``k`` of the pattern is input entry ``order[k]``, so a
            generator permutes its value sources with ``order`` once, when it builds the pattern.
        """
        order = torch.argsort(row * shape[1] + col)
        counts = torch.bincount(row, minlength=shape[0])
        crow = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        return cls(crow, col[order], shape), order

    @classmethod
    @functools.lru_cache(maxsize=64)
    def identity(cls, size: int) -> CSRPattern:
        """The diagonal of a ``(size, size)`` matrix (cached per size)."""
        return cls(torch.arange(size + 1), torch.arange(size), (size, size))

    def to(self, device: torch.device) -> CSRPattern:
        """This pattern on ``device`` (patterns are built on CPU; the copy is cached per pattern)."""
        return self if self.crow.device == device else _device_copy(self, device)

    def select(self, keep: Tensor) -> CSRPattern:
        """The sub-pattern of the entries where the ``(nnz,)`` bool ``keep`` is true."""
        counts = torch.bincount(self.row[keep], minlength=self.shape[0])
        return CSRPattern(torch.cat([counts.new_zeros(1), counts.cumsum(0)]), self.col[keep], self.shape)


@functools.lru_cache(maxsize=64)
def _device_copy(pattern: CSRPattern, device: torch.device) -> CSRPattern:
    return CSRPattern(pattern.crow.to(device), pattern.col.to(device), pattern.shape)


@dataclass(frozen=True)
class BatchedCSR:
    """``V`` sparse matrices of shape ``pattern.shape`` sharing one pattern.

    Attributes:
        pattern: the shared :class:`CSRPattern`.
        values: ``(V, nnz)``; ``V = B`` for per-sample matrices, ``V = 1`` for one matrix shared
            by every sample of the batch.
    """

    pattern: CSRPattern
    values: Tensor

    def __post_init__(self) -> None:
        if self.values.dim() != 2 or self.values.shape[1] != self.pattern.nnz:
            raise ValueError(
                f"values must have shape (V, nnz={self.pattern.nnz}); got {tuple(self.values.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.pattern.shape

    @property
    def shared(self) -> bool:
        """True when one matrix serves every sample."""
        return self.values.shape[0] == 1

    def to_sparse_csr(self, sample: int = 0) -> Tensor:
        """Matrix ``sample`` (0 for a shared one) as a 2-D ``torch.sparse_csr_tensor``."""
        values = self.values[0 if self.shared else sample]
        p = self.pattern
        return torch.sparse_csr_tensor(p.crow, p.col, values, p.shape, check_invariants=False)

    def to_dense(self) -> Tensor:
        """``(V, rows, cols)`` dense matrices (for tests and small examples)."""
        p = self.pattern
        dense = self.values.new_zeros(self.values.shape[0], p.shape[0] * p.shape[1])
        dense[:, p.row * p.shape[1] + p.col] = self.values
        return dense.reshape(-1, *p.shape)

    @classmethod
    def from_sparse_csr(cls, matrix: Tensor) -> BatchedCSR:
        """From a 2-D CSR tensor (``V = 1``) or a 3-D batched one whose batches share one pattern."""
        if matrix.layout != torch.sparse_csr or matrix.dim() not in (2, 3):
            raise TypeError(
                "a transposed Jacobian must be a 2-D or 3-D torch.sparse_csr_tensor or a BatchedCSR; "
                f"got layout {matrix.layout} with {matrix.dim()} dims"
            )
        crow, col, values = matrix.crow_indices(), matrix.col_indices(), matrix.values()
        if matrix.dim() == 3:
            if not (torch.equal(crow, crow[:1].expand_as(crow)) and torch.equal(col, col[:1].expand_as(col))):
                raise ValueError("a batched CSR Jacobian must have the same pattern in every batch")
            crow, col = crow[0], col[0]
        pattern = CSRPattern(crow.long(), col.long(), tuple(matrix.shape[-2:]))
        return cls(pattern, values.reshape(-1, pattern.nnz))
