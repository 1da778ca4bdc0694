"""torch's fused CUDA RNN-cell ops in the trace of a cell step (issue 30): lightning_bppsa/nn/cell_fused.py.

On CUDA, ``nn.LSTMCell`` / ``nn.GRUCell`` call ``aten._thnn_fused_lstm_cell`` / ``aten._thnn_fused_gru_cell``,
which this CPU-only torch has no kernel for. So: the decompositions are checked against the CPU cells' own
math in float64; the CUDA trace is made on this machine with fake tensors of device ``cuda`` (dispatch then
takes the CUDA branch of ``aten::lstm_cell`` / ``gru_cell``, and the fused ops' meta kernels give shapes); and a
cell calling the fused op itself is traced on the CPU, its traced loop and factored Jacobians compared with
torch's CPU cell on the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_bppsa.nn import cell_structure
from lightning_bppsa.nn.cell_fused import FUSED_CELL_DECOMPOSITIONS
from lightning_bppsa.nn.cell_structure import trace_cell

F64 = torch.float64


def _corpus():
    """tests/nn/test_cell_corpus.py (its Jacobian check)."""
    path = Path(__file__).resolve().with_name("test_cell_corpus.py")
    spec = importlib.util.spec_from_file_location("_corpus_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS = _corpus()
aten = torch.ops.aten
LSTM_OP, GRU_OP = aten._thnn_fused_lstm_cell.default, aten._thnn_fused_gru_cell.default


def _gates(cell: nn.Module, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two projections torch's CUDA cells hand the fused op (no biases: the op adds them)."""
    return x @ cell.weight_ih.t(), h @ cell.weight_hh.t()


