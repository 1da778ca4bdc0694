"""Sliding-window geometry shared by convolution and pooling (BPPSA Appendix D, Alg. 2-7 index maths)."""

from __future__ import annotations

import torch
from torch import Tensor


def pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    """``k`` or ``(k,)`` or ``(kh, kw)`` -> ``(kh, kw)``."""
    if isinstance(value, int):
        return value, value
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


def window_positions(
    in_hw: tuple[int, int],
    out_hw: tuple[int, int],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[Tensor, Tensor]:
    """Input pixel under every (output pixel, kernel offset) pair.

    Output pixel ``(p, q)`` with kernel offset ``(r, s)`` reads input pixel
    ``(p·sh − ph + r·dh, q·sw − pw + s·dw)`` (``ph``, ``pw``: padding before the first row/column).

    Returns:
        ``(pos, valid)``, both ``(ho·wo, kh·kw)``: the flat input pixel ``ih·wi + iw`` and whether it lies
        inside the (unpadded) input; entries over padding are guaranteed zeros.
    """
    (hi, wi), (ho, wo), (kh, kw) = in_hw, out_hw, kernel
    ih = torch.arange(ho)[:, None] * stride[0] - padding[0] + torch.arange(kh)[None, :] * dilation[0]
    iw = torch.arange(wo)[:, None] * stride[1] - padding[1] + torch.arange(kw)[None, :] * dilation[1]
    ih, iw = ih[:, None, :, None], iw[None, :, None, :]  # (ho, 1, kh, 1), (1, wo, 1, kw)
    valid = (ih >= 0) & (ih < hi) & (iw >= 0) & (iw < wi)
    pos = ih * wi + iw
    return pos.reshape(ho * wo, kh * kw), valid.reshape(ho * wo, kh * kw)
