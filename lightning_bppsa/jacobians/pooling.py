"""Transposed Jacobians of ``nn.MaxPool2d`` and ``nn.AvgPool2d`` (BPPSA App. D.3, Alg. 6-7; Table 1).

Both have the same input-independent pattern: output ``(c, p, q)`` reads the window of input pixels
``(c, p·sh − ph + r·dh, q·sw − pw + s·dw)`` inside the image, so ``Jᵀ`` (``c·hi·wi x c·ho·wo``) has
``hf·wf`` entries per column (density ``hf·wf / (c·hi·wi)``, Table 1, exact up to padding).

- Max-pooling: the entry of the window's argmax (the pooling index of this forward) is 1, the other
  window entries are explicit zeros; values per sample.
- Average pooling: every window entry is ``1 / divisor`` with torch's divisor (``count_include_pad``,
  ``ceil_mode``, ``divisor_override``); shared by the batch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bppsa.jacobians._window import WindowGeometry, window_positions
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import exact_dims, register_linearizer

__all__: list[str] = []


@functools.lru_cache(maxsize=32)
def _window_pattern(channels: int, window: WindowGeometry) -> tuple[CSRPattern, Tensor, Tensor]:
    """Pattern of per-channel windows and, per entry, its output pixel ``p·wo + q`` and input pixel."""
    pos, valid = window_positions(window)  # (P, K)
    n_pix, n_k, n_in = pos.shape[0], pos.shape[1], window.in_hw[0] * window.in_hw[1]
    c = torch.arange(channels)[:, None, None]
    pix = torch.arange(n_pix)[None, :, None].expand(channels, n_pix, n_k)
    mask = valid.expand(channels, n_pix, n_k)
    pos = pos.expand(channels, n_pix, n_k)
    in_idx = (c * n_in + pos)[mask]
    out_idx = (c * n_pix + pix)[mask]
    pattern, order = CSRPattern.from_coo(in_idx, out_idx, (channels * n_in, channels * n_pix))
    return pattern, pix[mask][order], pos[mask][order]


def _refuse_maxpool2d(module: nn.MaxPool2d) -> str | None:
    if module.return_indices:
        return "MaxPool2d(return_indices=True): the scan returns the pooled values only, not the indices"
    return None


@register_linearizer(nn.MaxPool2d, refuse=_refuse_maxpool2d, dims=exact_dims(4))
def linearize_maxpool2d(module: nn.MaxPool2d, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y, indices = F.max_pool2d(
        x,
        module.kernel_size,
        module.stride,
        module.padding,
        module.dilation,
        module.ceil_mode,
        return_indices=True,
    )
    window = WindowGeometry.of(x, y, module.kernel_size, module.stride, module.padding, module.dilation)
    pattern, out_pix, in_pix = _window_pattern(x.shape[1], window)
    # the channel of an entry is the same for its row and column: argmax of column (c, p) at c·P + p
    out_idx = pattern.col.to(x.device)
    argmax = indices.reshape(x.shape[0], -1)[:, out_idx]
    values = (argmax == in_pix.to(x.device)).to(x.dtype)
    return y, BatchedCSR(pattern.to(x.device), values)


@register_linearizer(nn.AvgPool2d, dims=exact_dims(4))
def linearize_avgpool2d(module: nn.AvgPool2d, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    y = module(x)
    window = WindowGeometry.of(x, y, module.kernel_size, module.stride, module.padding)
    pattern, out_pix, _ = _window_pattern(x.shape[1], window)
    divisor = _avg_divisor(window, module.count_include_pad, module.divisor_override)
    values = (1.0 / divisor[out_pix]).to(device=x.device, dtype=x.dtype)
    return y, BatchedCSR(pattern.to(x.device), values.unsqueeze(0))


def _avg_divisor(window: WindowGeometry, count_include_pad: bool, divisor_override: int | None) -> Tensor:
    """``(ho·wo,)`` float64 divisors, as torch's avg_pool2d computes them."""
    if divisor_override:
        return torch.full(
            (window.out_hw[0] * window.out_hw[1],), float(divisor_override), dtype=torch.float64
        )
    extents = []
    sizes = (window.in_hw, window.out_hw, window.kernel, window.stride, window.padding)
    for size, out, k, s, p in zip(*sizes, strict=True):
        start = torch.arange(out) * s - p
        end = torch.clamp(start + k, max=size + p)
        padded = end - start  # the window clipped to the padded input
        inside = torch.clamp(end, max=size) - torch.clamp(start, min=0)
        extents.append(padded if count_include_pad else inside)
    return (extents[0][:, None] * extents[1][None, :]).reshape(-1).to(torch.float64)
