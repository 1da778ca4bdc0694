"""Recurrent cells as objects: the math of each built-in cell's layer (BPPSA Sec. 4.1-4.2, Appendix E).

A :class:`RecurrentCell` owns, for one layer in one direction over a batch-first sequence:

- its forward by torch's fused op, with the Jacobian factors the backward needs recomputed with one GEMM
  (:mod:`lightning_bppsa.jacobians.recurrent`), and the calling convention of the compiled forward and
  backward kernels that emit or consume the same factors (:meth:`~RecurrentCell.kernel_forward`,
  :meth:`~RecurrentCell.kernel_backward`: the kernels module is the caller's choice);
- its step Jacobians as :class:`~lightning_bppsa.jacobians.FactoredJacobians`
  (``J = diag(u) + [diag(s)..] W``, never materialised);
- the map from state gradients to gate pre-activation gradients, and the parameter gradients as GEMMs over
  all steps at once (Eq. 2);
- its row of the cost model (:class:`~lightning_bppsa.cost_model.CellCost`).

No device is chosen here: :mod:`lightning_bppsa.backends` plans each layer call and runs it on a backend,
through the two ``torch.library`` ops of :mod:`lightning_bppsa.ops`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from lightning_bppsa.cost_model import CellCost
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.jacobians.recurrent import gate_preactivations, gru_jacobians
from lightning_bppsa.kernels import recurrent as native

__all__ = ["CELLS", "GRUCell", "LSTMCell", "RNNCell", "RecurrentCell", "cell_of"]

#: torch's fused single-layer forwards (batch first, no dropout, one direction)
_VF_FORWARD = {"rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu, "gru": torch._VF.gru}


def _constant(value: float, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A tensor of ``value`` in ``like``'s dtype and device, only ever read: for plain tensors made once per
    (value, shape, dtype, device), one launch less per backward on a GPU than filling it every call."""
    if type(like) is not Tensor:  # fake, functorch or other subclass tensors: never kept beyond their call
        return torch.full(shape, value, dtype=like.dtype, device=like.device)
    return _kept_constant(value, shape, like.dtype, like.device)


