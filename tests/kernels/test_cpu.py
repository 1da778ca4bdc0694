"""The compiled CPU kernel of the linear sweep (kernels/linear_scan.c) through the ops, and its fallback."""

import logging
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning_bppsa.kernels import cpu

from lightning_bppsa import FactoredJacobians, scan_ref
from lightning_bppsa._chains import FactoredChain
from lightning_bppsa.algorithms import torch_sweep
from lightning_bppsa.testing import assert_derived_close


def kernel_expected() -> bool:
    """A C compiler is on PATH and BPPSA_NATIVE is not 0: then the kernel must build (a failure fails)."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    return os.environ.get("BPPSA_NATIVE", "1") != "0" and bool(compiler) and shutil.which(compiler[0]) is not None


needs_kernel = pytest.mark.skipif(not kernel_expected(), reason="no C compiler on PATH: the kernel is not built")


@needs_kernel
def test_the_kernel_builds_where_a_compiler_exists():
    assert cpu.available(), "a C compiler is on PATH but kernels/linear_scan.c did not build (see the log)"


@pytest.fixture(params=[True, False], ids=["compiled", "torch-loop"])
def compiled(request, monkeypatch):
    """Run a test with the compiled kernel and again with the torch loop it replaces."""
    if request.param and not kernel_expected():
        pytest.skip("no C compiler on PATH: the kernel is not built")
    if request.param:
        assert cpu.available(), "a C compiler is on PATH but kernels/linear_scan.c did not build"
    if not request.param:
        monkeypatch.setattr(cpu, "available", lambda: False)
    return request.param


def contracting(batch, n, d, dtype):
    jac = torch.randn(batch, n, d, d, dtype=torch.float64)
    return (0.95 * jac / torch.linalg.matrix_norm(jac, ord=2, keepdim=True)).to(dtype)


def random_factored(batch, n, d, tiles, with_diagonal, dtype):
    weight = torch.randn(tiles * d, d, dtype=dtype) / (tiles * d) ** 0.5
    diagonal = torch.rand(batch, n, d, dtype=dtype) * 0.5 if with_diagonal else None
    return FactoredJacobians(weight, torch.rand(batch, n, tiles * d, dtype=dtype), diagonal)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize(("batch", "n", "d"), [(1, 1, 1), (3, 7, 5), (5, 50, 20), (2, 33, 9), (4, 16, 16)])
def test_dense_linear_matches_reference(compiled, dtype, per_step, batch, n, d):
    jt = contracting(batch, n, d, dtype)
    grad = torch.randn(batch, n + 1, d, dtype=dtype) if per_step else torch.randn(batch, d, dtype=dtype)
    out = torch.ops.bppsa.scan_dense(jt, grad, "linear", 1)
    assert_derived_close(out, scan_ref(jt, grad), floor=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("tiles", "with_diagonal"), [(1, False), (1, True), (3, True), (4, False)])
@pytest.mark.parametrize("per_step", [False, True])
# d = 37 > 32 takes the kernel's general blocked loop, the others its register-resident one
@pytest.mark.parametrize(("batch", "n", "d"), [(1, 1, 1), (3, 7, 5), (6, 40, 20), (2, 9, 12), (2, 6, 37)])
def test_factored_linear_matches_reference(compiled, dtype, tiles, with_diagonal, per_step, batch, n, d):
    jac = random_factored(batch, n, d, tiles, with_diagonal, dtype)
    grad = torch.randn(batch, n + 1, d, dtype=dtype) if per_step else torch.randn(batch, d, dtype=dtype)
    out = torch.ops.bppsa.scan_factored(jac.weight, jac.scales, jac.diagonal, grad, "linear", 1)
    assert_derived_close(out, scan_ref(jac, grad), floor=1e-12 if dtype == torch.float64 else 1e-5)


@needs_kernel
@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
def test_cpu_op_runs_its_linear_sweeps_in_the_kernel(monkeypatch, algorithm):
    """The CPU kernel of the op hands every linear sweep to the C kernel; where that declines, the torch
    loop runs instead (same result)."""
    calls = []
    for name in ("linear_factored", "linear_dense"):  # chunked scans its dense summaries linearly
        monkeypatch.setattr(cpu, name, lambda *args, name=name: calls.append(name) or False)
    jac = random_factored(2, 40, 4, 1, False, torch.float64)
    grad = torch.randn(2, 4, dtype=torch.float64)
    out = torch.ops.bppsa.scan_factored(jac.weight, jac.scales, None, grad, algorithm, 8)
    assert calls, "the compiled sweep was not asked"
    assert_derived_close(out, scan_ref(jac, grad), floor=1e-12)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [3, 20, 40])  # the register-blocked widths and the wide loop
@pytest.mark.parametrize("layout", ["time-major", "batch-major"])
def test_kernel_takes_strided_views_and_a_diagonal(layout, d, dtype):
    """The kernel reads the per-step tensors through their strides (a batch-major tensor's time-major view
    needs no copy) and adds the diagonal term itself: equal to the torch loop on the same chain."""
    batch, n, tiles = 3, 7, 2
    gen = torch.Generator().manual_seed(d)
    weight = torch.randn(tiles * d, d, generator=gen, dtype=torch.float64) / d**0.5
    scales, diagonal, add = (torch.randn(batch, n, w, generator=gen, dtype=torch.float64) for w in (tiles * d, d, d))
    last = torch.randn(batch, d, generator=gen, dtype=torch.float64)
    def torch_loop(dt):
        chain = FactoredChain(weight.to(dt), scales.to(dt).transpose(0, 1), diagonal.to(dt).transpose(0, 1))
        result = torch.empty(n + 1, batch, d, dtype=dt)
        result[n] = last.to(dt)
        torch_sweep(chain, result, add.to(dt).transpose(0, 1))
        return result

    expected, baseline = torch_loop(torch.float64), torch_loop(dtype)
    views = [t.to(dtype) for t in (weight, scales, diagonal, add)]
    if layout == "time-major":
        views[1:] = [t.transpose(0, 1).contiguous() for t in views[1:]]
        out = torch.empty(n + 1, batch, d, dtype=dtype)
    else:
        views[1:] = [t.transpose(0, 1) for t in views[1:]]
        out = torch.empty(batch, n + 1, d, dtype=dtype).transpose(0, 1)
    out[n] = last.to(dtype)
    assert cpu.linear_factored(*views, out)
    assert_derived_close(out, expected, baseline if dtype == torch.float32 else None, floor=1e-12)


@needs_kernel
def test_nan_propagates_through_the_kernel():
    jac = random_factored(2, 10, 4, 1, False, torch.float64)
    scales = jac.scales.clone()
    scales[1, 6, 2] = float("nan")
    out = torch.ops.bppsa.scan_factored(jac.weight, scales, None, torch.randn(2, 4, dtype=torch.float64), "linear", 1)
    assert out[1, :7].isnan().any() and not out[1, 7:].isnan().any() and not out[0].isnan().any()


@needs_kernel
def test_kernel_declines_what_it_does_not_handle():
    out = torch.zeros(3, 2, 4, dtype=torch.float16)
    assert not cpu.linear_factored(torch.eye(4).half(), torch.ones(2, 2, 4).half(), None, None, out)
    out = torch.zeros(3, 2, 4)
    assert not cpu.linear_factored(torch.eye(4).double(), torch.ones(2, 2, 4), None, None, out)  # mixed dtypes
    assert not cpu.linear_factored(torch.eye(4), torch.ones(2, 2, 4), None, None, torch.zeros(3, 4, 2).mT)


def test_disabled_by_environment(monkeypatch, caplog):
    monkeypatch.setenv("BPPSA_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="lightning_bppsa.kernels.cpu"):
        assert cpu._load() is None
    assert "BPPSA_NATIVE=0" in caplog.text


def _warnings_loading_with_compiler(compiler: str, monkeypatch, cache, caplog) -> str:
    """The warnings of a first load (cache directory ``cache``) with ``CC=compiler``, which must fail."""
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger="lightning_bppsa.kernels.cpu"):
        assert cpu._load() is None
    return caplog.text


def test_failing_compiler_is_named_with_its_status_and_the_fallback(monkeypatch, tmp_path, caplog):
    text = _warnings_loading_with_compiler("/bin/false", monkeypatch, tmp_path, caplog)
    assert "`/bin/false -std=c99 -O3 " in text and "exited with status 1" in text
    assert "linear_scan.c" in text and "torch loop instead" in text
    assert "['?']" not in text
    assert not list(tmp_path.glob("*.so"))


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    text = _warnings_loading_with_compiler("/nonexistent/cc", monkeypatch, tmp_path, caplog)
    assert "'/nonexistent/cc' not found" in text and "torch loop instead" in text


@pytest.mark.slow  # two fresh interpreters importing the package (~5 s each here)
@needs_kernel
def test_cut_short_cached_kernel_is_rebuilt_in_a_new_process(tmp_path):
    """Issue 13.1: a cached .so truncated to 4096 bytes made every later process die of SIGBUS."""
    script = textwrap.dedent(
        """
        import torch
        from lightning_bppsa import FactoredJacobians, backprop_scan, scan_ref
        from lightning_bppsa.kernels import cpu
        assert cpu.available()
        jac = FactoredJacobians(torch.randn(4, 4, dtype=torch.float64) / 4, torch.rand(2, 30, 4, dtype=torch.float64))
        g = torch.randn(2, 4, dtype=torch.float64)
        assert torch.allclose(backprop_scan(jac, g, algorithm="linear"), scan_ref(jac, g))
        """
    )
    env = {**os.environ, "BPPSA_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=300)
    (library,) = tmp_path.glob("bppsa_linear_*.so")
    with open(library, "r+b") as f:
        f.truncate(4096)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, f"exit {second.returncode}: {second.stderr[-2000:]}"
    assert "is unusable" in second.stderr and "rebuilding" in second.stderr
    assert library.stat().st_size > 4096
