"""The CUDA loop's layout for narrow state blocks (nn/cell_cuda.py, CELL_SPREAD in kernels/cell_loop_cuda.h).

A state of widths (31, 33) factors into 64 blocks of width 1 (their greatest common divisor): with one thread per
coordinate, thread 0 alone did a step's 64 x 64 multiply-adds with the weights in the forward and again in the
backward (CoprimeWidths ran 45 ms a training step on an H200 where HandLSTM ran 4.8). Below a warp's width the
block shares them out; these tests count the busiest thread's work from the launches and check the results
against autograd in float64 through the host emulation."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native
from lightning_bppsa.kernels.cell_cuda_emulated import H100_SHARED_BYTES, EmulatedBackend

from lightning_bppsa.nn import Recurrence, cell_cuda, recurrence
from lightning_bppsa.nn.cell_cuda import CudaCellKernel, generate, launch_config, weight_products
from lightning_bppsa.nn.cell_structure import trace_cell

F64 = torch.float64
CPU = torch.device("cpu")
FORWARD, BACKWARD = cell_cuda.KERNELS[:2]

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host emulation"),
    pytest.mark.skipif(
        not _native.build_expected(), reason="no C compiler: no CPU compiled loop to compare with"
    ),
]


def _sibling(name: str):
    """A test module of this folder, loaded by path (tests are not a package)."""
    path = Path(__file__).resolve().parent / name
    spec = importlib.util.spec_from_file_location(f"_sibling_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS = _sibling("test_cell_corpus.py")
CUDA_TESTS = _sibling("test_cell_cuda.py")  # its comparison of the emulated kernels with the CPU loop


def _source(cell_type, hidden: int):
    cell = cell_type(3, hidden).to(F64)
    states = tuple(torch.randn(2, s, dtype=F64) for s in cell.state_size)
    structure = trace_cell(cell, torch.randn(2, 3, dtype=F64), states, True)
    return cell, structure, torch.cat(states, -1), generate(structure, F64)[0]


def test_narrow_blocks_share_the_weight_products_over_the_block():
    """CoprimeWidths at H = 32: 64 states and 64 pieces of width 1 read all 64 state columns. Thread j alone
    would do 64 x 64 = 4096 multiply-adds a step in each kernel; spread over a block of 64 threads, 64. A state
    of warp-wide blocks (HandLSTM, H = 32) keeps one thread per coordinate: the launches it was timed with."""
    *_, source = _source(CORPUS.CoprimeWidths, 32)
    assert (source.width, source.n_states, source.pieces, source.read_columns) == (1, 64, 64, 64)
    assert source.spread and "#define CELL_SPREAD 1" in source.text
    alone = source.pieces * source.read_columns  # thread 0's share with one thread per coordinate
    assert alone == 4096
    # the forward's block: a thread per item of the step with its partials (64 states, 33 constant scales)
    for name, block in ((FORWARD, 128), (BACKWARD, 64)):
        launch = launch_config(source, name, 16, 1000, H100_SHARED_BYTES)
        assert (launch.grid, launch.block, launch.staged) == (16, block, True)
        assert weight_products(source, launch) == 64, name
    backward = launch_config(source, BACKWARD, 16, 1000, H100_SHARED_BYTES)
    # products, column sums, the states' gradient (two buffers), staged weights
    assert backward.shared_bytes == (2 * 64 + 64 + 2 * 64 + 64 * 64) * 8

    *_, lstm = _source(CORPUS.HandLSTM, 32)
    assert not lstm.spread and "#define CELL_SPREAD 0" in lstm.text
    for name in (FORWARD, BACKWARD):
        launch = launch_config(lstm, name, 16, 1000, H100_SHARED_BYTES)
        assert launch.block == 32 and weight_products(lstm, launch) == 4 * 32, name
    with pytest.raises(ValueError, match="no products"):
        weight_products(source, launch_config(source, cell_cuda.KERNELS[2], 16, 1000, H100_SHARED_BYTES))


@pytest.mark.parametrize("max_threads", [256, 32])  # 32: every thread takes two piece coordinates / columns
@pytest.mark.parametrize("staged", [True, False])
def test_narrow_blocks_equal_the_cpu_compiled_loop(monkeypatch, max_threads, staged):
    """The spread kernels' states, factors, fused sweeps (each gradient form) and products after a scan equal the
    CPU loop's to float64 rounding, with the weights staged or in global memory and a block smaller than the
    work (the strided loops' second trip)."""
    monkeypatch.setattr(cell_cuda, "MAX_THREADS", max_threads)
    torch.manual_seed(5)
    cell, structure, s0, source = _source(CORPUS.CoprimeWidths, 32)
    backend = CUDA_TESTS.assert_cuda_loop_equals_cpu_loop(cell, structure, s0, source, staged, batch=2, steps=3)
    launched = {(kernel, block) for kernel, _, block, _ in backend.launches if kernel in (FORWARD, BACKWARD)}
    assert launched == {(FORWARD, min(128, max_threads)), (BACKWARD, min(64, max_threads))}


@pytest.mark.parametrize("algorithm", ["linear", "blelloch"])
def test_coprime_widths_on_the_spread_loop_equal_autograd_in_float64(monkeypatch, algorithm):
    """Recurrence(CoprimeWidths) at H = 32 on the CUDA loop (emulated): outputs and every gradient equal autograd
    through the Python loop of the cell to 1e-10."""
    backend = EmulatedBackend()
    monkeypatch.setattr(
        recurrence,
        "_compiled_loop",
        lambda structure, dtype, device: CudaCellKernel(structure, dtype, device, backend),
    )
    torch.manual_seed(6)
    cell = CORPUS.CoprimeWidths(3, 32).to(F64)
    cell.output_fn = lambda state: torch.cat(state, -1)  # the loss reads both state tensors
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm=algorithm)
    ours = CORPUS._grads(lambda: module(x)[0], leaves)
    stats = module.last_stats
    assert stats["jacobians"] == "factored" and stats["cell_kernel"] == "cuda (emulated)", stats
    assert (FORWARD, 2, 128) in [launch[:3] for launch in backend.launches]
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.slow  # ~2 s of nvcc
def test_nvcc_compiles_the_spread_kernels_of_coprime_widths_without_spills(tmp_path):
    """The text NVRTC gets for CoprimeWidths at H = 32 (float32, the benchmark's), through nvcc for sm_90: the
    spread kernels build without warnings and without spilling registers."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit (no GPU needed)")
    cell = CORPUS.CoprimeWidths(3, 32)
    states = tuple(torch.randn(2, s) for s in cell.state_size)
    source = generate(trace_cell(cell, torch.randn(2, 3), states, True), torch.float32)[0]
    path = tmp_path / "coprime.cu"
    path.write_text(source.text)
    cmd = [nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-Xptxas", "-warn-spills"]
    result = subprocess.run(
        [*cmd, "-o", str(path.with_suffix(".cubin")), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count(" 0 bytes spill stores") == len(cell_cuda.ENTRIES), result.stderr[-3000:]
