"""One recurrent layer in one direction: fused torch forward, Jacobians, scan backward (BPPSA Sec. 4.1-4.2).

:class:`LayerFunction` connects ``(x, h0[, c0], W_ih, W_hh[, b_ih, b_hh])`` to the layer's outputs
``out`` ``(B, n, H)`` (``h_1..h_n``; ``h_n = out[:, -1]``) and, for LSTM, ``c_n`` ``(B, H)``:

- forward: torch's own fused single-layer kernel (no grad), then the Jacobian data of all steps
  (:mod:`lightning_bppsa.jacobians.recurrent`);
- backward: one scan gives ``g_t = ∇_{h_t} l`` for ``t = 0..n`` from the per-step output gradients
  (the ``(B, n + 1, d)`` direct-gradient form); the gate pre-activation gradients follow element-wise,
  and every parameter, input and ``h0`` gradient is one GEMM over all ``B n`` steps (Eq. 2);
- inside :func:`~lightning_bppsa.nn.reference_backward`, and under ``create_graph=True`` (double
  backward): plain autograd through a recomputed forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa import cost_model
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.jacobians.recurrent import gru_jacobians, lstm_jacobians, rnn_jacobians
from lightning_bppsa.nn._clock import clock, record
from lightning_bppsa.nn._reference_backward import reference_backward_enabled
from lightning_bppsa.scan import backprop_scan

__all__ = ["LayerFunction", "fused_layer"]


def fused_layer(mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: tuple[Tensor, ...]):
    """Torch's fused forward of one layer, one direction, batch first. Returns ``(out, h_n[, c_n])``."""
    has_bias = len(weights) == 4
    if mode == "LSTM":
        out, _, c_n = torch._VF.lstm(x, (h0[None], c0[None]), weights, has_bias, 1, 0.0, False, False, True)
        return out, c_n[0]
    fn = {"RNN_TANH": torch._VF.rnn_tanh, "RNN_RELU": torch._VF.rnn_relu, "GRU": torch._VF.gru}[mode]
    out, _ = fn(x, h0[None], weights, has_bias, 1, 0.0, False, False, True)
    return (out,)


def _direct(grad_out: Tensor | None, like: Tensor) -> Tensor:
    """``(B, n + 1, H)`` direct gradients (zero at ``h_0``), or ``(B, H)`` when only ``h_n`` receives one."""
    batch, n, hidden = like.shape
    if grad_out is None:
        return like.new_zeros(batch, hidden)
    # a loss on the last step only needs no affine rows; traced code cannot branch on values: keep them
    if n == 1 or (not torch.compiler.is_compiling() and not grad_out[:, :-1].count_nonzero()):
        return grad_out[:, -1].contiguous()
    return torch.cat([grad_out.new_zeros(batch, 1, hidden), grad_out], 1)


class LayerFunction(torch.autograd.Function):
    """See the module docstring. Args: ``mode``, ``algorithm``, ``stats`` (dict updated in place),
    then the tensors ``x`` ``(B, n, I)``, ``h0`` ``(B, H)``, ``c0`` ``(B, H)`` or ``None``, weights."""

    @staticmethod
    def forward(
        ctx, mode: str, algorithm: str, stats: dict, x: Tensor, h0: Tensor, c0: Tensor | None, *weights
    ):
        outputs = fused_layer(mode, x, h0, c0, weights)
        start = clock()
        out = outputs[0]
        h_prev = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
        w_ih, w_hh = weights[:2]
        b_ih, b_hh = weights[2:] if len(weights) == 4 else (None, None)
        if mode.startswith("RNN"):
            jac = rnn_jacobians(out, w_hh, mode[4:].lower())
            saved = (jac.scales,)
        elif mode == "GRU":
            jac, local = gru_jacobians(x, h_prev, w_ih, w_hh, b_ih, b_hh)
            saved = (jac.scales, jac.diagonal, local)
        else:
            lj = lstm_jacobians(x, h_prev, c0, w_ih, w_hh, b_ih, b_hh)
            saved = (lj.jacobians_t, lj.local_h, lj.local_c, lj.forget, lj.c_prev)
        record(stats, "jacobian_seconds", clock() - start, add=True)
        ctx.mode, ctx.algorithm, ctx.stats = mode, algorithm, stats
        ctx.save_for_backward(x, h0, c0, h_prev, *saved, *weights)
        ctx.n_saved = len(saved)
        return outputs if len(outputs) > 1 else out

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_cn: Tensor | None = None):
        x, h0, c0, h_prev, *rest = ctx.saved_tensors
        saved, weights = rest[: ctx.n_saved], tuple(rest[ctx.n_saved :])
        needs = ctx.needs_input_grad[3:]
        # grad mode is on in a backward only under create_graph=True (double backward, e.g. a gradient
        # penalty): the scan's result is not differentiable, autograd's through the recomputed forward is
        create_graph = torch.is_grad_enabled()
        if create_graph or reference_backward_enabled():
            grads = _autograd_grads(ctx.mode, (x, h0, c0, *weights), needs, (grad_out, grad_cn), create_graph)
        else:
            grads = _scan_backward(ctx, x, h0, c0, h_prev, saved, weights, grad_out, grad_cn)
        return (None, None, None, *(g if need else None for g, need in zip(grads, needs, strict=True)))


