"""nn.Recurrence: gradients equal autograd through the same Python loop, for user-written cells."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import json
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bppsa import BPPSAStrategy, layer_plan
from lightning_bppsa.nn import Recurrence, convert, recurrence, reference_backward
from lightning_bppsa.nn.convert import is_converted
from lightning_bppsa.testing import assert_derived_close

F64 = torch.float64


#: tests/strategy/test_strategy.py, for its ``trainer`` (a quiet float64 CPU Trainer)
_spec = importlib.util.spec_from_file_location(
    "_strategy_tests", Path(__file__).resolve().parents[1] / "strategy" / "test_strategy.py"
)
STRATEGY_TESTS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(STRATEGY_TESTS)


class GatedCell(nn.Module):
    """A minimal GRU-like cell, tensor state."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 3 * hidden), nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, h):
        z, r, n = self.ih(x).chunk(3, -1)
        hz, hr, hn = self.hh(h).chunk(3, -1)
        z, r = torch.sigmoid(z + hz), torch.sigmoid(r + hr)
        return (1 - z) * torch.tanh(n + r * hn) + z * h


class IndCell(nn.Module):
    """IndRNN: ``h = relu(x W + u ⊙ h + b)`` (a diagonal step Jacobian)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.lin = nn.Linear(inputs, hidden)
        self.u = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x, h):
        return torch.relu(self.lin(x) + self.u * h)


class PeepholeLSTM(nn.Module):
    """An LSTM variant with a tuple state ``(h, c)``, a peephole on ``c`` and a projected output."""

    def __init__(self, inputs: int, hidden: int, out: int = 2) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.gates = nn.Linear(inputs + hidden, 4 * hidden)
        self.peep = nn.Parameter(torch.randn(hidden) * 0.3)
        self.proj = nn.Linear(hidden, out)

    def forward(self, x, state):
        h, c = state
        i, f, g, o = self.gates(torch.cat([x, h], -1)).chunk(4, -1)
        c = torch.sigmoid(f + self.peep * c) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def output_fn(self, state):
        return self.proj(state[0])


class DeepTransition(nn.Module):
    """``h' = tanh(x U + W2 tanh(W1 h))``: the state passes two linear maps (not factorable)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.w1, self.w2 = (
            nn.Linear(inputs, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, hidden),
        )

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.w2(torch.tanh(self.w1(h))))


class NormedCell(GatedCell):
    """Layer norm of the state: a reduction over the hidden dimension (not factorable)."""

    def forward(self, x, h):
        return super().forward(x, nn.functional.layer_norm(h, h.shape[-1:]))


CELLS = {
    "gated": GatedCell,
    "ind": IndCell,
    "lstm": PeepholeLSTM,
    "deep": DeepTransition,
    "normed": NormedCell,
}
FACTORABLE = {"gated", "ind", "lstm"}


def fake_timer(monkeypatch, autograd_seconds, jacobian_seconds):
    """Inject the "auto" probe's clock: each probe reads it 3 times (start, after autograd, after Jacobians)."""
    calls = []
    values = itertools.accumulate(itertools.cycle([0.0, autograd_seconds, jacobian_seconds]))
    monkeypatch.setattr(recurrence, "_timer", lambda: calls.append(None) or next(values))
    return calls


@pytest.fixture
def measuring():
    """``"auto"`` measures (the probe, on the injected clock of :func:`fake_timer`), in this process only
    (tests/conftest.py keeps the plan cache off disk); the decisions are forgotten afterwards."""
    with layer_plan.measurements(True):
        yield
    layer_plan.forget()


@pytest.fixture
def scan_wins(monkeypatch, measuring):
    return fake_timer(monkeypatch, 1.0, 0.1)


def _zeros(cell, batch, dtype=F64):
    sizes = cell.state_size
    return (
        tuple(torch.zeros(batch, s, dtype=dtype) for s in sizes)
        if isinstance(sizes, tuple)
        else torch.zeros(batch, sizes, dtype=dtype)
    )


def loop(cell, x, state0, batch_first=False):
    """The reference: autograd through the plain Python loop, outputs as Recurrence defines them."""
    xs = x.unbind(1 if batch_first else 0)
    state, outs = state0, []
    for x_t in xs:
        state = cell(x_t, state)
        out = (
            cell.output_fn(state)
            if hasattr(cell, "output_fn")
            else state[0]
            if isinstance(state, tuple)
            else state
        )
        outs.append(out)
    return torch.stack(outs, 1 if batch_first else 0), state


def loss_of(out, final, where):
    last = final[0] if isinstance(final, tuple) else final
    if where == "last":
        return (last**2).sum() + last.sin().sum()
    return (out**2).sum() + out.sum() * 0.3 + last.cos().sum()


def grads(fn, leaves, params, where):
    for t in [*leaves, *params]:
        t.grad = None
    out, final = fn()
    loss_of(out, final, where).backward()
    return out.detach(), [t.grad for t in [*leaves, *params]]


