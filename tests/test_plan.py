"""The plan (kernel, algorithm, chunk, reason) of a scan: decided once, at run time, by lightning_bppsa.plan."""

import types

import pytest
import torch
from lightning_bppsa.kernels import cpu, cuda

from lightning_bppsa import FactoredJacobians, backprop_scan, cost_model, ops, plan

H100_OPTIN = 232448  # an H100's shared_memory_per_block_optin (227 KiB)
A100_OPTIN = 163 * 1024


@pytest.fixture
def fresh_plans():
    plan._choose.cache_clear()
    yield
    plan._choose.cache_clear()


@pytest.fixture
def cuda_kernels(monkeypatch, fresh_plans):
    """Make the CUDA kernels report ``(ok, reason)``."""

    def install(ok, reason="", shared_limit=H100_OPTIN):
        monkeypatch.setattr(cuda, "available", lambda: (ok, reason))
        monkeypatch.setattr(cuda, "current_shared_limit", lambda: shared_limit)
        monkeypatch.setattr(ops, "_WARNED", set())

    return install


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_choose_returns_a_concrete_algorithm_and_a_valid_chunk(device):
    for n in [0, 1, 2, 10, 1000, 30000]:
        for batch in [1, 16, 256]:
            chosen = plan.choose("auto", n=n, d=20, batch=batch, width=20, device=device, dtype=torch.float32)
            assert chosen.algorithm in ("linear", "blelloch", "chunked")
            assert 1 <= chosen.chunk <= max(n, 1)
            assert chosen.reason


def test_an_explicit_algorithm_is_kept_and_a_bad_one_named():
    assert (
        plan.choose("blelloch", n=100, d=4, batch=1, width=None, device="cpu", dtype=torch.float64).algorithm
        == "blelloch"
    )
    with pytest.raises(ValueError, match="algorithm must be one of .*got 'fast'"):
        plan.choose("fast", n=100, d=4, batch=1, width=None, device="cpu", dtype=torch.float64)


def test_half_precision_plans_like_float32():
    kwargs = dict(n=1000, d=20, batch=16, width=20, device="cpu")
    assert plan.choose("auto", dtype=torch.bfloat16, **kwargs) == plan.choose(
        "auto", dtype=torch.float32, **kwargs
    )


def test_without_the_c_kernel_the_parallel_scan_pays_on_long_small_batch_chains(monkeypatch, fresh_plans):
    monkeypatch.setattr(cpu, "available", lambda: False)
    chosen = plan.choose("auto", n=1000, d=20, batch=1, width=20, device="cpu", dtype=torch.float32)
    assert chosen.kernel == "torch" and chosen.algorithm != "linear"
    wide = plan.choose("auto", n=1000, d=20, batch=256, width=None, device="cpu", dtype=torch.float32)
    assert wide.algorithm == "linear"


def test_the_compiled_linear_kernel_wins_on_cpu(fresh_plans):
    assert cpu.available(), "a C compiler is on this machine: the kernel must build"
    for batch in (1, 16, 256):
        chosen = plan.choose("auto", n=1000, d=20, batch=batch, width=20, device="cpu", dtype=torch.float32)
        assert (chosen.kernel, chosen.algorithm) == ("c", "linear")
        assert str(chosen) == "linear [c]"


def test_cuda_without_kernels_plans_torch_and_the_op_warns_once_why(cuda_kernels):
    cuda_kernels(False, "CuPy is not installed")
    chosen = plan.choose("auto", n=10, d=3, batch=2, width=None, device="cuda", dtype=torch.float32)
    assert chosen.kernel == "torch" and "CuPy is not installed" in chosen.reason
    with pytest.warns(RuntimeWarning, match="CuPy is not installed.*run their torch implementation") as seen:
        for _ in range(2):
            ops._warn_torch_on_cuda(chosen, _Cuda())
    assert len(seen) == 1


class _Cuda:
    """Stands in for a CUDA tensor (only ``.device.type`` is read)."""

    class device:  # noqa: N801
        type = "cuda"


def test_available_cuda_kernels_get_the_plan_and_a_too_wide_state_runs_torch(cuda_kernels):
    cuda_kernels(True)
    chosen = plan.choose("auto", n=1000, d=20, batch=16, width=20, device="cuda", dtype=torch.float32)
    assert chosen.kernel == "cuda" and chosen.algorithm in ("linear", "chunked")
    wide = plan.choose("linear", n=10, d=12000, batch=1, width=None, device="cuda", dtype=torch.float64)
    assert wide.kernel == "torch" and "wide" in wide.reason


