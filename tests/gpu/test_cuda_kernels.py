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
def gpu(cuda) -> torch.device:
    ok, reason = kernels.available()
    if not ok and importlib.util.find_spec("cupy") is None:
        pytest.skip(f"CUDA kernels unavailable: {reason}")
    assert ok, f"CuPy is installed but the CUDA kernels are unavailable: {reason}"
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