def compare(cell, x, state0, *, where="every", batch_first=False, rec=None, **kwargs):
    """Recurrence (``rec`` or a new one) vs the loop: same outputs and gradients (float64, 1e-10)."""
    rec = rec or Recurrence(cell, batch_first=batch_first, **kwargs)
    given = state0 if state0 is not None else _zeros(cell, x.shape[0 if batch_first else 1], x.dtype)
    leaves = [x] + ([] if state0 is None else list(state0) if isinstance(state0, tuple) else [state0])
    params = list(cell.parameters())
    ours, g_ours = grads(lambda: rec(x, state0), leaves, params, where)
    ref, g_ref = grads(lambda: loop(cell, x, given, batch_first), leaves, params, where)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for k, (a, b) in enumerate(zip(g_ours, g_ref, strict=True)):
        assert (a is None) == (b is None), k
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"gradient {k}")
    return rec


def make(kind, batch, steps, inputs=3, hidden=5, dtype=F64, with_state0=True, batch_first=False):
    cell = CELLS[kind](inputs, hidden).to(dtype)
    shape = (batch, steps, inputs) if batch_first else (steps, batch, inputs)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    if not with_state0:
        return cell, x, None
    sizes = cell.state_size if isinstance(cell.state_size, tuple) else (cell.state_size,)
    states = tuple(torch.randn(batch, s, dtype=dtype, requires_grad=True) for s in sizes)
    return cell, x, states if isinstance(cell.state_size, tuple) else states[0]


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("where", ["every", "last"])
@pytest.mark.parametrize(
    ("batch", "steps", "with_state0", "batch_first"), [(3, 7, True, False), (1, 11, False, True)]
)
def test_gradients_equal_autograd_through_the_loop(
    kind, where, batch, steps, with_state0, batch_first, scan_wins
):
    cell, x, state0 = make(kind, batch, steps, with_state0=with_state0, batch_first=batch_first)
    rec = compare(cell, x, state0, where=where, batch_first=batch_first)
    assert rec.last_stats["path"] == "scan" and rec.last_stats["reason"] is None
    assert rec.last_stats["jacobians"] == ("factored" if kind in FACTORABLE else "dense")
    assert rec.last_stats["traced_forward"]


@pytest.mark.parametrize("kind", ["gated", "ind"])  # ind: a diagonal-only factored chain (no weight tiles)
@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
def test_every_algorithm_is_exact_including_one_step_and_one_wide_state(algorithm, kind):
    compare(*make(kind, 2, 13), algorithm=algorithm)
    rec = compare(*make("lstm", 3, 1), algorithm=algorithm)  # T = 1: an explicit algorithm still scans
    assert rec.last_stats["path"] == "scan"
    compare(*make("ind", 4, 5, hidden=1), algorithm=algorithm)


def test_long_sequence_spans_several_jacobian_chunks():
    # d = 64 -> 512 rows per batched-gradient call; B T = 1105 rows -> 3 calls
    compare(*make("gated", 5, 221, hidden=64, inputs=2), where="every")


def test_unbatched_input_and_state():
    cell = PeepholeLSTM(3, 4).double()
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    state0 = (torch.randn(4, dtype=F64, requires_grad=True), torch.randn(4, dtype=F64, requires_grad=True))
    out, (h, c) = Recurrence(cell)(x, state0)
    assert out.shape == (6, 2) and h.shape == c.shape == (4,)
    batched = tuple(s.unsqueeze(0) for s in state0)
    ref_out, (ref_h, _) = loop(cell, x.unsqueeze(1), batched)
    torch.testing.assert_close(out, ref_out.squeeze(1))
    (g_ours,) = torch.autograd.grad((out**2).sum() + h.sum(), state0[1])
    (g_ref,) = torch.autograd.grad((ref_out**2).sum() + ref_h.sum(), state0[1])
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-10)


def test_float32_within_the_derived_tolerance():
    cell64, x64, h64 = make("gated", 4, 50, hidden=8)
    cell32 = GatedCell(3, 8)
    cell32.load_state_dict(cell64.state_dict())
    x32, h32 = x64.detach().float().requires_grad_(), h64.detach().float().requires_grad_()
    _, ref = grads(lambda: loop(cell64, x64, h64), [x64, h64], list(cell64.parameters()), "every")
    _, base = grads(lambda: loop(cell32, x32, h32), [x32, h32], list(cell32.parameters()), "every")
    _, ours = grads(lambda: Recurrence(cell32)(x32, h32), [x32, h32], list(cell32.parameters()), "every")
    for k, (a, r, b) in enumerate(zip(ours, ref, base, strict=True)):
        assert_derived_close(a, r, b, name=f"gradient {k}")


class DropoutCell(GatedCell):
    def __init__(self, inputs, hidden):
        super().__init__(inputs, hidden)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, h):
        return super().forward(self.drop(x), h)


