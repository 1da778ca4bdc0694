"""Analytic step Jacobians of recurrent cells recomputed from torch's fused forward (BPPSA Appendix E).

The torch fallback of :mod:`lightning_bppsa.cells` (where the compiled cell kernels cannot run). Every
function takes what the fused torch forward produced (hidden states for all steps) plus the
cell's weights, recomputes the gates of all ``n`` steps with one GEMM each, and returns

- the chain of step Jacobians ``J_t = ∂x_t/∂x_{t-1}`` in the form :func:`~lightning_bppsa.scan.backprop_scan`
  consumes, and
- ``local``: the per-step factors that turn a state gradient ``g_t`` into the gradient of the gate
  pre-activations (Eq. 2: parameter gradients are GEMMs over all steps with these).

Shapes: ``x`` ``(B, n, I)`` inputs, ``h_prev`` ``(B, n, H)`` the states ``h_0..h_{n-1}``, ``out``
``(B, n, H)`` the states ``h_1..h_n``; weights as torch stores them (``W_ih`` ``(G H, I)``,
``W_hh`` ``(G H, H)`` with ``G`` gates).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["gate_preactivations", "gru_jacobians"]


def gate_preactivations(x: Tensor, h_prev: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None):
    """Input and hidden gate pre-activations of all steps: ``x W_ihᵀ + b_ih`` and ``h_prev W_hhᵀ + b_hh``."""
    gi = x @ w_ih.T if b_ih is None else torch.addmm(b_ih, x.flatten(0, 1), w_ih.T).view(*x.shape[:2], -1)
    gh = (
        h_prev @ w_hh.T
        if b_hh is None
        else torch.addmm(b_hh, h_prev.flatten(0, 1), w_hh.T).view(*x.shape[:2], -1)
    )
    return gi, gh


def gru_jacobians(
    x: Tensor,
    h_prev: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> tuple[FactoredJacobians, Tensor]:
    """GRU step Jacobian, Appendix E Eq. 11, with torch's gate order ``[r, z, n]``::

        r = σ(gi_r + gh_r),  z = σ(gi_z + gh_z),  n = tanh(gi_n + r ⊙ gh_n),  h_t = (1 - z) ⊙ n + z ⊙ h_{t-1}
        J_t = diag(z) + [diag(s_r) diag(s_z) diag(s_n)] W_hh
        s_r = (1-z)(1-n²) gh_n r(1-r),   s_z = (h_{t-1} - n) z(1-z),   s_n = (1-z)(1-n²) r

    Returns the chain (``scales`` ``(B, n, 3H)``, ``diagonal = z``) and ``local`` ``(B, n, 3H)``: the
    gradient of ``gi`` is ``tile(g_t, 3) ⊙ local`` (the gradient of ``gh`` is ``tile(g_t, 3) ⊙ scales``;
    they differ only in the n block, where ``gh_n`` is scaled by ``r``).
    """
    hidden = w_hh.shape[1]
    gi, gh = gate_preactivations(x, h_prev, w_ih, w_hh, b_ih, b_hh)
    rz = torch.sigmoid(gi[..., : 2 * hidden] + gh[..., : 2 * hidden])
    r, z = rz[..., :hidden], rz[..., hidden:]
    # n is recovered from h_t = (1 - z) n + z h_{t-1} only when z < 1; recompute it instead (exact).
    gh_n = gh[..., 2 * hidden :]
    n = torch.tanh(gi[..., 2 * hidden :] + r * gh_n)
    dn = (1 - z) * (1 - n * n)
    local = torch.cat([dn * gh_n * r * (1 - r), (h_prev - n) * z * (1 - z), dn], -1)
    scales = local.clone()
    scales[..., 2 * hidden :] *= r
    return FactoredJacobians(w_hh, scales, z), local