def _autograd_grads(
    mode: str,
    inputs: tuple[Tensor | None, ...],
    needs: tuple[bool, ...],
    grad_outputs: tuple[Tensor | None, ...],
    create_graph: bool,
) -> list[Tensor | None]:
    """Autograd through a recomputed fused forward: the gradients BPPSA must reproduce.

    With ``create_graph`` the recomputation starts from the layer's own inputs, so the gradients are
    functions of them (and of ``grad_outputs``) that autograd can differentiate again.
    """
    if create_graph:
        leaves = list(inputs)
    else:
        given = zip(inputs, needs, strict=True)
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in given]
    with torch.enable_grad():
        outputs = fused_layer(mode, leaves[0], leaves[1], leaves[2], tuple(leaves[3:]))
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=False) if g is not None]
    wanted = [t for t, need in zip(leaves, needs, strict=True) if t is not None and need]
    found = torch.autograd.grad(
        [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, create_graph=create_graph
    )
    by_id = {id(t): g for t, g in zip(wanted, found, strict=True)}
    return [None if t is None else by_id.get(id(t)) for t in leaves]


def _scan_backward(ctx, x, h0, c0, h_prev, saved, weights, grad_out, grad_cn) -> list[Tensor | None]:
    mode = ctx.mode
    batch, n, hidden = h_prev.shape
    # Under autocast the forward ran in half precision; the backward runs in the parameters' dtype.
    dtype = weights[0].dtype
    x_, h_prev, saved, grad_out, grad_cn = _cast(dtype, x, h_prev, saved, grad_out, grad_cn)
    w_ih, w_hh = weights[:2]
    start = clock()
    if mode == "LSTM":
        jac_t, local_h, local_c, forget, c_prev = saved
        direct = h_prev.new_zeros(batch, n + 1, 2 * hidden)
        if grad_out is not None:
            direct[:, 1:, :hidden] = grad_out
        if grad_cn is not None:
            direct[:, n, hidden:] = grad_cn
        g = backprop_scan(jac_t, direct, algorithm=ctx.algorithm)
        gh, gc = g[:, 1:, :hidden], g[:, 1:, hidden:]
        d_gates_h = gh.repeat(1, 1, 4) * local_h + gc.repeat(1, 1, 4) * local_c
        d_gates_i = d_gates_h
        g0, c0_grad = g[:, 0, :hidden], g[:, 0, hidden:]
    else:
        scales = saved[0]
        diagonal = saved[1] if mode == "GRU" else None
        g = backprop_scan(
            FactoredJacobians(w_hh, scales, diagonal), _direct(grad_out, h_prev), algorithm=ctx.algorithm
        )
        tiles = w_hh.shape[0] // hidden
        g_rows = torch.cat([g[:, 1:]] * tiles, -1) if tiles > 1 else g[:, 1:]  # cat: 2x faster than repeat
        d_gates_h = g_rows * scales
        d_gates_i = g_rows * saved[2] if mode == "GRU" else d_gates_h
        g0, c0_grad = g[:, 0], None
    record(ctx.stats, "scan_seconds", clock() - start, add=True)
    if not torch.compiler.is_compiling():
        ctx.stats["scan_algorithm"] = _resolved(ctx.algorithm, batch, n, hidden, w_hh, g.device.type, mode)
    # Eq. 2: every parameter gradient is one GEMM over all B n steps.
    dgi, dgh = d_gates_i.flatten(0, 1), d_gates_h.flatten(0, 1)
    grads = [
        (dgi @ w_ih).view_as(x).to(x.dtype),
        g0.to(h0.dtype),
        None if c0_grad is None else c0_grad.to(c0.dtype),
        dgi.T @ x_.flatten(0, 1),
        dgh.T @ h_prev.flatten(0, 1),
    ]
    if len(weights) == 4:
        ones = dgi.new_ones(dgi.shape[0])  # a column sum as a GEMV: several times faster than sum(0)
        grad_b_ih = dgi.T @ ones
        grads += [grad_b_ih, grad_b_ih.clone() if dgh is dgi else dgh.T @ ones]
    return grads


def _cast(dtype: torch.dtype, x: Tensor, h_prev: Tensor, saved: list[Tensor], grad_out, grad_cn) -> tuple:
    """Every tensor of the backward in ``dtype`` (``None`` stays ``None``)."""

    def to(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    return to(x), to(h_prev), [to(t) for t in saved], to(grad_out), to(grad_cn)


def _resolved(algorithm: str, batch: int, n: int, hidden: int, w_hh: Tensor, device: str, mode: str) -> str:
    """What ``backprop_scan`` ran for this layer, e.g. ``"linear"`` or ``"chunked(c=8)"``."""
    d, width = (2 * hidden, None) if mode == "LSTM" else (hidden, w_hh.shape[0])
    name, chunk = cost_model.choose(algorithm, n=n, d=d, batch=batch, width=width, device=device)
    return f"{name}(c={chunk})" if name == "chunked" else name
