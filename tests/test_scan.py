"""The scan engine: every algorithm against a plain float64 loop, shapes, errors, NaN propagation."""

import logging
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bppsa import FactoredJacobians, _native, backprop_scan
from lightning_bppsa.scan import run_dense, run_factored
from lightning_bppsa.testing import assert_derived_close

ALGOS = ["linear", "blelloch", "chunked", "auto"]
LENGTHS = [0, 1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 100]


def plain_backprop(jacobians_t, grad):
    """g_{i-1} = J_iᵀ g_i + δ_{i-1}, written out with nothing shared with the library."""
    batch, n, d, _ = jacobians_t.shape
    direct = grad if grad.dim() == 3 else torch.zeros(batch, n + 1, d, dtype=grad.dtype).index_copy(
        1, torch.tensor([n]), grad.unsqueeze(1)
    )
    out = [direct[:, n]]
    for i in range(n, 0, -1):
        out.append(torch.einsum("bij,bj->bi", jacobians_t[:, i - 1], out[-1]) + direct[:, i - 1])
    return torch.stack(out[::-1], 1)


def contracting(batch, n, d, dtype=torch.float64):
    """Random transposed Jacobians with spectral norm <= 0.95 (BP through a stable chain)."""
    jac = torch.randn(batch, n, d, d, dtype=dtype)
    norms = torch.linalg.matrix_norm(jac, ord=2, keepdim=True) if n and d else 1.0
    return 0.95 * jac / norms if n and d else jac


def random_factored(batch, n, d, tiles, with_diagonal, dtype=torch.float64):
    weight = torch.randn(tiles * d, d, dtype=dtype) / math.sqrt(tiles * d)
    scales = torch.rand(batch, n, tiles * d, dtype=dtype)
    diagonal = torch.rand(batch, n, d, dtype=dtype) * 0.5 if with_diagonal else None
    return FactoredJacobians(weight, scales, diagonal)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("per_step", [False, True])
def test_dense_matches_plain_float64(algorithm, n, per_step):
    jt = contracting(3, n, 4)
    grad = torch.randn(3, n + 1, 4, dtype=torch.float64) if per_step else torch.randn(3, 4, dtype=torch.float64)
    out = backprop_scan(jt, grad, algorithm=algorithm)
    assert out.shape == (3, n + 1, 4)
    assert_derived_close(out, plain_backprop(jt, grad), floor=1e-12)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 8, 1000])
@pytest.mark.parametrize("n", [1, 9, 16, 37])
def test_every_chunk_size(algorithm, chunk, n):
    jt = contracting(2, n, 3)
    grad = torch.randn(2, n + 1, 3, dtype=torch.float64)
    assert_derived_close(run_dense(jt, grad, algorithm, chunk), plain_backprop(jt, grad), floor=1e-12)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("tiles,with_diagonal", [(1, False), (3, True), (2, False)])
@pytest.mark.parametrize("n", [0, 1, 2, 17, 64])
@pytest.mark.parametrize("per_step", [False, True])
def test_factored_matches_dense(algorithm, tiles, with_diagonal, n, per_step):
    jac = random_factored(2, n, 5, tiles, with_diagonal)
    grad = torch.randn(2, n + 1, 5, dtype=torch.float64) if per_step else torch.randn(2, 5, dtype=torch.float64)
    out = backprop_scan(jac, grad, algorithm=algorithm)
    assert_derived_close(out, plain_backprop(jac.dense(), grad), floor=1e-12)


def test_factored_dense_is_the_transposed_jacobian():
    jac = random_factored(1, 1, 3, 3, True)
    u, s, w = jac.diagonal[0, 0], jac.scales[0, 0], jac.weight
    expected = torch.diag(u) + sum(torch.diag(s[3 * k : 3 * k + 3]) @ w[3 * k : 3 * k + 3] for k in range(3))
    torch.testing.assert_close(jac.dense()[0, 0], expected.T)


@pytest.mark.parametrize("batch,d", [(1, 1), (1, 7), (5, 1)])
@pytest.mark.parametrize("algorithm", ALGOS)
def test_degenerate_batch_and_width(batch, d, algorithm):
    jt = contracting(batch, 33, d)
    grad = torch.randn(batch, d, dtype=torch.float64)
    assert_derived_close(backprop_scan(jt, grad, algorithm=algorithm), plain_backprop(jt, grad), floor=1e-12)