@functools.lru_cache(maxsize=32)
def _kept_constant(value: float, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)


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
        out, _ = _VF_FORWARD[self.name](
            x, h0[None], tuple(weights), len(weights) == 4, 1, 0.0, True, False, True
        )
        return (out,)

    def input_projection(
        self, x: Tensor, weights: Sequence[Tensor], in_kernel: bool
    ) -> Tensor | native.Projection:
        """A forward kernel's ``gi``: ``x W_ihᵀ + b_ih`` (``+ b_hh`` where it sits outside the nonlinearity's
        gating) by one GEMM, or with ``in_kernel`` a :class:`~lightning_bppsa.kernels.recurrent.Projection`
        that the (CPU) forward kernel computes row by row."""
        w_ih = weights[0]
        bias = None
        if len(weights) == 4:
            bias = weights[2] + weights[3] if self._folds_hidden_bias else weights[2]
        if in_kernel:
            return native.Projection(x, w_ih, bias)
        flat = x.reshape(-1, x.shape[-1])
        gi = flat @ w_ih.T if bias is None else torch.addmm(bias, flat, w_ih.T)
        return gi.view(*x.shape[:2], -1)

    _folds_hidden_bias = True

    def kernel_forward(
        self,
        kernels: ModuleType,
        gi: Tensor | native.Projection,
        h0: Tensor,
        c0: Tensor | None,
        weights: Sequence[Tensor],
    ) -> tuple | None:
        """``(out, (c_n,) *factors)`` from the forward kernel of ``kernels`` (a module with ``rnn_forward`` /
        ``gru_forward`` / ``lstm_forward``: :mod:`~lightning_bppsa.kernels.recurrent`,
        :mod:`~lightning_bppsa.kernels.recurrent_cuda`), or its ``None`` where it cannot run."""
        raise NotImplementedError

    def torch_forward_with_factors(
        self, x: Tensor, h0: Tensor, c0: Tensor | None, weights: Sequence[Tensor]
    ) -> tuple:
        """``(out, (c_n,) *factors)`` by torch's fused forward, the factors recomputed by torch ops."""
        raise NotImplementedError

    def factor_shapes(self, batch: int, n: int, hidden: int) -> list[tuple[int, ...]]:
        """Shapes of the factors a forward returns after the outputs (for the ops' fake kernels)."""
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

        Where ``grad_out`` covers the whole state (``d = H``) it is one launch, ``grad_out`` after a kept zero
        row (no pass zeroing the whole buffer on a GPU)."""
        batch, n, hidden = like.shape
        d = self.state_factor * hidden
        if grad_out is not None and d == hidden:  # one launch: grad_out after a (cached) zero row
            direct = torch.cat([_constant(0.0, (batch, 1, d), like), grad_out.to(like.dtype)], 1)
        else:
            direct = like.new_zeros(batch, n + 1, d)
            if grad_out is not None:
                direct[:, 1:, :hidden].copy_(grad_out)
        if grad_hn is not None:
            direct[:, n, :hidden].add_(grad_hn)  # add_ on the view: `+=` would also copy it back onto itself
        if grad_cn is not None:
            direct[:, n, hidden:].copy_(grad_cn)
        return direct

    def jacobian_width(self, hidden: int) -> int:
        """Rows of the factored weight (``k d``)."""
        return self.gates * hidden

    def kernel_backward(
        self, kernels: ModuleType, out: Tensor, c0: Tensor | None, w_hh: Tensor, factors: Sequence[Tensor],
        grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None, sums: native.ParameterSums | None,
        need_x: bool,
    ) -> tuple | None:  # fmt: skip
        """``(d_gi, d_gh, [∇h_0(, ∇c_0)], parameter gradients or None)`` from the fused backward of ``kernels``
        (:mod:`~lightning_bppsa.kernels.recurrent`: the linear scan and the gate gradients in one pass; with
        ``sums`` the parameter gradients too, and ``d_gi`` / ``d_gh`` may be ``None`` where not needed), or its
        ``None`` where it cannot run."""
        raise NotImplementedError

    def needs_select_sweep(self, out: Tensor, grad_out: Tensor | None, grad_hn: Tensor | None) -> bool:
        """Whether only a step-by-step backward gives torch's result (the ReLU RNN with non-finite values:
        torch's backward selects, ``0 * nan`` in a scan's product would not). Reads values: a sync on a GPU."""
        return False

    def select_sweep(self, out: Tensor, factors: Sequence[Tensor], w_hh: Tensor, direct: Tensor) -> tuple:
        """Like :meth:`kernel_backward`, by a step-by-step sweep with torch's semantics."""
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

    def parameter_gradients(
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
        if self.relu:
            return (~(out <= 0)).to(out.dtype)
        return torch.addcmul(_constant(1.0, (), out), out, out, value=-1)  # 1 - h², one launch

    def kernel_forward(self, kernels, gi, h0, c0, weights):
        return kernels.rnn_forward(gi, weights[1], weights[3] if len(weights) == 4 else None, h0, self.relu)

    def torch_forward_with_factors(self, x, h0, c0, weights):
        return self.torch_forward(x, h0, c0, weights)

    def factor_shapes(self, batch, n, hidden):
        return []

    def jacobians(self, out, factors, w_hh):
        return FactoredJacobians(w_hh, self.slope(out))

    def gate_gradients(self, g, out, factors, jac):
        # select, not multiply, for ReLU: torch's backward gives 0 there even for a NaN gradient
        d_a = torch.where(out <= 0, 0.0, g) if self.relu else g * jac.scales  # jac.scales: the slope
        return d_a, d_a

    def needs_select_sweep(self, out, grad_out, grad_hn):
        return self.relu and not all(
            bool(torch.isfinite(t).all()) for t in (out, grad_out, grad_hn) if t is not None
        )

    def select_sweep(self, out, factors, w_hh, direct):
        """``d_a`` by torch's sequential ReLU backward, ``d_a = where(mask, g, 0)``."""
        mask, n = ~(out <= 0), direct.shape[1] - 1
        d_a = torch.empty_like(out)
        g = direct[:, n]
        for t in range(n - 1, -1, -1):
            d_a[:, t] = torch.where(mask[:, t], g, 0.0)
            g = d_a[:, t] @ w_hh + direct[:, t]
        return d_a, d_a, [g], None

    def kernel_backward(self, kernels, out, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        result = kernels.rnn_backward(out, w_hh, _contiguous(grad_out), self.relu, sums, need_x,
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

    def kernel_forward(self, kernels, gi, h0, c0, weights):
        return kernels.gru_forward(gi, weights[1], weights[3] if len(weights) == 4 else None, h0)

    def torch_forward_with_factors(self, x, h0, c0, weights):
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

    def kernel_backward(self, kernels, out, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        result = kernels.gru_backward(
            *factors, w_hh, _contiguous(grad_out), sums, need_x, _contiguous(grad_hn)
        )
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

    def kernel_forward(self, kernels, gi, h0, c0, weights):
        result = kernels.lstm_forward(gi, weights[1], h0, c0)
        if result is None:
            return None
        out, cells, gates = result
        return out, cells[:, -1].clone(), cells, gates, c0.clone()

    def torch_forward_with_factors(self, x, h0, c0, weights):
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

    def kernel_backward(self, kernels, out, c0, w_hh, factors, grad_out, grad_hn, grad_cn, sums, need_x):
        cells, gates, _ = factors
        result = kernels.lstm_backward(gates, cells, c0, w_hh, _contiguous(grad_out), _contiguous(grad_cn), sums,
                                       need_x, _contiguous(grad_hn))  # fmt: skip
        return (
            None if result is None else (result[0], result[0], list(result[1:3]), result[3] if sums else None)
        )


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


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