@pytest.mark.parametrize("algorithm", ["auto", "linear"])  # found by the probe / by the scan's forward
def test_dropout_in_the_cell_runs_autograd_with_the_same_masks_and_eval_scans(algorithm, scan_wins):
    cell, x, h0 = DropoutCell(3, 5).double(), *make("gated", 3, 9)[1:]
    rec = Recurrence(cell, algorithm=algorithm)
    params = list(cell.parameters())
    torch.manual_seed(7)
    with pytest.warns(RuntimeWarning, match="draws random numbers"):
        ours, g_ours = grads(lambda: rec(x, h0), [x, h0], params, "every")
    after = torch.get_rng_state()
    torch.manual_seed(7)
    ref, g_ref = grads(lambda: loop(cell, x, h0), [x, h0], params, "every")
    assert torch.equal(after, torch.get_rng_state())  # the generator advanced as by the plain loop
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert rec.last_stats["path"] == "autograd" and "random" in rec.last_stats["reason"]
    assert not recurrence_plans()  # what the probe found is no timing: the layer plan keeps nothing
    cell.eval()
    compare(cell, x, h0, algorithm=algorithm)  # no random numbers in eval mode: the same module scans again
    rec(x, h0)
    assert rec.last_stats["path"] == "scan"


class BatchNormedCell(GatedCell):
    """Mixes batch rows: the batched calls cannot reproduce the loop."""

    def forward(self, x, h):
        return super().forward(x, h - h.mean(0))


class ItemCell(GatedCell):
    """Python control flow on a value read over the whole batch with ``.item()``."""

    def forward(self, x, h):
        h = super().forward(x, h)
        return h * 0.5 if h.abs().max().item() > 0.9 else h


class InPlaceCell(GatedCell):
    """Modifies its input state in place."""

    def forward(self, x, h):
        h.clamp_(-5.0, 5.0)
        return super().forward(x, h)


class _NoVmapScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return 2 * t

    @staticmethod
    def backward(ctx, grad):
        assert grad.abs().sum().item() >= 0  # .item() on a batched gradient: vmap refuses it
        return 2 * grad


class NoVmapCell(GatedCell):
    def forward(self, x, h):
        return super().forward(x, _NoVmapScale.apply(h) / 2)


@pytest.mark.parametrize(
    ("cell_cls", "reason"),
    [
        (BatchNormedCell, "independently"),
        (ItemCell, "independently"),
        (InPlaceCell, "in.place"),
        (NoVmapCell, "batched cell calls failed"),
    ],
)
@pytest.mark.parametrize(
    "algorithm", ["auto", "linear"]
)  # found by the probe / by the scan's forward or backward
def test_cells_the_batched_calls_cannot_run_fall_back_exactly_warn_once_and_stick(
    cell_cls, reason, algorithm, scan_wins
):
    torch.manual_seed(3)
    cell = cell_cls(3, 5).double()
    x = (torch.randn(9, 4, 3, dtype=F64) * 3).requires_grad_()
    with pytest.warns(RuntimeWarning, match=reason) as record:
        rec = compare(cell, x, None, algorithm=algorithm)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert rec.last_stats["path"] == "autograd" and re.search(reason, rec.last_stats["reason"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per module
        rec(x)[0].sum().backward()
    assert rec.last_stats["path"] == "autograd" and "failed before" in rec.last_stats["reason"]


class WrongShape(nn.Module):
    state_size = 4

    def forward(self, x, h):
        return torch.cat([h, h], -1)


class WrongDtype(nn.Module):
    state_size = (3, 2)

    def forward(self, x, state):
        return state[0], state[1].float()


class WrongArity(nn.Module):
    state_size = (3, 2)

    def forward(self, x, state):
        return (state[0],)


class ShapeChangesMidway(nn.Module):
    state_size = 4

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x, h):
        self.calls += 1
        return h[:1] if self.calls == 3 else h + x.sum()


class NoSize(nn.Module):
    def forward(self, x, h):
        return h


@pytest.mark.parametrize(
    ("cell", "match"),
    [
        (WrongShape, "output state shape must equal the input state shape"),
        (ShapeChangesMidway, "output state shape must equal the input state shape"),
        (WrongDtype, "state dtypes must not differ"),
        (WrongArity, "same tuple arity"),
        (NoSize, "state0 is None and NoSize.state_size is None"),
    ],
)
@pytest.mark.parametrize("requires_grad", [True, False])
def test_bad_cells_get_an_error_naming_the_rule(cell, match, requires_grad):
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=requires_grad)
    with pytest.raises(ValueError, match=match):
        Recurrence(cell())(x)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        Recurrence(IndCell(2, 3), algorithm="fast")
    with pytest.raises(TypeError, match="cell must be an nn.Module"):
        Recurrence(lambda x, h: h)
    with pytest.raises(ValueError, match="memory_budget"):
        Recurrence(IndCell(2, 3), memory_budget=-1)
    rec = Recurrence(IndCell(2, 3))
    with pytest.raises(ValueError, match=r"input must be \(T, B, I\)"):
        rec(torch.randn(2, 3, 4, 2))
    with pytest.raises(ValueError, match=r"state0 tensor 0 must have shape \(B=4, d\)"):
        rec(torch.randn(5, 4, 2), torch.randn(3, 3))
    with pytest.raises(ValueError, match="state dtypes must not differ"):
        Recurrence(PeepholeLSTM(2, 3))(torch.randn(5, 4, 2), (torch.randn(4, 3), torch.randn(4, 3).double()))
    with pytest.raises(ValueError, match="output_fn must return a Tensor"):
        cell = IndCell(2, 3)
        cell.output_fn = lambda state: state.sum()
        Recurrence(cell)(torch.randn(5, 4, 2))


