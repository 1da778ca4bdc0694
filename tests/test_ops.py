"""The bppsa:: ops: opcheck, torch.compile(fullgraph=True), TorchScript."""

import pytest
import torch
from lightning_bppsa.kernels import cuda

import lightning_bppsa  # noqa: F401  (registers the ops)
from lightning_bppsa import FactoredJacobians, backprop_scan, cost_model, ops


def dense_args(algorithm, per_step):
    jt = torch.randn(2, 9, 3, 3, dtype=torch.float64) * 0.3
    grad = torch.randn(2, 10, 3, dtype=torch.float64) if per_step else torch.randn(2, 3, dtype=torch.float64)
    return (jt, grad, algorithm, 4)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("per_step", [False, True])
def test_opcheck_dense(algorithm, per_step):
    torch.library.opcheck(torch.ops.bppsa.scan_dense.default, dense_args(algorithm, per_step))


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("with_diagonal", [False, True])
def test_opcheck_factored(algorithm, with_diagonal):
    diagonal = torch.rand(2, 9, 3, dtype=torch.float64) if with_diagonal else None
    args = (torch.randn(6, 3, dtype=torch.float64), torch.rand(2, 9, 6, dtype=torch.float64), diagonal,
            torch.randn(2, 3, dtype=torch.float64), algorithm, 4)
    torch.library.opcheck(torch.ops.bppsa.scan_factored.default, args)


@pytest.mark.slow
def test_compile_fullgraph_dense_and_factored():
    def step(jt, w, s, grad):
        dense = backprop_scan(jt * 0.5, grad)
        factored = backprop_scan(FactoredJacobians(w, s.sigmoid()), grad, algorithm="chunked")
        return dense.sum(1) + factored.sum(1)

    jt, w, s, grad = torch.randn(2, 11, 4, 4), torch.randn(4, 4), torch.randn(2, 11, 4), torch.randn(2, 4)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(jt, w, s, grad), step(jt, w, s, grad))


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_torchscript_calls_the_ops():
    @torch.jit.script
    def scripted(jt: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a = torch.ops.bppsa.scan_dense(jt, grad, "blelloch", 4)
        b = torch.ops.bppsa.scan_factored(w, s, None, grad, "chunked", 4)
        return a + b

    jt, grad, w, s = torch.randn(2, 9, 3, 3), torch.randn(2, 3), torch.randn(3, 3), torch.rand(2, 9, 3)
    expected = backprop_scan(jt, grad, algorithm="linear") + backprop_scan(FactoredJacobians(w, s), grad, algorithm="linear")
    torch.testing.assert_close(scripted(jt, grad, w, s), expected)


# --- which kernel runs on CUDA: the CuPy kernels module, or the torch implementation after one warning ---


@pytest.fixture
def cuda_kernels(monkeypatch):
    """Make the CUDA kernels report ``(ok, reason)`` and forget the earlier choice."""

    def install(ok, reason=""):
        monkeypatch.setattr(ops, "_CUDA", {})
        monkeypatch.setattr(cuda, "available", lambda: (ok, reason))

    return install


def test_cuda_kernels_unavailable_say_why_once(cuda_kernels):
    cuda_kernels(False, "CuPy is not installed")
    grad = torch.ones(2, 3)
    with pytest.warns(RuntimeWarning, match="unavailable: CuPy is not installed; the bppsa ops run their torch") as seen:
        assert not ops._cuda_kernels_run(grad)
        assert not ops._cuda_kernels_run(grad)
    assert len(seen) == 1


def test_available_cuda_kernels_are_used(cuda_kernels, recwarn):
    cuda_kernels(True)
    assert ops._cuda_kernels_run(torch.ones(2, 20))
    assert not recwarn.list


def test_a_state_too_wide_for_the_cuda_kernels_runs_torch_with_a_warning(cuda_kernels, monkeypatch):
    cuda_kernels(True)
    with pytest.warns(RuntimeWarning, match="too wide.*running the torch implementation"):
        assert not ops._cuda_kernels_run(torch.ones(1, 5000, dtype=torch.float64))
    # the cost model does not ask the kernels' launch model about it either (it would raise)
    monkeypatch.setattr(cost_model, "_cuda_kernels_run", lambda: True)
    cost_model._choose.cache_clear()
    try:
        assert cost_model.choose("linear", n=10, d=5000, batch=1, width=None, device="cuda")[0] == "linear"
        assert cost_model.choose("auto", n=10, d=20, batch=1, width=None, device="cuda")[0] in ("linear", "chunked")
    finally:
        cost_model._choose.cache_clear()
