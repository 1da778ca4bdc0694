"""The recurrent forward kernels (``kernels/recurrent.cu``) on the ``backend`` (tests/gpu/conftest.py).

Every case of ``tests/kernels/test_recurrent_cuda_emulated.py`` (same inputs, same torch references, same
tolerances), plus what the emulator cannot show on its own: the launch on torch's current stream, the
shared-memory opt-in beyond 48 KiB, a long sequence against cuDNN (torch's CPU module when emulated). On a
CUDA machine where the kernels cannot load (CuPy missing included) these tests FAIL: they are never
skipped there.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import recurrent_cuda

from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_recurrent_cuda_emulated.py"
    spec = importlib.util.spec_from_file_location("_recurrent_emulated_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _load_cases()


def run_kernel(cell: str, args: dict, backend):
    """One layer's forward kernel on ``backend``: its outputs, on the CPU."""
    args = dict(zip(args, backend.to(*args.values()), strict=True))
    if cell.startswith("rnn"):
        result = backend.recurrent.rnn_forward(**args, relu=cell == "rnn_relu")
    else:
        result = {"gru": backend.recurrent.gru_forward, "lstm": backend.recurrent.lstm_forward}[cell](**args)
    assert result is not None, "the kernel declined to run"
    assert all(t.device.type == backend.device.type for t in result)
    return [t.cpu() for t in result]


def check_layer(cell, batch, steps, hidden, dtype, backend, *, fold_bias=False, seed=0):
    layer = CASES.make_layer(cell, batch, steps, hidden, seed)
    actual = run_kernel(cell, CASES.kernel_inputs(cell, layer, dtype, fold_bias), backend)
    reference = CASES.torch_reference(cell, layer, torch.float64)
    baseline = (
        CASES.torch_reference(cell, layer, dtype) if dtype != torch.float64 else [None] * len(reference)
    )
    for name, a, r, base in zip(CASES.NAMES[cell], actual, reference, baseline, strict=True):
        assert a.dtype == dtype
        assert_derived_close(
            a, r, base, floor=1e-12 if dtype == torch.float64 else 1e-6, name=f"{cell} {name}"
        )


@pytest.mark.parametrize("steps", [1, 5, 37])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("hidden", [1, 7, 20, 32, 33, 64])
@pytest.mark.parametrize("cell", CASES.CELLS)
def test_float64_matches_torch(backend, cell, hidden, batch, steps):
    check_layer(
        cell, batch, steps, hidden, torch.float64, backend, fold_bias=steps == 5, seed=hidden * 100 + steps
    )


@pytest.mark.parametrize("hidden", [7, 33])
@pytest.mark.parametrize("cell", CASES.CELLS)
def test_float32_within_derived_tolerance(backend, cell, hidden):
    check_layer(cell, 3, 37, hidden, torch.float32, backend, seed=hidden)


@pytest.mark.parametrize("cell", CASES.CELLS)
def test_long_sequence_against_cudnn(backend, cell):
    """B = 16, T = 1000, H = 20 in float32: as close to the float64 truth as cuDNN's own float32 forward."""
    layer = CASES.make_layer(cell, 16, 1000, 20, seed=5)
    actual = run_kernel(cell, CASES.kernel_inputs(cell, layer, torch.float32, False), backend)
    module = {"rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN, "gru": torch.nn.GRU, "lstm": torch.nn.LSTM}[
        cell
    ]
    kwargs = {"nonlinearity": "relu" if cell == "rnn_relu" else "tanh"} if cell.startswith("rnn") else {}
    cudnn = module(CASES.INPUT_SIZE, 20, batch_first=True, **kwargs).to(backend.device)
    with torch.no_grad():
        for name in ("w_ih", "w_hh", "b_ih", "b_hh"):
            getattr(cudnn, f"{'weight' if name[0] == 'w' else 'bias'}_{name[2:]}_l0").copy_(layer[name])
        c0 = layer["c0"][None] if cell == "lstm" else None
        x, h0, c0 = backend.to(layer["x"], layer["h0"][None], c0, dtype=torch.float32)
        baseline = cudnn(x, (h0, c0) if cell == "lstm" else h0)[0].cpu()
    reference = CASES.torch_reference(cell, layer, torch.float64)[0]
    assert_derived_close(actual[0], reference, baseline, floor=1e-6, name=f"{cell} out")


def test_shared_memory_opt_in_beyond_48_kib(backend):
    """An LSTM with H = 100 in float32 needs ~164 KB of shared memory (the sm_80 opt-in limit)."""
    assert recurrent_cuda.shared_bytes("lstm", 100, 4) > recurrent_cuda.PORTABLE_SHARED_BYTES
    check_layer("lstm", 2, 7, 100, torch.float32, backend, seed=100)