class _SeparateMemory(nn.Module):
    """``(h, m)``: ``h' = tanh(a)``, ``m' = m σ(b)``, ``[a | b]`` one linear map of ``[h | m]`` and ``x``: half of
    the factor columns the torch path lays out are structurally zero (``m'`` reads neither ``h`` nor ``m``
    through ``a``, ``h'`` none through ``b``)."""

    state_size = (4, 4)

    def __init__(self) -> None:
        super().__init__()
        self.hh, self.ih = nn.Linear(8, 8), nn.Linear(3, 8)

    def forward(self, x, state):
        h, m = state
        a, b = (self.hh(torch.cat([h, m], -1)) + self.ih(x)).chunk(2, -1)
        return torch.tanh(a), m * torch.sigmoid(b)


def test_auto_budgets_the_compiled_loops_factors_as_kept_not_the_full_layout(scan_wins):
    torch.manual_seed(0)
    cell = _SeparateMemory().double()
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    h0 = tuple(torch.randn(3, 4, dtype=F64, requires_grad=True) for _ in range(2))
    (traced,) = compare(cell, x, h0, algorithm="linear")._traced.values()
    kept = traced.kernel.factor_elements + traced.kernel.input_partial_elements
    assert kept < traced.structure.factor_elements  # the case: zero columns neither stored nor budgeted
    need = 3 * 6 * kept * 8
    assert compare(cell, x, h0, memory_budget=need).last_stats["path"] == "scan"
    assert compare(cell, x, h0, memory_budget=need - 1).last_stats["path"] == "autograd"


def test_auto_runs_autograd_where_the_scan_has_nothing_to_do_or_does_not_fit(scan_wins):
    cell, x, h0 = make("gated", 3, 6)
    assert (
        compare(cell, x[:1].detach().requires_grad_(), h0).last_stats["reason"]
        == "auto: one step, nothing to scan"
    )
    # B T float64s per step: the factors (gate pieces, the diagonal of z h) as the compiled loop keeps them (its
    # structurally nonzero columns) and its partials by its input values; the torch path's full layout without it
    (traced,) = compare(cell, x, h0, algorithm="linear")._traced.values()
    kernel = traced.kernel
    per_step = (
        kernel.factor_elements + kernel.input_partial_elements if kernel else traced.structure.factor_elements
    )
    factors = 3 * 6 * per_step * 8
    rec = compare(cell, x, h0, memory_budget=factors - 1)
    assert rec.last_stats["path"] == "autograd" and "factored Jacobians need" in rec.last_stats["reason"]
    assert compare(cell, x, h0, memory_budget=factors).last_stats["path"] == "scan"
    cell, x, h0 = make("deep", 3, 6)
    rec = compare(cell, x, h0, memory_budget=3 * 6 * 25 * 8 - 1)
    assert rec.last_stats["path"] == "autograd" and "dense Jacobians need" in rec.last_stats["reason"]
    assert compare(cell, x, h0, memory_budget=3 * 6 * 25 * 8).last_stats["path"] == "scan"
    rec = Recurrence(cell)
    with torch.no_grad():
        out, _ = rec(x, h0)
    torch.testing.assert_close(out, loop(cell, x, h0)[0])
    assert rec.last_stats["reason"] == "no gradient is needed"


def test_double_backward_and_reference_backward_equal_autograd():
    cell, x, h0 = make("lstm", 2, 5)
    rec = Recurrence(cell)

    def penalty(fn):
        out, _ = fn()
        (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), cell.gates.weight)[0]

    ref = penalty(lambda: loop(cell, x, h0))
    torch.testing.assert_close(penalty(lambda: rec(x, h0)), ref, rtol=1e-10, atol=1e-10)
    out, _ = rec(x, h0)
    with reference_backward():
        (g_ref,) = torch.autograd.grad(out.sum(), cell.gates.weight, retain_graph=True)
    (g_scan,) = torch.autograd.grad(out.sum(), cell.gates.weight)
    torch.testing.assert_close(g_scan, g_ref, rtol=1e-10, atol=1e-10)


