"""Recurrence's compiled loop on CUDA (nn/cell_cuda.py) on the ``backend`` (tests/gpu/conftest.py).

On a GPU the cell and the input live on the device and Recurrence's own dispatch picks the CUDA loop (NVRTC
through CuPy); emulated, the same generated kernels run through the host emulation on CPU tensors (the
dispatch is pointed at them). Either way the gradients equal autograd through the Python loop of the cell:
float64 to 1e-10, float32 as close to the float64 truth as autograd's own float32 loop (derived tolerance).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels.cell_cuda_emulated import EmulatedBackend
from torch import nn

from lightning_bppsa.nn import Recurrence, recurrence
from lightning_bppsa.nn.cell_cuda import CudaCellKernel
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda

F64 = torch.float64


def _load(name: str):
    """A module of tests/nn (its cells) by path."""
    path = Path(__file__).resolve().parents[1] / "nn" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_{name}_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES, CUDA_CASES, CORPUS = _load("test_cell_kernel"), _load("test_cell_cuda"), _load("test_cell_corpus")


class GateBlockGRU(nn.Module):
    """torch's GRUCell formula as people write it: pointwise ops on whole gate blocks, then ``chunk``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 3 * hidden), nn.Linear(hidden, 3 * hidden)

    def forward(self, x, h):
        gi, gh = self.ih(x), self.hh(h)
        i_r, i_z, i_n = gi.chunk(3, 1)
        h_r, h_z, h_n = gh.chunk(3, 1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h


@pytest.fixture
def loop_backend(backend, monkeypatch):
    """``backend``; emulated, Recurrence's compiled loop for CPU tensors is the CUDA one through the emulation."""
    if not backend.is_cuda:
        emulated = EmulatedBackend(timeout=600.0)
        monkeypatch.setattr(
            recurrence,
            "_compiled_loop",
            lambda structure, dtype, device: CudaCellKernel(structure, dtype, device, emulated),
        )
    return backend


def _platform(backend) -> str:
    return "cuda" if backend.is_cuda else "cuda (emulated)"


def _grads(module_or_cell, x, leaves, last_only: bool):
    """The outputs and the gradients of a weighted loss (on every step, or on the last)."""
    out = module_or_cell(x)[0] if isinstance(module_or_cell, Recurrence) else CORPUS._loop(module_or_cell, x)
    weights = torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype, device=out.device)
    loss = (out[-1].pow(2) * weights).sum() if last_only else (out.pow(2) * weights).sum()
    return [out.detach(), *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("last_only", [False, True])
@pytest.mark.parametrize("algorithm", ["linear", "blelloch"])
@pytest.mark.parametrize("cell_type", [*CUDA_CASES.CELLS, GateBlockGRU])
def test_gradients_equal_autograd_through_the_loop_in_float64(loop_backend, cell_type, algorithm, last_only):
    torch.manual_seed(0)
    _check_float64(loop_backend, cell_type, algorithm, last_only)


def _check_float64(loop_backend, cell_type, algorithm: str, last_only: bool) -> None:
    """``Recurrence(cell_type(...))`` factors, runs the CUDA loop, and its outputs and gradients equal autograd
    through the Python loop of the cell in float64 to 1e-10."""
    hidden = loop_backend.size(cuda=40, emulated=5)  # two warps per block on the GPU
    steps, batch = loop_backend.size(cuda=50, emulated=6), loop_backend.size(cuda=8, emulated=3)
    cell = cell_type(3, hidden).to(loop_backend.device, F64)
    if isinstance(cell.state_size, tuple):  # the loss reads every state tensor
        cell.output_fn = lambda state: torch.cat(state, -1)
    x = torch.randn(steps, batch, 3, dtype=F64, device=loop_backend.device, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm=algorithm)
    ours = _grads(module, x, leaves, last_only)
    stats = module.last_stats
    assert stats["path"] == "scan" and stats["jacobians"] == "factored", stats
    assert stats["cell_kernel"] == _platform(loop_backend), stats["cell_kernel_reason"]
    theirs = _grads(cell, x, leaves, last_only)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch"])
@pytest.mark.parametrize("cell_type", [CORPUS.TorchLSTMCell, CORPUS.TorchGRUCell], ids=lambda c: c.__name__)
def test_torchs_own_cells_factor_and_equal_autograd_through_their_loop(loop_backend, cell_type, algorithm):
    """``nn.LSTMCell`` / ``nn.GRUCell`` (issue 30): on CUDA they call torch's fused cell ops
    (``aten._thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``), which the trace writes as their pointwise math
    (nn/cell_fused.py): the Jacobians factor, the CUDA loop runs, and the gradients equal autograd through the
    Python loop of the cell itself (the fused kernels, float64) to 1e-10. Emulated, the cells trace to their CPU
    form: the same checks on the CPU dispatch."""
    torch.manual_seed(3)
    _check_float64(loop_backend, cell_type, algorithm, False)


@pytest.mark.parametrize("cell_type", [CASES.SmoothOps, GateBlockGRU])
def test_float32_gradients_within_the_derived_tolerance(loop_backend, cell_type):
    torch.manual_seed(1)
    hidden = loop_backend.size(cuda=64, emulated=33)  # a block of two warps
    steps, batch = loop_backend.size(cuda=200, emulated=5), loop_backend.size(cuda=16, emulated=2)
    cell = cell_type(3, hidden).to(loop_backend.device)
    x = torch.randn(steps, batch, 3, device=loop_backend.device, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm="linear")
    ours = _grads(module, x, leaves, False)
    assert module.last_stats["cell_kernel"] == _platform(loop_backend), module.last_stats[
        "cell_kernel_reason"
    ]
    baseline = _grads(cell, x, leaves, False)  # autograd through the loop in float32
    cell64 = copy.deepcopy(cell).double()
    x64 = x.detach().double().requires_grad_()
    reference = _grads(cell64, x64, [x64, *cell64.parameters()], False)
    for name, a, ref, base in zip(
        ["output", "x", *(n for n, _ in cell.named_parameters())], ours, reference, baseline, strict=True
    ):
        assert_derived_close(a, ref, base, factor=4.0, floor=1e-6, name=name)


def test_without_gradients_the_cuda_loop_runs_the_forward(loop_backend):
    torch.manual_seed(2)
    cell = CASES.ThreeStates(3, 5).to(loop_backend.device, F64)
    x = torch.randn(6, 3, 3, dtype=F64, device=loop_backend.device)
    module = Recurrence(cell)
    with torch.no_grad():
        out, final = module(x)
    assert module.last_stats["path"] == "compiled loop"
    reference = CORPUS._loop(cell, x)
    torch.testing.assert_close(out, reference[..., :5], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(final, -1), reference[-1], rtol=1e-12, atol=1e-12)
