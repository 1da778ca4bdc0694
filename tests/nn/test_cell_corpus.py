"""Cells written the ways people write them (issue 30): each factors (``last_stats["jacobians"] ==
"factored"``), runs the compiled loop on CPU, and equals autograd through the Python loop in float64; the
cells whose Jacobians do not factor (a reduction over the state, a layer norm of it) fall back with a reason.

Gate-block-first styles are the point: pointwise ops on the whole ``(rows, m H)`` gate block (biases, sums of
the input's and the state's projections, activations) before it is split by ``chunk``, ``split``,
``unbind`` of a ``(rows, m, H)`` view or slicing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from lightning_bppsa.kernels import _native
from torch import nn

from lightning_bppsa.nn import Recurrence, cell_kernel
from lightning_bppsa.nn.cell_structure import NotTraceable, trace_cell

F64 = torch.float64

pytestmark = pytest.mark.skipif(
    not _native.build_expected(), reason="no C compiler: the loop is not compiled"
)


class HandLSTM(nn.Module):
    """torch's LSTMCell formula by hand: ``gates = ih(x) + hh(h)`` then ``chunk(4, 1)``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.ih, self.hh = nn.Linear(inputs, 4 * hidden), nn.Linear(hidden, 4 * hidden)

    def forward(self, x, state):
        h, c = state
        gates = self.ih(x) + self.hh(h)
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class MethodLSTM(nn.Module):
    """An LSTM with activations as methods on the whole block, ``torch.split`` and ``torch.addcmul``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = (hidden, hidden)
        self.w = nn.Linear(inputs + hidden, 4 * hidden)

    def forward(self, x, state):
        h, c = state
        gates = self.w(torch.cat([x, h], -1))
        ifo = gates[:, : 3 * self.hidden].sigmoid()
        i, f, o = torch.split(ifo, self.hidden, dim=-1)
        g = gates[:, 3 * self.hidden :].tanh()
        c = torch.addcmul(f * c, i, g)
        return o * c.tanh(), c


class HandGRU(nn.Module):
    """torch's GRUCell formula by hand, the reset and update gates as one ``(rows, 2H)`` block."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 3 * hidden), nn.Linear(hidden, 3 * hidden)

    def forward(self, x, h):
        gi, gh = self.ih(x), self.hh(h)
        k = 2 * self.hidden
        r, z = torch.sigmoid(gi[:, :k] + gh[:, :k]).chunk(2, 1)
        n = torch.tanh(gi[:, k:] + r * gh[:, k:])
        return (1 - z) * n + z * h


class ViewGRU(nn.Module):
    """A GRU whose gate block is viewed ``(rows, 3, H)`` and unbound."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 3 * hidden), nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, h):
        i_r, i_z, i_n = self.ih(x).view(-1, 3, self.hidden).unbind(1)
        h_r, h_z, h_n = self.hh(h).view(-1, 3, self.hidden).unbind(1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        return torch.lerp(torch.tanh(i_n + r * h_n), h, z)


class MinGRU(nn.Module):
    """minGRU: gates from the input only, ``h' = (1 - z) h + z h~``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.lin = nn.Linear(inputs, 2 * hidden)

    def forward(self, x, h):
        z, candidate = self.lin(x).chunk(2, -1)
        z = torch.sigmoid(z)
        return (1 - z) * h + z * candidate


class MinLSTM(nn.Module):
    """minLSTM: normalised forget and input gates from the input only."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.lin = nn.Linear(inputs, 3 * hidden)

    def forward(self, x, h):
        f, i, candidate = self.lin(x).sigmoid().chunk(3, -1)
        total = f + i
        return (f / total) * h + (i / total) * candidate


class LiGRU(nn.Module):
    """Light GRU: one update gate and a ReLU candidate, ``a = W x + U h`` split in two."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.w, self.u = nn.Linear(inputs, 2 * hidden), nn.Linear(hidden, 2 * hidden, bias=False)

    def forward(self, x, h):
        a, c = (self.w(x) + self.u(h)).chunk(2, -1)
        z = torch.sigmoid(a)
        return z * h + (1 - z) * torch.relu(c)


