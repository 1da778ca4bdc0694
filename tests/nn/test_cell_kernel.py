"""The compiled cell loop (nn/cell_kernel.py): every op it generates, checked through Recurrence against autograd
through the same Python loop in float64; what it does not compile keeps the torch path, exactly."""

from __future__ import annotations

import copy
import gc
import importlib.util
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native
from torch import nn

from lightning_bppsa.cost_model import fastest
from lightning_bppsa.nn import Recurrence, cell_kernel
from lightning_bppsa.nn.cell_structure import _split_columns

F64 = torch.float64

pytestmark = pytest.mark.skipif(
    not _native.build_expected(), reason="no C compiler: the loop is not compiled"
)


#: tests/nn/test_cell_corpus.py, for its checks: ``_loop`` (the cell in a Python loop) and ``_grads``
_spec = importlib.util.spec_from_file_location(
    "_corpus_checks", Path(__file__).with_name("test_cell_corpus.py")
)
CORPUS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CORPUS)


class SmoothOps(nn.Module):
    """Every smooth unary and binary op of the generator, with scalars, a column parameter and alpha."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 2 * hidden), nn.Linear(hidden, 2 * hidden, bias=False)
        self.u = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x, h):
        a, b = self.ih(x).chunk(2, -1)
        p, q = self.hh(h).chunk(2, -1)
        s = torch.sigmoid(a + p)
        pos = 1.5 + torch.tanh(b - q)  # in (0.5, 2.5): log, sqrt, rsqrt, reciprocal, pow are defined
        mix = torch.add(torch.log(pos) * torch.sqrt(pos), torch.rsqrt(pos), alpha=0.5)
        mix = torch.sub(mix, torch.reciprocal(pos) / 3.0, alpha=2.0) + pos.pow(1.5) - torch.exp(-pos)
        mix = mix + torch.nn.functional.silu(q) * self.u - torch.abs(q) / pos + (-h) * 0.1
        return s * torch.tanh(mix) + (1 - s) * h


class PiecewiseOps(nn.Module):
    """relu, leaky_relu, clamps, hardtanh, where and comparisons, a (rows, 1) input value and a scalar buffer."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)
        self.register_buffer("scale", torch.tensor(0.7))

    def forward(self, x, h):
        z = self.ih(x) + self.hh(h)
        gate = x[:, :1] * self.scale  # one value per row, broadcast over the state
        y = torch.relu(z) - torch.nn.functional.leaky_relu(z, 0.2) + torch.clamp(z, -0.5, 0.8) * gate
        y = (
            y
            + torch.clamp_min(h, -0.3)
            - torch.clamp_max(h, 0.4)
            + torch.nn.functional.hardtanh(z, -0.6, 0.6)
        )
        return torch.where(z > 0.1, y, 0.5 * h) + torch.where(h <= 0, h * 0.2, torch.tanh(y))


class ThreeStates(nn.Module):
    """A tuple of three states: two read directly, one (``k``) reached only through a linear map, one new
    state independent of the old (``k' = tanh(x W)``)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden, hidden)
        self.gates = nn.Linear(inputs + hidden, 2 * hidden)
        self.kk = nn.Linear(hidden, hidden, bias=False)
        self.xk = nn.Linear(inputs, hidden)

    def forward(self, x, state):
        h, c, k = state
        f, g = self.gates(torch.cat([x, h], -1)).chunk(2, -1)
        c = torch.sigmoid(f) * c + torch.tanh(g) * torch.sigmoid(self.kk(k))
        return torch.tanh(c) * h.sigmoid(), c, torch.tanh(self.xk(x))


class DropoutCell(nn.Module):
    """Dropout inside the step: in training mode the step is random (not traced)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh, self.drop = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden), nn.Dropout(0.3)

    def forward(self, x, h):
        return torch.tanh(self.drop(self.ih(x)) + self.hh(h))


