"""The recurrent layers' backends (lightning_bppsa.backends): each against the torch backend on the same inputs,
the call's plan made once in the forward, and no silent fallback (a kernel that cannot launch is planned as
torch's forward before anything runs, and the plan says why). The CUDA backend runs on CPU tensors through
the host emulation of its kernels (kernels/recurrent_emulated.py)."""

from __future__ import annotations

import functools
import re
import shutil
import types

import pytest
import torch
from lightning_bppsa.kernels import recurrent as native
from lightning_bppsa.kernels import recurrent_cuda, recurrent_emulated
from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES

import lightning_bppsa.nn as bnn
from lightning_bppsa import backends, layer_plan, plan
from lightning_bppsa.backends import NATIVE, TORCH, CudaBackend, LayerCall
from lightning_bppsa.cells import CELLS
from lightning_bppsa.nn import _scan_layer, recurrent
from lightning_bppsa.testing import assert_derived_close

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")
needs_native = pytest.mark.skipif(not native.available(), reason="needs the compiled CPU cell kernels")
F64 = torch.float64


def emulated_cuda(
    shared_limit: int = SM80_OPTIN_SHARED_BYTES, device_type: str = "cpu", cluster_limit: int = 1
) -> CudaBackend:
    """The CUDA backend over the host emulation of its kernels (CPU tensors), as if on a device with
    ``shared_limit`` bytes of shared memory per block and clusters of up to ``cluster_limit`` blocks."""
    return CudaBackend(recurrent_emulated, device_type, lambda device: shared_limit, lambda: (True, ""),
                       lambda device: cluster_limit)  # fmt: skip


def layer_inputs(cell, *, batch=2, steps=5, inputs=3, hidden=4, bias=True, dtype=F64, seed=0):
    """``(x, h0, c0, weights)`` of one layer of ``cell``, random, contracting like a trained layer's."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, dtype=dtype, generator=gen) * scale

    gates = cell.gates * hidden
    weights = [rand(gates, inputs, scale=0.4), rand(gates, hidden, scale=0.4)]
    weights += [rand(gates, scale=0.1), rand(gates, scale=0.1)] if bias else []
    c0 = rand(batch, hidden, scale=0.5) if cell.has_cell_state else None
    return rand(batch, steps, inputs), rand(batch, hidden, scale=0.5), c0, weights


def upstream(cell, out, seed=1):
    """Random ``(grad_out, grad_hn, grad_cn)`` for a layer's outputs."""
    gen = torch.Generator().manual_seed(seed)
    batch, _, hidden = out.shape
    grad_cn = torch.randn(batch, hidden, dtype=out.dtype, generator=gen) if cell.has_cell_state else None
    return (
        torch.randn(out.shape, dtype=out.dtype, generator=gen),
        torch.randn(batch, hidden, dtype=out.dtype, generator=gen),
        grad_cn,
    )


def autograd_reference(cell, x, h0, c0, weights, grad_out, grad_hn, grad_cn) -> list[torch.Tensor]:
    """Torch autograd through the cell's fused torch forward: ``[grad_x, grad_h0, (grad_c0,) *grad_weights]``."""
    total = grad_out.clone()
    total[:, -1] += grad_hn  # h_n is out's last step
    needs = [True, True, c0 is not None] + [True] * len(weights)
    grads = cell.autograd_gradients(None, (x, h0, c0, *weights), needs, (total, grad_cn), False)
    return [g for g in grads if g is not None]


def split(cell, results):
    """``(out, factors)`` of a forward's ``[out, (c_n,) *factors]``."""
    return results[0], results[2 if cell.has_cell_state else 1 :]


def assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


CELL_NAMES = sorted(CELLS)


# inputs: the CPU kernel projects inputs up to 40 wide itself, wider ones take one GEMM
@needs_native
@pytest.mark.parametrize("inputs", [3, 41])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cpu_backend_forward_and_fused_backward_equal_the_torch_backend(name, bias, inputs):
    cell = CELLS[name]
    x, h0, c0, weights = layer_inputs(cell, inputs=inputs, bias=bias)
    expected = TORCH.forward(cell, x, h0, c0, weights)
    assert_all_close(NATIVE.forward(cell, x, h0, c0, weights), expected)

    out, factors = split(cell, expected)
    grads = upstream(cell, out)
    linear = backends.scan_plan(cell, "linear", batch=2, n=5, hidden=4, device="cpu", dtype=F64)
    assert linear.kernel == "c" and NATIVE.takes(linear)
    fused = backends.backward(
        cell, "linear", LayerCall(NATIVE, NATIVE, linear), x, h0, c0, weights, out, factors, *grads
    )
    torch_ = backends.backward(
        cell, "linear", LayerCall(TORCH, TORCH, linear), x, h0, c0, weights, out, factors, *grads
    )
    assert_all_close(fused, torch_)
    assert_all_close(torch_, autograd_reference(cell, x, h0, c0, weights, *grads))