def test_auto_measures_once_per_batch_shape_and_keeps_the_faster_backward(monkeypatch, measuring):
    cell, x, h0 = make("deep", 3, 40)  # not factorable: "auto" measures
    calls = fake_timer(monkeypatch, 0.1, 1.0)  # the scan's Jacobians measure slower than autograd
    rec = compare(cell, x, h0)
    measured = "measured: scan 1e+03 ms vs torch 100 ms for a backward through 40 steps"
    assert rec.last_stats["plan"] == f"autograd ({measured})" and rec.last_stats["reason"] == measured
    compare(cell, x, h0, rec=rec)
    assert len(calls) == 3  # measured once for this shape
    rec.train(False)
    calls = fake_timer(monkeypatch, 1.0, 0.1)
    assert compare(cell, x, h0, rec=rec).last_stats["path"] == "scan" and len(calls) == 3  # another mode
    _, x1, h1 = make("deep", 1, 40)
    assert compare(cell, x1, h1, rec=rec).last_stats["path"] == "scan" and len(calls) == 6  # another B


def test_torch_func_runs_autograd_through_the_loop():
    cell, x, h0 = make("ind", 2, 4)
    rec = Recurrence(cell)
    params = dict(cell.named_parameters())

    def loss(p):
        return (
            torch.func.functional_call(rec, {f"cell.{k}": v for k, v in p.items()}, (x, h0))[0].pow(2).sum()
        )

    ours = torch.func.grad(loss)(params)
    assert rec.last_stats["path"] == "autograd" and "torch.func" in rec.last_stats["reason"]
    ref = torch.autograd.grad(loop(cell, x, h0)[0].pow(2).sum(), list(params.values()))
    for a, b in zip(ours.values(), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_convert_keeps_a_recurrence_and_reports_it_scanned():
    model = nn.Sequential(Recurrence(GatedCell(3, 4)))
    inner = model[0]
    report = []
    assert convert(model, report=report) is model and model[0] is inner and is_converted(inner)
    assert [(r.path, r.scanned, r.already_converted) for r in report] == [("0", True, True)]


class CellModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.rec = Recurrence(PeepholeLSTM(3, 5, out=2), batch_first=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.rec(x)
        return nn.functional.cross_entropy(out[:, -1], y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy):
    pl.seed_everything(0, verbose=False)
    model = CellModel()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 6, 3, generator=g), torch.randint(0, 2, (8,), generator=g))
    trainer = STRATEGY_TESTS.trainer(strategy, max_steps=2)  # quiet, CPU, float64
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model, trainer


