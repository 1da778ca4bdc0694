"""torch's fused CUDA RNN-cell ops written as the pointwise math they compute, for the trace of a cell step.

On CUDA, ``aten::lstm_cell`` / ``aten::gru_cell`` (``nn.LSTMCell`` / ``nn.GRUCell``) make the two gate
projections with ``mm`` and hand the rest to one fused kernel, ``aten._thnn_fused_lstm_cell`` /
``aten._thnn_fused_gru_cell`` ``(input_gates, hidden_gates, cx | hx, input_bias=None, hidden_bias=None)``;
on the CPU the same cells trace to those ops' pointwise math. :data:`FUSED_CELL_DECOMPOSITIONS` (a
``make_fx`` decomposition table) writes the fused ops as that math, so that a cell's CUDA trace is the same
kind of graph as its CPU trace and its Jacobians factor (:mod:`~lightning_bppsa.nn.cell_structure`).

The math is the CUDA kernels' (``aten/src/ATen/native/cuda/RNN.cu``), per row of the ``(rows, k H)`` gate
blocks, biases ``(k H,)`` optional:

- LSTM, gates ``i, f, g, o`` in that order: ``i, f, o = sigmoid(.)``, ``g = tanh(.)`` of
  ``input_gates + input_bias + hidden_gates + hidden_bias``; ``cy = f cx + i g``, ``hy = o tanh(cy)``;
  outputs ``(hy, cy, workspace)``, the workspace being the four activated gates ``[i | f | g | o]``;
- GRU, gates ``r, z, n``: ``r = sigmoid(ig_r + b_ir + hg_r + b_hr)``, ``z`` the same,
  ``n = tanh(ig_n + b_in + r (hg_n + b_hn))``, ``hy = n + z (hx - n)`` (= ``(1 - z) n + z hx``); outputs
  ``(hy, workspace)``, the workspace ``[r | z | n | hx | hg_n + b_hn]``.

The workspace is what torch's backward of the fused op reads; a forward that does not read it leaves it
dead in the graph (the trace drops it). Two differences in rounding only: the biases are added to their own
projection first (``(ig + b_i) + (hg + b_h)``, as the CPU cell's ``addmm`` does: the input side is then
computed once for all rows), and every op rounds to the tensors' dtype, as on the CPU, where the CUDA kernel
keeps float16 / bfloat16 intermediates in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

__all__ = ["FUSED_CELL_DECOMPOSITIONS"]

aten = torch.ops.aten


def _biased(gates: Tensor, bias: Tensor | None) -> Tensor:
    """A gate block plus its bias (broadcast over the rows), where there is one."""
    return gates if bias is None else gates + bias


def _lstm_cell(
    input_gates: Tensor,
    hidden_gates: Tensor,
    cx: Tensor,
    input_bias: Tensor | None = None,
    hidden_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._thnn_fused_lstm_cell`` as pointwise ops: ``(hy, cy, workspace)`` (module docstring)."""
    gates = _biased(input_gates, input_bias) + _biased(hidden_gates, hidden_bias)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    cy = f * cx + i * g
    hy = o * torch.tanh(cy)
    return hy, cy, torch.cat([i, f, g, o], 1)


def _gru_cell(
    input_gates: Tensor,
    hidden_gates: Tensor,
    hx: Tensor,
    input_bias: Tensor | None = None,
    hidden_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``aten._thnn_fused_gru_cell`` as pointwise ops: ``(hy, workspace)`` (module docstring)."""
    i_r, i_z, i_n = _biased(input_gates, input_bias).chunk(3, 1)
    h_r, h_z, h_n = _biased(hidden_gates, hidden_bias).chunk(3, 1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, n, hx, h_n], 1)


_Decomposition = Callable[..., tuple[Tensor, ...]]

#: ``make_fx``'s ``decomposition_table`` for the fused RNN-cell ops (read-only)
FUSED_CELL_DECOMPOSITIONS: Mapping[torch._ops.OpOverload, _Decomposition] = MappingProxyType(
    {aten._thnn_fused_lstm_cell.default: _lstm_cell, aten._thnn_fused_gru_cell.default: _gru_cell}
)
