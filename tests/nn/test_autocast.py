"""Gradients under autocast do not depend on where ``backward()`` is called (issue 27 item 5).

Lightning's ``bf16-mixed`` with manual optimization calls ``manual_backward`` inside the autocast region; a
plain loop calls ``backward()`` after it. The forward decides the dtypes: with the backward inside, the
chunked scan failed ("Input dtypes must be the same"), the blelloch scan silently computed in bfloat16, and
``Recurrence`` fell back to autograd with a false "rows mixed" warning whenever the backward ran outside.

Every recurrent cell, scan algorithm, ``Recurrence`` and ``SparseChain``: forward under CPU autocast in
bfloat16 and float16 (the dtypes of CUDA's autocast, through the same code), backward inside and outside; the gradients must be the same both ways and as close to the float64 truth as torch's
own module's run the same way (:func:`~lightning_bppsa.testing.assert_derived_close`: twice its error, the
error of a bfloat16 forward). ``tests/gpu/test_autocast_cuda.py`` runs the same checks on CUDA.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

import lightning_bppsa.nn as bnn
from lightning_bppsa import layer_plan
from lightning_bppsa.nn import Recurrence, SparseChain
from lightning_bppsa.testing import assert_derived_close

ALGORITHMS = ["linear", "blelloch", "chunked", "auto"]
DTYPES = [torch.bfloat16, torch.float16]
#: (BPPSA module, torch module, keyword arguments of both)
LAYERS = {
    "RNN_TANH": (bnn.RNN, nn.RNN, {}),
    "RNN_RELU": (bnn.RNN, nn.RNN, {"nonlinearity": "relu"}),
    "GRU": (bnn.GRU, nn.GRU, {}),
    "LSTM": (bnn.LSTM, nn.LSTM, {}),
}


def gradients(module: nn.Module, x: Tensor, autocast: tuple[str, torch.dtype] | None, inside: bool) -> list[Tensor]:
    """Gradients of ``x`` and the parameters of ``Σ out²`` (``out``: the module's output, its first for a
    tuple), the forward under ``autocast`` (device type, dtype; ``None``: off), the backward inside that
    region or after it."""
    x = x.detach().requires_grad_()
    wrt = [x, *module.parameters()]
    device_type, dtype = autocast if autocast is not None else (x.device.type, None)
    with torch.autocast(device_type, dtype=dtype, enabled=autocast is not None):
        out = module(x)
        loss = (out[0] if isinstance(out, tuple) else out).float().pow(2).sum()
        if inside:
            return list(torch.autograd.grad(loss, wrt))
    return list(torch.autograd.grad(loss, wrt))


def torch_gradients(module: nn.Module, x: Tensor, autocast: tuple[str, torch.dtype], inside: bool) -> list[Tensor]:
    """:func:`gradients` of torch's own module; where oneDNN refuses torch's LSTM under CPU autocast (CPUs
    without AVX-512 BF16), of the module cast to the autocast dtype by hand: the same half-precision forward."""
    try:
        return gradients(module, x, autocast, inside)
    except RuntimeError:
        cast = copy.deepcopy(module).to(autocast[1])
        return [g.float() for g in gradients(cast, x.to(autocast[1]), autocast, inside)]


def check_autocast_gradients(
    ours: nn.Module,
    reference: nn.Module,
    x: Tensor,
    autocast: tuple[str, torch.dtype],
    *,
    path: Callable[[], str] | None = None,
    same_tolerance: float = 0.0,
) -> None:
    """``ours`` and torch's ``reference`` (same parameters) under ``autocast``, backward inside and outside:
    ``ours``'s gradients equal both ways (up to ``same_tolerance``, relative) and within
    :func:`~lightning_bppsa.testing.assert_derived_close` of the float64 truth, with torch's as the baseline;
    ``path()`` (where given) must say the scan ran."""
    truth = gradients(copy.deepcopy(reference).double().cpu(), x.double().cpu(), None, inside=False)
    names = ["x", *(name for name, _ in ours.named_parameters())]
    both = []
    for inside in (False, True):
        got = gradients(ours, x, autocast, inside)
        if path is not None:
            assert path() == "scan", f"inside={inside}: {path()}"
        baseline = torch_gradients(reference, x, autocast, inside)
        for name, actual, base, expected in zip(names, got, baseline, truth, strict=True):
            assert actual.dtype == base.dtype, name
            assert_derived_close(actual.cpu(), expected, base.cpu(), name=f"{name} (backward inside={inside})")
        both.append(got)
    for name, outside, inside in zip(names, *both, strict=True):
        difference = (outside - inside).norm() / outside.norm()
        assert difference <= same_tolerance, f"{name}: backward inside autocast differs by {difference:.3e}"


def layer_pair(cell: str, algorithm: str, device: torch.device | str = "cpu") -> tuple[nn.Module, nn.Module]:
    """A BPPSA recurrent layer with ``algorithm`` and torch's twin with the same parameters."""
    ours_type, torch_type, kwargs = LAYERS[cell]
    torch.manual_seed(0)
    reference = torch_type(3, 8, batch_first=True, device=device, **kwargs)
    ours = ours_type(3, 8, batch_first=True, algorithm=algorithm, device=device, **kwargs)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


