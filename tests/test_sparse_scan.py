"""The sparse scan against a plain dense loop; schedules, plans, the FLOP report, dtypes, NaN and errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_bppsa import sparse_scan
from lightning_bppsa.jacobians import BatchedCSR, CSRPattern, linearize
from lightning_bppsa.sparse_scan import ALGORITHMS, plan_schedule, scan_flop_report, sparse_backprop_scan


def random_chain(dims, batch, shared, density=0.4):
    """J_iᵀ of shapes (dims[i-1], dims[i]) with random patterns; per-sample values unless ``shared``."""
    chain, dense = [], []
    for i, (rows, cols) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        mask = torch.rand(rows, cols) < density
        r, c = mask.nonzero(as_tuple=True)
        pattern, order = CSRPattern.from_coo(r, c, (rows, cols))
        values = torch.randn(1 if shared[i] else batch, pattern.nnz, dtype=torch.float64) * 0.8
        jac = BatchedCSR(pattern, values)
        chain.append(jac)
        dense.append(jac.to_dense().expand(batch, rows, cols))
    return chain, dense


def varying_width_backprop(dense, grad):
    """g_{i-1} = J_iᵀ g_i over dense ``(B, d_{i-1}, d_i)`` matrices, nothing shared with the library
    (``scan_ref`` takes one width d for every state; a layer chain changes width)."""
    out = [grad]
    for jt in reversed(dense):
        out.insert(0, torch.einsum("bij,bj->bi", jt, out[0]))
    return out


def assert_states_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(
    dims=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_every_schedule_matches_varying_width_backprop(dims, batch, seed, data):
    torch.manual_seed(seed)
    n = len(dims) - 1
    shared = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    chain, dense = random_chain(dims, batch, shared)
    grad = torch.randn(batch, dims[-1], dtype=torch.float64)
    expected = varying_width_backprop(dense, grad)
    for algorithm in ALGORITHMS:
        assert_states_close(sparse_backprop_scan(chain, grad, algorithm=algorithm), expected)
    for up_levels in range(max(0, (n - 1).bit_length() - 1) + 1):
        assert_states_close(sparse_backprop_scan(chain, grad, up_levels=up_levels), expected)
    for chunk in range(1, max(n, 1) + 1):
        assert_states_close(sparse_backprop_scan(chain, grad, algorithm="chunked", chunk=chunk), expected)


def test_layer_chain_jacobians_scan_to_autograds_gradient():
    """A conv chain's Jacobians from ``linearize`` through the sparse scan's entry point: autograd's grads."""
    layers = [nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 2, 3), nn.Tanh()]
    layers = [m.double() for m in layers]
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64, requires_grad=True)
    h, jacs = x, []
    for m in layers:
        h, jac = linearize(m, h)
        jacs.append(jac)
    grad = torch.randn_like(h)
    (expected,) = torch.autograd.grad(nn.Sequential(*layers)(x), x, grad)
    for algorithm in ALGORITHMS:
        states = sparse_backprop_scan(jacs, grad.reshape(2, -1), algorithm=algorithm)
        torch.testing.assert_close(states[0].reshape_as(x), expected, atol=1e-10, rtol=1e-10)