class Unsupported(nn.Module):
    """``sin`` is not generated: the traced step runs in torch."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, hidden), nn.Linear(hidden, hidden)

    def forward(self, x, h):
        return torch.sin(self.ih(x) + self.hh(h))


@pytest.mark.parametrize("cell_type", [SmoothOps, PiecewiseOps, ThreeStates])
@pytest.mark.parametrize("algorithm", ["linear", "blelloch"])
@pytest.mark.parametrize("last_only", [False, True])
def test_compiled_loop_equals_autograd_through_the_loop_in_float64(cell_type, algorithm, last_only):
    torch.manual_seed(0)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(9, 4, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm=algorithm)
    if isinstance(cell.state_size, tuple):  # every state tensor's gradient path: the loss reads all of them
        cell.output_fn = lambda state: torch.cat(state, -1)
    ours = CORPUS._grads(lambda: module(x)[0], leaves, last_only)
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    theirs = CORPUS._grads(lambda: CORPUS._loop(cell, x), leaves, last_only)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_what_factors_does_not_depend_on_the_releases_pointwise_tags(monkeypatch):
    # torch 2.11 does not tag leaky_relu pointwise (2.13 does): PiecewiseOps then fell back to dense Jacobians
    op = torch.ops.aten.leaky_relu.default
    monkeypatch.setattr(op, "_tags", [tag for tag in op.tags if tag != torch.Tag.pointwise])
    torch.manual_seed(10)
    cell = PiecewiseOps(3, 5).to(F64)
    x = torch.randn(6, 2, 3, dtype=F64, requires_grad=True)
    module = Recurrence(cell, algorithm="linear")
    ours = CORPUS._grads(lambda: module(x)[0], [x, *cell.parameters()])
    assert module.last_stats["jacobians"] == "factored", module.last_stats["dense_reason"]
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), [x, *cell.parameters()]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_compiled_loop_float32_within_float32_tolerance_and_backward_twice():
    torch.manual_seed(1)
    cell = SmoothOps(3, 16)
    x = torch.randn(50, 8, 3, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm="linear")
    out = module(x)[0]
    assert module.last_stats["cell_kernel"]
    loss = out.pow(2).mean()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)  # the recorded input part is kept for a second backward
    cell64, x64 = copy.deepcopy(cell).double(), x.detach().double().requires_grad_()
    reference = torch.autograd.grad(CORPUS._loop(cell64, x64).pow(2).mean(), [x64, *cell64.parameters()])
    for a, b, ref in zip(first, second, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a.double(), ref, rtol=1e-4, atol=1e-5)


def _torch_path_exactly(cell: nn.Module, seed: int, reason: str) -> None:
    """``Recurrence(cell)`` runs without the compiled loop, saying ``reason``, and equals the loop exactly."""
    torch.manual_seed(seed)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm="linear")
    ours = CORPUS._grads(lambda: module(x)[0], leaves, False)
    assert module.last_stats["jacobians"] == "factored" and not module.last_stats["cell_kernel"]
    assert reason in module.last_stats["cell_kernel_reason"], module.last_stats["cell_kernel_reason"]
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), leaves, False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_an_op_the_generator_lacks_keeps_the_torch_path_exactly():
    _torch_path_exactly(Unsupported(3, 5).to(F64), 2, "aten.sin")


def test_a_wrong_generated_derivative_is_caught_by_the_check_and_not_used(monkeypatch):
    value, _ = cell_kernel._UNARY[torch.ops.aten.tanh.default]
    monkeypatch.setitem(cell_kernel._UNARY, torch.ops.aten.tanh.default, (value, "(1 + {y} * {y})"))
    _torch_path_exactly(SmoothOps(3, 4).to(F64), 3, "does not reproduce")


def test_without_native_builds_the_loop_runs_in_torch(monkeypatch):
    monkeypatch.setenv("BPPSA_NATIVE", "0")
    monkeypatch.setattr(cell_kernel, "_LIBRARIES", {})
    _torch_path_exactly(PiecewiseOps(3, 6).to(F64), 4, "could not be built")


def test_a_state_too_wide_for_the_loops_stack_arrays_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(cell_kernel, "_STACK_BYTES", 100)  # 5 d doubles = 200 bytes here
    _torch_path_exactly(PiecewiseOps(3, 5).to(F64), 8, "too wide")


def test_split_columns_backward_takes_adjacent_gradients_as_a_view():
    a = torch.randn(7, 9, dtype=F64, requires_grad=True)
    pieces = _split_columns(a * 1, [3, 2, 4])
    grads = torch.randn(7, 12, dtype=F64)
    (adjacent,) = torch.autograd.grad(
        pieces, a, [grads[:, :3], grads[:, 3:5], grads[:, 5:9]], retain_graph=True
    )
    torch.testing.assert_close(adjacent, grads[:, :9])
    scattered = [grads[:, 9:12], grads[:, :2], grads[:, 2:6]]  # not in order: concatenated
    (copied,) = torch.autograd.grad(pieces, a, scattered, retain_graph=True)
    torch.testing.assert_close(copied, torch.cat(scattered, -1))
    # the others' gradients: zeros
    (partial,) = torch.autograd.grad(pieces[1], a, torch.ones(7, 2, dtype=F64))
    torch.testing.assert_close(
        partial,
        torch.cat(
            [torch.zeros(7, 3, dtype=F64), torch.ones(7, 2, dtype=F64), torch.zeros(7, 4, dtype=F64)], -1
        ),
    )


def test_a_diagonal_only_chain_plans_the_linear_sweep():
    # m = 0 tiles used to price the chunked scan at zero work (25 ms measured against 0.9 ms linear)
    assert fastest(n=1000, d=32, batch=16, width=0, device="cpu", native=True, chunk=32) == "linear"


def test_without_gradients_the_compiled_loop_runs_the_forward():
    torch.manual_seed(5)
    cell = ThreeStates(3, 5).to(F64)
    x = torch.randn(8, 4, 3, dtype=F64)
    module = Recurrence(cell)
    with torch.inference_mode():  # no trace yet for this shape: inference_mode cannot make one
        module(x)
    assert module.last_stats["path"] == "autograd"
    with torch.no_grad():
        out, (h, c, k) = module(x)
    assert module.last_stats["path"] == "compiled loop"
    reference = CORPUS._loop(cell, x)
    torch.testing.assert_close(out, reference[..., :5], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([h, c, k], -1), reference[-1], rtol=1e-12, atol=1e-12)
    with torch.inference_mode():  # the trace made above is used
        again, _ = module(x)
    assert module.last_stats["path"] == "compiled loop"
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_without_gradients_a_cell_drawing_random_numbers_is_called():
    torch.manual_seed(6)
    cell = DropoutCell(3, 5).to(F64)  # training mode: dropout draws
    x = torch.randn(6, 2, 3, dtype=F64)
    module = Recurrence(cell)
    with torch.no_grad():
        torch.manual_seed(7)
        out, _ = module(x)
        torch.manual_seed(7)
        reference = CORPUS._loop(cell, x)
    assert module.last_stats["path"] == "autograd"
    torch.testing.assert_close(out, reference, rtol=0, atol=0)


def test_gradients_handed_out_survive_the_next_backward():
    # the sweep's buffers are reused by the next backward: what a backward returns must not change with it
    torch.manual_seed(9)
    cell = ThreeStates(3, 4).to(F64)
    module = Recurrence(cell, algorithm="linear")
    state0 = tuple(torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(3))
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    first = torch.autograd.grad(module(x, state0)[0].pow(2).sum(), [x, *state0])
    kept = [g.clone() for g in first]
    torch.autograd.grad((module(x * 2, state0)[0] * 3).sum(), [x, *state0])  # another backward, same shapes
    for a, b in zip(first, kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _final(state):
    return torch.cat(state, -1) if isinstance(state, tuple) else state


@pytest.mark.parametrize("cell_type", [SmoothOps, ThreeStates])
@pytest.mark.parametrize("uses", ["outputs and final state", "final state"])
def test_the_sweep_takes_the_outputs_and_the_final_states_gradients_as_given(cell_type, uses):
    """The outputs' gradient (B, T, d) and the final state's (B, d) reach the compiled sweep as autograd
    hands them over (no (B, T + 1, d) gradient assembled); either may be absent."""
    torch.manual_seed(1)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(9, 4, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm="linear")
    if isinstance(cell.state_size, tuple):
        cell.output_fn = lambda state: torch.cat(state, -1)

    def loss(out, final):
        weights = torch.linspace(0.5, 1.5, final.shape[-1], dtype=final.dtype)
        on_final = (final.sin() * weights).sum()
        return on_final + (out.pow(2).sum() if uses == "outputs and final state" else 0)

    out, final = module(x)
    ours = torch.autograd.grad(loss(out, _final(final)), leaves)
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    steps = CORPUS._loop(cell, x)
    theirs = torch.autograd.grad(loss(steps, steps[-1]), leaves)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_forwards_factor_buffers_are_reused_only_once_nothing_references_them():
    """A forward's factors go into a buffer of an earlier forward only where no tensor shares that buffer any more
    (a view of the factors keeps it); the reused buffer then holds the new forward's factors. Factors whose
    Jacobians were read (as every backward does) are freed when dropped, without a garbage collection."""
    if cell_kernel._SOLE is None:
        pytest.skip("this torch release gives no storage use count: every forward allocates its buffers")
    gc.disable()
    try:
        _check_buffer_reuse()
    finally:
        gc.enable()


def _check_buffer_reuse() -> None:
    torch.manual_seed(10)
    cell = ThreeStates(3, 4).to(F64)
    module = Recurrence(cell, algorithm="linear")
    x = torch.randn(5, 2, 3, dtype=F64)
    module(x.requires_grad_())
    (traced,) = module._traced.values()
    kernel, params = traced.kernel, list(cell.parameters())
    x_flat, s0 = x.detach().reshape(10, 3), torch.zeros(2, 12, dtype=F64)
    _, first = kernel.forward(params, x_flat, s0, 2, True)
    _, second = kernel.forward(params, x_flat * 2, s0, 2, True)
    address = first.scales.data_ptr()
    assert second.scales.data_ptr() != address
    view, kept = first.scales[:, :1], first.scales[:, :1].clone()
    assert first.jacobians.length == 5
    del first
    _, third = kernel.forward(params, x_flat * 3, s0, 2, True)
    assert third.scales.data_ptr() != address
    torch.testing.assert_close(view, kept, rtol=0, atol=0)
    del view
    _, fourth = kernel.forward(params, x_flat * 4, s0, 2, True)
    assert fourth.scales.data_ptr() == address
    _, fresh = cell_kernel.CellKernel(traced.structure, F64).forward(params, x_flat * 4, s0, 2, True)
    torch.testing.assert_close(fourth.scales, fresh.scales, rtol=0, atol=0)
