"""The host side of a recurrent layer's CUDA training step: what it launches and which torch ops it calls.

On a GPU the step's Python, allocations and launches cost more than its kernels (H100, RNN B=16 T=1000
H=20: 1.6-2.0 ms eager, 0.74 ms CUDA-graphed), so the ops per step are counted here, on the CPU: the
layer's CUDA path (forward kernel, scan planned as on CUDA, ``cuda.run`` and its launcher) runs on CPU
tensors with both launchers replaced by the host emulation of the same kernels, and a dispatch mode counts
every aten op of one step (forward, ``out.sum()``, backward). The counts are capped at what the path does
now: a new op or launch fails here. The gradients of the counted step are checked against torch's own
layer in float64.

The CuPy launchers are checked with a stand-in ``cupy`` (``conftest.py``): one stream wrapper per torch
stream, one kernel lookup per device, not one per launch.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from lightning_bppsa.kernels import cuda, recurrent_cuda, recurrent_emulated

import lightning_bppsa.nn as bnn
from lightning_bppsa import cells
from lightning_bppsa.nn import _scan_layer
from lightning_bppsa.testing import OpCounter, assert_derived_close, cuda_path_on_cpu

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")

#: the most aten ops / kernel-launching aten ops one steady-state step may make, by (cell, algorithm); kernel
#: launches are always 2 (forward kernel, scan). Before the host-path work of issue 29 the same steps made RNN
#: 67 / 26, GRU 79 / 27, LSTM 156 / 95 (either algorithm); until the chunked kernel's flags needed no clearing
#: per launch, its steps made one more of each (the zeroed flags: an allocation and a memset launch), now
#: only its scratch's allocation (no launch) more than the sweep's. Since then the direct gradients are one
#: launch (a kept zero row before grad_out), the tanh slope one (addcmul), and h0's gradient is copied out of
#: the scan's buffer only where asked for (was RNN 45 / 16, GRU 52 / 16, LSTM 107 / 39). An LSTM's linear scan
#: is the fused backward kernel (the recursion and its gate gradients in one launch: was 105 / 37), and so
#: is the linear scan of an RNN / GRU wider than a warp ("fused" below: H = 33).
MAX_OPS = {
    ("RNN", "chunked"): (40, 13),
    ("RNN", "linear"): (39, 13),
    ("GRU", "chunked"): (48, 14),
    ("GRU", "linear"): (47, 14),
    ("LSTM", "chunked"): (106, 37),
    ("LSTM", "fused"): (44, 14),
    ("RNN", "fused"): (35, 11),
    ("GRU", "fused"): (39, 11),
}


@pytest.fixture
def launches(monkeypatch, cuda_on_cpu) -> Counter:
    """The CUDA path of the recurrent layers on CPU tensors, both launchers emulated (``cuda_on_cpu``); counts
    launches by kernel.

    Everything between the layer and the launchers is the CUDA path's own code: the CUDA backend
    (``backends.CudaBackend``, registered for the CPU tensors) runs the emulated forward kernels through
    ``recurrent_cuda.forward``, ``plan.choose`` answers as for a CUDA tensor, the scan runs
    ``cuda.scan_factored`` -> ``cuda.run``, and ``_scan_layer`` calls the ops directly as in an eager GPU step
    (the counting mode would otherwise route them through the dispatcher).
    """
    counted: Counter = Counter()

    def counting(launch_fn):
        def launch(config, *rest):
            counted[config.kernel] += 1
            return launch_fn(config, *rest)

        return launch

    real_launcher = recurrent_emulated._launcher
    monkeypatch.setattr(recurrent_emulated, "_launcher", lambda *a: counting(real_launcher(*a)))
    monkeypatch.setattr(cuda, "_launch_cuda", counting(cuda._launch_cuda))
    monkeypatch.setattr(_scan_layer, "_dispatched", lambda tensors: False)
    return counted


@needs_gxx
@pytest.mark.parametrize(
    ("kind", "algorithm", "hidden"),
    [*((kind, algorithm, 5) for kind in ("RNN", "GRU", "LSTM") for algorithm in ("chunked", "linear")),
     ("RNN", "linear", 33), ("GRU", "linear", 33)],  # wider than a warp: the fused backward, not the sweep
)  # fmt: skip
def test_cuda_step_ops_and_launches_are_capped(launches, kind, algorithm, hidden):
    torch.manual_seed(0)
    batch, steps, inputs = 2, 9, 3
    layer = getattr(bnn, kind)(inputs, hidden, batch_first=True, algorithm=algorithm).double()
    reference = getattr(torch.nn, kind)(inputs, hidden, batch_first=True).double()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(batch, steps, inputs, dtype=torch.float64)

    layer(x)[0].sum().backward()  # the first step: plans, and the chunked kernel's flag buffer, made once
    launches.clear()
    layer.zero_grad()
    counter = OpCounter()
    with counter:
        layer(x)[0].sum().backward()
    cell = cells.cell_of(layer.mode).name
    # an LSTM's or a wide state's linear scan is the fused backward kernel, not the factored scan
    fused = algorithm == "linear" and (kind == "LSTM" or hidden > 32)
    backward_kernel = f"{cell}_backward" if fused else f"{'chunked' if algorithm == 'chunked' else 'warpsweep'}_factored"
    assert dict(launches) == {f"bppsa_{cell}_forward_f64": 1, f"bppsa_{backward_kernel}_f64": 1}
    assert layer.last_stats["plan"].endswith(", fused backward kernel" if fused else "[cuda]")
    total, launching = sum(counter.ops.values()), counter.launching()
    cap_total, cap_launching = MAX_OPS[(kind, "fused" if fused else algorithm)]
    assert total <= cap_total and launching <= cap_launching, (
        f"{kind} {algorithm}: {total} aten ops ({launching} launching) per step, cap {cap_total} ({cap_launching}): "
        f"{dict(sorted(counter.ops.items()))}"
    )

    reference(x)[0].sum().backward()
    for name, param in layer.named_parameters():
        assert_derived_close(param.grad, getattr(reference, name).grad, name=name)


def test_a_chunked_scan_launches_nothing_but_its_kernel_in_steady_state(monkeypatch):
    """``cuda.run`` of the chunked kernel: the first call on a stream makes its flag buffer (zeroed once);
    later calls allocate only the output and the scratch (torch's caching allocator: no launch) and queue
    only the kernel, each with a new epoch on the same buffer."""
    monkeypatch.setattr(cuda, "_FLAGS", {})
    weight, scales, grad = torch.randn(4, 4), torch.rand(2, 9, 4), torch.randn(2, 10, 4)
    launched = []

    def launcher(launch, args, device):
        launched.append((launch.kernel, args[6], args[-1]))  # the sync buffer and the epoch

    def step() -> Counter:
        counter = OpCounter()
        with counter:
            cuda.run(weight, scales, None, grad, algorithm="chunked", chunk_size=3, launcher=launcher)
        return counter.ops

    first, second, third = step(), step(), step()
    assert first["zeros"] == 1 and "zeros" not in second and second == third == Counter(empty=2)
    assert [kernel for kernel, _, _ in launched] == ["bppsa_chunked_factored_f32"] * 3
    assert len({sync for _, sync, _ in launched}) == 1 and [epoch for _, _, epoch in launched] == [1, 2, 3]


def test_scan_launcher_makes_one_stream_wrapper_per_torch_stream(fake_device):
    fake, current = fake_device
    launch = cuda.launch_config(factored=True, element_bytes=4, n=7, batch=2, d=4, m=4, affine=True,
                                algorithm="linear", chunk_size=1)  # fmt: skip
    module = cuda.prepare(0, launch.warp_shape)  # the module of (d, k) = (4, 1)
    kernel = module["bppsa_warpsweep_factored_f32"]
    args = [11, 12, 0, 13, 14, 0, 0, 7, 2, 4, 4, 7, 1, 4]
    device = torch.device("cuda", 0)
    for handle in (0x1000, 0x1000, 0x2000, 0x1000):
        current["stream"] = handle
        cuda._launch_cuda(launch, args, device)
    assert fake.streams_made == 2  # one per torch stream, not one per launch
    assert [call[-1] for call in kernel.calls] == [0x1000, 0x1000, 0x2000, 0x1000]
    assert kernel.calls[0][:4] == ((2,), (32,), tuple(args), launch.shared_bytes)
    assert all(type(word) is int for word in kernel.calls[0][2])  # no per-argument object of ours
    assert sum(fake.compiled.values()) == 1 and max(fake.lookups.values()) == 1  # compiled and fetched once


def test_recurrent_launcher_fetches_each_kernel_once(fake_device):
    fake, current = fake_device
    device = torch.device("cuda", 0)
    small = recurrent_cuda.Launch("bppsa_gru_forward_f64", 2, 64, 1024, (1, 2, 3))
    large = recurrent_cuda.Launch("bppsa_gru_forward_f64", 2, 128, 100 * 1024, (4, 5, 6))
    for launch in (small, small, large, large, small):
        recurrent_cuda._launch_cuda(launch, device)
    kernel = fake.kernels[(0, "bppsa_gru_forward_f64")]
    assert set(fake.lookups.values()) == {1} and len(fake.lookups) == len(recurrent_cuda.KERNELS)
    assert (
        kernel.opt_ins == 1 and kernel.max_dynamic_shared_size_bytes == 100 * 1024
    )  # opted in once, when needed
    assert [call[2] for call in kernel.calls] == [(1, 2, 3), (1, 2, 3), (4, 5, 6), (4, 5, 6), (1, 2, 3)]
    assert fake.streams_made == 1


def test_scan_launcher_enters_another_device_only(fake_device):
    fake, _ = fake_device
    launch = cuda.launch_config(factored=True, element_bytes=4, n=3, batch=1, d=2, m=2, affine=False,
                                algorithm="linear", chunk_size=1)  # fmt: skip
    cuda.prepare(0, launch.warp_shape), cuda.prepare(1, launch.warp_shape)  # the module of (d, k) = (2, 1)
    fake.devices_entered.clear()
    for device in (torch.device("cuda"), torch.device("cuda", 0), torch.device("cuda", 1)):
        cuda._launch_cuda(launch, [0] * 14, device)
    assert fake.devices_entered == [
        1
    ]  # the current device (0) needs no switch; device 1's module lives there
    assert (
        len(fake.kernels[(0, launch.kernel)].calls) == 2 and len(fake.kernels[(1, launch.kernel)].calls) == 1
    )


@needs_gxx
def test_cuda_path_on_cpu_runs_or_drops_the_kernels_and_restores_the_cpu_path(monkeypatch):
    """``testing.cuda_path_on_cpu``: the layer plans as on CUDA inside (its gradients torch's where the kernels
    run; with ``run_kernels=False`` nothing is launched: the host proxy's setting), and as on the CPU again after."""
    torch.manual_seed(0)
    layer = bnn.GRU(3, 5, batch_first=True, algorithm="linear").double()
    reference = torch.nn.GRU(3, 5, batch_first=True).double()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    with cuda_path_on_cpu(run_kernels=False):
        loaded = []
        real = recurrent_emulated.library
        with monkeypatch.context() as patch:
            patch.setattr(recurrent_emulated, "library", lambda *options: loaded.append(options) or real(*options))
            layer(x)[0].sum().backward()
        assert "[cuda]" in layer.last_stats["plan"] and loaded == []
    layer.zero_grad()
    with cuda_path_on_cpu():
        layer(x)[0].sum().backward()
        assert "[cuda]" in layer.last_stats["plan"]
    reference(x)[0].sum().backward()
    for name, param in layer.named_parameters():
        assert_derived_close(param.grad, getattr(reference, name).grad, name=name)
    layer(x)[0].sum().backward()
    assert layer.last_stats["plan"].endswith("[c]")