@pytest.mark.parametrize(
    "scan", [plan.Plan("torch", "chunked", 2, "test"), plan.Plan("torch", "blelloch", 1, "test")]
)
@pytest.mark.parametrize("name", CELL_NAMES)
def test_torch_backend_equals_autograd(name, scan):
    cell = CELLS[name]
    x, h0, c0, weights = layer_inputs(cell, steps=7, seed=2)
    out, factors = split(cell, TORCH.forward(cell, x, h0, c0, weights))
    torch.testing.assert_close(out, cell.torch_forward(x, h0, c0, weights)[0], rtol=0, atol=0)
    grads = upstream(cell, out)
    actual = backends.backward(
        cell, scan.algorithm, LayerCall(TORCH, TORCH, scan), x, h0, c0, weights, out, factors, *grads
    )
    assert_all_close(actual, autograd_reference(cell, x, h0, c0, weights, *grads))


@needs_gxx
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cuda_backend_forward_equals_the_torch_backend(name, bias):
    cell = CELLS[name]
    x, h0, c0, weights = layer_inputs(cell, bias=bias, seed=3)
    cuda = emulated_cuda()
    assert cuda.refuses(cell, 4, (x, h0, c0, *weights)) == ""
    assert_all_close(cuda.forward(cell, x, h0, c0, weights), TORCH.forward(cell, x, h0, c0, weights))


# limits: no opt-in, an A100's opt-in, and one where only the threads per block bind
@pytest.mark.parametrize("limit", [48 * 1024, SM80_OPTIN_SHARED_BYTES, 1 << 30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cuda_backend_refuses_exactly_where_prepare_declines_and_says_why(name, dtype, limit):
    """The plan's question (no allocation, with a reason) and the launch's own answer (``prepare``) agree."""
    cell = CELLS[name]
    backend = emulated_cuda(limit)
    for hidden in (1, 32, 33, 71, 100, 142, 202, 256, 257):
        gates = cell.gates * hidden
        gi, w_hh, h0 = (
            torch.zeros(1, 1, gates, dtype=dtype),
            torch.zeros(gates, hidden, dtype=dtype),
            torch.zeros(1, hidden, dtype=dtype),
        )
        c0 = torch.zeros(1, hidden, dtype=dtype) if cell.has_cell_state else None
        declined = (
            recurrent_cuda.prepare(name, gi, w_hh, None, h0, c0, device_type="cpu", shared_limit=limit)
            is None
        )
        why = backend.refuses(cell, hidden, (gi, w_hh, h0, c0))
        assert declined == bool(why), (name, dtype, limit, hidden, why)
        if why:
            assert f"H={hidden}" in why and ("shared memory" in why or "thread" in why), why
    assert "dtype torch.float16" in backend.refuses(cell, 4, (torch.zeros(1, 4, dtype=torch.float16),))
    assert "mixed" in backend.refuses(cell, 4, (torch.zeros(1, 4), torch.zeros(1, 4, dtype=F64)))


def test_the_forward_kernels_limits_are_stated_once_by_refusal(monkeypatch):
    """The plan's question and the launch's own check are both ``recurrent_cuda.refusal``: a limit changed
    there (a stand-in refusing H=7 only) changes both, with its reason (no second copy of the limits)."""
    cell = CELLS["gru"]
    asked = []

    def stand_in(name, hidden, dtype, shared_limit, cluster_limit):
        asked.append((name, hidden, dtype, shared_limit, cluster_limit))
        return "a stand-in limit: H=7" if hidden == 7 else None

    monkeypatch.setattr(recurrent_cuda, "refusal", stand_in)
    backend = emulated_cuda(1024)  # a limit the real refusal would reject every H here with
    for hidden in (7, 8):
        gi, w_hh, h0 = (
            torch.zeros(1, 1, 3 * hidden, dtype=F64),
            torch.zeros(3 * hidden, hidden, dtype=F64),
            torch.zeros(1, hidden, dtype=F64),
        )
        prepared = recurrent_cuda.prepare(
            "gru", gi, w_hh, None, h0, None, device_type="cpu", shared_limit=1024
        )
        why = backend.refuses(cell, hidden, (gi, w_hh, h0))
        assert (prepared is None, why) == ((True, "a stand-in limit: H=7") if hidden == 7 else (False, ""))
    assert asked == [("gru", h, F64, 1024, 1) for h in (7, 7, 8, 8)]


@pytest.fixture
def counted_plans(monkeypatch):
    """How often a layer call plans (``plan_call``) and asks the scan's plan (``plan.choose``)."""
    calls = {"plan_call": 0, "choose": 0}
    real_plan_call, real_choose = _scan_layer.plan_call, plan.choose

    def plan_call(*args):
        calls["plan_call"] += 1
        return real_plan_call(*args)

    def choose(*args, **kwargs):
        calls["choose"] += 1
        return real_choose(*args, **kwargs)

    monkeypatch.setattr(_scan_layer, "plan_call", plan_call)
    monkeypatch.setattr(plan, "choose", choose)
    return calls


@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
def test_a_layer_call_is_planned_once_in_the_forward_and_the_backward_runs_that_plan(
    counted_plans, algorithm
):
    layer = bnn.GRU(3, 4, num_layers=2, batch_first=True, algorithm=algorithm, dtype=F64)
    out, _ = layer(torch.randn(2, 6, 3, dtype=F64, requires_grad=True))
    # one per layer, before its forward op ran; the second layer's shape is the first's: its plan kept
    assert counted_plans == {"plan_call": 2, "choose": 1}
    reported = layer.last_stats["plan"]
    assert (
        reported.startswith(f"scan {algorithm}") and reported == f"scan {layer.last_stats['scan_algorithm']}"
    )
    out.pow(2).sum().backward()
    assert counted_plans == {"plan_call": 2, "choose": 1}  # the backward asks nothing again
    assert layer.last_stats["plan"] == reported


@needs_gxx
def test_a_forward_kernel_that_cannot_launch_is_planned_as_torchs_forward_before_anything_runs(monkeypatch):
    """Weights beyond the (emulated) device's shared memory: the plan says so and torch's forward runs; the
    kernel is never asked to launch. With room, the same layer launches the kernel once per call."""
    launched = []
    real_launcher = recurrent_emulated._launcher
    monkeypatch.setattr(
        recurrent_emulated, "_launcher", lambda *a: lambda launch, device: launched.append(launch)
    )
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cpu": emulated_cuda(shared_limit=1024)})
    torch.manual_seed(0)
    ours = bnn.GRU(3, 20, batch_first=True, algorithm="linear", dtype=F64)
    reference = torch.nn.GRU(3, 20, batch_first=True, dtype=F64)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 3, dtype=F64)
    for module in (ours, reference):
        module(x)[0].pow(2).sum().backward()
    assert launched == []
    assert "torch forward: the CUDA forward kernel of H=20 needs" in ours.last_stats["plan"], ours.last_stats
    assert "shared memory per block, the device has 1024 B" in ours.last_stats["plan"]
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)

    monkeypatch.setattr(recurrent_emulated, "_launcher", lambda *a: _counting(real_launcher(*a), launched))
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cpu": emulated_cuda()})
    ours(x)[0].pow(2).sum().backward()
    assert [launch.kernel for launch in launched] == ["bppsa_gru_forward_f64"]
    assert "torch forward" not in ours.last_stats["plan"]


