"""Every emulated-kernel case of tests/kernels/test_cuda_emulated.py, on a real GPU through CuPy.

Same inputs, same float64 plain loop, same tolerances; plus what the emulator cannot show: the launch
on torch's current stream (a side stream here), and the look-back under real concurrency (a long chain
of many chunks, repeated).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels

from lightning_bppsa.jacobians.factored import FactoredJacobians

pytestmark = pytest.mark.cuda


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_cuda_emulated.py"
    spec = importlib.util.spec_from_file_location("_emulated_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _load_cases()


@pytest.fixture
def gpu(cuda) -> torch.device:  # the conftest fixture already failed if the kernels cannot run here
    return cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), CASES.SWEEP_CASES)
def test_sweep_factored_gru_tiles(gpu, batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d)
    weight, scales, diag, grad = CASES.make_factored(batch, n, d, 3, True, per_step, gen)
    args = [t.to(gpu, dtype) for t in (weight, scales, diag, grad)]
    out = kernels.scan_factored(*args, "linear", 1)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), CASES.SWEEP_CASES)
def test_sweep_dense(gpu, batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d + 1)
    jt, grad = CASES.make_dense(batch, n, d, per_step, gen)
    CASES.check(kernels.scan_dense(jt.to(gpu, dtype), grad.to(gpu, dtype), "linear", 1).cpu(), jt, grad, dtype)


@pytest.mark.parametrize(("tiles", "diagonal", "d"), [(1, False, 20), (1, True, 7), (2, False, 13), (5, True, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_warp_sweep_any_number_of_weight_tiles(gpu, tiles, diagonal, d, dtype):
    gen = torch.Generator().manual_seed(tiles * 100 + d)
    weight, scales, diag, grad = CASES.make_factored(2, 15, d, tiles, diagonal, True, gen)
    args = [None if t is None else t.to(gpu, dtype) for t in (weight, scales, diag, grad)]
    out = kernels.scan_factored(*args, "linear", 1)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_warp_sweeps_with_five_tiles(gpu, dtype):
    gen = torch.Generator().manual_seed(32)
    weight, scales, diag, grad = CASES.make_factored(2, 23, 32, 5, True, True, gen)
    out = kernels.scan_factored(*(t.to(gpu, dtype) for t in (weight, scales, diag, grad)), "chunked", 5)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


def test_warp_sweep_long_rows_many_blocks(gpu):
    """B = 160 rows (more one-warp blocks than an H100 has SMs) of 301 steps, d = 20, GRU tiles."""
    gen = torch.Generator().manual_seed(7)
    weight, scales, diag, grad = CASES.make_factored(160, 301, 20, 3, True, False, gen)
    out = kernels.scan_factored(*(t.to(gpu) for t in (weight, scales, diag, grad)), "linear", 1)
    reference = CASES.plain_loop(FactoredJacobians(weight, scales, diag).dense(), grad)
    CASES.check(out.cpu(), reference, grad, torch.float64)


@pytest.mark.parametrize(("batch", "n", "d", "chunk", "resident", "per_step"), CASES.CHUNKED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked(gpu, batch, n, d, chunk, resident, per_step, dtype):
    gen = torch.Generator().manual_seed(n + d)
    tiles, diagonal = (3, True) if d > 1 else (1, False)
    weight, scales, diag, grad = CASES.make_factored(batch, n, d, tiles, diagonal, per_step, gen)
    args = [None if t is None else t.to(gpu, dtype) for t in (weight, scales, diag, grad)]
    out = kernels.scan_factored(*args, "chunked", chunk)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)
    jt, grad = CASES.make_dense(batch, n, d, per_step, gen)
    CASES.check(kernels.scan_dense(jt.to(gpu, dtype), grad.to(gpu, dtype), "blelloch", chunk).cpu(), jt, grad, dtype)


def test_long_chain_look_back_repeated(gpu):
    """625 chunks per row: most blocks look back over aggregates of still-running blocks."""
    gen = torch.Generator().manual_seed(1)
    weight, scales, diag, grad = CASES.make_factored(4, 5000, 20, 1, False, True, gen)
    reference = CASES.plain_loop(FactoredJacobians(weight, scales, diag).dense(), grad)
    args = [None if t is None else t.to(gpu) for t in (weight, scales, diag, grad)]
    for _ in range(5):
        out = kernels.scan_factored(*args, "chunked", 8)
        CASES.check(out.cpu(), reference, grad, torch.float64)


def test_launch_runs_on_the_current_stream(gpu):
    gen = torch.Generator().manual_seed(2)
    jt, grad = CASES.make_dense(4, 300, 20, True, gen)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        jt_gpu, grad_gpu = jt.to(gpu), grad.to(gpu)
        out = kernels.scan_dense(jt_gpu, grad_gpu, "chunked", 16)
        host = out.to("cpu", non_blocking=False)
    CASES.check(host, jt, grad, torch.float64)


def test_empty_chain(gpu):
    grad = torch.randn(3, 1, 4, dtype=torch.float64, device=gpu)
    out = kernels.scan_dense(torch.empty(3, 0, 4, 4, dtype=torch.float64, device=gpu), grad, "chunked", 4)
    torch.testing.assert_close(out, grad)


def test_wide_states_several_passes_and_tiles(gpu):
    gen = torch.Generator().manual_seed(260)
    jt, grad = CASES.make_dense(1, 2, 260, True, gen)
    CASES.check(kernels.scan_dense(jt.to(gpu), grad.to(gpu), "linear", 2).cpu(), jt, grad, torch.float64)
    weight, scales, diag, grad = CASES.make_factored(1, 6, 50, 3, True, True, gen)
    args = [t.to(gpu, torch.float32) for t in (weight, scales, diag, grad)]
    out = kernels.scan_factored(*args, "chunked", 3)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


def test_half_precision_and_non_contiguous(gpu):
    gen = torch.Generator().manual_seed(3)
    jt, grad = CASES.make_dense(2, 9, 5, True, gen)
    out = kernels.scan_dense(jt.to(gpu, torch.bfloat16), grad.to(gpu, torch.bfloat16), "chunked", 3)
    assert out.dtype == torch.bfloat16
    expected = CASES.plain_loop(jt.bfloat16().float(), grad.bfloat16().float())
    torch.testing.assert_close(out.cpu(), expected.bfloat16())
    jt_gpu, grad_gpu = jt.to(gpu).mT.contiguous().mT, grad.to(gpu).mT.contiguous().mT
    CASES.check(kernels.scan_dense(jt_gpu, grad_gpu, "chunked", 5).cpu(), jt, grad, torch.float64)


def test_chunked_kernel_beyond_48_kib_of_shared_memory(gpu):
    """d = 120 (float32): two 121 x 120 matrices need ~114 KiB: the launch opts in to the device's limit."""
    gen = torch.Generator().manual_seed(120)
    weight, scales, diag, grad = CASES.make_factored(2, 40, 120, 1, True, True, gen)
    launch = kernels.launch_config(
        factored=True, element_bytes=4, n=40, batch=2, d=120, m=120, affine=True, algorithm="chunked",
        chunk_size=4, shared_limit=kernels.device_shared_limit(torch.cuda.current_device()),
    )  # fmt: skip
    assert launch.kernel.startswith("bppsa_chunked_") and launch.shared_bytes > kernels.SHARED_BYTES
    args = [t.to(gpu, torch.float32) for t in (weight, scales, diag, grad)]
    out = kernels.scan_factored(*args, "chunked", 4)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