@pytest.mark.parametrize("bias", [True, False])
def test_the_lstm_decomposition_equals_torchs_lstm_cell(bias):
    torch.manual_seed(0)
    cell = nn.LSTMCell(3, 5, bias=bias, dtype=F64)
    x, h, c = torch.randn(4, 3, dtype=F64), torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64)
    hy, cy, workspace = FUSED_CELL_DECOMPOSITIONS[LSTM_OP](*_gates(cell, x, h), c, cell.bias_ih, cell.bias_hh)
    expected_h, expected_c = cell(x, (h, c))
    torch.testing.assert_close(hy, expected_h, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(cy, expected_c, rtol=1e-14, atol=1e-14)
    # the workspace is the activated gates [i | f | g | o] the outputs are made of
    i, f, g, o = workspace.chunk(4, 1)
    assert workspace.shape == (4, 20)
    assert ((i > 0) & (i < 1) & (f > 0) & (f < 1) & (o > 0) & (o < 1)).all()
    torch.testing.assert_close(f * c + i * g, expected_c, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(o * torch.tanh(expected_c), expected_h, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("bias", [True, False])
def test_the_gru_decomposition_equals_torchs_gru_cell(bias):
    torch.manual_seed(1)
    cell = nn.GRUCell(3, 5, bias=bias, dtype=F64)
    x, h = torch.randn(4, 3, dtype=F64), torch.randn(4, 5, dtype=F64)
    input_gates, hidden_gates = _gates(cell, x, h)
    hy, workspace = FUSED_CELL_DECOMPOSITIONS[GRU_OP](
        input_gates, hidden_gates, h, cell.bias_ih, cell.bias_hh
    )
    expected = cell(x, h)
    torch.testing.assert_close(hy, expected, rtol=1e-14, atol=1e-14)
    # the workspace is [r | z | n | hx | hg_n + b_hn], as the CUDA kernel saves it for its backward
    r, z, n, hx, h_n = workspace.chunk(5, 1)
    b_n = cell.bias_hh[10:] if bias else 0
    torch.testing.assert_close(hx, h, rtol=0, atol=0)
    torch.testing.assert_close(h_n, hidden_gates[:, 10:] + b_n, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close((1 - z) * n + z * h, expected, rtol=1e-14, atol=1e-14)
    b_in = cell.bias_ih[10:] if bias else 0
    torch.testing.assert_close(torch.tanh(input_gates[:, 10:] + b_in + r * h_n), n, rtol=1e-14, atol=1e-14)


def _fake_cuda(cell: nn.Module, rows: int, inputs: int, sizes: tuple[int, ...]):
    """``cell`` moved to fake tensors of device ``cuda``, an input and states there too: tracing them takes
    torch's CUDA dispatch without a GPU (values are never computed)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        cell.to_empty(device="cuda")
        x = torch.empty(rows, inputs, device="cuda", dtype=F64)
        states = tuple(torch.empty(rows, n, device="cuda", dtype=F64) for n in sizes)
    return cell, x, states


def _pointwise_ops(structure) -> list[str]:
    return [str(n.target) for n in structure.pointwise.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cell_type", [nn.LSTMCell, nn.GRUCell])
def test_torchs_cells_traced_on_cuda_factor_as_on_the_cpu(cell_type, bias, monkeypatch):
    """The CUDA trace (fused op, decomposed) factors into the same pointwise part as the CPU trace."""
    is_tuple = cell_type is nn.LSTMCell
    sizes = (5, 5) if is_tuple else (5,)
    on_cpu = cell_type(3, 5, bias=bias, dtype=F64)
    cpu = trace_cell(
        on_cpu, torch.zeros(4, 3, dtype=F64), tuple(torch.zeros(4, n, dtype=F64) for n in sizes), is_tuple
    )
    cell, x, states = _fake_cuda(cell_type(3, 5, bias=bias, dtype=F64), 4, 3, sizes)
    # the CUDA dispatch is taken here: the trace reaches the fused op (and writes it as its math)
    called = []
    recording = {
        op: lambda *a, op=op, **k: called.append(op) or FUSED_CELL_DECOMPOSITIONS[op](*a, **k)
        for op in FUSED_CELL_DECOMPOSITIONS
    }
    monkeypatch.setattr(cell_structure, "FUSED_CELL_DECOMPOSITIONS", recording)
    cuda = trace_cell(cell, x, states, is_tuple)
    assert called and set(called) == {LSTM_OP if is_tuple else GRU_OP}
    assert cpu.reason is None and cuda.reason is None, cuda.reason
    assert _pointwise_ops(cuda) == _pointwise_ops(cpu)
    # the same column blocks of the state's linear maps (the frontier may hold its values in another order)
    blocks = lambda structure: [(p.offset, p.reads) for p in structure.pieces]  # noqa: E731
    assert blocks(cuda) == blocks(cpu) and cuda.has_offsets == cpu.has_offsets


class FusedLSTM(nn.Module):
    """An LSTM cell written with torch's fused CUDA op itself (no CPU kernel: only its trace can run here)."""

    def __init__(self, cell: nn.LSTMCell) -> None:
        super().__init__()
        self.cell = cell
        self.state_size = (cell.hidden_size, cell.hidden_size)

    def forward(self, x, state):
        h, c = state
        hy, cy, _ = LSTM_OP(*_gates(self.cell, x, h), c, self.cell.bias_ih, self.cell.bias_hh)
        return hy, cy


class FusedGRU(nn.Module):
    """A GRU cell written with torch's fused CUDA op itself."""

    def __init__(self, cell: nn.GRUCell) -> None:
        super().__init__()
        self.cell = cell
        self.state_size = cell.hidden_size

    def forward(self, x, h):
        return GRU_OP(*_gates(self.cell, x, h), h, self.cell.bias_ih, self.cell.bias_hh)[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("cell_type", "wrapper"), [(nn.LSTMCell, FusedLSTM), (nn.GRUCell, FusedGRU)])
def test_a_cell_calling_the_fused_op_traces_to_torchs_cell_math_and_jacobians(cell_type, wrapper, bias):
    """On the CPU: the traced step (the fused op decomposed) computes torch's CPU cell on the same weights, and
    its factored Jacobians are autograd's of that cell."""
    torch.manual_seed(2)
    reference = cell_type(3, 5, bias=bias, dtype=F64)
    cell = wrapper(reference)
    is_tuple = cell_type is nn.LSTMCell
    sizes = (5, 5) if is_tuple else (5,)
    x = torch.randn(6, 3, dtype=F64)
    states = tuple(torch.randn(6, n, dtype=F64) for n in sizes)
    structure = trace_cell(cell, x, states, is_tuple)
    assert structure.reason is None, structure.reason
    params = list(cell.parameters())
    (new,) = structure.loop(params, x, states, 1)
    jacobians, outs = structure.linearize(params, x, states, 6)
    expected = reference(x, states if is_tuple else states[0])
    expected = torch.cat(expected, -1) if is_tuple else expected
    for ours in (new, outs):
        torch.testing.assert_close(torch.cat(ours, -1), expected, rtol=1e-12, atol=1e-12)

    def step(flat):
        out = reference(x, tuple(flat.split(list(sizes), -1)) if is_tuple else flat)
        return torch.cat(out, -1) if is_tuple else out

    CORPUS.assert_jacobians_of(jacobians, step, states)


class ReadsWorkspace(FusedLSTM):
    """Reads the fused op's workspace (its forget gate): pointwise in the state too, so it factors."""

    def forward(self, x, state):
        h, c = state
        hy, cy, workspace = LSTM_OP(*_gates(self.cell, x, h), c, self.cell.bias_ih, self.cell.bias_hh)
        return hy + workspace[:, 5:10], cy


class NormedGRU(nn.Module):
    """``nn.GRUCell`` then a layer norm: another fused op (``native_layer_norm``), which stays and is refused."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.cell = nn.GRUCell(inputs, hidden, dtype=F64)

    def forward(self, x, h):
        return F.layer_norm(self.cell(x, h), (h.shape[-1],))


def test_a_cell_reading_the_workspace_gets_its_values():
    torch.manual_seed(3)
    cell = ReadsWorkspace(nn.LSTMCell(3, 5, dtype=F64))
    x, states = torch.randn(4, 3, dtype=F64), (torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64))
    structure = trace_cell(cell, x, states, True)
    assert structure.reason is None, structure.reason
    ((hy, cy),) = structure.loop(list(cell.parameters()), x, states, 1)
    lstm = cell.cell
    forget = torch.sigmoid(
        F.linear(x, lstm.weight_ih, lstm.bias_ih) + F.linear(states[0], lstm.weight_hh, lstm.bias_hh)
    )
    expected_h, expected_c = lstm(x, states)
    torch.testing.assert_close(hy, expected_h + forget[:, 5:10], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cy, expected_c, rtol=1e-12, atol=1e-12)


def test_another_fused_op_on_cuda_falls_back_with_its_reason():
    cell, x, states = _fake_cuda(NormedGRU(3, 5), 4, 3, (5,))
    structure = trace_cell(cell, x, states, False)
    assert structure.reason is not None and "native_layer_norm" in structure.reason, structure.reason