class IndRNN(nn.Module):
    """IndRNN: ``h' = relu(x W + u ⊙ h + b)``, with a clamp on the recurrent weight."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.w = nn.Linear(inputs, hidden)
        self.u = nn.Parameter(torch.rand(hidden))

    def forward(self, x, h):
        return F.relu(self.w(x) + self.u.clamp(-1, 1) * h)


class PeepholeLSTM(nn.Module):
    """A peephole LSTM: the gates see the cell state through per-coordinate weights."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.w = nn.Linear(inputs + hidden, 4 * hidden)
        self.peep = nn.Parameter(torch.randn(3, hidden) * 0.3)

    def forward(self, x, state):
        h, c = state
        i, f, g, o = self.w(torch.cat([x, h], -1)).chunk(4, -1)
        i = torch.sigmoid(i + self.peep[0] * c)
        f = torch.sigmoid(f + self.peep[1] * c)
        c = f * c + i * torch.tanh(g)
        return torch.sigmoid(o + self.peep[2] * c) * torch.tanh(c), c


class CoupledGRU(nn.Module):
    """A GRU with coupled gates as ``torch.lerp`` and the recurrent weights as ``F.linear(h, weight.t())``
    (stored ``(in, out)``), the input's as ``x @ weight``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.wx = nn.Parameter(torch.randn(inputs, 3 * hidden) * 0.4)
        self.wh = nn.Parameter(torch.randn(hidden, 3 * hidden) * 0.4)
        self.b = nn.Parameter(torch.zeros(3 * hidden))

    def forward(self, x, h):
        gx = x @ self.wx + self.b
        gh = F.linear(h, self.wh.t())
        z, r, _ = (gx + gh).sigmoid().chunk(3, 1)
        n = torch.tanh(gx.chunk(3, 1)[2] + r * gh.chunk(3, 1)[2])
        return torch.lerp(h, n, z)


class LeakyMemory(nn.Module):
    """A gated cell with a leaky memory and a tuple state ``(h, m)``, the gate block through ``torch.addmm``
    and sliced by hand."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = (hidden, hidden)
        self.ih = nn.Linear(inputs, 3 * hidden)
        self.whh = nn.Parameter(torch.randn(3 * hidden, hidden) * 0.4)
        self.leak = nn.Parameter(torch.rand(hidden))

    def forward(self, x, state):
        h, m = state
        H = self.hidden
        gates = torch.addmm(self.ih(x), h, self.whh.t())
        a, g, o = gates[:, :H], gates[:, H : 2 * H].sigmoid(), gates[:, 2 * H :]
        decay = torch.sigmoid(self.leak)
        m = decay * m + (1 - decay) * torch.tanh(a) * g
        return torch.sigmoid(o) * torch.tanh(m) + 0.1 * h, m


class SizesGRU(nn.Module):
    """A GRU whose gate block is split by a list of sizes ``[2H, H]``, viewed ``(rows, 2, H)`` and indexed
    (a negative index too), and sliced from the end (``[:, -H:]``)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = hidden
        self.ih = nn.Linear(inputs, 3 * hidden)
        self.hh = nn.Parameter(torch.randn(hidden, 3 * hidden) * 0.4)

    def forward(self, x, h):
        H = self.hidden
        gi, gh = self.ih(x), h @ self.hh
        rz, _ = torch.split(gi + gh, [2 * H, H], dim=1)
        gates = torch.sigmoid(rz).view(-1, 2, H)
        r, z = gates[:, 0], gates[:, -1]
        n = torch.tanh(gi[:, -H:] + r * gh[:, -H:])
        return z * h + (1 - z) * n


class SlicedWeights(nn.Module):
    """One weight matrix sliced per use: ``F.linear`` with its blocks, ``torch.matmul`` and ``@`` with transposed
    blocks."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = hidden
        self.w = nn.Parameter(torch.randn(2 * hidden, hidden + inputs) * 0.4)

    def forward(self, x, h):
        H = self.hidden
        z = torch.sigmoid(F.linear(h, self.w[:H, :H]) + F.linear(x, self.w[:H, H:]))
        n = torch.tanh(torch.matmul(h, self.w[H:, :H].t()) + x @ self.w[H:, H:].t())
        return z * h + (1 - z) * n