def test_torch_csr_inputs_and_unbatched_grad():
    eye = torch.eye(3, dtype=torch.float64)
    batched = torch.stack([2 * eye, 3 * eye]).to_sparse_csr()  # (2, 3, 3), same pattern
    states = sparse_backprop_scan([eye.to_sparse_csr(), batched], torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(states[0], torch.tensor([[2.0] * 3, [3.0] * 3], dtype=torch.float64))
    single = sparse_backprop_scan([(2 * eye).to_sparse_csr()], torch.ones(3, dtype=torch.float64))
    assert [tuple(s.shape) for s in single] == [(3,), (3,)]


def test_empty_chain_returns_the_gradient():
    grad = torch.randn(2, 4)
    states = sparse_backprop_scan([], grad)
    assert len(states) == 1 and torch.equal(states[0], grad)


def test_products_are_planned_once_per_pattern_pair():
    chain, _ = random_chain([6, 5, 7, 4, 5], 1, [True] * 4)
    patterns = [j.pattern for j in chain]
    first, second = plan_schedule(patterns, 1), plan_schedule(patterns, 1)
    assert first is second  # the schedule is cached too
    other = plan_schedule(patterns[:3], 1)
    assert other.steps[0][0].plan is first.steps[0][0].plan  # same pair of patterns, same plan


def test_chunked_is_its_own_schedule_never_auto_in_disguise():
    diag = [CSRPattern.identity(5)] * 11
    chunked = plan_schedule(diag, algorithm="chunked")
    assert chunked.reduce == "chunked" and 2 <= chunked.chunk <= 5
    assert plan_schedule(diag, algorithm="auto").reduce == "tree"
    forced = plan_schedule(diag, algorithm="chunked", chunk=4)
    # chunks [0, 4), [4, 8), [8, 11): a left fold of 3 steps, 3 linear steps, a sweep of 3 steps
    assert [step[0].phase for step in forced.steps] == ["up"] * 3 + ["linear"] * 3 + ["down"] * 3
    assert [op.span for op in forced.steps[0]] == [(0, 2), (4, 6), (8, 10)]
    assert [op.span for op in forced.steps[2]] == [(0, 4), (4, 8)]
    assert forced.up_levels == 3
    dense = [CSRPattern.from_coo(*torch.ones(20, 20).nonzero(as_tuple=True), (20, 20))[0]] * 8
    assert plan_schedule(dense, algorithm="chunked", max_pairs=100).chunk == 1  # nothing fits: linear, said


def test_the_scan_runs_exactly_the_operations_the_report_counts(monkeypatch):
    chain, _ = random_chain([6, 5, 7, 4, 5, 3, 4], 2, [False, True] * 3)
    ran = []
    multiply, matvec = sparse_scan._multiply, sparse_scan._matvec
    monkeypatch.setattr(sparse_scan, "_multiply", lambda plan, a, b: ran.append("mm") or multiply(plan, a, b))
    monkeypatch.setattr(sparse_scan, "_matvec", lambda m, g: ran.append(m.pattern.nnz) or matvec(m, g))
    for kwargs in ({"algorithm": "blelloch"}, {"algorithm": "chunked", "chunk": 3}, {"up_levels": 1}):
        ran.clear()
        sparse_backprop_scan(chain, torch.randn(2, 4, dtype=torch.float64), **kwargs)
        rows = [r for r in scan_flop_report(chain, **kwargs) if r.method == "bppsa"]
        assert ran == ["mm" if r.kind == "mm" else r.nnz for r in rows], kwargs


def test_mixed_and_half_precision_operands_scan_in_one_dtype():
    """Autocast gives bfloat16 activation Jacobians beside float32 weights: promoted, at least float32."""
    chain, dense = random_chain([5, 4, 6, 3], 2, [True, False, False])
    grad = torch.randn(2, 3, dtype=torch.float64)
    expected = varying_width_backprop(dense, grad)
    low = [
        BatchedCSR(j.pattern, j.values.to(dtype))
        for j, dtype in zip(chain, [torch.float32, torch.bfloat16, torch.float16], strict=True)
    ]
    states = sparse_backprop_scan(low, grad.to(torch.bfloat16), algorithm="blelloch")
    assert all(s.dtype == torch.float32 for s in states)
    for s, e in zip(states, expected, strict=True):
        torch.testing.assert_close(s.double(), e, atol=5e-2, rtol=5e-2)
    assert sparse_backprop_scan(low, grad)[0].dtype == torch.float64


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stored_zeros_select_like_torchs_relu_backward(algorithm):
    """A NaN upstream gradient stops at a ReLU's masked entry (torch: exactly 0); a NaN output passes it."""
    linear = nn.Linear(4, 4).double()
    with torch.no_grad():
        linear.bias[2] = -100.0  # ReLU masks entry 2 of every sample
    layers = [nn.ReLU(), linear, nn.ReLU(), nn.Tanh(), nn.ReLU()]
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0, 1] = float("nan")  # sample 0: NaN through the forward
    x.requires_grad_()
    h, jacs = x, []
    for m in layers:
        h, jac = linearize(m, h.detach())
        jacs.append(jac)
    grad = torch.randn_like(h)
    grad[1:, 2] = float("nan")  # samples 1, 2: NaN gradient at the masked entry
    (expected,) = torch.autograd.grad(nn.Sequential(*layers)(x), x, grad)
    assert expected[0, 1].isnan() and expected[1:].isfinite().all()
    states = sparse_backprop_scan(jacs, grad, algorithm=algorithm)
    torch.testing.assert_close(states[0], expected, atol=1e-12, rtol=1e-12, equal_nan=True)


