"""``Recurrence``'s per-step outputs of a tuple state: the scan hands its backward the gradient of the columns the
outputs read (the first state tensor's, ``(B, T, w)``, ``w < d``) where autograd left it, never a zero-filled
``(B, T, d)`` one; the compiled loop's sweep (C and its CUDA twin through the host emulation) reads it with its
strides and width, the torch paths widen it. Gradients against autograd through the loop in float64."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native
from lightning_bppsa.kernels.cell_cuda_emulated import EmulatedBackend

from lightning_bppsa.nn import Recurrence, cell_kernel, recurrence
from lightning_bppsa.nn.cell_cuda import CudaCellKernel
from lightning_bppsa.nn.cell_kernel import CellKernel, Unsupported
from lightning_bppsa.nn.cell_structure import cell_tensors, trace_cell

F64 = torch.float64
CPU = torch.device("cpu")

needs_compiler = pytest.mark.skipif(
    not _native.build_expected(), reason="no C compiler: no compiled loop to read the gradient"
)


def _corpus():
    """tests/nn/test_cell_corpus.py, loaded by path (its cells: WideFirst, a state ``(m, h)`` of widths ``(2 H, H)``
    read by one linear map, whose outputs ``m`` are the flat state's first ``2 H`` of ``3 H`` columns)."""
    path = Path(__file__).resolve().parent / "test_cell_corpus.py"
    spec = importlib.util.spec_from_file_location("_test_cell_corpus_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WideFirst = _corpus().WideFirst


class Summed(WideFirst):
    """:class:`WideFirst` whose outputs are made by ``output_fn`` from every state tensor (all ``d`` columns)."""

    def output_fn(self, state):
        m, h = state
        return m[:, : self.hidden] * h


def _gradients(fn, cell, x, state0, batch_first, where):
    """``fn``'s outputs and the gradients of ``x``, ``state0`` and the parameters under a loss on every step's
    outputs (``"every"``) or the last step's (``"last"``), and on both final state tensors."""
    out, final = fn()
    last = out[:, -1] if batch_first else out[-1]
    per_step = last if where == "last" else out
    loss = (per_step**2).sum() + per_step.sum() * 0.3 + final[1].sin().sum() + final[0].cos().sum()
    return out.detach(), torch.autograd.grad(loss, [x, *state0, *cell.parameters()])


def _loop(cell, x, state0, batch_first):
    state, outs = state0, []
    for x_t in x.unbind(1 if batch_first else 0):
        state = cell(x_t, state)
        outs.append(cell.output_fn(state) if hasattr(cell, "output_fn") else state[0])
    return torch.stack(outs, 1 if batch_first else 0), state


def _inputs(cell, batch, steps, batch_first):
    shape = (batch, steps, 3) if batch_first else (steps, batch, 3)
    x = torch.randn(*shape, dtype=F64, requires_grad=True)
    return x, tuple(torch.randn(batch, s, dtype=F64, requires_grad=True) for s in cell.state_size)


def _assert_exact(cell, x, state0, batch_first, where, **kwargs):
    """Recurrence's outputs and gradients equal autograd's through the loop (float64); returns the module."""
    rec = Recurrence(cell, batch_first=batch_first, **kwargs)
    ours, g_ours = _gradients(lambda: rec(x, state0), cell, x, state0, batch_first, where)
    ref, g_ref = _gradients(lambda: _loop(cell, x, state0, batch_first), cell, x, state0, batch_first, where)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for k, (a, b) in enumerate(zip(g_ours, g_ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"gradient {k}")
    return rec


def _no_compiled_loop(*args: object) -> None:
    raise Unsupported("not in this test")


@needs_compiler
@pytest.mark.parametrize("where", ["every", "last"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_the_compiled_sweep_reads_the_output_columns_gradient_where_it_lies(monkeypatch, batch_first, where):
    """Time-major outputs' gradient is a transposed view: the sweep gets it as it is, ``(B, T, 2 H)``, no copy and
    no zero columns (a slice of the ``(B, T, 3 H)`` states filled and copied a ``(B, T, 3 H)`` gradient)."""
    seen = []
    scan = CellKernel.scan

    def recording(self, factors, grad_steps, grad_final):
        seen.append(None if grad_steps is None else (tuple(grad_steps.shape), grad_steps.is_contiguous()))
        return scan(self, factors, grad_steps, grad_final)

    monkeypatch.setattr(CellKernel, "scan", recording)
    torch.manual_seed(0)
    cell = WideFirst(3, 4).to(F64)
    x, state0 = _inputs(cell, 3, 7, batch_first)
    rec = _assert_exact(cell, x, state0, batch_first, where, algorithm="linear")
    assert rec.last_stats["cell_kernel"] == "cpu"
    # a loss on the last step alone: its gradient joins the final state's (B, d), the sweep gets no per-step ones
    assert seen == [None if where == "last" else ((3, 7, 8), batch_first)]


def _exact_on(monkeypatch, compiled: bool, cell, batch_first: bool, where: str, algorithm: str) -> None:
    """:func:`_assert_exact` with the compiled loop (``compiled``) or the traced step in torch."""
    if not compiled:
        monkeypatch.setattr(recurrence, "_compiled_loop", _no_compiled_loop)
    elif not _native.build_expected():
        pytest.skip("no C compiler")
    x, state0 = _inputs(cell, 2, 6, batch_first)
    rec = _assert_exact(cell, x, state0, batch_first, where, algorithm=algorithm)
    assert rec.last_stats["jacobians"] == "factored"
    assert rec.last_stats["cell_kernel"] == ("cpu" if compiled else None)


@pytest.mark.parametrize("where", ["every", "last"])
@pytest.mark.parametrize(
    ("algorithm", "compiled"), [("linear", False), ("blelloch", False), ("blelloch", True)]
)
def test_the_scans_in_torch_widen_the_output_columns_gradient(monkeypatch, algorithm, compiled, where):
    """Where the scan runs in torch (no compiled loop, or a scan other than the loop's sweep) the ``(B, T, 2 H)``
    gradient is widened to the states' ``(B, T + 1, 3 H)`` with zeros in its place."""
    torch.manual_seed(1)
    _exact_on(monkeypatch, compiled, WideFirst(3, 3).to(F64), False, where, algorithm)


@pytest.mark.parametrize("compiled", [True, False])
def test_outputs_made_by_output_fn_read_every_column(monkeypatch, compiled):
    """``output_fn`` reads every state tensor: the scan's output is all ``d`` columns of the new states."""
    torch.manual_seed(2)
    _exact_on(monkeypatch, compiled, Summed(3, 2).to(F64), True, "every", "linear")


@needs_compiler
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host emulation")
def test_both_sweeps_read_a_narrow_strided_gradient_as_its_zero_padded_copy():
    """The C sweep and its CUDA twin (host emulation) given the first ``w`` columns' gradient as a transposed view
    equal the C sweep given the same gradient widened with zeros to ``(B, T, d)``, contiguous."""
    torch.manual_seed(3)
    cell = WideFirst(3, 5).to(F64)
    batch, steps, d, w = 2, 4, 15, 10
    states = tuple(torch.randn(batch, s, dtype=F64) for s in cell.state_size)
    structure = trace_cell(cell, torch.randn(batch, 3, dtype=F64), states, True)
    s0 = torch.cat(states, -1)
    x_flat = torch.randn(batch * steps, 3, dtype=F64)
    c_loop = CellKernel(structure, F64)
    cuda = CudaCellKernel(structure, F64, CPU, EmulatedBackend())
    _, factors = c_loop.forward(cell_tensors(cell), x_flat, s0, batch, True)
    _, factors_cuda = cuda.forward(cell_tensors(cell), x_flat, s0, batch, True)
    narrow = torch.randn(steps, batch, w, dtype=F64).transpose(0, 1)  # as time-major outputs' gradient lies
    wide = torch.cat([narrow, narrow.new_zeros(batch, steps, d - w)], -1)
    final = torch.randn(batch, d, dtype=F64)
    for given in (final, None):
        expected = [t.clone() for t in c_loop.scan(factors, wide, given)]
        for kernel, f in ((c_loop, factors), (cuda, factors_cuda)):
            for got, want in zip(kernel.scan(f, narrow, given), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_compiler
def test_a_gradient_wider_than_the_state_is_an_error():
    cell = WideFirst(3, 2).to(F64)
    states = tuple(torch.randn(1, s, dtype=F64) for s in cell.state_size)
    kernel = CellKernel(trace_cell(cell, torch.randn(1, 3, dtype=F64), states, True), F64)
    _, factors = kernel.forward(
        cell_tensors(cell), torch.randn(2, 3, dtype=F64), torch.cat(states, -1), 1, True
    )
    with pytest.raises(ValueError, match=r"must be \(B=1, T=2, w <= 6\); got \(1, 2, 7\)"):
        kernel.scan(factors, torch.zeros(1, 2, 7, dtype=F64), None)


@needs_compiler
def test_the_compiled_loops_states_buffer_is_reused_only_once_nothing_references_it():
    """The compiled loop writes its states into a buffer of an earlier forward only where no tensor shares it any
    more: the final state a call without gradients returns is a view of its states and keeps it."""
    if cell_kernel._SOLE is None:
        pytest.skip("this torch release gives no storage use count: every forward allocates its states")
    torch.manual_seed(4)
    cell = WideFirst(3, 2).to(F64)
    rec = Recurrence(cell, algorithm="linear")
    xs = torch.randn(3, 5, 2, 3, dtype=F64)
    rec(xs[0].requires_grad_())  # traces and builds the loop
    (traced,) = rec._traced.values()
    pooled = lambda: {t.untyped_storage().data_ptr() for t in traced.kernel._pool["states"]}  # noqa: E731
    with torch.no_grad():
        _, first = rec(xs[0])
        assert rec.last_stats["path"] == "compiled loop"
        kept, address = first[1].clone(), first[1].untyped_storage().data_ptr()
        _, second = rec(xs[1])
        assert second[1].untyped_storage().data_ptr() != address
        torch.testing.assert_close(first[1], kept, rtol=0, atol=0)  # not overwritten while held
        del first
        _, third = rec(xs[2])
    assert address in pooled() and third[1].untyped_storage().data_ptr() in pooled()
    for x, (m, h) in ((xs[1], second), (xs[2], third)):
        _, (m_ref, h_ref) = _loop(
            cell, x, tuple(torch.zeros(2, s, dtype=F64) for s in cell.state_size), False
        )
        torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m, m_ref, rtol=1e-12, atol=1e-12)
