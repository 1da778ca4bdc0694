"""Every emulated-kernel case of tests/kernels/test_cuda_emulated.py, on the ``backend`` (tests/gpu/conftest.py).

Same inputs, same float64 plain loop, same tolerances; plus what the emulator cannot show on its own: the
launch on torch's current stream (a side stream here), CUDA graph capture, and the look-back under real
concurrency (a long chain of many chunks, repeated). On a GPU these run at their full sizes; on CPU the
same bodies run on the host emulation at the sizes it affords, so that a mistake in a test shows there.
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


@pytest.mark.slow  # the emulated grid on CPU: CI runs it, the quick loop does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), CASES.SWEEP_CASES)
def test_sweep_factored_gru_tiles(backend, batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d)
    weight, scales, diag, grad = CASES.make_factored(batch, n, d, 3, True, per_step, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=dtype), "linear", 1)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.slow  # the emulated grid on CPU: CI runs it, the quick loop does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), CASES.SWEEP_CASES)
def test_sweep_dense(backend, batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d + 1)
    jt, grad = CASES.make_dense(batch, n, d, per_step, gen)
    CASES.check(backend.scan_dense(*backend.to(jt, grad, dtype=dtype), "linear", 1).cpu(), jt, grad, dtype)


@pytest.mark.parametrize(
    ("tiles", "diagonal", "d"), [(1, False, 20), (1, True, 7), (2, False, 13), (5, True, 32)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_warp_sweep_any_number_of_weight_tiles(backend, tiles, diagonal, d, dtype):
    gen = torch.Generator().manual_seed(tiles * 100 + d)
    weight, scales, diag, grad = CASES.make_factored(2, 15, d, tiles, diagonal, True, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=dtype), "linear", 1)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_warp_sweeps_with_five_tiles(backend, dtype):
    gen = torch.Generator().manual_seed(32)
    weight, scales, diag, grad = CASES.make_factored(2, 23, 32, 5, True, True, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=dtype), "chunked", 5)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


def test_warp_sweep_long_rows_many_blocks(backend):
    """On a GPU B = 160 rows (more one-warp blocks than an H100 has SMs) of 301 steps, d = 20, GRU tiles."""
    gen = torch.Generator().manual_seed(7)
    rows = backend.size(cuda=160, emulated=3)
    weight, scales, diag, grad = CASES.make_factored(rows, 301, 20, 3, True, False, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad), "linear", 1)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


@pytest.mark.slow  # the emulated grid on CPU: CI runs it, the quick loop does not
@pytest.mark.parametrize(("batch", "n", "d", "chunk", "resident", "per_step"), CASES.CHUNKED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked(backend, batch, n, d, chunk, resident, per_step, dtype):
    gen = torch.Generator().manual_seed(n + d)
    tiles, diagonal = (3, True) if d > 1 else (1, False)
    weight, scales, diag, grad = CASES.make_factored(batch, n, d, tiles, diagonal, per_step, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=dtype), "chunked", chunk)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, dtype)
    jt, grad = CASES.make_dense(batch, n, d, per_step, gen)
    CASES.check(
        backend.scan_dense(*backend.to(jt, grad, dtype=dtype), "blelloch", chunk).cpu(), jt, grad, dtype
    )


def test_long_chain_look_back_repeated(backend):
    """On a GPU 625 chunks per row: most blocks look back over aggregates of still-running blocks."""
    gen = torch.Generator().manual_seed(1)
    rows, n = backend.size(cuda=4, emulated=2), backend.size(cuda=5000, emulated=61)
    weight, scales, diag, grad = CASES.make_factored(rows, n, 20, 1, False, True, gen)
    dense = FactoredJacobians(weight, scales, diag).dense()
    args = backend.to(weight, scales, diag, grad)
    for _ in range(backend.size(cuda=5, emulated=2)):
        out = backend.scan_factored(*args, "chunked", 8)
        CASES.check(out.cpu(), dense, grad, torch.float64)


def test_launch_runs_on_the_current_stream(backend):
    gen = torch.Generator().manual_seed(2)
    jt, grad = CASES.make_dense(backend.size(cuda=4, emulated=1), 300, 20, True, gen)
    with backend.side_stream():
        out = backend.scan_dense(*backend.to(jt, grad), "chunked", 16)
        host = out.to("cpu", non_blocking=False)
    CASES.check(host, jt, grad, torch.float64)


def test_empty_chain(backend):
    grad = torch.randn(3, 1, 4, dtype=torch.float64, device=backend.device)
    jt = torch.empty(3, 0, 4, 4, dtype=torch.float64, device=backend.device)
    torch.testing.assert_close(backend.scan_dense(jt, grad, "chunked", 4), grad)


def test_wide_states_several_passes_and_tiles(backend):
    gen = torch.Generator().manual_seed(260)
    jt, grad = CASES.make_dense(1, 2, 260, True, gen)
    CASES.check(backend.scan_dense(*backend.to(jt, grad), "linear", 2).cpu(), jt, grad, torch.float64)
    weight, scales, diag, grad = CASES.make_factored(1, 6, 50, 3, True, True, gen)
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=torch.float32), "chunked", 3)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


def test_half_precision_and_non_contiguous(backend):
    gen = torch.Generator().manual_seed(3)
    jt, grad = CASES.make_dense(2, 9, 5, True, gen)
    out = backend.scan_dense(*backend.to(jt, grad, dtype=torch.bfloat16), "chunked", 3)
    assert out.dtype == torch.bfloat16
    expected = CASES.plain_loop(jt.bfloat16().float(), grad.bfloat16().float())
    torch.testing.assert_close(out.cpu(), expected.bfloat16())
    jt_strided, grad_strided = (t.mT.contiguous().mT for t in backend.to(jt, grad))
    CASES.check(backend.scan_dense(jt_strided, grad_strided, "chunked", 5).cpu(), jt, grad, torch.float64)


def test_chunked_kernel_beyond_48_kib_of_shared_memory(backend):
    """d = 120 (float32): two 121 x 120 matrices need ~114 KiB: the launch opts in to the device's limit."""
    gen = torch.Generator().manual_seed(120)
    n = backend.size(cuda=40, emulated=12)
    weight, scales, diag, grad = CASES.make_factored(2, n, 120, 1, True, True, gen)
    launch = kernels.launch_config(
        factored=True, element_bytes=4, n=n, batch=2, d=120, m=120, affine=True, algorithm="chunked",
        chunk_size=4, shared_limit=backend.shared_limit,
    )  # fmt: skip
    assert launch.kernel.startswith("bppsa_chunked_") and launch.shared_bytes > kernels.SHARED_BYTES
    out = backend.scan_factored(*backend.to(weight, scales, diag, grad, dtype=torch.float32), "chunked", 4)
    CASES.check(out.cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


def test_deterministic_algorithms_repeat_the_bits(backend):
    gen = torch.Generator().manual_seed(4)
    rows, n = backend.size(cuda=8, emulated=2), backend.size(cuda=3000, emulated=37)
    weight, scales, diag, grad = CASES.make_factored(rows, n, 20, 3, True, True, gen)
    args = backend.to(weight, scales, diag, grad)
    torch.use_deterministic_algorithms(True)
    try:
        runs = [backend.scan_factored(*args, "chunked", 4) for _ in range(backend.size(cuda=5, emulated=2))]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(runs[0], other) for other in runs[1:])
    CASES.check(runs[0].cpu(), FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


def test_exact_look_back_stress_bit_equal_to_the_sweep(backend):
    """Signed permutations and integer gradients (exact in any order): the chunked kernel over a grid far
    above residency (on a GPU 64 rows x 2500 chunks) must give the sweep's bits on every repeat."""
    gen = torch.Generator().manual_seed(5)
    jt, grad = CASES.exact_dense(
        backend.size(cuda=64, emulated=1), backend.size(cuda=5000, emulated=41), 4, gen
    )
    jt, grad = backend.to(jt, grad)
    sweep = backend.scan_dense(jt, grad, "linear", 1)
    assert torch.equal(sweep.cpu(), CASES.plain_loop(jt.cpu(), grad.cpu()))
    for _ in range(backend.size(cuda=10, emulated=2)):
        assert torch.equal(backend.scan_dense(jt, grad, "chunked", 2), sweep)


def test_cuda_graph_capture_after_the_first_call(backend):
    gen = torch.Generator().manual_seed(6)
    jt, grad = CASES.make_dense(backend.size(cuda=4, emulated=1), 300, 20, True, gen)
    jt_dev, grad_dev = backend.to(jt, grad)
    backend.scan_dense(jt_dev, grad_dev, "chunked", 16)  # compiled and loaded outside the capture
    with backend.graph_capture() as replay:
        out = backend.scan_dense(jt_dev, grad_dev, "chunked", 16)
    replay()
    if backend.is_cuda:
        torch.cuda.synchronize()
    CASES.check(out.cpu(), jt, grad, torch.float64)


def test_flags_never_cleared_across_streams_and_graph_replays(backend):
    """The chunked kernel's flags are not cleared per launch (each launch an epoch of its own): eager launches
    of two shapes on the current stream and on a side stream (a buffer per stream), between replays of a
    captured launch (a buffer of the graph's own, zeroed by the captured memset), each against the loop."""
    gen = torch.Generator().manual_seed(8)
    rows = backend.size(cuda=4, emulated=1)
    jt, grad = CASES.make_dense(rows, backend.size(cuda=300, emulated=13), 6, True, gen)
    jt2, grad2 = CASES.make_dense(rows + 1, backend.size(cuda=500, emulated=17), 6, False, gen)
    args, args2 = backend.to(jt, grad), backend.to(jt2, grad2)
    backend.scan_dense(*args, "chunked", 4)  # compiled and loaded outside the capture
    with backend.graph_capture() as replay:
        captured = backend.scan_dense(*args, "chunked", 4)
    for _ in range(backend.size(cuda=3, emulated=2)):
        replay()
        eager = backend.scan_dense(*args2, "chunked", 3)
        with backend.side_stream():
            side = backend.scan_dense(*backend.to(jt2, grad2), "chunked", 5).to("cpu")
        CASES.check(eager.cpu(), jt2, grad2, torch.float64)
        CASES.check(side, jt2, grad2, torch.float64)
        CASES.check(captured.cpu(), jt, grad, torch.float64)