@contextmanager
def modelled_plans() -> Iterator[None]:
    """``algorithm="auto"`` decides by the cost model alone (no timing of this machine, which would also run
    torch's LSTM: oneDNN refuses it under CPU float16 autocast), from a clean slate."""
    layer_plan.forget()
    try:
        with layer_plan.measurements(False):
            yield
    finally:
        layer_plan.forget()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("cell", list(LAYERS))
def test_recurrent_layer_gradients_do_not_depend_on_where_backward_runs(cell, algorithm, dtype):
    ours, reference = layer_pair(cell, algorithm)
    x = torch.randn(4, 40, 3)
    with modelled_plans():
        check_autocast_gradients(ours, reference, x, ("cpu", dtype), path=lambda: ours.last_stats["path"])


class GatedCell(nn.Module):
    """``h' = σ(z) h + (1 - σ(z)) tanh(n)``, ``[z | n] = W x + U h + b``: its linears run in bfloat16 under
    autocast, its state stays float32."""

    state_size = 8

    def __init__(self) -> None:
        super().__init__()
        self.ih, self.hh = nn.Linear(3, 16), nn.Linear(8, 16)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        z, n = (self.ih(x) + self.hh(h)).chunk(2, -1)
        gate = torch.sigmoid(z)
        return (gate * h + (1 - gate) * torch.tanh(n)).to(h.dtype)


class Loop(nn.Module):
    """The cell looped over time by autograd: the reference ``Recurrence`` must reproduce."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x: Tensor) -> Tensor:
        h = x.new_zeros(x.shape[0], self.cell.state_size)
        states = []
        for x_t in x.unbind(1):
            h = self.cell(x_t, h)
            states.append(h)
        return torch.stack(states, 1)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback to autograd warns: none may happen
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_recurrence_gradients_do_not_depend_on_where_backward_runs(algorithm, dtype):
    torch.manual_seed(0)
    cell = GatedCell()
    ours = Recurrence(copy.deepcopy(cell), batch_first=True, algorithm=algorithm)
    # "auto" measures which backward is faster on this machine: either may run, never a fallback
    path = None if algorithm == "auto" else lambda: ours.last_stats["path"]
    check_autocast_gradients(ours, Loop(cell), torch.randn(4, 40, 3), ("cpu", dtype), path=path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chain_gradients_do_not_depend_on_where_backward_runs(algorithm, dtype):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2))
    chain = SparseChain.from_sequential(copy.deepcopy(reference), algorithm=algorithm)
    check_autocast_gradients(
        chain, reference, torch.randn(2, 1, 9, 9), ("cpu", dtype), path=lambda: chain.last_stats["path"]
    )


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
def test_under_autocast_a_layer_computes_in_its_parameters_dtype_and_rounds_only_its_outputs(cell):
    # input 64: the input projection is a torch GEMM (not the CPU kernel's own), which autocast would lower
    torch.manual_seed(0)
    layer = getattr(bnn, cell)(64, 8, batch_first=True, algorithm="linear")
    x = torch.randn(3, 7, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = layer(x)
    ref_out, ref_state = layer(x)
    states = state if cell == "LSTM" else (state,)
    ref_states = ref_state if cell == "LSTM" else (ref_state,)
    # torch's CPU GRU returns float32 under autocast (its float32 state enters each output): so does ours
    low = torch.float32 if cell == "GRU" else torch.bfloat16
    for got, want in zip((out, *states), (ref_out, *ref_states), strict=True):
        assert got.dtype == low
        assert torch.equal(got, want.to(low))


def test_the_layer_takes_torchs_dtype_under_autocast():
    # torch's autocast wrapper of _cudnn_rnn casts to float16 also under bfloat16 autocast: a BPPSA layer on
    # CUDA rounds its outputs to float16 too (bfloat16 ones were 2x less exact than torch's on an H100)
    from lightning_bppsa.nn._scan_layer import layer_autocast_dtype

    assert layer_autocast_dtype("cuda", torch.bfloat16) is torch.float16
    assert layer_autocast_dtype("cuda", torch.float16) is torch.float16
    assert layer_autocast_dtype("cpu", torch.bfloat16) is torch.bfloat16
    with torch.backends.cudnn.flags(enabled=False):  # torch's native CUDA layers follow autocast's dtype
        assert layer_autocast_dtype("cuda", torch.bfloat16) is torch.bfloat16