def test_deterministic_algorithms_repeat_the_bits(gpu):
    gen = torch.Generator().manual_seed(4)
    weight, scales, diag, grad = CASES.make_factored(8, 3000, 20, 3, True, True, gen)
    args = [t.to(gpu) for t in (weight, scales, diag, grad)]
    torch.use_deterministic_algorithms(True)
    try:
        runs = [kernels.scan_factored(*args, "chunked", 4) for _ in range(5)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(runs[0], other) for other in runs[1:])
    CASES.check(runs[0].cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


def test_exact_look_back_stress_bit_equal_to_the_sweep(gpu):
    """Signed permutations and integer gradients (exact in any order): the chunked kernel over a grid far
    above residency (64 rows x 2500 chunks) must give the sweep's bits on every repeat."""
    gen = torch.Generator().manual_seed(5)
    jt, grad = CASES.exact_dense(64, 5000, 4, gen)
    jt, grad = jt.to(gpu), grad.to(gpu)
    sweep = kernels.scan_dense(jt, grad, "linear", 1)
    assert torch.equal(sweep.cpu(), CASES.plain_loop(jt.cpu(), grad.cpu()))
    for _ in range(10):
        assert torch.equal(kernels.scan_dense(jt, grad, "chunked", 2), sweep)


def test_cuda_graph_capture_after_the_first_call(gpu):
    gen = torch.Generator().manual_seed(6)
    jt, grad = CASES.make_dense(4, 300, 20, True, gen)
    jt_gpu, grad_gpu = jt.to(gpu), grad.to(gpu)
    kernels.scan_dense(jt_gpu, grad_gpu, "chunked", 16)  # compiled and loaded outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.scan_dense(jt_gpu, grad_gpu, "chunked", 16)
    graph.replay()
    torch.cuda.synchronize()
    CASES.check(out.cpu(), jt, grad, torch.float64)