def _counting(launch_fn, launched):
    def launch(config, device):
        launched.append(config)
        return launch_fn(config, device)

    return launch


def test_a_kernel_that_declines_what_its_plan_accepted_raises_instead_of_falling_back(monkeypatch):
    cell = CELLS["rnn_tanh"]
    monkeypatch.setattr(native, "rnn_forward", lambda *args: None)
    x, h0, c0, weights = layer_inputs(cell)
    with pytest.raises(RuntimeError, match="the cpu kernels declined a rnn_tanh layer their plan accepted"):
        NATIVE.forward(cell, x, h0, c0, weights)


def test_auto_on_cuda_keeps_torchs_layer_where_the_forward_kernel_cannot_launch(monkeypatch):
    """On a (stand-in) CUDA device whose scan kernels load but whose forward kernel cannot launch for this H,
    ``auto`` keeps torch's own layer (cuDNN) and says why, before the model is asked."""
    rnn = bnn.LSTM(2, 120, batch_first=True)
    x = torch.randn(3, 5, 2, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(plan, "choose", lambda algorithm, **shape: plan.Plan("cuda", "linear", 1, "stand-in"))
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cuda": emulated_cuda(48 * 1024, device_type="cuda")})
    monkeypatch.setattr(
        recurrent, "_predict", lambda shape: pytest.fail("no model where the kernels cannot run")
    )
    path, reason, _ = rnn._path(x, None)
    assert path == "autograd"
    assert reason.startswith(
        "auto on CUDA without the scan's kernels (forward: the CUDA forward kernel of H=120"
    )


def test_auto_on_an_sm90_device_prices_a_layer_whose_kernels_run_as_clusters(monkeypatch):
    """A GRU of H = 384 on an H100 / H200 (its block budget, clusters of up to 8 blocks): its kernels run as
    clusters of 8 blocks, which the step model prices (fitted on the H200's whole steps at 213b46c: 8.6 ms
    against cuDNN's 34.5 at B = 16 T = 1000), sure enough to run the scan unmeasured (measurements are off
    here); on a device without clusters it keeps torch's layer because the forward kernel cannot launch."""
    rnn = bnn.GRU(2, 384, batch_first=True)
    x = torch.randn(16, 1000, 2, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(plan, "choose", lambda algorithm, **shape: plan.Plan("cuda", "linear", 1, "stand-in"))
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cuda": emulated_cuda(232448, device_type="cuda", cluster_limit=8)})
    path, reason, _ = rnn._path(x, None)
    assert path == "scan" and reason.startswith("cost model: scan "), reason
    scan, torch_ = (float(t) for t in re.findall(r"([\d.]+) ms", reason))
    assert 2 * scan < torch_, reason
    layer_plan.forget()
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cuda": emulated_cuda(232448, device_type="cuda")})
    path, reason, _ = rnn._path(x, None)
    assert path == "autograd" and reason.startswith(
        "auto on CUDA without the scan's kernels (forward: the CUDA forward kernel runs one thread per hidden unit"
    )


@needs_gxx
@pytest.mark.parametrize(
    ("kind", "hidden", "limit", "spread"),
    [("GRU", 130, 48 * 1024, False), ("LSTM", 150, 48 * 1024, False), ("RNN", 300, 48 * 1024, False),
     ("GRU", 170, 232448, True), ("LSTM", 140, 232448, True), ("GRU", 128, 232448, True)],
)  # fmt: skip
def test_a_layer_on_an_sm90_device_runs_its_cluster_kernels_both_ways(
    cuda_on_cpu, monkeypatch, kind, hidden, limit, spread
):
    """The whole layer path on an emulated sm_90 stand-in whose block (48 KiB, or an H100's 227 KiB) cannot hold
    these layers' W_hh (nor its 256 threads the RNN's 300 units): ``algorithm="linear"`` runs the forward kernel
    and the fused backward as clusters of blocks (launched with their cluster, the GRU of H = 170 and the LSTM
    of H = 140 of this small batch spread from 2 blocks over 4 of 4 lanes a unit, the GRU of H = 128, whose one
    block holds part of its backward's share in shared memory, its backward alone; the step model is sure the
    fused kernel beats the factored scan's block sweep at these widths), and every gradient equals float64
    autograd's as closely as torch's float32 one."""
    launched = []
    real_launcher = recurrent_emulated._launcher
    monkeypatch.setattr(recurrent_emulated, "_launcher", lambda *a: _counting(real_launcher(*a), launched))
    on_sm90 = {
        name: functools.partial(getattr(recurrent_emulated, name), shared_limit=limit, cluster_limit=8)
        for name in ("rnn_forward", "rnn_backward", "gru_forward", "gru_backward", "lstm_forward", "lstm_backward")
    }
    sm90 = CudaBackend(types.SimpleNamespace(**on_sm90), "cpu", lambda device: limit, lambda: (True, ""),
                       lambda device: 8)  # fmt: skip
    monkeypatch.setitem(backends.DEVICE_BACKENDS, "cpu", sm90)
    torch.manual_seed(0)
    ours = getattr(bnn, kind)(3, hidden, batch_first=True, algorithm="linear")
    exact = getattr(torch.nn, kind)(3, hidden, batch_first=True).double()
    exact.load_state_dict(ours.state_dict())
    reference = getattr(torch.nn, kind)(3, hidden, batch_first=True)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 3)
    grads = []
    for module, inputs in ((ours, x), (reference, x), (exact, x.double())):
        inputs = inputs.clone().requires_grad_()
        out, _ = module(inputs)
        (out.square().mean() + out[:, -1].sum()).backward()
        grads.append([inputs.grad, *(p.grad for p in module.parameters())])
    for i, (a, b, r) in enumerate(zip(*grads, strict=True)):
        assert_derived_close(a, r, b, floor=1e-6, name=f"{kind} gradient {i}")
    cell = {"RNN": "rnn_tanh"}.get(kind, kind.lower())
    layouts = [recurrent_cuda.launch_layout(cell, hidden, d, limit, 8, True) for d in ("forward", "backward")]
    clusters = [1 if layout is None else layout.cluster for layout in layouts]
    said = str(clusters[0]) if clusters[0] == clusters[1] else f"{clusters[0]} / {clusters[1]}"
    assert ours.last_stats["plan"].endswith(f", fused backward kernel, clusters of {said} blocks a row"), ours.last_stats
    assert [(c.kernel, c.cluster) for c in launched] == [
        (f"bppsa_{cell}_{d}_f32_h{hidden}" + (f"_c{q}" if q > 1 else ""), q)
        for d, q in zip(("forward", "backward"), clusters, strict=True)
    ]
    smallest = [recurrent_cuda.cluster_layout(cell, hidden, d, limit, 8) for d in ("forward", "backward")]
    smallest = [1 if layout is None else layout.cluster for layout in smallest]
    spread_from_one_block = (kind, hidden) == ("GRU", 128)  # its backward alone
    spread_to = ([1, 4], [1, 1]) if spread_from_one_block else ([4, 4], [2, 2])
    assert (clusters, smallest) == (spread_to if spread else (smallest, clusters))


@needs_gxx
def test_dispatched_ops_plan_at_run_time_as_the_eager_layer_does(monkeypatch):
    """Under the profiler the layer's ops go through the dispatcher, without the layer's plan: each op plans
    from its inputs and runs the same backends (here the emulated CUDA forward kernel, once)."""
    launched = []
    real_launcher = recurrent_emulated._launcher
    monkeypatch.setattr(recurrent_emulated, "_launcher", lambda *a: _counting(real_launcher(*a), launched))
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cpu": emulated_cuda()})
    ours = bnn.RNN(3, 5, batch_first=True, algorithm="chunked", dtype=F64)
    reference = torch.nn.RNN(3, 5, batch_first=True, dtype=F64)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 3, dtype=F64)
    with torch.profiler.profile() as prof:
        ours(x)[0].pow(2).sum().backward()
    reference(x)[0].pow(2).sum().backward()
    assert {"bppsa::recurrent_forward", "bppsa::recurrent_backward"} <= {e.key for e in prof.key_averages()}
    assert [launch.kernel for launch in launched] == ["bppsa_rnn_tanh_forward_f64"]
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


