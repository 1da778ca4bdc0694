"""Transposed Jacobians of ``nn.Linear`` and ``nn.Flatten`` (dense blocks and the identity).

``nn.Linear`` on a sample of shape ``(*s, in)`` applies ``y = W x + b`` to each of the ``m = prod(s)``
rows, so ``Jᵀ = I_m ⊗ Wᵀ`` (``m·in x m·out``; ``Jᵀ[i·in + a, i·out + b] = W[b, a]``), shared by the batch.
``nn.Flatten`` only reshapes: ``Jᵀ = I`` (``d x d``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import register_linearizer

__all__: list[str] = []


@functools.lru_cache(maxsize=32)
def _kron_pattern(rows: int, in_features: int, out_features: int) -> tuple[CSRPattern, Tensor]:
    """Pattern of ``I_rows ⊗ Wᵀ`` and the flat index into ``W`` of every entry."""
    i = torch.arange(rows)[:, None, None]
    a = torch.arange(in_features)[None, :, None]
    b = torch.arange(out_features)[None, None, :]
    shape = (rows, in_features, out_features)
    in_idx, out_idx = (i * in_features + a).expand(shape), (i * out_features + b).expand(shape)
    w_idx = (b * in_features + a).expand(shape).reshape(-1)
    pattern, order = CSRPattern.from_coo(
        in_idx.reshape(-1), out_idx.reshape(-1), (rows * in_features, rows * out_features)
    )
    return pattern, w_idx[order]


def _batched_linear_dims(module: nn.Linear, ndim: int) -> int | None:
    return ndim if ndim >= 2 else None  # a 1-D input is one unbatched sample to torch


def _flatten_dims(module: nn.Flatten, ndim: int) -> int | None:
    start, end = module.start_dim % ndim, module.end_dim % ndim
    return ndim - max(end - start, 0) if start > 0 else None  # start 0 would merge the batch


@register_linearizer(nn.Linear, dims=_batched_linear_dims)
def linearize_linear(module: nn.Linear, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = module(x)
    rows = x[0].numel() // module.in_features
    pattern, w_idx = _kron_pattern(rows, module.in_features, module.out_features)
    values = module.weight.detach().reshape(-1)[w_idx.to(x.device)].to(y.dtype)  # as autocast used it
    return y, BatchedCSR(pattern.to(x.device), values.unsqueeze(0))


@register_linearizer(nn.Flatten, dims=_flatten_dims)
def linearize_flatten(module: nn.Flatten, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = module(x)
    size = x[0].numel()
    ones = torch.ones(1, size, dtype=x.dtype, device=x.device)
    return y, BatchedCSR(CSRPattern.identity(size).to(x.device), ones)