def test_auto_stops_the_up_sweep_when_products_densify():
    """Diagonal chains never densify: auto climbs the tree; dense chains stay linear."""
    diag = [CSRPattern.identity(50)] * 16
    assert plan_schedule(diag, None, workers=None).up_levels >= 2  # L = 2 and 3 tie on the critical path
    assert plan_schedule(diag, None, workers=1).up_levels == 0  # the tree adds work: one worker stays linear
    dense = [CSRPattern.from_coo(*torch.ones(40, 40).nonzero(as_tuple=True), (40, 40))[0]] * 16
    assert plan_schedule(dense, None, workers=None).up_levels == 0


def test_forced_levels_beyond_max_pairs_are_refused():
    dense = [CSRPattern.from_coo(*torch.ones(20, 20).nonzero(as_tuple=True), (20, 20))[0]] * 8
    with pytest.raises(ValueError, match="max_pairs"):
        plan_schedule(dense, 2, max_pairs=1000)
    assert plan_schedule(dense, None, max_pairs=1000).up_levels == 0


def test_flop_report_counts_and_critical_path():
    chain, _ = random_chain([6, 5, 7, 4, 5, 3], 2, [False] * 5)
    rows = scan_flop_report(chain, up_levels=2)
    bp = [r for r in rows if r.method == "bp"]
    assert [r.flops for r in bp] == [2 * j.pattern.nnz for j in reversed(chain)]
    assert all(r.critical and r.kind == "mv" for r in bp)
    scan = [r for r in rows if r.method == "bppsa"]
    assert [r.phase for r in scan] == ["up", "up", "up", "linear", "linear", "down", "down", "down"]
    assert {r.kind for r in scan if r.phase == "up"} == {"mm"}
    for step in {r.step for r in scan}:  # exactly one critical op per step, the costliest
        ops = [r for r in scan if r.step == step]
        critical = [r for r in ops if r.critical]
        assert len(critical) == 1 and critical[0].flops == max(r.flops for r in ops)
    product = chain[0].to_dense()[0] @ chain[1].to_dense()[0]
    assert scan[0].shape == (6, 7) and scan[0].nnz >= int((product != 0).sum())
    assert 0 < scan[0].density <= 1


def test_mismatched_shapes_are_named():
    chain, _ = random_chain([3, 4, 5], 1, [True, True])
    with pytest.raises(ValueError, match=r"jacobians_t\[0\] has shape \(3, 4\)"):
        sparse_backprop_scan([chain[0], chain[0]], torch.randn(1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad has 6 features"):
        sparse_backprop_scan(chain, torch.randn(1, 6, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"algorithm must be one of \('linear', 'blelloch', 'chunked', 'auto'\)"
    ):
        sparse_backprop_scan(chain, torch.randn(1, 5, dtype=torch.float64), algorithm="tree")
    with pytest.raises(ValueError, match="chunk must be in"):
        sparse_backprop_scan(chain, torch.randn(1, 5, dtype=torch.float64), algorithm="chunked", chunk=3)
    with pytest.raises(ValueError, match="chunk is the chunk size"):
        sparse_backprop_scan(chain, torch.randn(1, 5, dtype=torch.float64), chunk=2)
    with pytest.raises(ValueError, match="chunk="):
        sparse_backprop_scan(chain, torch.randn(1, 5, dtype=torch.float64), algorithm="chunked", up_levels=0)
    with pytest.raises(ValueError, match="up_levels"):
        sparse_backprop_scan(chain, torch.randn(1, 5, dtype=torch.float64), up_levels=3)
    with pytest.raises(TypeError, match=r"jacobians_t\[0\]"):
        sparse_backprop_scan([torch.eye(3)], torch.randn(1, 3))
