"""Recurrent cells as objects: each built-in cell owns its whole layer (BPPSA Sec. 4.1-4.2, Appendix E).

A :class:`RecurrentCell` owns, for one layer in one direction over a batch-first sequence:

- its forward over the sequence, which also emits the Jacobian factors the backward needs (the compiled
  kernel of :mod:`lightning_bppsa.kernels.recurrent` in one pass; else torch's fused forward and the
  factors recomputed with one GEMM, :mod:`lightning_bppsa.jacobians.recurrent`);
- its step Jacobians as :class:`~lightning_bppsa.jacobians.FactoredJacobians`
  (``J = diag(u) + [diag(s)..] W``, never materialised);
- the map from state gradients to gate pre-activation gradients, and the parameter gradients as GEMMs over
  all steps at once (Eq. 2);
- its row of the cost model (:class:`~lightning_bppsa.cost_model.CellCost`).

The layer runs as two ``torch.library`` ops (defined with the scan's in :mod:`lightning_bppsa.ops`), opaque to
``torch.compile`` (one node each, nothing unrolled):

- ``bppsa::recurrent_forward(cell, x, h0, c0, weights) -> [out, (c_n,) *factors]``
- ``bppsa::recurrent_backward(cell, algorithm, x, h0, c0, weights, out, factors, grad_out, grad_hn, grad_cn, need_x)
  -> [grad_x (empty unless need_x), grad_h0, (grad_c0,) *grad_weights]``

``cell`` names an entry of :data:`CELLS`. The backward's plan is decided inside the op, at run time
(:func:`lightning_bppsa.plan.choose`): on CPU the linear schedule with a compiled kernel runs the scan and the
gate gradients in one fused call; any other plan runs the factored scan op's implementation, then the gates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_bppsa import ops, plan
from lightning_bppsa.cost_model import CellCost
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.jacobians.recurrent import gate_preactivations, gru_jacobians
from lightning_bppsa.kernels import recurrent as native
from lightning_bppsa.kernels import recurrent_cuda

__all__ = ["CELLS", "GRUCell", "LSTMCell", "RNNCell", "RecurrentCell", "cell_of", "forward_kernel_runs"]

log = logging.getLogger(__name__)

#: torch's fused single-layer forwards (batch first, no dropout, one direction)
_VF_FORWARD = {"rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu, "gru": torch._VF.gru}


class RecurrentCell:
    """One built-in cell kind. Subclasses set ``name``, ``gates`` (G: ``W_hh`` is ``(G H, H)``),
    ``state_factor`` (the scan state is ``state_factor * H``), ``has_cell_state`` and ``cost``."""

    name: str
    gates: int
    state_factor: int = 1
    has_cell_state: bool = False
    cost: CellCost

    # ---- forward ---------------------------------------------------------------------------------
    def torch_forward(self, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]) -> tuple:
        """Torch's fused forward (no factors): ``(out,)`` or ``(out, c_n)``; differentiable by autograd."""
        out, _ = _VF_FORWARD[self.name](x, h0[None], tuple(weights), len(weights) == 4, 1, 0.0, True, False, True)
        return (out,)

    def forward(self, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]) -> list[Tensor]:
        """``[out, (c_n,) *factors]``: the compiled kernel where it runs, else torch plus the factors."""
        kernels = _forward_kernels(x)
        result = None
        if kernels is not None:
            result = self._native_forward(kernels, self._input_projection(x, weights, kernels), h0, c0, weights)
        if result is None:
            result = self._torch_forward_with_factors(x, h0, c0, weights)
        return list(result)

    def _input_projection(self, x: Tensor, weights: Sequence[Tensor], kernels) -> Tensor | native.Projection:
        """``x W_ihᵀ + b_ih`` (``+ b_hh`` where it sits outside the nonlinearity's gating): one GEMM, or
        for a narrow input on the CPU a :class:`~lightning_bppsa.kernels.recurrent.Projection` that the
        forward kernel computes row by row."""
        w_ih = weights[0]
        bias = None
        if len(weights) == 4:
            bias = weights[2] + weights[3] if self._folds_hidden_bias else weights[2]
        if kernels is native and native.projects_inputs(x.shape[-1]):
            return native.Projection(x, w_ih, bias)
        flat = x.reshape(-1, x.shape[-1])
        gi = flat @ w_ih.T if bias is None else torch.addmm(bias, flat, w_ih.T)
        return gi.view(*x.shape[:2], -1)

    _folds_hidden_bias = True

    def _native_forward(self, kernels, gi, h0, c0, weights) -> tuple | None:
        """The compiled forward of ``kernels`` (:mod:`~lightning_bppsa.kernels.recurrent` or
        :mod:`~lightning_bppsa.kernels.recurrent_cuda`), or ``None`` where it cannot run."""
        raise NotImplementedError

    def _torch_forward_with_factors(self, x, h0, c0, weights) -> tuple:
        raise NotImplementedError

    def factor_shapes(self, batch: int, n: int, hidden: int) -> list[tuple[int, ...]]:
        """Shapes of the factors :meth:`forward` returns after the outputs (for the ops' fake kernels)."""
        raise NotImplementedError

    # ---- backward --------------------------------------------------------------------------------
    def jacobians(self, out: Tensor, factors: Sequence[Tensor], w_hh: Tensor) -> FactoredJacobians:
        """The step Jacobians of the chain, factored (the scan state is ``state_factor * H``)."""
        raise NotImplementedError

    def gate_gradients(
        self, g: Tensor, out: Tensor, factors: Sequence[Tensor], jac: FactoredJacobians
    ) -> tuple[Tensor, Tensor]:
        """``(d_gi, d_gh)``, the gradients of ``x W_ihᵀ + b_ih`` and ``h W_hhᵀ + b_hh`` from the scan's
        state gradients ``g`` ``(B, n, d)`` of ``x_1..x_n`` (``out``: the layer's states; ``jac``: what
        :meth:`jacobians` gave the scan, whose scales hold the local derivatives: not computed twice)."""
        raise NotImplementedError

    def direct_gradients(
        self, grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None, like: Tensor
    ) -> Tensor:
        """``(B, n + 1, d)`` direct gradients of the scan states ``x_0..x_n`` (zero at ``x_0``).

        Where ``grad_out`` covers the whole state (``d = H``) only ``x_0``'s row is zeroed (one launch less
        and no pass over the whole buffer on a GPU)."""
        batch, n, hidden = like.shape
        d = self.state_factor * hidden
        if grad_out is not None and d == hidden:
            direct = like.new_empty(batch, n + 1, d)
            direct[:, 0].zero_()
            direct[:, 1:].copy_(grad_out)
        else:
            direct = like.new_zeros(batch, n + 1, d)
            if grad_out is not None:
                direct[:, 1:, :hidden].copy_(grad_out)
        if grad_hn is not None:
            direct[:, n, :hidden].add_(grad_hn)  # add_ on the view: `+=` would also copy it back onto itself
        if grad_cn is not None:
            direct[:, n, hidden:].copy_(grad_cn)
        return direct

    def plan(self, algorithm: str, *, batch: int, n: int, hidden: int, device: str, dtype: torch.dtype) -> plan.Plan:
        """The scan plan of this cell's backward (what :meth:`backward` runs and the modules report)."""
        d, width = self.state_factor * hidden, self.jacobian_width(hidden)
        return plan.choose(algorithm, n=n, d=d, batch=batch, width=width, device=device, dtype=dtype)

    def jacobian_width(self, hidden: int) -> int:
        """Rows of the factored weight (``k d``)."""
        return self.gates * hidden

    @staticmethod
    def fused_backward(chosen: plan.Plan, device: str, dtype: torch.dtype) -> bool:
        """Whether the backward under ``chosen`` on ``device`` (type) and ``dtype`` is the compiled kernel's
        fused scan + gate gradients."""
        return chosen.kernel == "c" and chosen.algorithm == "linear" and _native_ok(device, dtype)

    def backward(
        self,
        algorithm: str,
        x: Tensor,
        h0: Tensor,
        c0: Tensor | None,
        weights: Sequence[Tensor],
        out: Tensor,
        factors: Sequence[Tensor],
        grad_out: Tensor | None,
        grad_hn: Tensor | None,
        grad_cn: Tensor | None,
        need_x: bool = True,
    ) -> list[Tensor]:
        """Every input gradient: ``[grad_x, grad_h0, (grad_c0,) grad_W_ih, grad_W_hh, (grad_b_ih, grad_b_hh)]``
        (``grad_x`` empty when not ``need_x``: a first layer's input seldom needs one), from the gradients of
        ``out``, of the last state ``h_n`` (besides ``out``'s last step) and of ``c_n`` (each may be ``None``).

        Runs in the parameters' dtype (under autocast the forward ran in half precision).
        """
        dtype = weights[0].dtype
        x_, out_, h0_, c0_, grad_out, grad_hn, grad_cn = (
            _cast(t, dtype) for t in (x, out, h0, c0, grad_out, grad_hn, grad_cn)
        )
        factors = [_cast(f, dtype) for f in factors]
        batch, n, hidden = out.shape
        chosen = self.plan(algorithm, batch=batch, n=n, hidden=hidden, device=x.device.type, dtype=dtype)
        fused, bias = None, len(weights) == 4
        if self.fused_backward(chosen, out_.device.type, out_.dtype):
            sums = native.ParameterSums(x_, out_, h0_, bias) if native.sums_parameters(
                hidden, x.shape[-1], self.gates, dtype) else None  # fmt: skip
            fused = self._native_backward(out_, h0_, c0_, weights[1], factors, grad_out, grad_hn, grad_cn, sums,
                                          need_x)  # fmt: skip
        direct = None if fused is not None else self.direct_gradients(grad_out, grad_hn, grad_cn, out_)
        if fused is None and self._needs_torch_semantics(out_, grad_out, grad_hn):
            fused = self._select_sweep(out_, factors, weights[1], direct)
        if fused is None:
            jac = self.jacobians(out_, factors, weights[1])
            g = ops.execute_factored(chosen, jac, direct)
            d_gi, d_gh = self.gate_gradients(g[:, 1:], out_, factors, jac)
            fused = d_gi, d_gh, g[:, 0].split(hidden, -1), None
        d_gi, d_gh, starts, param_grads = fused
        grad_x = _cast((d_gi.reshape(-1, d_gi.shape[-1]) @ weights[0]).view(x.shape), x.dtype) if need_x else x.new_empty(0)
        states = [_cast(starts[0], h0.dtype)] + ([_cast(starts[1], c0.dtype)] if c0 is not None else [])
        if param_grads is None:
            param_grads = self._parameter_gradients(d_gi, d_gh, x_, h0_, out_, bias)
        return [grad_x, *states, *param_grads]

    def _native_backward(
        self, out, h0, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums: native.ParameterSums | None,
        need_x: bool,
    ) -> tuple | None:
        """``(d_gi, d_gh, [∇h_0(, ∇c_0)], parameter gradients or None)`` from the compiled backward (which
        sums the parameter gradients itself with ``sums``; ``d_gi`` / ``d_gh`` may then be ``None`` where
        not needed), or ``None`` where it cannot run."""
        raise NotImplementedError

    def _needs_torch_semantics(self, out: Tensor, grad_out: Tensor | None, grad_hn: Tensor | None) -> bool:
        """Whether only a step-by-step backward gives torch's result (the ReLU RNN with non-finite values:
        torch's backward selects, ``0 * nan`` in a scan's product would not)."""
        return False

    def _select_sweep(self, out: Tensor, factors: Sequence[Tensor], w_hh: Tensor, direct: Tensor) -> tuple:
        """Like :meth:`_native_backward`, by a step-by-step sweep with torch's semantics."""
        raise NotImplementedError

    def autograd_gradients(
        self,
        low: torch.dtype | None,
        inputs: Sequence[Tensor | None],
        needs: Sequence[bool],
        grad_outputs: Sequence[Tensor | None],
        create_graph: bool,
    ) -> list[Tensor | None]:
        """Autograd through the recomputed :meth:`torch_forward` (run in ``low`` if given, as under
        autocast): the gradients BPPSA must reproduce, of ``inputs = (x, h0, c0, *weights)``.

        With ``create_graph`` the recomputation starts from the layer's own inputs, so the gradients are
        functions of them (and of ``grad_outputs``) that autograd can differentiate again.
        """
        if create_graph:
            leaves = list(inputs)
        else:
            given = zip(inputs, needs, strict=True)
            leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in given]
        with torch.enable_grad():
            args = leaves if low is None else [None if t is None else t.to(low) for t in leaves]
            outputs = self.torch_forward(args[0], args[1], args[2], tuple(args[3:]))
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=False) if g is not None]
        wanted = [t for t, need in zip(leaves, needs, strict=True) if t is not None and need]
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True, create_graph=create_graph
        )
        by_id = {id(t): g for t, g in zip(wanted, found, strict=True)}
        return [None if t is None else by_id.get(id(t)) for t in leaves]

    def _parameter_gradients(
        self, d_gi: Tensor, d_gh: Tensor, x: Tensor, h0: Tensor, out: Tensor, bias: bool
    ) -> list[Tensor]:
        """Eq. 2 as two GEMMs over all ``B n`` steps at once, ``d_giᵀ x`` (``W_ih``) and ``d_ghᵀ h_prev``
        (``W_hh``), and the biases' gradients as the column sums of ``d_gi`` and ``d_gh``: each result a new
        contiguous tensor (an op's outputs may not share storage), no operand assembled beyond ``h_prev``."""
        inputs, hidden = x.shape[-1], h0.shape[-1]
        flat_gi, flat_gh = d_gi.reshape(-1, d_gi.shape[-1]), d_gh.reshape(-1, d_gh.shape[-1])
        h_prev = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
        grads = [torch.mm(flat_gi.T, x.reshape(-1, inputs)), torch.mm(flat_gh.T, h_prev.view(-1, hidden))]
        if bias:
            b_hh = flat_gh.sum(0)
            # RNN, LSTM: d_gi is d_gh, and copying its sum reads H values, summing again B n H
            grads += [b_hh.clone() if d_gi is d_gh else flat_gi.sum(0), b_hh]
        return grads