class TorchLSTMCell(nn.Module):
    """torch's own ``nn.LSTMCell`` (its CPU trace updates the gate block and its pieces in place)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.cell = nn.LSTMCell(inputs, hidden)

    def forward(self, x, state):
        return self.cell(x, state)


class TorchGRUCell(nn.Module):
    """torch's own ``nn.GRUCell`` (``add_``, ``sigmoid_``, ``mul_``, ``tanh_`` in its CPU trace)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.cell = nn.GRUCell(inputs, hidden)

    def forward(self, x, h):
        return self.cell(x, h)


class InPlaceLSTM(HandLSTM):
    """:class:`HandLSTM` written with in-place ops on its own values: the projections summed into one, three gates
    activated in place through one view and read through another made before (the same elements), the memory
    updated in place."""

    def forward(self, x, state):
        h, c = state
        H = self.ih.out_features // 4
        gates = self.ih(x)
        gates.add_(self.hh(h))
        ifo, g = gates[:, : 3 * H], gates[:, 3 * H :]
        gates[:, : 3 * H].sigmoid_()
        i, f, o = ifo.chunk(3, 1)
        c = f * c
        c.add_(i * torch.tanh(g))
        return o * torch.tanh(c), c


class WideMemory(nn.Module):
    """An LSTM whose memory is twice as wide as its output: ``(h, c)`` of widths ``(H, 2 H)``, the output reading
    the sum of the memory's halves."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = (hidden, 2 * hidden)
        self.ih, self.hh = nn.Linear(inputs, 7 * hidden), nn.Linear(hidden, 7 * hidden)

    def forward(self, x, state):
        h, c = state
        H = self.hidden
        gates = self.ih(x) + self.hh(h)
        i, f, g = gates[:, : 6 * H].chunk(3, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        a, b = c.chunk(2, 1)
        return torch.sigmoid(gates[:, 6 * H :]) * torch.tanh(a + b), c


class WideFirst(nn.Module):
    """A state ``(m, h)`` of widths ``(2 H, H)``, both read by one linear map of ``cat([x, m, h])``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = (2 * hidden, hidden)
        self.w = nn.Linear(inputs + 3 * hidden, 3 * hidden)

    def forward(self, x, state):
        m, h = state
        H = self.hidden
        z, n = self.w(torch.cat([x, m, h], -1)).split([2 * H, H], -1)
        m = torch.lerp(m, torch.tanh(z), 0.3)
        return m, torch.tanh(n + m[:, :H] * m[:, H:])


class CoprimeWidths(nn.Module):
    """A state of widths ``(H - 1, H + 1)`` (blocks of their greatest common divisor)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden - 1, hidden + 1)
        self.ih, self.hh = nn.Linear(inputs, 2 * hidden), nn.Linear(2 * hidden, 2 * hidden)

    def forward(self, x, state):
        h, c = state
        z = torch.tanh(self.ih(x) + self.hh(torch.cat([h, c], -1)))
        return z[:, : h.shape[-1]] + 0.5 * h * z[:, : h.shape[-1]], z[:, h.shape[-1] :] + 0.5 * c


FACTORED = [
    HandLSTM,
    MethodLSTM,
    HandGRU,
    ViewGRU,
    SizesGRU,
    MinGRU,
    MinLSTM,
    LiGRU,
    IndRNN,
    PeepholeLSTM,
    CoupledGRU,
    LeakyMemory,
    SlicedWeights,
    TorchLSTMCell,
    TorchGRUCell,
    InPlaceLSTM,
    WideMemory,
    WideFirst,
    CoprimeWidths,
]


class PerPieceLSTM(HandLSTM):
    """:class:`HandLSTM` written per piece: each gate's sum of its own column blocks."""

    def forward(self, x, state):
        h, c = state
        i, f, g, o = (a + b for a, b in zip(self.ih(x).chunk(4, 1), self.hh(h).chunk(4, 1), strict=True))
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class ReducedOverState(nn.Module):
    """A step that reads the mean over the state's coordinates: every coordinate depends on all of them."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.hh(h) - h.mean(-1, keepdim=True))


class NormalisedState(nn.Module):
    """A step with a layer norm of the state."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.hh(self.norm(h)))


