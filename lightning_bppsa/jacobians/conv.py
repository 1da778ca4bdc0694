"""Transposed Jacobian of ``nn.Conv2d`` in CSR (BPPSA Appendix D.1, Alg. 2-4; Table 1 row 1).

For ``y[o, p, q] = b[o] + Σ_{c', r, s} W[o, c', r, s] · x[g·cig + c', p·sh − ph + r·dh, q·sw − pw + s·dw]``
(group ``g = o // (co / groups)``, ``cig = ci / groups``) the transposed Jacobian ``Jᵀ`` (``ci·hi·wi`` x
``co·ho·wo``) has ``Jᵀ[x-index, y-index] = W[o, c', r, s]`` wherever the input pixel is inside the image:
it depends on the weight only, so one matrix serves the whole batch (``V = 1``). Its density is about
``hf·wf / (hi·wi)`` (Table 1, exact up to padding; ×``1/groups``). Weights that are exactly zero (pruned)
are left out of the pattern, which is rebuilt only when the set of zero weights changes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from lightning_bppsa.jacobians._window import WindowGeometry, pair, window_positions
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import exact_dims, register_linearizer

__all__: list[str] = []


def _same_padding(kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int]:
    # torch pads d·(k − 1) in total, the smaller half before (the odd extra goes after)
    return tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation, strict=True))


@functools.lru_cache(maxsize=32)
def _full_pattern(channels: tuple[int, int, int], window: WindowGeometry) -> tuple[CSRPattern, Tensor]:
    """Pattern of every weight (none pruned) and, per entry, the flat index of its weight."""
    ci, co, groups = channels
    cig, cog = ci // groups, co // groups
    pos, valid = window_positions(window)  # (P, K)
    n_pix, n_k, n_in = pos.shape[0], pos.shape[1], window.in_hw[0] * window.in_hw[1]
    o = torch.arange(co)[:, None, None, None]  # (co, P, cig, K) broadcast below
    c = (o // cog) * cig + torch.arange(cig)[None, None, :, None]
    in_idx = c * n_in + pos[None, :, None, :]
    out_idx = o * n_pix + torch.arange(n_pix)[None, :, None, None]
    w_idx = (o * cig + torch.arange(cig)[None, None, :, None]) * n_k + torch.arange(n_k)
    mask = valid[None, :, None, :].expand(co, n_pix, cig, n_k)
    in_idx, out_idx, w_idx = (t.expand(co, n_pix, cig, n_k)[mask] for t in (in_idx, out_idx, w_idx))
    pattern, order = CSRPattern.from_coo(in_idx, out_idx, (ci * n_in, co * n_pix))
    return pattern, w_idx[order]


class _PrunedPatterns:
    """Patterns without pruned weights, per geometry and zero set (layers may share a geometry)."""

    def __init__(self, per_geometry: int = 8) -> None:
        self.per_geometry = per_geometry
        self._cache: dict[tuple, list[tuple[Tensor, CSRPattern, Tensor]]] = {}

    def get(self, geometry: tuple, weight: Tensor) -> tuple[CSRPattern, Tensor]:
        pattern, w_idx = _full_pattern(*geometry)
        nonzero = weight.detach().reshape(-1).cpu() != 0
        if bool(nonzero.all()):
            return pattern, w_idx
        entries = self._cache.setdefault(geometry, [])
        for mask, pruned, pruned_idx in entries:
            if torch.equal(mask, nonzero):
                return pruned, pruned_idx
        keep = nonzero[w_idx]
        entry = (nonzero, pattern.select(keep), w_idx[keep])
        entries.insert(0, entry)
        del entries[self.per_geometry :]
        return entry[1], entry[2]


_PRUNED = _PrunedPatterns()


def _refuse_conv2d(module: nn.Conv2d) -> str | None:
    if module.padding_mode != "zeros":
        return f"Conv2d with padding_mode={module.padding_mode!r}: only 'zeros' padding has a Jacobian here"
    return None


@register_linearizer(nn.Conv2d, refuse=_refuse_conv2d, dims=exact_dims(4))
def linearize_conv2d(module: nn.Conv2d, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    """``(y, Jᵀ)`` for a batch ``x`` of shape ``(B, ci, hi, wi)``; ``Jᵀ`` is shared by the batch.

    Under autocast the values are the weights as the forward used them (cast to ``y``'s dtype)."""
    y = module(x)
    padding = module.padding
    if padding == "same":
        padding = _same_padding(pair(module.kernel_size), pair(module.dilation))
    elif padding == "valid":
        padding = 0
    window = WindowGeometry.of(x, y, module.kernel_size, module.stride, padding, module.dilation)
    geometry = ((module.in_channels, module.out_channels, module.groups), window)
    pattern, w_idx = _PRUNED.get(geometry, module.weight)
    pattern = pattern.to(x.device)
    values = module.weight.detach().reshape(-1)[w_idx.to(x.device)].to(y.dtype)
    return y, BatchedCSR(pattern, values.unsqueeze(0))