def _native_ok(device: str, dtype: torch.dtype) -> bool:
    """Whether the compiled CPU cell kernels may run on tensors of ``device`` (type) and ``dtype`` (CPU,
    float32/float64, kernel built)."""
    return device == "cpu" and dtype in (torch.float32, torch.float64) and native.available()


def forward_kernel_runs(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """Whether a layer's forward op on ``x`` and ``weights`` runs the compiled CPU kernel (not torch's fused
    forward): CPU, float32 / float64 throughout, kernels built, no CPU autocast (which casts to bfloat16)."""
    same = all(w.dtype == x.dtype and w.device == x.device for w in weights)
    return same and _native_ok(x.device.type, x.dtype) and not torch.is_autocast_enabled("cpu")


#: reasons already logged for running torch's fused forward instead of a compiled one
_LOGGED: set[str] = set()


def _forward_kernels(x: Tensor):
    """The compiled forward kernels for ``x``'s device, or ``None`` (torch's fused forward runs; logged
    once per reason)."""
    if _native_ok(x.device.type, x.dtype):
        return native
    if x.device.type == "cuda" and x.dtype in (torch.float32, torch.float64):
        ok, reason = recurrent_cuda.available()
        if ok:
            return recurrent_cuda
    elif x.dtype not in (torch.float32, torch.float64):
        reason = f"dtype {x.dtype} (the compiled cell kernels take float32 / float64)"
    elif x.device.type == "cpu":
        reason = "the compiled CPU cell kernels are unavailable (see the build log)"
    else:
        reason = f"no compiled cell kernels for device {x.device.type}"
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        log.info("lightning_bppsa: recurrent layers run torch's fused forward: %s", reason)
    return None


class RNNCell(RecurrentCell):
    """Elman RNN ``h_t = f(x_t W_ihᵀ + b_ih + h_{t-1} W_hhᵀ + b_hh)``: ``J_t = diag(f'_t) W_hh`` (k = 1).

    No factor: ``f'`` is a function of the states ``out`` (:meth:`slope`), so the forward stores nothing
    beyond them.
    """

    gates = 1
    _folds_hidden_bias = False  # its forward kernels add b_hh themselves: no addition of the biases per call

    def __init__(self, nonlinearity: str) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity must be 'tanh' or 'relu'; got {nonlinearity!r}")
        self.name = f"rnn_{nonlinearity}"
        self.relu = nonlinearity == "relu"
        self.cost = CellCost(autograd_ops_per_step=3.5, gates=1, state_factor=1, autograd_step=55e-6,
                             autograd_row=0.37e-6, autograd_row_mac=0.33e-9, native_row=0.14e-6,
                             native_row_mac=0.18e-9)  # fmt: skip

    def slope(self, out: Tensor) -> Tensor:
        """``f'`` ``(B, n, H)`` from the states: ``1 - h²`` (tanh) or the ReLU mask (1 where NOT ``h <= 0``,
        as torch's ``threshold_backward``: a NaN output passes the gradient)."""
        return (~(out <= 0)).to(out.dtype) if self.relu else 1 - out * out

    def _native_forward(self, kernels, gi, h0, c0, weights):
        return kernels.rnn_forward(gi, weights[1], weights[3] if len(weights) == 4 else None, h0, self.relu)

    def _torch_forward_with_factors(self, x, h0, c0, weights):
        return self.torch_forward(x, h0, c0, weights)

    def factor_shapes(self, batch, n, hidden):
        return []

    def jacobians(self, out, factors, w_hh):
        return FactoredJacobians(w_hh, self.slope(out))

    def gate_gradients(self, g, out, factors, jac):
        # select, not multiply, for ReLU: torch's backward gives 0 there even for a NaN gradient
        d_a = torch.where(out <= 0, 0.0, g) if self.relu else g * jac.scales  # jac.scales: the slope
        return d_a, d_a

    def _needs_torch_semantics(self, out, grad_out, grad_hn):
        # values are read on CPU only (on CUDA it would be a sync; there a NaN may spread further than torch's)
        if not self.relu or out.device.type != "cpu":
            return False
        return not all(bool(torch.isfinite(t).all()) for t in (out, grad_out, grad_hn) if t is not None)

    def _select_sweep(self, out, factors, w_hh, direct):
        """``d_a`` by torch's sequential ReLU backward, ``d_a = where(mask, g, 0)``."""
        mask, n = ~(out <= 0), direct.shape[1] - 1
        d_a = torch.empty_like(out)
        g = direct[:, n]
        for t in range(n - 1, -1, -1):
            d_a[:, t] = torch.where(mask[:, t], g, 0.0)
            g = d_a[:, t] @ w_hh + direct[:, t]
        return d_a, d_a, [g], None

    def _native_backward(self, out, h0, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        result = native.rnn_backward(out, w_hh, _contiguous(grad_out), self.relu, sums, need_x,
                                     _contiguous(grad_hn))  # fmt: skip
        return None if result is None else (result[0], result[0], [result[1]], result[2] if sums else None)


class GRUCell(RecurrentCell):
    """GRU, Appendix E Eq. 11: ``J_t = diag(z) + [diag(s_r) diag(s_z) diag(s_n)] W_hh`` (k = 3).

    Factors: ``scales`` ``(B, n, 3H)``, ``z`` ``(B, n, H)``, ``dn = (1-z)(1-n²)`` ``(B, n, H)`` (the input
    gate gradient's n block, which the hidden one scales by ``r``).
    """

    name = "gru"
    gates = 3
    _folds_hidden_bias = False  # b_hh's n block sits inside r ⊙ (.)

    def __init__(self) -> None:
        self.cost = CellCost(autograd_ops_per_step=10.0, gates=3, state_factor=1, autograd_step=150e-6,
                             autograd_row=1.35e-6, autograd_row_mac=0.35e-9, native_row=0.31e-6,
                             native_row_mac=0.25e-9)  # fmt: skip

    def _native_forward(self, kernels, gi, h0, c0, weights):
        return kernels.gru_forward(gi, weights[1], weights[3] if len(weights) == 4 else None, h0)

    def _torch_forward_with_factors(self, x, h0, c0, weights):
        (out,) = self.torch_forward(x, h0, c0, weights)
        h_prev = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
        b_ih, b_hh = weights[2:] if len(weights) == 4 else (None, None)
        jac, local = gru_jacobians(x, h_prev, weights[0], weights[1], b_ih, b_hh)
        hidden = h0.shape[-1]
        return out, jac.scales, jac.diagonal, local[..., 2 * hidden :].contiguous()

    def factor_shapes(self, batch, n, hidden):
        return [(batch, n, 3 * hidden), (batch, n, hidden), (batch, n, hidden)]

    def jacobians(self, out, factors, w_hh):
        return FactoredJacobians(w_hh, factors[0], factors[1])

    def gate_gradients(self, g, out, factors, jac):
        scales, _, dn = factors
        batch, n, hidden = g.shape
        # g broadcast over the three gates: one launch (a concatenation first would be two)
        d_gh = (g.unsqueeze(2) * scales.reshape(batch, n, 3, hidden)).view(batch, n, 3 * hidden)
        d_gi = d_gh.clone()
        torch.mul(g, dn, out=d_gi[..., 2 * hidden :])
        return d_gi, d_gh

    def _native_backward(self, out, h0, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        result = native.gru_backward(*factors, w_hh, _contiguous(grad_out), sums, need_x, _contiguous(grad_hn))
        return None if result is None else (result[0], result[1], [result[2]], result[3] if sums else None)


class LSTMCell(RecurrentCell):
    """LSTM over the joint state ``[h; c]`` (``d = 2H``), gates ``[i, f, g, o]``.

    Its step Jacobian is structured, never a dense ``2H x 2H``: with ``x = [g_h, g_c]`` (row form)::

        gc_tot = g_c + g_h ⊙ o ⊙ tanh'(c)          d_gates = tile(g_h, 4) ⊙ local_h + tile(g_c, 4) ⊙ local_c
        g_h' = d_gates W_hh                          g_c' = gc_tot ⊙ f

    which is a factored Jacobian with k = 5 tiles of the joint state over ``W5`` ``(10 H, 2 H)``: tile q < 4
    scales ``[g_h, g_c]`` by ``[local_h_q, local_c_q]`` against ``[[W_q, 0], [W_q, 0]]``, tile 4 by
    ``[o tanh'(c) f, f]`` against ``[[0, I], [0, I]]``. The compiled backward runs the recursion directly.
    Factors: ``cells`` ``(B, n, H)`` = ``c_1..c_n``, ``gates`` ``(B, n, 4H)`` (activated) and ``c_0``
    ``(B, H)`` (a copy: the op's outputs may not alias its inputs).
    """

    name = "lstm"
    gates = 4
    state_factor = 2
    has_cell_state = True

    def __init__(self) -> None:
        # torch's CPU LSTM backward is one fused op per step
        self.cost = CellCost(autograd_ops_per_step=1.0, gates=4, state_factor=2, autograd_step=3e-6,
                             autograd_row=1.3e-6, autograd_row_mac=0.21e-9, native_row=0.40e-6,
                             native_row_mac=0.18e-9, autograd_call=5.2e-4)  # fmt: skip

    def jacobian_width(self, hidden: int) -> int:
        return 10 * hidden

    def torch_forward(self, x, h0, c0, weights):
        out, _, c_n = torch._VF.lstm(x, (h0[None], c0[None]), tuple(weights), len(weights) == 4, 1, 0.0, True,
                                     False, True)  # fmt: skip
        return out, c_n[0]

    def _native_forward(self, kernels, gi, h0, c0, weights):
        result = kernels.lstm_forward(gi, weights[1], h0, c0)
        if result is None:
            return None
        out, cells, gates = result
        return out, cells[:, -1].clone(), cells, gates, c0.clone()

    def _torch_forward_with_factors(self, x, h0, c0, weights):
        out, c_n = self.torch_forward(x, h0, c0, weights)
        h_prev = torch.cat([h0.unsqueeze(1), out[:, :-1]], 1)
        b_ih, b_hh = weights[2:] if len(weights) == 4 else (None, None)
        gi, gh = gate_preactivations(x, h_prev, weights[0], weights[1], b_ih, b_hh)
        pre = gi + gh
        hidden = h0.shape[-1]
        gates = torch.cat([torch.sigmoid(pre[..., : 2 * hidden]), torch.tanh(pre[..., 2 * hidden : 3 * hidden]),
                           torch.sigmoid(pre[..., 3 * hidden :])], -1)  # fmt: skip
        i, f, g, _ = gates.split(hidden, -1)
        ig = i * g
        cells = x.new_empty(x.shape[1] + 1, x.shape[0], hidden)  # time-major: every step a contiguous block
        cells[0] = c0
        for t in range(x.shape[1]):  # c_t = f_t c_{t-1} + i_t g_t: element-wise, no GEMM
            torch.addcmul(ig[:, t], f[:, t], cells[t], out=cells[t + 1])
        return out, c_n, cells[1:].transpose(0, 1).contiguous(), gates, c0.clone()

    def factor_shapes(self, batch, n, hidden):
        return [(batch, n, hidden), (batch, n, 4 * hidden), (batch, hidden)]

    def _scales(self, factors: Sequence[Tensor]) -> Tensor:
        """The factored Jacobian's scales ``(B, n, 5, 2, H)``: tile q < 4 holds ``[local_h_q, local_c_q]``, tile 4
        ``[o tanh'(c) f, f]``. Written in place into one buffer (no concatenation: ~18 launches on a GPU)."""
        cells, gates, c0 = factors
        batch, n, hidden = cells.shape
        i, f, g, o = gates.split(hidden, -1)
        c_prev = torch.cat([c0.unsqueeze(1), cells[:, :-1]], 1)
        tc = torch.tanh(cells)
        dtc = o * (1 - tc * tc)
        slopes = gates * (1 - gates)  # σ' of i, f and o (g's entry unused)
        di, df, _, do = slopes.split(hidden, -1)
        scales = cells.new_empty(batch, n, 5, 2, hidden)
        local_h, local_c = scales[:, :, :4, 0], scales[:, :, :4, 1]
        torch.mul(g, di, out=local_c[:, :, 0])
        torch.mul(c_prev, df, out=local_c[:, :, 1])
        torch.mul(i, 1 - g * g, out=local_c[:, :, 2])
        local_c[:, :, 3].zero_()  # c does not depend on o
        torch.mul(local_c[:, :, :3], dtc.unsqueeze(2), out=local_h[:, :, :3])
        torch.mul(tc, do, out=local_h[:, :, 3])
        torch.mul(dtc, f, out=scales[:, :, 4, 0])
        scales[:, :, 4, 1].copy_(f)
        return scales

    def jacobians(self, out, factors, w_hh):
        batch, n, hidden = out.shape
        return FactoredJacobians(_joint_weight(w_hh), self._scales(factors).view(batch, n, 10 * hidden))

    def gate_gradients(self, g, out, factors, jac):
        # tile q of jac's scales is [local_h_q, local_c_q]: d_gates_q = g_h local_h_q + g_c local_c_q
        batch, n, hidden = out.shape
        tiles = jac.scales[..., : 8 * hidden].view(batch, n, 4, 2, hidden)
        d_gates = (g.view(batch, n, 1, 2, hidden) * tiles).sum(3).view(batch, n, 4 * hidden)
        return d_gates, d_gates

    def _native_backward(self, out, h0, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        cells, gates, _ = factors
        result = native.lstm_backward(gates, cells, c0, w_hh, _contiguous(grad_out), _contiguous(grad_cn), sums,
                                      need_x, _contiguous(grad_hn))  # fmt: skip
        return None if result is None else (result[0], result[0], list(result[1:3]), result[3] if sums else None)


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t.to(dtype)``, without its call where the dtype is already right (~2 µs each, ~8 per backward)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _joint_weight(w_hh: Tensor) -> Tensor:
    """``W5`` ``(10 H, 2 H)`` of :class:`LSTMCell`: ``[[W_q, 0], [W_q, 0]]`` for each gate q, then
    ``[[0, I], [0, I]]``."""
    hidden = w_hh.shape[1]
    joint = w_hh.new_zeros(5, 2, hidden, 2 * hidden)  # (tile, row half, row, column): three launches in all
    joint[:4, :, :, :hidden] = w_hh.view(4, 1, hidden, hidden)
    joint[4, :, :, hidden:].diagonal(dim1=-2, dim2=-1).fill_(1)
    return joint.view(10 * hidden, 2 * hidden)


#: every built-in cell by the name the ``bppsa::recurrent_*`` ops carry
CELLS: dict[str, RecurrentCell] = {
    cell.name: cell for cell in (RNNCell("tanh"), RNNCell("relu"), GRUCell(), LSTMCell())
}


def cell_of(mode: str) -> RecurrentCell:
    """The cell of a torch ``nn.RNNBase`` ``mode`` (``"RNN_TANH"``, ``"RNN_RELU"``, ``"GRU"``, ``"LSTM"``)."""
    return CELLS[mode.lower()]