class ReversedMemory(nn.Module):
    """A memory twice as wide as ``h`` whose coordinates are reversed every step (``flip``): not per coordinate."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.state_size = (hidden, 2 * hidden)
        self.ih, self.hh = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)

    def forward(self, x, state):
        h, c = state
        c = 0.9 * c.flip(-1) + 0.1 * torch.cat([h, h], -1)
        return torch.tanh(self.ih(x) + self.hh(h)) * c[:, : self.hidden], c


class ActivatedAfterSplit(nn.Module):
    """Slices its gate block, then activates the whole block in place: the slices (views made before) read the
    activated values, which an out-of-place rewrite would lose."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 2 * hidden), nn.Linear(hidden, 2 * hidden)

    def forward(self, x, h):
        gates = self.ih(x) + self.hh(h)
        H = h.shape[-1]
        z, n = gates[:, :H], gates[:, H:]
        gates.sigmoid_()
        return z * h + (1 - z) * n


def _loop(cell: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every step's state (tuple states concatenated) by calling the cell in a Python loop from zero."""
    size = cell.state_size
    state = (
        tuple(x.new_zeros(x.shape[1], s) for s in size)
        if isinstance(size, tuple)
        else x.new_zeros(x.shape[1], size)
    )
    outs = []
    for x_t in x:
        state = cell(x_t, state)
        outs.append(torch.cat(state, -1) if isinstance(state, tuple) else state)
    return torch.stack(outs)


def _grads(forward, leaves: list[torch.Tensor], last_only: bool = False) -> list[torch.Tensor]:
    """``forward()``'s outputs and the gradients of a loss on every step (weighted per coordinate) or on the last."""
    out = forward()
    loss = (
        out[-1].pow(2).sum()
        if last_only
        else (out.pow(2) * torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype)).sum()
    )
    return [out.detach(), *torch.autograd.grad(loss, leaves)]


def _recurrence(cell: nn.Module, x: torch.Tensor) -> tuple[Recurrence, list[torch.Tensor]]:
    """``Recurrence(cell)`` with the linear scan, and its outputs' and gradients' values."""
    module = Recurrence(cell, algorithm="linear")
    if isinstance(cell.state_size, tuple):  # every state tensor's gradient path: the loss reads all of them
        cell.output_fn = lambda state: torch.cat(state, -1)
    leaves = [x, *cell.parameters()]
    return module, _grads(lambda: module(x)[0], leaves)