@pytest.mark.parametrize("algorithm", ["blelloch", "chunked", "auto"])
@pytest.mark.parametrize("kind", ["dense", "factored"])
def test_float32_long_chain(algorithm, kind):
    """n = 30000 in float32 with spectral radius <= 1, per-step gradients: relative error <= 1e-5 (x2 linear)."""
    n, d = 30000, 8
    if kind == "dense":
        jac64 = contracting(1, n, d)
        jac32 = jac64.float()
        dense64 = jac64
    else:
        fac = random_factored(1, n, d, 1, False)
        fac = FactoredJacobians(0.95 * fac.weight / torch.linalg.matrix_norm(fac.weight, ord=2), fac.scales)
        jac32 = FactoredJacobians(fac.weight.float(), fac.scales.float())
        dense64 = fac.dense()
    grad64 = torch.randn(1, n + 1, d, dtype=torch.float64)
    reference = run_dense(dense64, grad64, "linear", 0)
    baseline = backprop_scan(jac32, grad64.float(), algorithm="linear")
    out = backprop_scan(jac32, grad64.float(), algorithm=algorithm)
    assert_derived_close(out, reference, baseline, floor=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    n=st.integers(0, 70),
    d=st.integers(1, 6),
    per_step=st.booleans(),
    algorithm=st.sampled_from(["blelloch", "chunked"]),
    chunk=st.integers(1, 80),
)
def test_fuzz_shapes(batch, n, d, per_step, algorithm, chunk):
    jt = contracting(batch, n, d)
    shape = (batch, n + 1, d) if per_step else (batch, d)
    grad = torch.randn(*shape, dtype=torch.float64)
    assert_derived_close(run_dense(jt, grad, algorithm, chunk), plain_backprop(jt, grad), floor=1e-12)


def test_half_precision_accumulates_in_float32():
    jt = contracting(2, 40, 4).to(torch.bfloat16)
    grad = torch.randn(2, 4).to(torch.bfloat16)
    out = backprop_scan(jt, grad, algorithm="chunked")
    assert out.dtype == torch.bfloat16
    reference = plain_backprop(jt.double(), grad.double())
    assert_derived_close(out, reference, floor=2e-2)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
def test_nan_and_inf_propagate_like_backprop(algorithm):
    jt = contracting(1, 20, 3)
    jt[0, 9, 1, 1] = float("nan")
    grad = torch.randn(1, 3, dtype=torch.float64)
    out = backprop_scan(jt, grad, algorithm=algorithm)
    expected = plain_backprop(jt, grad)
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    torch.testing.assert_close(out[finite], expected[finite])


def test_does_not_mutate_inputs():
    jt = contracting(2, 9, 3)
    grad = torch.randn(2, 10, 3, dtype=torch.float64)
    jt_copy, grad_copy = jt.clone(), grad.clone()
    for algorithm in ["linear", "blelloch", "chunked"]:
        backprop_scan(jt, grad, algorithm=algorithm)
    assert torch.equal(jt, jt_copy) and torch.equal(grad, grad_copy)


def test_flush_denormal_state_is_restored():
    before = torch.tensor(1e-39, dtype=torch.float32) * 1.0
    backprop_scan(contracting(1, 50, 3).float(), torch.randn(1, 3), algorithm="chunked")
    after = torch.tensor(1e-39, dtype=torch.float32) * 1.0
    assert before.item() == after.item()


@pytest.mark.parametrize(
    "jt,grad,kwargs,error,match",
    [
        (torch.randn(2, 3, 4), torch.randn(2, 4), {}, ValueError, r"jacobians_t must have shape \(B, n, d, d\)"),
        (torch.randn(2, 3, 4, 5), torch.randn(2, 4), {}, ValueError, "jacobians_t must have shape"),
        (torch.randn(2, 3, 4, 4), torch.randn(3, 4), {}, ValueError, r"grad must have shape \(B, d\)"),
        (torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4), {}, ValueError, r"\(B, n \+ 1, d\) = \(2, 4, 4\)"),
        (torch.randn(2, 3, 4, 4), torch.randn(2, 4, dtype=torch.float64), {}, TypeError, "dtype"),
        (torch.ones(2, 3, 4, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64), {}, TypeError, "floating"),
        (torch.randn(2, 3, 4, 4), torch.randn(2, 4), {"algorithm": "fast"}, ValueError, "algorithm must be"),
        ("not a tensor", torch.randn(2, 4), {}, TypeError, "jacobians_t must be"),
    ],
)
def test_bad_input_names_the_argument(jt, grad, kwargs, error, match):
    with pytest.raises(error, match=match):
        backprop_scan(jt, grad, **kwargs)