def test_trainer_with_bppsa_strategy_scans_a_recurrence_and_matches_autograd():
    ours, trainer = _fit(BPPSAStrategy(algorithm="chunked"))
    ref, _ = _fit("auto")
    assert [(r.path, r.scanned) for r in trainer.strategy.conversion_report] == [("rec", True)]
    assert ours.rec.algorithm == "chunked" and ours.rec.last_stats["path"] == "scan"
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
def test_torch_compile_traces_the_plain_loop_and_says_so():
    cell, x, h0 = make("gated", 2, 5)
    rec = Recurrence(cell)
    compiled = torch.compile(rec, fullgraph=True)
    out, _ = compiled(x, h0)
    ref_out, _ = loop(cell, x, h0)
    torch.testing.assert_close(out, ref_out)
    assert rec.last_stats["path"] == "autograd" and "torch.compile" in rec.last_stats["reason"]
    (g,) = torch.autograd.grad(out.sum(), cell.ih.weight)
    (g_ref,) = torch.autograd.grad(ref_out.sum(), cell.ih.weight)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 4),
    steps=st.integers(1, 9),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    as_tuple=st.booleans(),
    algorithm=st.sampled_from(["linear", "blelloch", "chunked"]),
)
def test_random_shapes_and_state_layouts_match_the_loop(batch, steps, sizes, as_tuple, algorithm):
    class Mixer(nn.Module):
        """Every state tensor is updated from all of them: a dense Jacobian across the tuple."""

        def __init__(self):
            super().__init__()
            self.state_size = tuple(sizes) if as_tuple or len(sizes) > 1 else sizes[0]
            self.lin = nn.Linear(2 + sum(sizes), sum(sizes), dtype=F64)

        def forward(self, x, state):
            flat = torch.cat([x, *state] if isinstance(state, tuple) else [x, state], -1)
            new = torch.tanh(self.lin(flat)).split(sizes, -1)
            return tuple(new) if isinstance(state, tuple) else new[0]

    cell = Mixer()
    x = torch.randn(steps, batch, 2, dtype=F64, requires_grad=True)
    compare(cell, x, None, algorithm=algorithm)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_factored_jacobians_equal_the_dense_ones_or_say_why_not(kind):
    cell, x, state0 = make(kind, 3, 6)
    rec = compare(cell, x, state0, algorithm="linear")
    stats = rec.last_stats
    if kind in FACTORABLE:
        assert stats["jacobians"] == "factored" and stats["dense_reason"] is None
    else:
        assert stats["jacobians"] == "dense"
        assert re.search("matrix product" if kind == "deep" else "neither pointwise", stats["dense_reason"])
    given = state0 if isinstance(state0, tuple) else (state0,)
    spec = recurrence._StateSpec(tuple(s.shape[-1] for s in given), isinstance(state0, tuple), F64)
    xb = x.detach().transpose(0, 1)
    states = rec._loop(xb, torch.cat([s.detach() for s in given], -1), spec)
    traced = rec._trace(xb, states[:, 0], spec)
    dense, _ = recurrence._step_jacobians(rec, spec, xb.reshape(-1, xb.shape[-1]), states)
    if kind in FACTORABLE:
        factored, _ = recurrence._factored_pass(
            rec, traced.structure, spec, xb.reshape(-1, xb.shape[-1]), states
        )
        torch.testing.assert_close(factored.dense().reshape(dense.shape), dense, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cell_cls", [GatedCell, PeepholeLSTM])
def test_traced_forward_equals_the_cells_loop_in_float32(cell_cls):
    cell, x = cell_cls(3, 5), torch.randn(30, 4, 3, requires_grad=True)
    rec = Recurrence(cell, algorithm="linear")
    out, _ = rec(x)
    assert rec.last_stats["traced_forward"]
    ref, _ = loop(cell, x, _zeros(cell, 4, torch.float32))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


class BranchingCell(GatedCell):
    """Python control flow on the state's values: tracing cannot bake it in."""

    def forward(self, x, h):
        h = super().forward(x, h)
        return h * 0.5 if bool((h > 0.9).any()) else h


class RowViewCell(GatedCell):
    """Bakes the row count into a view of the input: the input part cannot run on all steps at once."""

    def forward(self, x, h):
        return super().forward(x.view(h.shape[0], -1), h)


@pytest.mark.parametrize(
    ("cell_cls", "reason"), [(BranchingCell, "tracing failed"), (RowViewCell, "row count")]
)
def test_cells_that_do_not_trace_call_the_cell_with_dense_jacobians(cell_cls, reason):
    torch.manual_seed(1)
    cell = cell_cls(3, 5).double()
    rec = compare(cell, torch.randn(8, 3, 3, dtype=F64, requires_grad=True), None, algorithm="linear")
    stats = rec.last_stats
    assert stats["path"] == "scan" and stats["jacobians"] == "dense" and not stats["traced_forward"]
    assert re.search(reason, stats["trace_reason"]) and stats["dense_reason"] == stats["trace_reason"]


class InputMixingCell(GatedCell):
    """Centres its input over the batch rows: the input part run once for all steps would mix steps."""

    def forward(self, x, h):
        return super().forward(x - x.mean(0), h)


def test_a_traced_step_that_does_not_reproduce_the_cell_is_not_used():
    torch.manual_seed(2)
    cell = InputMixingCell(3, 5).double()
    rec = Recurrence(cell, algorithm="linear")
    with pytest.warns(RuntimeWarning, match="independently"):  # the batched calls mix the rows too
        compare(cell, torch.randn(6, 4, 3, dtype=F64, requires_grad=True), None, rec=rec)
    (traced,) = rec._traced.values()
    assert traced.structure is None and "does not reproduce the cell's loop" in traced.reason


class SlicedCell(nn.Module):
    """Gates sliced (not chunked) from ``h @ W.T``, one from the end: still factored."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size, self.hidden = hidden, hidden
        self.ih = nn.Linear(inputs, hidden)
        self.w = nn.Parameter(torch.randn(2 * hidden, hidden) * 0.4)

    def forward(self, x, h):
        z = h @ self.w.T
        gate = torch.sigmoid(z[:, : self.hidden])
        return gate * h + (1 - gate) * torch.tanh(self.ih(x) + z[:, -self.hidden :])


class _RoundThrough(torch.autograd.Function):
    """Rounds, with the gradient of the identity (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, t):
        return torch.round(t * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class StraightThroughCell(IndCell):
    """A custom backward the traced graph does not have: the check against the cell's Jacobians finds it."""

    def forward(self, x, h):
        return super().forward(x, _RoundThrough.apply(h))


def test_sliced_gates_factor_and_a_custom_backward_stays_dense():
    cell, x, h0 = SlicedCell(3, 5).double(), *make("gated", 3, 6)[1:]
    assert compare(cell, x, h0, algorithm="linear").last_stats["jacobians"] == "factored"
    cell, x, h0 = StraightThroughCell(3, 5).double(), *make("gated", 3, 6)[1:]
    rec = compare(cell, x, h0, algorithm="linear")
    assert rec.last_stats["jacobians"] == "dense" and "do not match" in rec.last_stats["dense_reason"]


def test_all_zero_reads_the_whole_tensor_where_its_last_step_is_zero():
    zeros = torch.zeros(2, 5, 3)
    assert recurrence._all_zero(zeros)
    early = zeros.clone()
    early[1, 0, 2] = 1e-30  # nonzero only at an early step
    assert not recurrence._all_zero(early)
    late = zeros.clone()
    late[0, -1, 0] = -2.0
    assert not recurrence._all_zero(late)
    nan = zeros.clone()
    nan[0, 1, 1] = float("nan")
    assert not recurrence._all_zero(nan)


def test_all_zero_reads_no_device_value_off_the_cpu():
    # on CUDA reading the min-max would synchronize with the device every backward: off the CPU the
    # general path runs (the meta device has no values to read, so a read raises)
    assert not recurrence._all_zero(torch.zeros(2, 5, 3, device="meta"))


@pytest.mark.parametrize("batch", [1, 3])
def test_outputs_modified_in_place_still_backpropagate_like_the_loop(batch):
    """The outputs are a tensor of their own whatever the batch (at B=1 the states' view is contiguous):
    modifying them in place, as torch's RNN allows, neither raises nor touches what the backward keeps."""
    torch.manual_seed(0)
    cell = CELLS["gated"](3, 5).to(F64)
    x = torch.randn(batch, 6, 3, dtype=F64)
    rec = Recurrence(cell, batch_first=True, algorithm="linear")
    grads = []
    for run in (lambda: rec(x)[0], lambda: loop(cell, x, _zeros(cell, batch, F64), True)[0]):
        out = run()
        out.mul_(2.0)
        grads.append(torch.autograd.grad((out**2).sum(), list(cell.parameters())))
    assert rec.last_stats["path"] == "scan"
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------------
# "auto" decides through the layer plan (lightning_bppsa.layer_plan.plan_layer), measured by the probe
# --------------------------------------------------------------------------------------------------


def recurrence_plans() -> dict:
    """The layer plan's cached decisions of user cells."""
    return {
        shape: plan for shape, plan in layer_plan._decisions.items() if shape.cell.startswith("Recurrence(")
    }


def test_auto_measures_once_per_cell_and_probed_steps_until_forgotten(scan_wins):
    cell, x, h0 = make("gated", 1, 300)
    rec = compare(cell, x, h0)
    measured = "measured: scan 100 ms vs torch 1e+03 ms for a backward through 256 steps"
    assert len(scan_wins) == 3 and rec.last_stats["plan"] == "scan" and rec.last_stats["decision"] == measured
    (shape,) = recurrence_plans()
    assert (shape.batch, shape.steps, shape.hidden, shape.persist) == (1, 256, 5, True)
    compare(cell, x, h0, rec=rec)
    _, longer, _ = make("gated", 1, 310)  # another T, the same 256 probed steps: the per-step costs measured
    compare(cell, longer, h0, rec=rec)
    assert len(scan_wins) == 3 and rec.last_stats["decision"] == measured
    short = x[:6].detach().requires_grad_()  # 6 steps are all the probe can time: another decision
    compare(cell, short, h0, rec=rec)
    assert len(scan_wins) == 6 and rec.last_stats["decision"].endswith("through 6 steps")
    layer_plan.forget()  # clears Recurrence's decisions too
    compare(cell, short, h0, rec=rec)
    assert len(scan_wins) == 9


class CheckedCell(GatedCell):
    """Python control flow on the state's values (rows stay independent): does not trace."""

    def forward(self, x, h):
        if not bool(torch.isfinite(h).all()):
            raise ValueError("a non-finite state")
        return super().forward(x, h)


class Activated(nn.Module):
    """``h' = f(W [x, h] + b)``: one class, one set of parameter shapes, a graph per ``f``."""

    state_size = 5

    def __init__(self, f) -> None:
        super().__init__()
        self.f, self.lin = f, nn.Linear(3 + 5, 5)

    def forward(self, x, h):
        return self.f(self.lin(torch.cat([x, h], -1)))


def test_different_cells_never_share_a_decision_and_copies_of_one_do(monkeypatch, measuring):
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    calls = fake_timer(monkeypatch, 1.0, 0.1)  # the scan measures faster
    tanh = compare(Activated(torch.tanh).double(), x, None)
    assert tanh.last_stats["path"] == "scan" and len(calls) == 3
    assert compare(Activated(torch.tanh).double(), x, None).last_stats["path"] == "scan" and len(calls) == 3
    copied = copy.deepcopy(tanh)  # a copy of a traced cell: the same step, the same decision
    assert compare(copied.cell, x, None, rec=copied).last_stats["path"] == "scan" and len(calls) == 3
    calls = fake_timer(monkeypatch, 0.1, 1.0)  # the scan measures slower: only a new cell sees it
    assert compare(Activated(torch.sigmoid).double(), x, None).last_stats["path"] == "autograd"
    assert len(calls) == 3 and len(recurrence_plans()) == 2
    # cells whose step does not trace are told apart by their object, in this process only
    untraced = CheckedCell(3, 5).double()
    rec = compare(untraced, x, None, algorithm="linear")
    assert rec.last_stats["trace_reason"].startswith("tracing failed")
    auto = compare(untraced, x, None)
    assert len(calls) == 6
    compare(untraced, x, None)  # the same cell in another module: its decision
    assert len(calls) == 6
    compare(CheckedCell(3, 5).double(), x, None)  # an equal cell, but another object: measured
    assert len(calls) == 9
    copied = copy.deepcopy(auto)
    compare(copied.cell, x, None, rec=copied)  # so is a copy
    assert len(calls) == 12
    assert sorted(shape.persist for shape in recurrence_plans()) == [False, False, False, True, True]


def test_a_used_module_deep_copies_and_pickles_and_its_copy_traces_again():
    cell, x, h0 = make("gated", 2, 5)
    rec = compare(cell, x, h0, algorithm="linear")
    for copied in (copy.deepcopy(rec), pickle.loads(pickle.dumps(rec))):
        assert not copied._traced and copied.cell is not cell
        compare(copied.cell, x, h0, rec=copied)
        assert copied.last_stats["path"] == "scan" and copied.last_stats["jacobians"] == "factored"


def test_a_cached_decision_survives_torch_compile_and_nothing_is_measured_while_compiling(scan_wins):
    cell, x, h0 = make("ind", 2, 5)
    rec = Recurrence(cell)
    compiled = torch.compile(rec, backend="eager", fullgraph=True)
    compiled(x, h0)
    assert rec.last_stats["path"] == "autograd" and "torch.compile" in rec.last_stats["reason"]
    assert not scan_wins and not recurrence_plans()  # nothing measured or decided while compiling
    rec(x, h0)
    assert len(scan_wins) == 3 and rec.last_stats["path"] == "scan"
    (shape,) = recurrence_plans()
    out, _ = compiled(x, h0)
    assert rec.last_stats["path"] == "autograd" and len(scan_wins) == 3 and layer_plan.cached(shape)
    torch.testing.assert_close(out, loop(cell, x, h0)[0])
    rec(x, h0)
    assert rec.last_stats["path"] == "scan" and len(scan_wins) == 3


PLAN_CELLS = '''
import torch
from torch import nn


class Deep(nn.Module):
    """Dense Jacobians (two linear maps of the state): no compiled loop to build."""

    state_size = 4

    def __init__(self):
        super().__init__()
        self.ih, self.w1, self.w2 = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, h):
        return torch.tanh(self.ih(x) + self.w2(torch.tanh(self.w1(h))))


class Checked(Deep):
    """Python control flow on the state's values (rows stay independent): does not trace."""

    def forward(self, x, h):
        if not bool(torch.isfinite(h).all()):
            raise ValueError("a non-finite state")
        return super().forward(x, h)
'''

READ_BACK = """
import sys, torch
torch.set_num_threads({threads})  # the thread count is part of a CPU setup
from lightning_bppsa.nn import Recurrence, recurrence
import plan_cells

recurrence._timer = lambda: sys.exit("measured although the decision is on disk")
torch.manual_seed(0)
rec = Recurrence(plan_cells.Deep().double())
rec(torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True))
print(rec.last_stats["decision"])
"""


def test_only_a_traced_cells_decision_is_kept_on_disk_and_another_process_reads_it(
    monkeypatch, tmp_path, scan_wins
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "1")
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(cache))
    (tmp_path / "plan_cells.py").write_text(PLAN_CELLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    plan_cells = __import__("plan_cells")
    x = torch.randn(6, 2, 3, dtype=F64, requires_grad=True)
    Recurrence(plan_cells.Checked().double())(x)
    assert len(scan_wins) == 3 and not list(cache.glob("layer-plans-*.json"))  # in memory only
    torch.manual_seed(0)
    rec = Recurrence(plan_cells.Deep().double())
    rec(torch.randn(6, 2, 3, dtype=F64, requires_grad=True))
    assert len(scan_wins) == 6 and rec.last_stats["path"] == "scan"
    (path,) = cache.glob("layer-plans-*.json")
    (key,) = json.loads(path.read_text())["decisions"]
    assert key.startswith("Recurrence(Deep) ") and "B=2 T=6 input=3 H=4 torch.float64" in key
    script = READ_BACK.format(threads=torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    measured = "measured: scan 100 ms vs torch 1e+03 ms for a backward through 6 steps (on-disk plan cache)"
    assert result.stdout.strip() == measured


def test_the_compiled_loops_linear_backward_never_expands_its_factors(monkeypatch):
    """The loop's own sweep reads the kept columns: planning it must not build the full-layout Jacobians (their
    ``scales`` / ``weight`` are the torch path's, tens to hundreds of MB a backward for wide tuple states)."""
    from lightning_bppsa.nn import cell_kernel

    def refuse(self):
        raise AssertionError("the full-layout Jacobians were built")

    torch.manual_seed(0)
    cell = _SeparateMemory().double()
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    h0 = tuple(torch.randn(3, 4, dtype=F64, requires_grad=True) for _ in range(2))
    rec = compare(cell, x, h0, algorithm="linear")  # the trace's one-time check compares the full layouts
    monkeypatch.setattr(cell_kernel._ExpandedJacobians, "scales", property(refuse))
    monkeypatch.setattr(cell_kernel._ExpandedJacobians, "weight", property(refuse))
    assert compare(cell, x, h0, rec=rec).last_stats["cell_kernel"] == "cpu"