@pytest.mark.parametrize("cell_type", FACTORED, ids=lambda c: c.__name__)
def test_cells_written_by_style_factor_and_equal_autograd_through_the_loop(cell_type):
    torch.manual_seed(0)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(7, 4, 3, dtype=F64, requires_grad=True)
    module, ours = _recurrence(cell, x)
    stats = module.last_stats
    assert stats["jacobians"] == "factored", stats.get("dense_reason")
    assert stats["cell_kernel"], stats["cell_kernel_reason"]
    theirs = _grads(lambda: _loop(cell, x), [x, *cell.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("cell_type", "reason"),
    [
        (ReducedOverState, "aten.mean"),
        (NormalisedState, "layer_norm"),
        (ReversedMemory, "aten.flip"),
        (ActivatedAfterSplit, "after modifying memory it overlaps in place (aten.sigmoid_"),
    ],
    ids=["reduction over H", "layer norm of h", "permuted wide memory", "in place under a view"],
)
def test_cells_that_do_not_factor_fall_back_with_a_reason_and_stay_exact(cell_type, reason):
    torch.manual_seed(1)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(6, 2, 3, dtype=F64, requires_grad=True)
    module, ours = _recurrence(cell, x)
    stats = module.last_stats
    assert stats["jacobians"] == "dense" and reason in stats["dense_reason"], stats.get("dense_reason")
    theirs = _grads(lambda: _loop(cell, x), [x, *cell.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cell_type", [HandLSTM, TorchLSTMCell, InPlaceLSTM], ids=lambda c: c.__name__)
def test_a_gate_block_first_cell_factors_as_if_written_per_piece(cell_type):
    """The same pieces of the same weights, and the same pointwise ops, as the cell written per piece (torch's own
    LSTMCell and an LSTM written with in-place ops too: their traces normalise to the same graph)."""
    structures = []
    for kind in (cell_type, PerPieceLSTM):
        torch.manual_seed(2)
        cell = kind(3, 5).to(F64)
        states = (torch.zeros(4, 5, dtype=F64), torch.zeros(4, 5, dtype=F64))
        structures.append(trace_cell(cell, torch.randn(4, 3, dtype=F64), states, is_tuple=True))
    block, per_piece = structures
    assert block.reason is None and per_piece.reason is None
    assert [(p.offset, p.reads) for p in block.pieces] == [(p.offset, p.reads) for p in per_piece.pieces]
    assert len(block.pieces) == 4 and block.factor_elements == per_piece.factor_elements
    assert block.has_offsets and per_piece.has_offsets
    ops = [
        Counter(str(n.target) for n in s.pointwise.graph.nodes if n.op == "call_function") for s in structures
    ]
    assert ops[0] == ops[1]


@pytest.mark.parametrize("cell_type", [HandLSTM, SizesGRU, CoupledGRU], ids=lambda c: c.__name__)
def test_per_piece_rewrite_is_exact_on_the_torch_path(cell_type, monkeypatch):
    """Where nothing is compiled (as on a GPU) the rewritten step runs in torch: factored and exact."""
    monkeypatch.setenv("BPPSA_NATIVE", "0")
    monkeypatch.setattr(cell_kernel, "_LIBRARIES", {})
    torch.manual_seed(3)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    module, ours = _recurrence(cell, x)
    stats = module.last_stats
    assert stats["jacobians"] == "factored" and stats["traced_forward"] and not stats["cell_kernel"]
    theirs = _grads(lambda: _loop(cell, x), [x, *cell.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_input_terms_added_to_pieces_are_taken_into_their_offsets_and_read_whole():
    """``ih(x) + hh(h)`` per gate: the pointwise part reads no input value (no partials by them are kept), and the
    pieces' terms are one ``(rows, 4H)`` tensor (``ih(x)`` with both biases in one GEMM) the loop reads as is."""
    torch.manual_seed(4)
    cell = HandLSTM(3, 5).to(F64)
    states = (torch.zeros(4, 5, dtype=F64), torch.zeros(4, 5, dtype=F64))
    structure = trace_cell(cell, torch.randn(4, 3, dtype=F64), states, is_tuple=True)
    kernel = cell_kernel.CellKernel(structure, F64)
    assert kernel.input_partial_elements == 0
    x = torch.randn(6, 3, dtype=F64)
    _, terms = structure.kernel_inputs(list(cell.parameters()), x)
    joined = cell_kernel._joined(terms, 6, 5)
    assert joined.data_ptr() == terms[0].data_ptr() and joined.shape == (6, 20)
    torch.testing.assert_close(joined, cell.ih(x) + cell.hh.bias, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("cell_type", "groups"),
    [(WideMemory, (1, 2)), (WideFirst, (2, 1)), (CoprimeWidths, (2, 3))],
    ids=lambda c: getattr(c, "__name__", str(c)),
)
def test_states_of_different_widths_are_traced_as_blocks_of_their_common_divisor(cell_type, groups):
    """The structure's states are the blocks (``n_states`` of ``width``) in the flat state's order, and its loop
    and linearisation take and give the cell's own tensors."""
    torch.manual_seed(5)
    cell = cell_type(3, 5).to(F64)
    sizes = cell.state_size
    width = sizes[0] // groups[0]
    states = tuple(torch.randn(6, n, dtype=F64) for n in sizes)
    x = torch.randn(6, 3, dtype=F64)
    structure = trace_cell(cell, x, states, is_tuple=True)
    assert structure.reason is None and (structure.width, structure.n_states) == (width, sum(groups))
    (new,) = structure.loop(list(cell.parameters()), x, states, 1)
    jacobians, outs = structure.linearize(list(cell.parameters()), x, states, 6)
    expected = cell(x, states)
    for ours in (new, outs):
        assert [tuple(t.shape) for t in ours] == [(6, n) for n in sizes]
        torch.testing.assert_close(torch.cat(ours, -1), torch.cat(expected, -1), rtol=1e-12, atol=1e-12)
    assert_jacobians_of(jacobians, lambda s: torch.cat(cell(x, s.split(list(sizes), -1)), -1), states)


def assert_jacobians_of(jacobians, step, states) -> None:
    """``jacobians`` (of ``rows`` rows, factored) equal the dense per-row Jacobians of ``step(flat) -> flat``
    (the flat state: ``states`` concatenated) at ``states``, float64 to 1e-12 (shared with test_cell_fused)."""
    flat = torch.cat(states, -1)
    rows, width = flat.shape
    dense = torch.func.jacrev(step)(flat)  # (rows, d, rows, d)
    index = torch.arange(rows)
    torch.testing.assert_close(
        jacobians.dense().reshape(rows, width, width),
        dense[index, :, index].transpose(1, 2),
        rtol=1e-12,
        atol=1e-12,
    )


def test_a_cell_modifying_its_buffer_in_place_is_not_traced():
    """The out-of-place rewrite is for the step's own values: a buffer (state kept across calls) is refused."""

    class Counting(HandLSTM):
        def __init__(self, inputs: int, hidden: int) -> None:
            super().__init__(inputs, hidden)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x, state):
            self.calls.add_(1)
            return super().forward(x, state)

    cell = Counting(3, 4).to(F64)
    states = (torch.zeros(2, 4, dtype=F64), torch.zeros(2, 4, dtype=F64))
    with pytest.raises(NotTraceable, match=r"modifies a parameter or buffer in place \(aten.add_.Tensor\)"):
        trace_cell(cell, torch.randn(2, 3, dtype=F64), states, is_tuple=True)


@pytest.mark.parametrize(
    ("cell_type", "kept", "full"),
    [(HandLSTM, 9, 10), (WideMemory, 17, 27), (CoprimeWidths, 10, 50)],
    ids=lambda c: getattr(c, "__name__", str(c)),
)
def test_the_compiled_loop_keeps_only_the_partials_not_zero_by_structure(cell_type, kept, full):
    """The loop stores and sweeps only the partials a path of the traced graph connects (an LSTM's memory does not
    depend on its output gate; a state traced as narrow blocks has each new block depend on its own blocks
    only): every column it drops is zero in autograd's partials on random inputs, every one it keeps is not,
    and its factors expanded are the torch path's Jacobians."""
    torch.manual_seed(6)
    cell = cell_type(3, 5).to(F64)
    rows, params = 6, list(cell.parameters())
    states = tuple(torch.randn(rows, n, dtype=F64) for n in cell.state_size)
    x = torch.randn(rows, 3, dtype=F64)
    structure = trace_cell(cell, x, states, is_tuple=True)
    _, factors = cell_kernel.CellKernel(structure, F64).forward(params, x, torch.cat(states, -1), rows, True)
    reference, _ = structure.linearize(params, x, states, rows)
    columns = reference.scales.view(rows, full, structure.width).abs().amax((0, 2))
    chosen = list(factors.layout.scale_columns)
    assert len(chosen) == kept and len(structure.scale_columns) == full
    assert all(columns[c] > 0 for c in chosen)
    assert all(columns[c] == 0 for c in range(full) if c not in chosen)
    assert factors.scales.shape[-1] == kept * structure.width
    torch.testing.assert_close(factors.jacobians.scales, reference.scales, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(factors.jacobians.weight, reference.weight, rtol=0, atol=0)


@pytest.mark.parametrize("cell_type", [WideMemory, CoprimeWidths], ids=lambda c: c.__name__)
def test_a_scan_other_than_the_sweep_reads_the_kept_partials_expanded_exactly(cell_type):
    """``algorithm="blelloch"``: the scan reads the compiled loop's factors as FactoredJacobians (the kept columns
    in their places, zeros elsewhere), exact against autograd through the loop."""
    torch.manual_seed(7)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    module = Recurrence(cell, algorithm="blelloch")
    cell.output_fn = lambda state: torch.cat(state, -1)
    ours = _grads(lambda: module(x)[0], [x, *cell.parameters()])
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    theirs = _grads(lambda: _loop(cell, x), [x, *cell.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class SineGated(MinGRU):
    """minGRU with a gate the generator cannot compile (``sin`` of the input's projection): that stays in torch."""

    def forward(self, x, h):
        z, candidate = self.lin(x).chunk(2, -1)
        z = torch.sin(z)
        return (1 - z) * h + z * candidate


@pytest.mark.parametrize(
    ("cell_type", "in_step"),
    [(MinLSTM, True), (SineGated, False)],
    ids=lambda c: getattr(c, "__name__", str(c)),
)
def test_input_only_pointwise_values_the_step_alone_reads_are_computed_in_the_compiled_step(
    cell_type, in_step
):
    """minLSTM's ``f / (f + i)`` and ``i / (f + i) * candidate`` depend on the input only: the compiled step computes
    them from ``f``, ``i`` and ``candidate`` (no autograd through them), the torch path's step reads them made
    for all rows; an op the generator lacks keeps them in torch (the loop still compiled). Exact either way."""
    torch.manual_seed(8)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    module, ours = _recurrence(cell, x)
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    (traced,) = module._traced.values()
    structure, kernel = traced.structure, traced.kernel
    assert len(structure.kernel_views) == 2
    assert (kernel._layout.view is structure.kernel_views[0]) == in_step
    ops = lambda graph: {str(n.target) for n in graph.nodes if n.op == "call_function"}  # noqa: E731
    assert "aten.div.Tensor" not in ops(structure.pointwise.graph) or cell_type is SineGated
    assert ("aten.div.Tensor" in ops(kernel._layout.view.pointwise.graph)) == in_step
    theirs = _grads(lambda: _loop(cell, x), [x, *cell.parameters()])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cell_type", [HandGRU, CoupledGRU, TorchGRUCell], ids=lambda c: c.__name__)
def test_the_compiled_loops_input_part_splits_each_projection_once(cell_type):
    """The pieces' input-only terms and the input values the step reads are blocks of one projection (sliced,
    chunked, or split again for the terms): the loop's input part takes them from one split of it, so that the
    backward joins their gradients once (no zero-padded gradient per split or slice, then their sum)."""
    cell = cell_type(3, 5).to(F64)
    states = (torch.zeros(4, 5, dtype=F64),)
    structure = trace_cell(cell, torch.randn(4, 3, dtype=F64), states, is_tuple=False)
    graph = structure.kernel_views[-1].inputs.graph
    splits = Counter(n.args[0] for n in graph.nodes if n.op == "call_function" and "split" in str(n.target))
    assert splits and max(splits.values()) == 1, splits
    assert not [
        n for n in graph.nodes if n.target is torch.ops.aten.slice.Tensor and n.meta["val"].shape[-1] == 5
    ]