def test_the_op_plans_at_run_time_even_under_torch_compile(monkeypatch, fresh_plans):
    """Nothing is decided while dynamo traces: the op asks the plan with each call's concrete shapes."""
    seen = []
    original = plan.choose

    def spy(algorithm, **kwargs):
        assert not torch.compiler.is_compiling()
        seen.append(kwargs["batch"])
        return original(algorithm, **kwargs)

    monkeypatch.setattr(plan, "choose", spy)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=True, backend="eager")
    def scan(w, s, g):
        return backprop_scan(FactoredJacobians(w, s), g)

    for batch in (3, 5):  # a second batch size: dynamic shapes, no retrace of the plan
        w, s, g = torch.randn(4, 4), torch.rand(batch, 7, 4), torch.randn(batch, 4)
        expected = backprop_scan(FactoredJacobians(w, s), g, algorithm="linear")
        torch.testing.assert_close(scan(w, s, g), expected)
    assert seen[-1] == 5 and 3 in seen


def test_cost_model_predictions_grow_with_work():
    kwargs = dict(d=20, batch=16, width=20, device="cpu")
    for algorithm in ["linear", "blelloch", "chunked"]:
        small = cost_model.predict_seconds(algorithm, n=100, chunk_size=8, **kwargs)
        large = cost_model.predict_seconds(algorithm, n=10000, chunk_size=8, **kwargs)
        assert large > small > 0


@pytest.mark.parametrize("algorithm", ["chunked", "blelloch", "auto"])
def test_a_chunked_launch_the_device_cannot_make_is_planned_as_the_sweep_and_said(cuda_kernels, algorithm):
    """The device's own limit decides (an A100 has 163 KiB: d=150 float32 fits an H100's chunked kernel, not
    its); the plan says why, from the kernels' own refusal, and a layer's report shows it."""
    from lightning_bppsa.backends import TORCH, LayerCall

    shape = dict(n=1000, d=150, batch=16, width=150, device="cuda", dtype=torch.float32)
    cuda_kernels(True, shared_limit=A100_OPTIN)
    small = plan.choose(algorithm, **shape)
    why = cuda.refusal("chunked", d=150, element_bytes=4, shared_limit=A100_OPTIN)
    assert why and "d=150" in why and f"the device gives {A100_OPTIN} B" in why
    assert (small.kernel, small.algorithm, small.chunk) == ("cuda", "linear", 1) and why in small.reason
    assert small.instead == ("" if algorithm == "auto" else f"{algorithm} asked: {why}")
    if algorithm != "auto":
        assert str(LayerCall(TORCH, TORCH, small)) == f"scan linear [cuda] ({algorithm} asked: {why})"
    # the same shape on an H100, and the same device asked explicitly for its limit: the chunked kernel
    cuda_kernels(True, shared_limit=H100_OPTIN)
    plan._choose.cache_clear()
    if algorithm != "auto":
        for large in (
            plan.choose(algorithm, **shape),
            plan.choose(algorithm, **shape, shared_limit=H100_OPTIN),
        ):
            assert (large.algorithm, large.instead) == (algorithm, "") and large.chunk > 1


def test_the_launcher_refuses_a_chunked_launch_no_plan_checked(monkeypatch):
    """``cuda.run`` never turns a chunked launch into the sweep behind the plan's back: it raises, naming why."""
    launched = []
    w, s, g = torch.randn(150, 150), torch.rand(1, 8, 150), torch.randn(1, 150)
    with pytest.raises(
        ValueError,
        match="chunked scan was planned that the CUDA kernels cannot launch: the chunked scan kernel of d=150",
    ):
        cuda.run(w, s, None, g, algorithm="chunked", chunk_size=2, launcher=lambda *a: launched.append(a),
                 shared_limit=A100_OPTIN)  # fmt: skip
    assert launched == []
    # one chunk (chunk >= n) is the sweep of that chunk, not a refusal; so is the sweep asked for
    for algorithm, chunk in (("chunked", 8), ("linear", 1)):
        cuda.run(w, s, None, g, algorithm=algorithm, chunk_size=chunk, launcher=lambda *a: launched.append(a[0]),
                 shared_limit=A100_OPTIN)  # fmt: skip
    assert [launch.kernel for launch in launched] == ["bppsa_sweep_factored_f32"] * 2


def test_a_scan_op_plans_by_the_limit_of_its_own_gpu_not_the_current_one(cuda_kernels, monkeypatch):
    """``bppsa::scan_*`` on ``cuda:1`` (an A100's 163 KiB) while ``cuda:0`` (an H100) is current: d=150's chunked
    kernel fits the current device, not the tensors' one, so the op plans the sweep and says why (planned with
    the current device's limit, ``cuda.run`` would refuse the launch)."""
    cuda_kernels(True, shared_limit=H100_OPTIN)
    monkeypatch.setattr(cuda, "device_shared_limit", {0: H100_OPTIN, 1: A100_OPTIN}.__getitem__)
    grad = types.SimpleNamespace(shape=(16, 150), device=torch.device("cuda", 1), dtype=torch.float32)
    chosen = ops._plan_for("chunked", 0, grad, 1000, 150, 150)
    why = cuda.refusal("chunked", d=150, element_bytes=4, shared_limit=A100_OPTIN)
    assert (chosen.algorithm, chosen.instead) == ("linear", f"chunked asked: {why}")
    grad.device = torch.device("cuda", 0)
    assert ops._plan_for("chunked", 0, grad, 1000, 150, 150).algorithm == "chunked"
