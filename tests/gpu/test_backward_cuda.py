"""The CUDA backward kernels (``bppsa_<cell>_backward_*``) on the ``backend`` (tests/gpu/conftest.py).

The cases of ``tests/kernels/test_backward_cuda_emulated.py`` (torch autograd through its own layer in
float64, the pre-activations as the layer's input), on the GPU at its sizes; and on a GPU the layers
themselves: ``bnn.RNN/GRU/LSTM(algorithm="linear")`` plan the fused backward, launch it, and their gradients
are as exact as cuDNN's (emulated: planned as on CUDA over the host emulation); with measurements on, the
first backward of a shape times both kernels and later calls run the faster. On a CUDA machine where the kernels cannot load these tests FAIL (never skipped
there).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import cupy_loader, recurrent_cuda

import lightning_bppsa.nn as bnn
from lightning_bppsa import backends, layer_plan
from lightning_bppsa.cells import cell_of
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_backward_cuda_emulated.py"
    spec = importlib.util.spec_from_file_location("_backward_emulated_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _load_cases()


def check(cell: str, p: dict, dtype: torch.dtype, backend) -> None:
    CASES.check(cell, p, dtype, kernels=backend.recurrent, to=lambda t: t.to(backend.device))


@pytest.mark.parametrize("hidden", [1, 20, 33, 70])
@pytest.mark.parametrize("cell", CASES.CELLS)
def test_float64_matches_autograd(backend, cell, hidden):
    for given in (True, False):
        check(cell, CASES.make_inputs(cell, 3, 37, hidden, seed=hidden, given=given), torch.float64, backend)


@pytest.mark.parametrize("cell", CASES.CELLS)
def test_long_sequence_float32_as_exact_as_torch(backend, cell):
    """B = 16, T = 1000, H = 20 on a GPU (smaller emulated): float32 within the derived tolerance of torch's
    own float32 autograd (cuDNN on a GPU: the inputs are moved there before the baseline runs)."""
    batch, steps = backend.size(16, 3), backend.size(1000, 50)
    p = CASES.make_inputs(cell, batch, steps, 20, seed=7, given=True)
    on_device = {k: None if v is None else v.to(backend.device) for k, v in p.items()}
    actual = CASES.kernel(cell, p, torch.float32, kernels=backend.recurrent, to=lambda t: t.to(backend.device))
    reference, baseline = CASES.autograd(cell, p, torch.float64), CASES.autograd(cell, on_device, torch.float32)
    for name, a, r, b in zip(CASES.NAMES, actual, reference, baseline, strict=True):
        if r is not None:
            assert_derived_close(a, r, b.cpu(), floor=1e-6, name=f"{cell} {name}")


@pytest.mark.parametrize(("cell", "hidden", "split", "hybrid"), CASES.LAYOUTS)
def test_float32_wide_layers_register_kernels(backend, cell, hidden, split, hybrid):
    """Float32 wider than a warp, ``W_hh`` in registers split over 1-4 lanes a unit (the rest of a lane's share
    in shared memory where it does not fit), in the forward kernels (whose states and factors the backward's gradients depend on) and the
    backward ones: B = 16, T = 1000 on a GPU (smaller emulated), within the derived tolerance of float64. One
    module per cell, direction and H is compiled on its first launch: a forward-only twin would compile more."""
    p = CASES.make_inputs(cell, backend.size(16, 2), backend.size(1000, 9), hidden, seed=hidden, given=True)
    check(cell, p, torch.float32, backend)


#: layers an H100 / H200 runs as clusters of blocks (GRU H > 160, LSTM H > 133, any H > 256: two and four blocks
#: a row); emulated, the stand-ins of CASES.CLUSTER_CASES[0, 2, 4]
SM90_CLUSTER_LAYERS = (("GRU", 256), ("LSTM", 200), ("RNN", 512))


@pytest.mark.parametrize("index", range(len(SM90_CLUSTER_LAYERS)))
def test_float32_cluster_kernels(backend, index):
    """Layers whose W_hh no block holds run as a cluster of blocks a row (sm_90): on a GPU a GRU of H = 256, an
    LSTM of H = 200 and an RNN of H = 512, kernels and then the whole ``algorithm="linear"`` layer (B = 16,
    T = 1000; gradients as exact as cuDNN's; the plan names the fused backward); emulated, the small stand-ins of
    ``tests/kernels`` (a small block budget forces the clusters). Needs compute capability 9.0 on a GPU."""
    if backend.is_cuda:
        if torch.cuda.get_device_capability(backend.device)[0] < 9:
            pytest.skip("thread-block clusters need compute capability 9.0 (this device refuses these layers)")
        kind, hidden = SM90_CLUSTER_LAYERS[index]
        kernels = backend.recurrent
    else:
        cell, hidden, limit, _, _ = CASES.CLUSTER_CASES[2 * index]
        kind = "RNN" if cell == "rnn_tanh" else cell.upper()
        kernels = types.SimpleNamespace(**{
            name: functools.partial(getattr(backend.recurrent, name), shared_limit=limit, cluster_limit=8)
            for name in ("rnn_forward", "rnn_backward", "gru_forward", "gru_backward", "lstm_forward", "lstm_backward")
        })  # fmt: skip
    cell = "rnn_tanh" if kind == "RNN" else kind.lower()
    p = CASES.make_inputs(cell, backend.size(16, 2), backend.size(1000, 9), hidden, seed=hidden, given=True)
    CASES.check(cell, p, torch.float32, kernels=kernels, to=lambda t: t.to(backend.device))
    if backend.is_cuda:
        layers = _layers(kind, hidden, backend, seed=1)
        _check_step(kind, layers, backend, _with_states)
        assert ", fused backward kernel, clusters of " in layers[0].last_stats["plan"], layers[0].last_stats


@pytest.mark.parametrize("spread", [True, False])
def test_float32_two_block_layers_of_a_small_batch_spread_over_four(backend, spread):
    """A GRU whose kernels take 2 blocks a row runs on 4 blocks of 4 lanes a unit for a batch of at most 16 rows
    (``recurrent_cuda.launch_layout``), on 2 for a larger one: the kernels' gradients as exact as cuDNN's either
    way. On a GPU H = 192 (B = 16 / 17, T = 1000), then the whole layer; emulated H = 170 at an H100's block
    budget (B = 2 / 17, T = 5). Needs compute capability 9.0 on a GPU."""
    limit = 232448
    if backend.is_cuda:
        if torch.cuda.get_device_capability(backend.device)[0] < 9:
            pytest.skip("thread-block clusters need compute capability 9.0 (this device refuses these layers)")
        kernels, hidden = backend.recurrent, 192
        limit = cupy_loader.shared_limit(backend.device.index or 0)
    else:
        kernels, hidden = types.SimpleNamespace(**{
            name: functools.partial(getattr(backend.recurrent, name), shared_limit=limit, cluster_limit=8)
            for name in ("gru_forward", "gru_backward")
        }), 170  # fmt: skip
    batch = (backend.size(16, 2) if spread else 17)
    layout = recurrent_cuda.launch_layout("gru", hidden, "backward", limit, 8, batch <= recurrent_cuda.SPREAD_BATCH)
    assert (layout.cluster, layout.split) == ((4, 4) if spread else (2, 2))
    p = CASES.make_inputs("gru", batch, backend.size(1000, 5), hidden, seed=hidden, given=True)
    CASES.check("gru", p, torch.float32, kernels=kernels, to=lambda t: t.to(backend.device))
    if backend.is_cuda and spread:
        layers = _layers("GRU", hidden, backend, seed=2)
        _check_step("GRU", layers, backend, _with_states)
        assert layers[0].last_stats["plan"].endswith(", clusters of 4 blocks a row"), layers[0].last_stats


@pytest.fixture
def cuda_plans(backend, request: pytest.FixtureRequest) -> Iterator[None]:
    """Emulated: CPU tensors get the CUDA kernels' backend over their host emulation and are planned as CUDA
    tensors would be (``cuda_on_cpu``); on a GPU nothing changes."""
    if not backend.is_cuda:
        request.getfixturevalue("cuda_on_cpu")
    yield


def _layers(kind: str, hidden: int, backend, seed: int) -> tuple:
    """``(ours, cudnn, exact, x)``: ``bnn.<kind>(algorithm="linear")`` on the backend's device, torch's module
    with the same weights there and in float64, and an input batch."""
    torch.manual_seed(seed)
    ours = getattr(bnn, kind)(12, hidden, batch_first=True, algorithm="linear").to(backend.device)
    cudnn = getattr(torch.nn, kind)(12, hidden, batch_first=True).to(backend.device)
    cudnn.load_state_dict(ours.state_dict())
    exact = getattr(torch.nn, kind)(12, hidden, batch_first=True).double()
    exact.load_state_dict(ours.state_dict())
    return ours, cudnn, exact, torch.randn(backend.size(16, 2), backend.size(300, 7), 12)


def _check_step(kind: str, layers: tuple, backend, loss) -> None:
    """One step of each module of ``layers`` (``loss(out, state)``): our gradients of every parameter and of
    the input equal float64 autograd's as closely as cuDNN's float32 ones."""
    *modules, x = layers
    grads = []
    for module, inputs in zip(modules, (x.to(backend.device), x.to(backend.device), x.double()), strict=True):
        module.zero_grad()
        inputs = inputs.clone().requires_grad_()
        loss(*module(inputs)).backward()
        grads.append([inputs.grad.cpu(), *(p.grad.cpu() for p in module.parameters())])
    for i, (a, b, r) in enumerate(zip(*grads, strict=True)):
        assert_derived_close(a, r, b, floor=1e-6, name=f"{kind} gradient {i}")


def _with_states(out, state):
    states = state if isinstance(state, tuple) else (state,)
    return out.square().mean() + sum(s.sum() for s in states)


# an RNN / GRU state wider than a warp (narrower ones run the warp sweep), an LSTM of any width
@pytest.mark.parametrize(("kind", "hidden"), [("RNN", 40), ("GRU", 40), ("LSTM", 20)])
def test_the_layers_plan_and_run_the_fused_backward(backend, kind, hidden, cuda_plans):
    """``bnn.<kind>(algorithm="linear")`` on the GPU: the plan names the fused backward, and the gradients of
    every parameter and of the input equal float64 autograd as closely as cuDNN's float32 ones. Emulated: the
    layer on CPU tensors planned as on CUDA, its kernels' backend over the host emulation (torch's CPU layer
    the float32 baseline)."""
    layers = _layers(kind, hidden, backend, seed=0)
    _check_step(kind, layers, backend, _with_states)
    assert layers[0].last_stats["plan"].endswith(", fused backward kernel"), layers[0].last_stats


def _model_is_sure(kind: str, hidden: int, batch: int, steps: int) -> bool:
    """Whether the CUDA step model's two backward kernels of a float32 linear layer are
    :data:`~lightning_bppsa.backends.SURE_BACKWARD` apart (then the faster runs unmeasured)."""
    cell = cell_of(getattr(torch.nn, kind)(1, 1).mode)
    scan = backends.scan_plan(cell, "linear", batch=batch, n=steps, hidden=hidden, device="cuda", dtype=torch.float32)
    times = backends._kernel_seconds(cell.gates, hidden, cell.state_factor * hidden, cell.jacobian_width(hidden),
                                     batch, steps, torch.float32, scan)  # fmt: skip
    return max(times) >= backends.SURE_BACKWARD * min(times)


# the first three unsure at both backends' sizes (measured); GRU 40 and LSTM 20 sure on a GPU (B=16, T=300:
# modelled 19x and 32x apart), not emulated (B=2, T=7)
@pytest.mark.parametrize(("kind", "hidden"), [("RNN", 20), ("GRU", 20), ("LSTM", 8), ("GRU", 40), ("LSTM", 20)])
def test_the_first_backward_of_a_shape_measures_both_kernels_where_the_model_is_unsure(
    backend, kind, hidden, cuda_plans
):
    """With measurements on (as in a user's process): the first backward of a ``linear`` layer times the
    factored scan and the fused kernel on its own data (on a GPU with CUDA events), later calls plan the one
    the measurement found faster and say both times; where the model is sure (the kernels 5x apart) the fused
    kernel runs from the first call, unmeasured. Every call's gradients are as exact as cuDNN's against
    float64 autograd. Emulated: the host emulation's wall-clock times decide."""
    layers = _layers(kind, hidden, backend, seed=1)
    plans = []
    with layer_plan.measurements(True):
        for _ in range(2):
            _check_step(kind, layers, backend, lambda out, _: out.square().mean())
            plans.append(layers[0].last_stats["plan"])
    if _model_is_sure(kind, hidden, *layers[-1].shape[:2]):
        assert plans == ["scan linear [cuda], fused backward kernel"] * 2, plans
        return
    assert plans[0] == "scan linear [cuda], backward kernel measured on its first call", plans
    found = re.fullmatch(
        r"scan linear \[cuda\], (fused backward kernel|factored scan) \(measured: factored scan (\S+) ms, "
        r"fused kernel (\S+) ms\)",
        plans[1],
    )
    assert found, plans
    factored, fused = float(found.group(2)), float(found.group(3))
    if factored != fused:  # equal to the 3 digits shown: either may have been faster
        assert found.group(1) == ("fused backward kernel" if fused < factored else "factored scan"), plans
