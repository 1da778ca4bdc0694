"""Diagonal transposed Jacobians of element-wise modules (BPPSA Appendix D.2, Alg. 5; Table 1 row 2).

For ``y = f(x)`` element-wise, ``Jᵀ = diag(f′(x))`` (``d x d``, ``d = x.numel()``, density ``1/d``):

- ``ReLU``: ``f′ = [not y <= 0]``, as torch's ``threshold_backward`` selects: a NaN output passes the
  gradient, and the scan's stored zeros give exactly 0 even against a NaN gradient (a select);  ``LeakyReLU``: ``f′ = 1 if x > 0 else negative_slope`` (torch's at 0)
- ``Tanh``: ``f′ = 1 − y²``;  ``Sigmoid``: ``f′ = y (1 − y)``
- ``Dropout`` (training, ``0 < p``): ``f′ = m / (1 − p)`` with the Bernoulli(1 − p) mask ``m`` of *this*
  forward: the linearizer draws ``m`` itself (as torch's CPU kernel does: ``empty_like(x).bernoulli_``) and
  computes ``y = x · m / (1 − p)`` from it, so ``y`` and ``Jᵀ`` always agree; eval mode is the identity.
- ``BatchNorm2d`` in eval mode: ``f′ = γ_c / sqrt(running_var_c + ε)`` per channel, shared by the batch.

Only the diagonal pattern (cached per size) is input independent; the values are filled per sample.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import exact_dims, register_linearizer

__all__: list[str] = []


def _diag(values: Tensor) -> BatchedCSR:
    """``(V, *shape)`` derivatives -> ``V`` diagonal matrices."""
    flat = values.reshape(values.shape[0], -1)
    return BatchedCSR(CSRPattern.identity(flat.shape[1]).to(flat.device), flat)


@register_linearizer(nn.ReLU)
def linearize_relu(module: nn.ReLU, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = torch.relu(x)
    return y, _diag((~(y <= 0)).to(x.dtype))


@register_linearizer(nn.LeakyReLU)
def linearize_leaky_relu(module: nn.LeakyReLU, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    slope = module.negative_slope
    y = torch.nn.functional.leaky_relu(x, slope)
    return y, _diag(torch.where(x > 0, x.new_tensor(1.0), x.new_tensor(slope)))


@register_linearizer(nn.Tanh)
def linearize_tanh(module: nn.Tanh, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = torch.tanh(x)
    return y, _diag(1 - y * y)


@register_linearizer(nn.Sigmoid)
def linearize_sigmoid(module: nn.Sigmoid, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = torch.sigmoid(x)
    return y, _diag(y * (1 - y))


@register_linearizer(nn.Dropout)
def linearize_dropout(module: nn.Dropout, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    p = module.p
    if not module.training or p == 0:
        return x.clone(), _diag(torch.ones_like(x[:1]))
    if p == 1:
        return torch.zeros_like(x), _diag(torch.zeros_like(x))
    scale = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    return x * scale, _diag(scale)


def _refuse_batchnorm2d(module: nn.BatchNorm2d) -> str | None:
    if module.training or module.running_var is None:
        return (
            "BatchNorm2d in training mode or without running statistics (track_running_stats=False): "
            "normalising with the batch's statistics couples the samples of the batch"
        )
    return None


@register_linearizer(nn.BatchNorm2d, refuse=_refuse_batchnorm2d, dims=exact_dims(4))
def linearize_batchnorm2d(module: nn.BatchNorm2d, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = module(x)
    scale = torch.rsqrt(module.running_var.detach() + module.eps)
    if module.weight is not None:
        scale = scale * module.weight.detach()
    per_pixel = scale.to(y.dtype)[:, None, None].expand(x.shape[1:]).unsqueeze(0)
    return y, _diag(per_pixel)
