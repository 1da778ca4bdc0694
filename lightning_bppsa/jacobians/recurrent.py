"""Analytic step Jacobians of recurrent cells, batched over all steps (BPPSA Sec. 4.1, Appendix E).

Every function takes what the fused torch forward produced (hidden states for all steps) plus the
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

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["LSTMJacobians", "gru_jacobians", "lstm_jacobians", "rnn_jacobians"]


def _gates(x: Tensor, h_prev: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None):
    """Input and hidden gate pre-activations of all steps: ``x W_ihᵀ + b_ih`` and ``h_prev W_hhᵀ + b_hh``."""
    gi = x @ w_ih.T if b_ih is None else torch.addmm(b_ih, x.flatten(0, 1), w_ih.T).view(*x.shape[:2], -1)
    gh = (
        h_prev @ w_hh.T
        if b_hh is None
        else torch.addmm(b_hh, h_prev.flatten(0, 1), w_hh.T).view(*x.shape[:2], -1)
    )
    return gi, gh


def rnn_jacobians(out: Tensor, w_hh: Tensor, nonlinearity: str) -> FactoredJacobians:
    """Elman RNN ``h_t = f(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``: ``J_t = diag(f'_t) W_hh`` (k = 1).

    ``f'`` is read off the outputs: ``1 - h_t²`` for tanh, ``[h_t > 0]`` for relu. The scales ``f'_t``
    are also the local factors: ``∂l/∂a_t = g_t ⊙ f'_t``.
    """
    slope = 1 - out * out if nonlinearity == "tanh" else (out > 0).to(out.dtype)
    return FactoredJacobians(w_hh, slope)


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
    gi, gh = _gates(x, h_prev, w_ih, w_hh, b_ih, b_hh)
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


@dataclass(frozen=True)
class LSTMJacobians:
    """LSTM chain over the joint state ``x_t = [h_t; c_t]`` (``d = 2H``) and its local factors.

    Attributes:
        jacobians_t: ``(B, n, 2H, 2H)`` transposed step Jacobians (dense; see :func:`lstm_jacobians`).
        local_h: ``(B, n, 4H)``: the gate pre-activation gradient takes ``g^h_t ⊙ local_h`` ...
        local_c: ``(B, n, 4H)``: ... plus ``g^c_t ⊙ local_c`` (tiled over the 4 gates).
        forget: ``(B, n, H)`` forget gate ``f_t`` (``∂c_t/∂c_{t-1}``).
        c_prev: ``(B, n, H)`` cell states ``c_0..c_{n-1}``.
    """

    jacobians_t: Tensor
    local_h: Tensor
    local_c: Tensor
    forget: Tensor
    c_prev: Tensor


def lstm_jacobians(
    x: Tensor,
    h_prev: Tensor,
    c0: Tensor,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> LSTMJacobians:
    """LSTM step Jacobian over ``[h; c]`` with torch's gate order ``[i, f, g, o]``::

        c_t = f ⊙ c_{t-1} + i ⊙ g,   h_t = o ⊙ tanh(c_t)
        ∂c_t/∂h_{t-1} = [diag(g i') diag(c_{t-1} f') diag(i g') 0] W_hh =: S_c W_hh,   ∂c_t/∂c_{t-1} = diag(f)
        ∂h_t/∂h_{t-1} = diag(o tanh'(c_t)) S_c W_hh + diag(tanh(c_t) o') W_o
        ∂h_t/∂c_{t-1} = diag(o tanh'(c_t) f)

    (``σ' = σ(1-σ)``, ``tanh' = 1 - tanh²``). The cell states are not returned by torch's fused forward;
    they come from the gates with one element-wise pass per step.
    """
    hidden = w_hh.shape[1]
    batch, n, _ = x.shape
    gi, gh = _gates(x, h_prev, w_ih, w_hh, b_ih, b_hh)
    pre = gi + gh
    act = torch.cat([torch.sigmoid(pre[..., : 2 * hidden]), torch.tanh(pre[..., 2 * hidden : 3 * hidden]),
                     torch.sigmoid(pre[..., 3 * hidden :])], -1)  # fmt: skip
    i, f, g, o = act.split(hidden, -1)
    ig = i * g
    cells = x.new_empty(n + 1, batch, hidden)  # time-major: every step writes a contiguous block
    cells[0] = c0
    for t in range(n):  # c_t = f_t c_{t-1} + i_t g_t: element-wise, no GEMM
        torch.addcmul(ig[:, t], f[:, t], cells[t], out=cells[t + 1])
    cells = cells.transpose(0, 1)
    c_prev, c = cells[:, :n], cells[:, 1:]
    tc = torch.tanh(c)
    dtc = o * (1 - tc * tc)
    local_c = torch.cat([g * i * (1 - i), c_prev * f * (1 - f), i * (1 - g * g), torch.zeros_like(o)], -1)
    local_h = local_c * dtc.repeat(1, 1, 4)
    local_h[..., 3 * hidden :] = tc * o * (1 - o)
    w = w_hh.unflatten(0, (4, hidden))  # (4, H, H)
    dh_dh = torch.einsum("bnkr,krc->bnrc", local_h.unflatten(-1, (4, hidden)), w)
    dc_dh = torch.einsum("bnkr,krc->bnrc", local_c.unflatten(-1, (4, hidden)), w)
    jac = x.new_zeros(batch, n, 2 * hidden, 2 * hidden)
    jac[..., :hidden, :hidden] = dh_dh
    jac[..., hidden:, :hidden] = dc_dh
    jac[..., :hidden, hidden:] = torch.diag_embed(dtc * f)
    jac[..., hidden:, hidden:] = torch.diag_embed(f)
    return LSTMJacobians(jac.mT, local_h, local_c, f, c_prev)