def test_launch_runs_on_the_current_stream(backend):
    layer = CASES.make_layer("gru", 4, 300, 20, seed=6)
    args = CASES.kernel_inputs("gru", layer, torch.float64, False)
    with backend.side_stream():
        moved = dict(zip(args, backend.to(*args.values()), strict=True))
        out = backend.recurrent.gru_forward(**moved)[0].to("cpu", non_blocking=False)
    assert_derived_close(out, CASES.torch_reference("gru", layer, torch.float64)[0], floor=1e-12)


def test_non_contiguous_and_declined_inputs(backend):
    kernels = backend.recurrent
    inputs = CASES.kernel_inputs("lstm", CASES.make_layer("lstm", 3, 11, 9, seed=9), torch.float64, False)
    args = dict(zip(inputs, backend.to(*inputs.values()), strict=True))
    strided = {k: v.mT.contiguous().mT for k, v in args.items()}
    for a, r in zip(kernels.lstm_forward(**strided), kernels.lstm_forward(**args), strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    assert kernels.lstm_forward(**{k: v.half() for k, v in args.items()}) is None
    # beyond the widest layer a cluster of blocks takes (H = 257 runs as a cluster on sm_90)
    wide = CASES.kernel_inputs(
        "rnn_tanh", CASES.make_layer("rnn_tanh", 1, 2, recurrent_cuda.MAX_CLUSTER_HIDDEN + 1, seed=3),
        torch.float32, False,
    )
    assert kernels.rnn_forward(**dict(zip(wide, backend.to(*wide.values()), strict=True)), relu=False) is None


@pytest.mark.parametrize("hidden", [1, 5, 20, 31, 32])
@pytest.mark.parametrize("cell", CASES.CELLS)
def test_float32_per_hidden_kernels_around_the_ring_depth(backend, cell, hidden):
    """The kernels compiled per H (gi staged through the shared-memory ring, cp.async on sm_80+): sequences
    around the ring's depth, and a long one with many rows in flight. Emulated, the last two cases only
    (tests/kernels/test_recurrent_cuda_emulated.py runs them all there)."""
    long = (backend.size(cuda=2000, emulated=CASES.RING + 3), backend.size(cuda=48, emulated=2))
    cases = [*CASES.RING_CASES, long] if backend.is_cuda else [CASES.RING_CASES[-1], long]
    for steps, batch in cases:
        check_layer(cell, batch, steps, hidden, torch.float32, backend, seed=hidden + steps)


@pytest.mark.parametrize("warm", [True, False])
def test_per_hidden_kernel_inside_a_cuda_graph(backend, warm):
    """A per-H kernel captured in a CUDA graph gives its forward on replay. ``warm``: launched once before the
    capture (the per-H kernel is captured); else an H never launched before (CuPy cannot compile inside a
    capture: the shared-memory kernel of the cell is captured instead, with a warning)."""
    hidden = 23 if warm else 29  # an H no other test of the session launches first
    layer = CASES.make_layer("lstm", 3, 40, hidden, seed=hidden)
    inputs = CASES.kernel_inputs("lstm", layer, torch.float32, False)
    args = dict(zip(inputs, backend.to(*inputs.values()), strict=True))
    if warm:
        backend.recurrent.lstm_forward(**args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backend.graph_capture() as replay:
            captured = backend.recurrent.lstm_forward(**args)
    assert (not warm and backend.is_cuda) == any("CUDA graph capture" in str(w.message) for w in caught)
    replay()
    if backend.is_cuda:
        torch.cuda.synchronize()
    reference = CASES.torch_reference("lstm", layer, torch.float64)
    baseline = CASES.torch_reference("lstm", layer, torch.float32)
    for name, a, r, base in zip(CASES.NAMES["lstm"], captured, reference, baseline, strict=True):
        assert_derived_close(a.cpu(), r, base, floor=1e-6, name=f"captured lstm {name}")


@pytest.mark.parametrize(("kind", "hidden"), [("RNN", 20), ("GRU", 20), ("GRU", 256)])
def test_inference_runs_the_forward_measured_faster_with_torchs_outputs(backend, kind, hidden):
    """Without gradients ``"auto"`` measures, once per shape, the forward kernel alone against cuDNN's forward and
    runs the faster (which: the GPU's to say; a GRU H=256 runs as clusters of blocks on sm_90, where cuDNN's
    forward took ~16 ms at T=1000 on an H200), with torch's outputs either way. Emulated, the CPU's kernels run."""
    from lightning_bppsa import layer_plan
    from lightning_bppsa import nn as bnn

    torch.manual_seed(4)
    ours = getattr(bnn, kind)(8, hidden, batch_first=True).to(backend.device).eval()
    twin = getattr(torch.nn, kind)(8, hidden, batch_first=True).to(backend.device).eval()
    twin.load_state_dict(ours.state_dict())
    x = torch.randn(backend.size(16, 2), backend.size(300, 6), 8, device=backend.device)
    with layer_plan.measurements(True), torch.no_grad():
        got, want = ours(x), twin(x)
    layer_plan.forget()
    decision = ours.last_stats["decision"]
    assert ours.last_stats["path"] == "forward kernel" or decision.startswith("measured: "), ours.last_stats
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
