"""The CUDA scan kernels (``kernels/scan.cu``) run on the CPU through the host-emulation header.

Same source, same launches (``cuda.launch_config``) as on a GPU; compared with a float64 plain loop.
One OS thread per CUDA thread: the grids stay tiny. ``resident`` bounds the blocks running at once
(1 = strictly one after another), which checks the chunked kernel's inter-block waits for deadlock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning_bppsa.kernels import cuda, emulated

from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")


def plain_loop(jacobians_t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``g_n`` = last-state gradient, ``g_t = J_{t+1}ᵀ g_{t+1} + δ_t``, in the inputs' dtype."""
    batch, n, d, _ = jacobians_t.shape
    per_step = grad.dim() == 3
    out = grad.new_empty(batch, n + 1, d)
    out[:, n] = grad[:, n] if per_step else grad
    for t in range(n - 1, -1, -1):
        out[:, t] = (jacobians_t[:, t] @ out[:, t + 1].unsqueeze(-1)).squeeze(-1)
        if per_step:
            out[:, t] += grad[:, t]
    return out


def make_factored(batch, n, d, tiles, diagonal, per_step, generator):
    def rand(*shape):
        return torch.rand(*shape, dtype=torch.float64, generator=generator)

    weight = (rand(tiles * d, d) - 0.5) * (2.0 / d**0.5)
    scales = 0.5 + rand(batch, n, tiles * d)
    diag = 0.5 * rand(batch, n, d) if diagonal else None
    grad = rand(batch, n + 1, d) - 0.5 if per_step else rand(batch, d) - 0.5
    return weight, scales, diag, grad


def make_dense(batch, n, d, per_step, generator):
    jt = (torch.rand(batch, n, d, d, dtype=torch.float64, generator=generator) - 0.5) * (2.2 / d**0.5)
    shape = (batch, n + 1, d) if per_step else (batch, d)
    return jt, torch.rand(*shape, dtype=torch.float64, generator=generator) - 0.5


def check(actual, jt64, grad64, dtype):
    reference = plain_loop(jt64, grad64)
    baseline = plain_loop(jt64.to(dtype), grad64.to(dtype)) if dtype != torch.float64 else None
    assert actual.dtype == dtype and actual.shape == reference.shape
    assert_derived_close(actual, reference, baseline, floor=1e-12 if dtype == torch.float64 else 1e-5)


SWEEP_CASES = [  # (batch, n, d, per_step)
    (1, 1, 1, True),
    (3, 130, 1, False),
    (2, 41, 20, True),
    (4, 17, 20, False),
    (2, 23, 33, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), SWEEP_CASES)
def test_sweep_factored_gru_tiles(batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d)
    weight, scales, diag, grad = make_factored(batch, n, d, 3, True, per_step, gen)
    args = [t.to(dtype) if t is not None else None for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, "linear", 1)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), SWEEP_CASES)
def test_sweep_dense(batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d + 1)
    jt, grad = make_dense(batch, n, d, per_step, gen)
    check(emulated.scan_dense(jt.to(dtype), grad.to(dtype), "linear", 1), jt, grad, dtype)


CHUNKED_CASES = [  # (batch, n, d, chunk, resident, per_step); chunk counts odd where possible
    (3, 130, 1, 10, None, True),  # 13 chunks, all resident: the look-back sees aggregates
    (2, 61, 20, 12, None, False),  # 6 chunks, one of them partial
    (2, 45, 20, 3, None, True),  # 15 chunks of 3 steps
    (1, 37, 33, 5, 2, True),  # 8 chunks, 2 blocks resident
    (4, 19, 20, 4, 1, False),  # one block at a time: waits only on finished blocks
]


@pytest.mark.parametrize(("batch", "n", "d", "chunk", "resident", "per_step"), CHUNKED_CASES)
def test_chunked_factored(batch, n, d, chunk, resident, per_step):
    gen = torch.Generator().manual_seed(n + d)
    tiles, diagonal = (3, True) if d > 1 else (1, False)
    weight, scales, diag, grad = make_factored(batch, n, d, tiles, diagonal, per_step, gen)
    out = emulated.scan_factored(weight, scales, diag, grad, "chunked", chunk, resident=resident)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


