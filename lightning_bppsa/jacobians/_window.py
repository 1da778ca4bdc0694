"""Sliding-window geometry shared by convolution and pooling (BPPSA Appendix D, Alg. 2-7 index maths)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    """``k`` or ``(k,)`` or ``(kh, kw)`` -> ``(kh, kw)``."""
    if isinstance(value, int):
        return value, value
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])


class WindowGeometry(NamedTuple):
    """Where a 2-d sliding window reads: every field is an ``(h, w)`` pair.

    Hashable, so it keys the pattern caches of convolution and pooling (``functools.lru_cache``).
    """

    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)

    @classmethod
    def of(
        cls,
        x: Tensor,
        y: Tensor,
        kernel: int | tuple[int, ...],
        stride: int | tuple[int, ...] | None,
        padding: int | tuple[int, ...],
        dilation: int | tuple[int, ...] = 1,
    ) -> WindowGeometry:
        """From a layer's input ``x`` and output ``y`` (``(B, C, H, W)``) and its hyper-parameters as torch
        takes them (an int or a pair; ``stride=None`` means the kernel size, as in pooling)."""
        return cls(
            (x.shape[-2], x.shape[-1]),
            (y.shape[-2], y.shape[-1]),
            pair(kernel),
            pair(kernel if stride is None else stride),
            pair(padding),
            pair(dilation),
        )


def window_positions(geometry: WindowGeometry) -> tuple[Tensor, Tensor]:
    """Input pixel under every (output pixel, kernel offset) pair.

    Output pixel ``(p, q)`` with kernel offset ``(r, s)`` reads input pixel
    ``(p·sh − ph + r·dh, q·sw − pw + s·dw)`` (``ph``, ``pw``: padding before the first row/column).

    Returns:
        ``(pos, valid)``, both ``(ho·wo, kh·kw)``: the flat input pixel ``ih·wi + iw`` and whether it lies
        inside the (unpadded) input; entries over padding are guaranteed zeros.
    """
    (hi, wi), (ho, wo), (kh, kw), stride, padding, dilation = geometry
    ih = torch.arange(ho)[:, None] * stride[0] - padding[0] + torch.arange(kh)[None, :] * dilation[0]
    iw = torch.arange(wo)[:, None] * stride[1] - padding[1] + torch.arange(kw)[None, :] * dilation[1]
    ih, iw = ih[:, None, :, None], iw[None, :, None, :]  # (ho, 1, kh, 1), (1, wo, 1, kw)
    valid = (ih >= 0) & (ih < hi) & (iw >= 0) & (iw < wi)
    pos = ih * wi + iw
    return pos.reshape(ho * wo, kh * kw), valid.reshape(ho * wo, kh * kw)
