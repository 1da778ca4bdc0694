"""The scan engine: every algorithm against the float64 reference ``scan_ref``, shapes, errors, NaN."""

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bppsa import FactoredJacobians, backprop_scan, scan_ref
from lightning_bppsa.algorithms import run_dense, run_factored
from lightning_bppsa.testing import assert_derived_close

ALGOS = ["linear", "blelloch", "chunked", "auto"]
LENGTHS = [0, 1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 100]


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
    assert_derived_close(out, scan_ref(jt, grad), floor=1e-12)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 8, 1000])
@pytest.mark.parametrize("n", [1, 9, 16, 37])
def test_every_chunk_size(algorithm, chunk, n):
    jt = contracting(2, n, 3)
    grad = torch.randn(2, n + 1, 3, dtype=torch.float64)
    assert_derived_close(run_dense(jt, grad, algorithm, chunk), scan_ref(jt, grad), floor=1e-12)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("tiles,with_diagonal", [(1, False), (3, True), (2, False), (0, True)])  # 0: diagonal only
@pytest.mark.parametrize("n", [0, 1, 2, 17, 64])
@pytest.mark.parametrize("per_step", [False, True])
def test_factored_matches_reference(algorithm, tiles, with_diagonal, n, per_step):
    jac = random_factored(2, n, 5, tiles, with_diagonal)
    grad = torch.randn(2, n + 1, 5, dtype=torch.float64) if per_step else torch.randn(2, 5, dtype=torch.float64)
    out = backprop_scan(jac, grad, algorithm=algorithm)
    assert_derived_close(out, scan_ref(jac, grad), floor=1e-12)


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
    assert_derived_close(backprop_scan(jt, grad, algorithm=algorithm), scan_ref(jt, grad), floor=1e-12)


@functools.cache
def long_float32_chain(kind):
    """n = 30000, d = 8, spectral norm <= 0.95, per-step gradients: (float32 chain, grad, float64 reference)."""
    n, d = 30000, 8
    if kind == "dense":
        jac64 = contracting(1, n, d)
        jac32 = jac64.float()
    else:
        fac = random_factored(1, n, d, 1, False)
        jac64 = FactoredJacobians(0.95 * fac.weight / torch.linalg.matrix_norm(fac.weight, ord=2), fac.scales)
        jac32 = FactoredJacobians(jac64.weight.float(), jac64.scales.float())
    grad64 = torch.randn(1, n + 1, d, dtype=torch.float64)
    return jac32, grad64.float(), scan_ref(jac64, grad64)


@pytest.mark.parametrize("algorithm", ["blelloch", "chunked", "auto"])
@pytest.mark.parametrize("kind", ["dense", "factored"])
def test_float32_long_chain(algorithm, kind):
    """float32 over 30000 steps: as close to the float64 reference as the linear schedule (x2, 1e-5 floor)."""
    jac32, grad32, reference = long_float32_chain(kind)
    baseline = backprop_scan(jac32, grad32, algorithm="linear")
    out = backprop_scan(jac32, grad32, algorithm=algorithm)
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
    assert_derived_close(run_dense(jt, grad, algorithm, chunk), scan_ref(jt, grad), floor=1e-12)


def test_half_precision_accumulates_in_float32():
    jt = contracting(2, 40, 4).to(torch.bfloat16)
    grad = torch.randn(2, 4).to(torch.bfloat16)
    out = backprop_scan(jt, grad, algorithm="chunked")
    assert out.dtype == torch.bfloat16
    reference = scan_ref(jt, grad)
    assert_derived_close(out, reference, floor=2e-2)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
def test_nan_and_inf_propagate_like_backprop(algorithm):
    jt = contracting(1, 20, 3)
    jt[0, 9, 1, 1] = float("nan")
    grad = torch.randn(1, 3, dtype=torch.float64)
    out = backprop_scan(jt, grad, algorithm=algorithm)
    expected = scan_ref(jt, grad)
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
@pytest.mark.parametrize("scan", [backprop_scan, scan_ref])
def test_bad_input_names_the_argument(scan, jt, grad, kwargs, error, match):
    with pytest.raises(error, match=match):
        scan(jt, grad, **kwargs)


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


# --- the reference and the autograd boundary ---


def test_scan_ref_is_autograd_on_a_real_chain():
    """x_i = tanh(M_i x_{i-1}), loss = sum_i <w_i, x_i>: scan_ref over J_iᵀ = (diag(1 - x_i²) M_i)ᵀ
    gives autograd's gradient w.r.t. every state (float64)."""
    batch, n, d = 2, 7, 3
    mats = torch.randn(n, batch, d, d, dtype=torch.float64) * 0.6
    states = [torch.randn(batch, d, dtype=torch.float64, requires_grad=True)]
    for i in range(n):
        states.append(torch.tanh(torch.einsum("bij,bj->bi", mats[i], states[-1])))
        states[-1].retain_grad()
    weights = torch.randn(batch, n + 1, d, dtype=torch.float64)
    sum((weights[:, i] * x).sum() for i, x in enumerate(states)).backward()
    jt = torch.stack([(torch.diag_embed(1 - states[i + 1] ** 2) @ mats[i]).mT for i in range(n)], 1).detach()
    expected = torch.stack([x.grad for x in states], 1)
    torch.testing.assert_close(scan_ref(jt, weights), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(backprop_scan(jt, weights), expected, rtol=1e-12, atol=1e-12)


def test_scan_ref_returns_float64_whatever_the_input_dtype():
    jac = random_factored(2, 5, 3, 2, True, torch.float32)
    out = scan_ref(jac, torch.randn(2, 3))
    assert out.dtype == torch.float64 and out.shape == (2, 6, 3)
    with pytest.raises(ValueError, match="algorithm must be"):
        scan_ref(jac, torch.randn(2, 3), algorithm="fast")


@pytest.mark.parametrize("needs_grad", ["jacobians_t", "grad", "weight", "diagonal"])
def test_inputs_requiring_grad_are_refused_at_call_time(needs_grad):
    if needs_grad in ("weight", "diagonal"):
        jac = random_factored(2, 5, 3, 1, True)
        getattr(jac, needs_grad).requires_grad_()
        grad = torch.randn(2, 3, dtype=torch.float64)
    else:
        jac, grad = contracting(2, 5, 3), torch.randn(2, 3, dtype=torch.float64)
        (jac if needs_grad == "jacobians_t" else grad).requires_grad_()
    with pytest.raises(RuntimeError, match="not differentiable with respect to jacobians_t or grad.*detach"):
        backprop_scan(jac, grad)
    with torch.no_grad():  # e.g. inside an autograd.Function's backward
        expected = scan_ref(jac, grad)
        assert_derived_close(backprop_scan(jac, grad), expected, floor=1e-12)
    # the reference is plain torch: differentiable
    scan_ref(jac, grad).sum().backward()