@pytest.mark.parametrize(("batch", "n", "d", "chunk", "resident", "per_step"), CHUNKED_CASES[:2] + CHUNKED_CASES[3:])
def test_chunked_dense_float32(batch, n, d, chunk, resident, per_step):
    gen = torch.Generator().manual_seed(n + d + 7)
    jt, grad = make_dense(batch, n, d, per_step, gen)
    out = emulated.scan_dense(jt.float(), grad.float(), "blelloch", chunk, resident=resident)
    check(out, jt, grad, torch.float32)


def test_half_precision_runs_in_float32():
    gen = torch.Generator().manual_seed(3)
    jt, grad = make_dense(2, 9, 5, True, gen)
    out = emulated.scan_dense(jt.bfloat16(), grad.bfloat16(), "chunked", 3)
    assert out.dtype == torch.bfloat16
    expected = plain_loop(jt.bfloat16().float(), grad.bfloat16().float())
    torch.testing.assert_close(out, expected.bfloat16())


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(5)
    jt, grad = make_dense(2, 12, 4, True, gen)
    out = emulated.scan_dense(jt.mT.contiguous().mT, grad.mT.contiguous().mT, "chunked", 5)
    check(out, jt, grad, torch.float64)


def test_empty_chain_returns_the_last_gradient():
    grad = torch.randn(3, 1, 4, dtype=torch.float64)
    out = emulated.scan_dense(torch.empty(3, 0, 4, 4, dtype=torch.float64), grad, "chunked", 4)
    torch.testing.assert_close(out, grad)


@pytest.mark.slow
def test_thread_sanitizer_finds_no_race(tmp_path):
    """A ThreadSanitizer build of the chunked kernel, every block resident (the look-back races if any)."""
    libtsan = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(libtsan):
        pytest.skip("g++ has no ThreadSanitizer runtime (libtsan.so)")
    script = textwrap.dedent(
        """
        import torch
        from lightning_bppsa.jacobians.factored import FactoredJacobians
        from lightning_bppsa.kernels import emulated
        g = torch.Generator().manual_seed(11)
        w = torch.rand(6, 3, dtype=torch.float64, generator=g) - 0.5
        s = torch.rand(2, 14, 6, dtype=torch.float64, generator=g)
        u = torch.rand(2, 14, 3, dtype=torch.float64, generator=g)
        grad = torch.rand(2, 15, 3, dtype=torch.float64, generator=g)
        out = emulated.scan_factored(w, s, u, grad, "chunked", 3, sanitize="thread")
        jt = FactoredJacobians(w, s, u).dense()
        ref = grad.clone()
        for t in range(13, -1, -1):
            ref[:, t] += (jt[:, t] @ ref[:, t + 1].unsqueeze(-1)).squeeze(-1)
        print("max error", (out - ref).abs().max().item())
        assert (out - ref).abs().max().item() < 1e-12
        """
    )
    env = {
        **os.environ,
        "LD_PRELOAD": libtsan,
        "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "max error" in result.stdout


def test_launch_config_is_what_cuda_uses():
    """The emulated launch goes through cuda.launch_config: a chunked call makes B * ceil(n / c) blocks."""
    launch = cuda.launch_config(
        factored=True, element_bytes=8, n=130, batch=3, d=20, m=60, affine=True, algorithm="chunked", chunk_size=10
    )
    assert (launch.kernel, launch.grid, launch.chunk) == ("bppsa_chunked_factored_f64", 39, 10)
    assert launch.block % 32 == 0 and launch.shared_bytes <= cuda.SHARED_BYTES


def test_a_launch_that_does_not_finish_is_aborted():
    """The emulator's deadlock guard: every wait checks the abort flag, so a stuck launch raises."""
    gen = torch.Generator().manual_seed(9)
    jt, grad = make_dense(4, 40, 8, True, gen)
    with pytest.raises(emulated.LaunchTimeout, match="did not finish"):
        emulated.scan_dense(jt, grad, "chunked", 4, resident=1, timeout=1e-4)