@needs_gxx
@pytest.mark.parametrize("given", ["all", "out only"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", CELL_NAMES)
def test_cuda_fused_backward_equals_the_torch_backend_and_autograd(name, bias, given):
    """The fused backward kernel (emulated) as a call's backward: the same gradients as the torch backend's
    factored scan and as autograd, in float64."""
    cell = CELLS[name]
    x, h0, c0, weights = layer_inputs(cell, bias=bias, steps=6, seed=5)
    cuda = emulated_cuda()
    out, factors = split(cell, cuda.forward(cell, x, h0, c0, weights))
    grads = upstream(cell, out)
    if given == "out only":
        grads = (grads[0], None, None)
    fused_call = LayerCall(cuda, cuda.fused, plan.Plan("cuda", "linear", 1, "test"))
    actual = backends.backward(cell, "linear", fused_call, x, h0, c0, weights, out, factors, *grads)
    torch_call = LayerCall(TORCH, TORCH, plan.Plan("torch", "linear", 1, "test"))
    expected = backends.backward(cell, "linear", torch_call, x, h0, c0, weights, out, factors, *grads)
    assert_all_close(actual, expected)
    zero = torch.zeros_like(h0)
    full = (grads[0], zero if grads[1] is None else grads[1], None if c0 is None else zero if grads[2] is None else grads[2])
    assert_all_close(actual, autograd_reference(cell, x, h0, c0, weights, *full))


@needs_gxx
@pytest.mark.parametrize(("name", "hidden", "fuses"), [("lstm", 4, True), ("gru", 33, True), ("rnn_tanh", 40, True),
                                                       ("gru", 32, False), ("rnn_relu", 20, False)])  # fmt: skip
def test_a_linear_cuda_call_plans_the_fused_backward_where_the_warp_sweep_would_not_run_and_its_block_fits(
    monkeypatch, name, hidden, fuses
):
    """Planned in the forward, said in the plan: an LSTM, or a state wider than a warp, runs the fused kernel
    where its block fits; a device whose shared memory holds the forward kernel's block but not the
    backward's (GRU, LSTM) keeps the factored scan on the CUDA scan kernels; RNN / GRU with H <= 32 keep the
    warp sweep."""
    monkeypatch.setattr(plan, "choose", lambda algorithm, **shape: plan.Plan("cuda", "linear", 1, "stand-in"))
    cell = CELLS[name]
    x, h0, c0, weights = layer_inputs(cell, hidden=hidden)
    forward_bytes = recurrent_cuda.shared_bytes(name, hidden, 8)
    limits = [(SM80_OPTIN_SHARED_BYTES, fuses)]
    if forward_bytes < recurrent_cuda.backward_shared_bytes(name, hidden, 8):  # GRU, LSTM (an RNN's: equal)
        limits.append((forward_bytes, False))
    for limit, fused in limits:
        monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cpu": emulated_cuda(limit)})
        call = backends.plan_call(cell, "linear", x, h0, c0, weights)
        assert isinstance(call.forward, CudaBackend)
        assert isinstance(call.backward, backends.FusedBackward) == fused, (limit, call)
        assert str(call).endswith(", fused backward kernel") == fused


@pytest.mark.parametrize(
    ("batch", "steps", "hidden", "expected"), [(16, 1034, 20, "linear"), (1, 10000, 8, "chunked")]
)
def test_auto_plans_the_fused_backward_where_the_model_prices_it_below_the_chunked_scan(
    monkeypatch, batch, steps, hidden, expected
):
    """``auto`` on CUDA: the scan model's chunked plan for an LSTM (d = 2 H) is compared with the fused
    kernel's modelled sweep (B = 16 T = 1034 H = 20: ~0.2 ms vs ~3.4 ms; B = 1 T = 10000 H = 8: the chunked
    scan is priced lower, ~0.6 ms vs ~2 ms); a GRU keeps the scan model's plan (its linear scan is the warp
    sweep)."""
    chunked = plan.Plan("cuda", "chunked", 32, "stand-in chunked")
    monkeypatch.setattr(
        plan,
        "choose",
        lambda algorithm, **shape: plan.Plan("cuda", "linear", 1, "stand-in") if algorithm == "linear" else chunked,
    )
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cuda": emulated_cuda(device_type="cuda")})
    shape = dict(batch=batch, n=steps, hidden=hidden, device="cuda", dtype=torch.float32)
    chosen = backends.scan_plan(CELLS["lstm"], "auto", **shape)
    assert chosen.algorithm == expected, chosen
    if expected == "linear":
        assert chosen.reason.startswith("the fused backward kernel, modelled"), chosen.reason
    assert backends.scan_plan(CELLS["gru"], "auto", **shape) is chunked
    assert backends.scan_plan(CELLS["lstm"], "chunked", **shape) is chunked  # asked for: kept


@needs_gxx
@pytest.mark.parametrize(("kind", "hidden"), [("LSTM", 5), ("GRU", 33), ("RNN", 34)])
def test_stacked_bidirectional_layers_on_the_fused_backward_equal_torchs(monkeypatch, kind, hidden):
    """Two layers, both directions, dropout off, an initial state given: every layer call plans the fused
    backward (emulated CUDA kernels on CPU tensors, planned as on CUDA) and the gradients of the input, the
    initial states and every parameter are torch's in float64."""
    real_choose = plan.choose
    monkeypatch.setattr(
        plan, "choose", lambda algorithm, *, device, **shape: real_choose(algorithm, device="cuda", **shape)
    )
    monkeypatch.setattr(backends, "DEVICE_BACKENDS", {"cpu": emulated_cuda()})
    monkeypatch.setattr(backends.cuda_scan, "available", lambda: (True, ""))
    monkeypatch.setattr(backends.cuda_scan, "current_shared_limit", lambda: SM80_OPTIN_SHARED_BYTES)
    plan._choose.cache_clear()
    try:
        torch.manual_seed(0)
        ours = getattr(bnn, kind)(3, hidden, num_layers=2, bidirectional=True, batch_first=True, algorithm="linear")
        reference = getattr(torch.nn, kind)(3, hidden, num_layers=2, bidirectional=True, batch_first=True)
        ours, reference = ours.double(), reference.double()
        reference.load_state_dict(ours.state_dict())
        x = torch.randn(2, 6, 3, dtype=F64)
        states = [torch.randn(4, 2, hidden, dtype=F64) for _ in range(2 if kind == "LSTM" else 1)]
        grads = []
        for module in (ours, reference):
            inputs = [x.clone().requires_grad_(), *(s.clone().requires_grad_() for s in states)]
            hx = tuple(inputs[1:]) if kind == "LSTM" else inputs[1]
            out, last = module(inputs[0], hx)
            last = last if isinstance(last, tuple) else (last,)
            (out.sin().sum() + sum(s.square().sum() for s in last)).backward()
            grads.append([t.grad for t in inputs] + [p.grad for p in module.parameters()])
        assert ours.last_stats["plan"].endswith(", fused backward kernel"), ours.last_stats
        assert_all_close(grads[0], grads[1])
    finally:
        plan._choose.cache_clear()


@needs_gxx
@pytest.mark.parametrize(("kind", "hidden", "faster"), [("RNN", 20, "fused kernel"), ("LSTM", 4, "factored scan")])
def test_a_linear_cuda_backward_is_measured_once_per_shape_and_the_faster_kernel_runs(
    monkeypatch, cuda_on_cpu, kind, hidden, faster
):
    """Where both kernels of a ``linear [cuda]`` backward can run (the fused kernel and the factored scan), the
    first backward of a shape times both on its own inputs (an injected clock: ``faster`` is scripted to take
    1 ms, the other 3 ms; the opposite of the unmeasured rule's choice for both cells) and returns the faster
    one's gradients; later calls plan that kernel directly, say the measurement, and measure nothing more. The
    gradients equal torch's in float64 on every call. With measurements off the unmeasured rule plans."""
    ran: list[str] = []
    for name, backend in (("factored scan", cuda_on_cpu), ("fused kernel", cuda_on_cpu.fused)):
        real = backend.backward
        monkeypatch.setattr(backend, "backward", lambda *a, real=real, name=name: ran.append(name) or real(*a))
    timed: list[str] = []

    def timer(fn):
        ran.clear()
        fn()
        timed.append(ran[-1])
        return 1e-3 if ran[-1] == faster else 3e-3

    monkeypatch.setattr(layer_plan, "device_timer", lambda device: timer)
    torch.manual_seed(0)
    ours = getattr(bnn, kind)(3, hidden, batch_first=True, algorithm="linear").double()
    reference = getattr(torch.nn, kind)(3, hidden, batch_first=True).double()
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 3, dtype=F64)
    with layer_plan.measurements(False):
        ours(x)[0].sum().backward()
    unmeasured = ours.last_stats["plan"]
    assert unmeasured.endswith(", fused backward kernel") == (faster == "factored scan"), unmeasured
    with layer_plan.measurements(True):
        for call in range(3):
            ours.zero_grad()
            reference.zero_grad()
            grads, last = [], []
            for module in (ours, reference):
                inputs = x.clone().requires_grad_()
                out, _ = module(inputs)
                ran.clear()
                out.sin().sum().backward()
                grads.append([inputs.grad, *(p.grad for p in module.parameters())])
                last += ran[-1:]
            assert_all_close(grads[0], grads[1])
            assert last == [faster], (call, last)  # ours ran the faster kernel last (torch's module: none)
            plan_text = ours.last_stats["plan"]
            if call == 0:
                assert plan_text == "scan linear [cuda], backward kernel measured on its first call", plan_text
                assert sorted(timed) == ["factored scan"] * 2 + ["fused kernel"] * 2, timed
            else:
                assert len(timed) == 4, timed  # measured once
                kernel = "fused backward kernel" if faster == "fused kernel" else "factored scan"
                other = "fused kernel" if faster == "factored scan" else "factored scan"
                assert f", {kernel} (measured: " in plan_text and f"{faster} 1 ms" in plan_text, plan_text
                assert f"{other} 3 ms" in plan_text, plan_text


@needs_gxx
def test_a_linear_cuda_backward_modelled_too_long_to_time_is_not_measured(monkeypatch, cuda_on_cpu):
    """A shape whose two backward kernels are modelled to take more than the measuring budget three times over
    plans the unmeasured rule's kernel, measurements on or not."""
    monkeypatch.setattr(layer_plan, "MEASURE_BUDGET_SECONDS", 0.0)
    monkeypatch.setattr(layer_plan, "device_timer", lambda device: pytest.fail("measured"))
    cell = CELLS["rnn_tanh"]
    x, h0, c0, weights = layer_inputs(cell, hidden=20)
    with layer_plan.measurements(True):
        call = backends.plan_call(cell, "linear", x, h0, c0, weights)
    assert call.backward is cuda_on_cpu and str(call) == "scan linear [cuda]", call


@needs_gxx
@pytest.mark.parametrize(
    ("modelled", "planned"),
    [((1e-3, 5e-3), "fused"), ((5e-3, 1e-3), "factored"), ((1e-3, 4e-3), "measured"), ((4e-3, 1e-3), "measured")],
)
def test_a_linear_cuda_backward_the_model_is_sure_of_runs_unmeasured(monkeypatch, cuda_on_cpu, modelled, planned):
    """Where the model's two backward kernels (``(fused, factored)`` seconds, scripted) are SURE_BACKWARD (5x)
    apart the faster is planned without a measurement (the slower one's runs cost up to seconds on a first
    call), also against the unmeasured rule (an RNN at H <= 32 keeps the factored warp sweep unmeasured);
    nearer, the first backward measures both."""
    monkeypatch.setattr(backends, "_kernel_seconds", lambda *args: modelled)
    timed = []
    monkeypatch.setattr(layer_plan, "device_timer", lambda device: lambda fn: timed.append(fn) or 1e-3)
    cell = CELLS["rnn_tanh"]
    x, h0, c0, weights = layer_inputs(cell, hidden=20)
    with layer_plan.measurements(True):
        call = backends.plan_call(cell, "linear", x, h0, c0, weights)
    expected = {"fused": cuda_on_cpu.fused, "factored": cuda_on_cpu}.get(planned)
    if expected is None:
        assert isinstance(call.backward, backends.MeasuredBackward), call
    else:
        assert call.backward is expected, call
    assert timed == [], "planning measures nothing: a measured backward times its first call"


@needs_gxx
@pytest.mark.parametrize(("kind", "faster"), [("rnn_tanh", "fused kernel"), ("gru", "factored scan")])
def test_a_chunked_scan_auto_planned_is_measured_against_the_fused_kernel(monkeypatch, cuda_on_cpu, kind, faster):
    """Where ``"auto"`` plans a chunked scan and the fused backward kernel can run the same recursion (here a
    layer whose linear scan is the warp sweep, which ``auto`` never priced against the fused kernel), the model
    unsure which is faster: the first backward times both on its own inputs (injected clock), returns the
    faster one's gradients (equal to autograd's), and later calls plan it, saying the measurement. A chunked
    scan asked for runs as asked, measured nothing; so does one the model is sure of."""
    chunked = plan.Plan("cuda", "chunked", 2, "stand-in: the scan model's chunked plan")
    monkeypatch.setattr(backends, "scan_plan", lambda *args, **kwargs: chunked)
    monkeypatch.setattr(backends, "_kernel_seconds", lambda *args: (1e-3, 2e-3))  # within SURE_BACKWARD
    ran = []
    for name, backend in (("factored scan", cuda_on_cpu), ("fused kernel", cuda_on_cpu.fused)):
        real = backend.backward
        monkeypatch.setattr(backend, "backward", lambda *a, real=real, name=name: ran.append((name, a[1])) or real(*a))
    monkeypatch.setattr(
        layer_plan, "device_timer", lambda device: lambda fn: 1e-3 if (fn(), ran[-1][0])[1] == faster else 3e-3
    )
    cell = CELLS[kind]
    x, h0, c0, weights = layer_inputs(cell, hidden=20)
    assert backends.plan_call(cell, "chunked", x, h0, c0, weights).backward is cuda_on_cpu  # asked: as asked
    lstm = CELLS["lstm"]  # nothing may measure: the chunked scan planned (an LSTM's linear default is fused)
    assert backends.plan_call(lstm, "auto", *layer_inputs(lstm, hidden=4)).backward is cuda_on_cpu
    with layer_plan.measurements(True):
        assert backends.plan_call(cell, "chunked", x, h0, c0, weights).backward is cuda_on_cpu
        call = backends.plan_call(cell, "auto", x, h0, c0, weights)
        assert isinstance(call.backward, backends.MeasuredBackward), call
        assert str(call) == "scan chunked(c=2) [cuda], backward kernel measured on its first call", call
        out, factors = split(cell, call.forward.forward(cell, x, h0, c0, weights))
        grad_out, grad_hn = torch.randn_like(out), torch.randn_like(h0)
        grads = backends.backward(cell, "auto", call, x, h0, c0, weights, out, factors, grad_out, grad_hn, None)
        assert ran[-1][0] == faster and {scan for name, scan in ran if name == "factored scan"} == {chunked}
        assert_all_close(grads, autograd_reference(cell, x, h0, c0, weights, grad_out, grad_hn, None))
        measured = backends.plan_call(cell, "auto", x, h0, c0, weights)
    assert measured.backward is (cuda_on_cpu.fused if faster == "fused kernel" else cuda_on_cpu), measured
    kernel = "fused backward kernel" if faster == "fused kernel" else "factored scan"
    assert str(measured).startswith(f"scan chunked(c=2) [cuda], {kernel} (measured: "), measured
    monkeypatch.setattr(backends, "_kernel_seconds", lambda *args: (5e-3, 1e-3))  # sure: the chunked scan
    layer_plan.forget()
    with layer_plan.measurements(True):
        assert backends.plan_call(cell, "auto", x, h0, c0, weights).backward is cuda_on_cpu


@needs_gxx
def test_a_final_plan_is_kept_per_shape_and_planned_again_where_it_may_differ(monkeypatch, cuda_on_cpu, counted_plans):
    """A layer call's final plan is kept (the same object, the scan's plan not asked again) for inputs of the
    same shape, dtype and device; not for another batch, nor for inputs that do not agree (a weight of another
    dtype: torch's forward, saying why), nor after the decisions are forgotten, nor while a measurement of its
    backward kernel is pending (two kernels modelled near each other): each of those is planned anew."""
    monkeypatch.setattr(backends, "_kernel_seconds", lambda *args: (1e-3, 1e-2))  # sure: the fused kernel
    cell = CELLS["rnn_tanh"]
    x, h0, c0, weights = layer_inputs(cell, hidden=20)
    first = backends.plan_call(cell, "linear", x, h0, c0, weights)
    assert first.backward is cuda_on_cpu.fused, first
    assert backends.plan_call(cell, "linear", x, h0, c0, weights) is first and counted_plans["choose"] == 1
    other_batch = backends.plan_call(cell, "linear", x[:1], h0[:1], c0, weights)
    assert other_batch is not first and counted_plans["choose"] == 2
    mixed = backends.plan_call(cell, "linear", x, h0, c0, [weights[0].float(), *weights[1:]])
    assert mixed.forward is TORCH and "mixed dtypes" in mixed.reason, mixed
    layer_plan.forget()
    again = backends.plan_call(cell, "linear", x, h0, c0, weights)
    assert again is not first and str(again) == str(first) and counted_plans["choose"] == 4
    monkeypatch.setattr(backends, "_kernel_seconds", lambda *args: (1e-3, 2e-3))  # unsure: measured
    layer_plan.forget()
    for measuring in (False, True):  # off: the unmeasured rule, for now; on: the measured backward
        with layer_plan.measurements(measuring):
            pending = [backends.plan_call(cell, "linear", x, h0, c0, weights) for _ in range(2)]
        assert pending[0] is not pending[1], pending
    assert isinstance(pending[0].backward, backends.MeasuredBackward), pending