def test_bad_factored_input():
    with pytest.raises(ValueError, match=r"weight must have shape \(k \* d, d\)"):
        backprop_scan(FactoredJacobians(torch.randn(5, 3), torch.rand(1, 2, 5)), torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"scales must have shape \(B, n, 6\)"):
        backprop_scan(FactoredJacobians(torch.randn(6, 3), torch.rand(1, 2, 3)), torch.randn(1, 3))
    with pytest.raises(ValueError, match="diagonal must have shape"):
        backprop_scan(FactoredJacobians(torch.randn(3, 3), torch.rand(1, 2, 3), torch.rand(1, 3, 3)), torch.randn(1, 3))
    with pytest.raises(ValueError, match="grad must have shape"):
        backprop_scan(FactoredJacobians(torch.randn(3, 3), torch.rand(1, 2, 3)), torch.randn(2, 3))


def test_kernels_reject_auto():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        run_factored(torch.eye(2), torch.rand(1, 3, 2), None, torch.randn(1, 2), "auto", 1)


# --- the compiled linear-schedule kernel (lightning_bppsa._native) and its torch-loop fallback ---

needs_native = pytest.mark.skipif(not _native.available(), reason="no C compiler: the kernel is not built")


@pytest.fixture(params=[True, False], ids=["native", "torch-loop"])
def native(request, monkeypatch):
    """Run a test with the compiled kernel and again with the torch loop it replaces."""
    if request.param and not _native.available():
        pytest.skip("no C compiler: the kernel is not built")
    if not request.param:
        monkeypatch.setattr(_native, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_step", [False, True])
@pytest.mark.parametrize(("batch", "n", "d"), [(1, 1, 1), (3, 7, 5), (5, 50, 20), (2, 33, 9), (4, 16, 16)])
def test_dense_linear_matches_plain_loop(native, dtype, per_step, batch, n, d):
    jt = contracting(batch, n, d, dtype)
    grad = torch.randn(batch, n + 1, d, dtype=dtype) if per_step else torch.randn(batch, d, dtype=dtype)
    expected = plain_backprop(jt.double(), grad.double())
    floor = 1e-12 if dtype == torch.float64 else 1e-5
    assert_derived_close(run_dense(jt, grad, "linear", 1).double(), expected, floor=floor)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("tiles", "with_diagonal"), [(1, False), (1, True), (3, True), (4, False)])
@pytest.mark.parametrize("per_step", [False, True])
# d = 37 > 32 takes the kernel's general blocked loop, the others its register-resident one
@pytest.mark.parametrize(("batch", "n", "d"), [(1, 1, 1), (3, 7, 5), (6, 40, 20), (2, 9, 12), (2, 6, 37)])
def test_factored_linear_matches_plain_loop(native, dtype, tiles, with_diagonal, per_step, batch, n, d):
    jac = random_factored(batch, n, d, tiles, with_diagonal, dtype)
    grad = torch.randn(batch, n + 1, d, dtype=dtype) if per_step else torch.randn(batch, d, dtype=dtype)
    expected = plain_backprop(jac.dense().double(), grad.double())
    out = run_factored(jac.weight, jac.scales, jac.diagonal, grad, "linear", 1)
    assert_derived_close(out.double(), expected, floor=1e-12 if dtype == torch.float64 else 1e-5)


@needs_native
def test_nan_propagates_through_the_kernel():
    jac = random_factored(2, 10, 4, 1, False)
    scales = jac.scales.clone()
    scales[1, 6, 2] = float("nan")
    out = run_factored(jac.weight, scales, None, torch.randn(2, 4, dtype=torch.float64), "linear", 1)
    assert out[1, :7].isnan().any() and not out[1, 7:].isnan().any() and not out[0].isnan().any()


@needs_native
def test_kernel_declines_what_it_does_not_handle():
    out = torch.zeros(3, 2, 4, dtype=torch.float16)
    assert not _native.linear_factored(torch.eye(4).half(), torch.ones(2, 2, 4).half(), None, out)
    out = torch.zeros(3, 2, 4)
    assert not _native.linear_factored(torch.eye(4).double(), torch.ones(2, 2, 4), None, out)  # mixed dtypes


def test_disabled_by_environment(monkeypatch, caplog):
    monkeypatch.setenv("BPPSA_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="lightning_bppsa._native"):
        assert _native._load() is None
    assert "BPPSA_NATIVE=0" in caplog.text


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false"])
def test_missing_or_failing_compiler_falls_back_with_a_warning(monkeypatch, tmp_path, caplog, compiler):
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lightning_bppsa._native"):
        assert _native._load() is None
    assert "torch loop" in caplog.text
    assert not list(tmp_path.glob("*.so"))
