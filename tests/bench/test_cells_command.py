"""``benchmarks/cells.py``: the JAX translation of every benchmarked cell, its table in the CPU smoke mode, and
the user-cells stage of ``benchmarks/gpu.py --all`` (tiny sizes, an injected clock: nothing here depends on
how fast this machine is)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bppsa.testing import relative_error

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


cells = _load("cells_benchmark", "cells.py")
gpu = _load("gpu_benchmark_cells", "gpu.py")
cell_jax = sys.modules["cell_jax"]  # the module cells.py imported


class FakeClock:
    """Seconds that advance by 1 ms on every reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def _runner(tmp_path: Path, shapes, budget: float = 1e4):
    clock = FakeClock()
    return cells.Runner("cpu", shapes, deadline=budget, clock=clock, results=tmp_path, command="test")


def _rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # past the names and the rule
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def _states(cell: nn.Module, rows: int) -> tuple[torch.Tensor, ...]:
    size = cell.state_size
    return tuple(
        torch.randn(rows, s, dtype=torch.float64) for s in (size if isinstance(size, tuple) else (size,))
    )


@pytest.mark.parametrize("name", list(cells.CELLS))
def test_the_jax_step_is_the_cell_s_math(name: str) -> None:
    """One step and its VJP (states, input, parameters) in JAX equal the torch cell's in float64."""
    torch.manual_seed(0)
    cell = cells.CELLS[name](3, 4).double()
    x, states = torch.randn(5, 3, dtype=torch.float64, requires_grad=True), _states(cell, 5)
    for s in states:
        s.requires_grad_()
    new = cell(x, states if len(states) > 1 else states[0])
    new = new if isinstance(new, tuple) else (new,)
    cotangents = [torch.randn_like(s) for s in new]
    leaves = [*cell.parameters(), x, *states]
    expected = [*new, *torch.autograd.grad(new, leaves, cotangents)]

    step = cell_jax.jax_cell(cell, 5, 3, jax)
    as_jax = [cell_jax.to_jax(jax, t.float()) for t in (*cell.parameters(), x, *states)]
    n = len(list(cell.parameters()))
    outs, vjp = jax.vjp(lambda p, xx, ss: step(p, ss, xx), as_jax[:n], as_jax[n], tuple(as_jax[n + 1 :]))
    param_grads, x_grad, state_grads = vjp(tuple(cell_jax.to_jax(jax, c.float()) for c in cotangents))
    got = [*outs, *param_grads, x_grad, *state_grads]
    assert len(got) == len(expected)
    for value, reference in zip(got, expected, strict=True):
        assert relative_error(torch.tensor(jax.device_get(value)), reference) < 1e-5


class Cumulative(nn.Module):
    """A step reading the running sum over the state's coordinates (``cumsum``: no JAX counterpart here)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.lin = nn.Linear(inputs, hidden)

    def forward(self, x, h):
        return torch.tanh(self.lin(x) + h.cumsum(-1))


def test_a_cell_with_an_op_jax_is_not_given_is_named() -> None:
    with pytest.raises(cell_jax.NotTranslated, match=r"no JAX counterpart for aten\.cumsum"):
        cell_jax.jax_cell(Cumulative(3, 4), 2, 3, jax)


def test_a_failing_jax_arm_leaves_the_torch_arms_and_a_failing_row_the_next(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setitem(cells.CELLS, "cumulative", Cumulative)
    real = cells.measure_row

    def failing_for_gated(runner, row, *args):
        if row[0] == "gated":
            raise RuntimeError("boom\nsecond line")
        return real(runner, row, *args)

    monkeypatch.setattr(cells, "measure_row", failing_for_gated)
    shapes = cells.CellRows(
        cells.rows_of(["gated", "cumulative"], 3, 2, 4), quantities=("step",), rounds=1, max_steps=1
    )
    failed, measured = cells.device_table(_runner(tmp_path, shapes), name="cells.md")
    assert failed[5] == "failed: RuntimeError: boom" and failed[6:] == ["-"] * (len(cells.COLUMNS) - 6)
    values = dict(zip(cells.COLUMNS, measured, strict=True))
    assert (
        values["step ms JAX"]
        == values["grad err JAX"]
        == "n/a: NotTranslated: no JAX counterpart for aten.cumsum.default"
    )
    assert float(values["step ms loop"]) > 0 and float(values["step ms Recurrence"]) > 0
    assert float(values["grad err Recurrence"]) < 1e-5


def test_the_tiny_table_has_every_arm_with_float64_checked_gradients(tmp_path: Path) -> None:
    shapes = cells.CellRows(cells.rows_of(["HandLSTM"], 3, 2, 5), rounds=2, max_steps=1)
    cells.device_table(_runner(tmp_path, shapes), name="cells.md")
    text = (tmp_path / "cells.md").read_text()
    assert "JAX 0." in text and "Rows done: 1 of 1" in text and "min of 2 interleaved rounds" in text
    assert (
        "Load average (1, 5, 15 min)" in text
        and "Files differing from the commit under lightning_bppsa/ and kernels/: " in text
    )
    (row,) = _rows(text)
    assert dict(zip(cells.COLUMNS[:6], row, strict=False)) == {
        "cell": "HandLSTM", "H": "3", "B": "2", "T": "5", "d": "6", "Recurrence path": "factored, compiled loop (cpu)",
    }  # fmt: skip
    values = dict(zip(cells.COLUMNS, row, strict=True))
    for quantity in cells.QUANTITIES:
        for arm in cells.ARMS:
            assert float(values[f"{quantity} ms {arm}"]) > 0, (quantity, arm)
    for speedup in ("bwd vs loop", "bwd vs JAX", "step vs loop", "step vs JAX"):
        assert values[speedup].endswith("x")
    for arm in cells.ARMS:  # float32 against the float64 loop: rounding, not a different computation
        assert float(values[f"grad err {arm}"]) < 1e-5, arm
    for arm in ("loop", "Recurrence"):
        assert float(values[f"peak MiB {arm}"]) >= 0, arm  # tiny tensors: often no whole page more
    assert values["peak MiB JAX"] == "n/a: XLA's allocator"
    assert float(values["JAX compile s"]) >= 0 and values["auto picks"]


def test_each_arm_s_peak_memory_is_its_own_step_s(tmp_path: Path, monkeypatch) -> None:
    # each arm's whole step is measured by itself (a stand-in measure, by the arm it is asked for)
    sizes = {"loop": 1.5, "Recurrence": 0.25, "JAX": 3.0}

    def measured(step, device, arm):
        step()
        return sizes[arm] * 2**20

    real = cells._peak_bytes
    monkeypatch.setattr(cells, "_peak_bytes", measured)
    shapes = cells.CellRows(cells.rows_of(["gated"], 3, 2, 4), quantities=("step",), rounds=1, max_steps=1)
    cells.device_table(_runner(tmp_path, shapes), name="cells.md")
    values = dict(zip(cells.COLUMNS, _rows((tmp_path / "cells.md").read_text())[0], strict=True))
    assert [values[f"peak MiB {arm}"] for arm in cells.ARMS] == ["1.5", "0.2", "3.0"]
    for device in ("cpu", "cuda"):  # XLA keeps its own pool: not measured, on either device
        assert real(lambda: pytest.fail("ran"), device, "JAX") == "n/a: XLA's allocator"


def test_without_jax_its_columns_say_why(tmp_path: Path) -> None:
    shapes = cells.CellRows(cells.rows_of(["indrnn"], 3, 2, 4), quantities=("step",), rounds=1, max_steps=1)
    cells.device_table(_runner(tmp_path, shapes), jax_reason="n/a: JAX not installed", name="cells.md")
    values = dict(zip(cells.COLUMNS, _rows((tmp_path / "cells.md").read_text())[0], strict=True))
    assert values["step ms JAX"] == values["grad err JAX"] == values["peak MiB JAX"] == "n/a: JAX not installed"
    assert float(values["step ms Recurrence"]) > 0 and values["step vs JAX"] == "-"
    assert values["fwd ms loop"] == "-", "a quantity not asked for is not measured"


def test_past_the_deadline_rows_are_skipped_without_measuring(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cells, "measure_row", lambda *args: pytest.fail("measured past the deadline"))
    shapes = cells.CellRows(cells.rows_of(["gated", "leaky"], 3, 2, 4))
    done = cells.device_table(_runner(tmp_path, shapes, budget=-1.0), jax_reason="n/a", name="cells.md")
    assert [row[:4] for row in done] == [["gated", "3", "2", "4"], ["leaky", "3", "2", "4"]]
    assert all(row[5] == cells.SKIPPED for row in done)
    assert "Rows done: 2 of 2" in (tmp_path / "cells.md").read_text()


def test_every_corpus_cell_is_a_row_and_unknown_names_are_refused() -> None:
    corpus = [cell.__name__ for cell in cells._corpus()]  # FACTORED of tests/nn/test_cell_corpus.py
    assert len(corpus) >= 13 and list(cells.CELLS) == [*cells.OWN, *corpus]
    with pytest.raises(ValueError, match="unknown cells nope; known: gated, indrnn"):
        cells.rows_of(["gated", "nope"], 3, 2, 4)


def test_the_gpu_command_s_cells_stage_writes_its_table(tmp_path: Path) -> None:
    runner = gpu.Runner("cpu", gpu.TINY_SHAPES, deadline=1e4, clock=FakeClock(), results=tmp_path)
    done = gpu.cells_stage(runner)
    rows = _rows((tmp_path / "cells-gpu.md").read_text())
    assert rows == done and [row[:4] for row in rows] == [["gated", "3", "2", "5"]]
    values = dict(zip(cells.COLUMNS, rows[0], strict=True))
    assert float(values["step ms Recurrence"]) > 0 and values["step vs loop"].endswith("x")
    assert values["bwd ms loop"] == "-", "the stage times the whole step only"


class StaysZero(nn.Module):
    """``h' = tanh(W x) h``: from the zero state the output is 0 whatever the weights, every gradient 0."""

    state_size = 3

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(inputs, hidden)

    def forward(self, x, h):
        return torch.tanh(self.lin(x)) * h


def test_a_cell_with_nothing_to_compare_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(cells.CELLS, "zero", StaysZero)
    shapes = cells.CellRows(cells.rows_of(["zero"], 3, 2, 4), quantities=("step",), rounds=1, max_steps=1)
    cells.device_table(_runner(tmp_path, shapes), name="cells.md")
    values = dict(zip(cells.COLUMNS, _rows((tmp_path / "cells.md").read_text())[0], strict=True))
    assert [values[f"grad err {arm}"] for arm in cells.ARMS] == [cells.ZERO_GRADIENT] * 3


def test_the_summary_counts_the_rows_below_each_target() -> None:
    def row(name: str, bwd: str, step: str) -> list[str]:
        values = dict.fromkeys(cells.COLUMNS, "-") | {"cell": name, "bwd vs loop": bwd, "step vs loop": step}
        return [values[column] for column in cells.COLUMNS]

    done = [
        row("a", "12.00x", "9.00x"),
        row("b", "9.99x", "8.00x"),
        row("c", "-", "-"),
        row("d", "10.00x", "2.50x"),
    ]
    assert cells.summary(done, "cpu") == (
        "- bwd >= 10x loop: 2 of 3 measured rows; below: b 9.99x\n- step >= 8x loop: 2 of 3 measured rows; below: d 2.50x\n"
    )


def test_a_prepared_call_is_timed_without_its_preparation(tmp_path: Path) -> None:
    """``Backward.prepare`` (the forward) runs before every timed call and outside its time."""
    clock, calls = FakeClock(), []
    runner = cells.Runner("cpu", cells.TINY, deadline=1e4, clock=clock, results=tmp_path)

    def forward() -> str:
        clock.now += 100.0  # a slow forward: seen in the timings if it were timed
        calls.append("forward")
        return "graph"

    backward = cells.Backward(forward, lambda graph: calls.append(f"backward of {graph}"))
    assert runner.call_seconds(backward, 2) == [pytest.approx(1e-3)] * 2
    assert calls == ["forward", "backward of graph"] * 2


class FusedLSTMStep(nn.Module):
    """``nn.LSTMCell``'s step as torch runs it on CUDA: its fused op (no CPU kernel: only a trace runs here)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTMCell(inputs, hidden)
        self.state_size = (hidden, hidden)

    def forward(self, x, state):
        h, c = state
        gates = (x @ self.lstm.weight_ih.t(), h @ self.lstm.weight_hh.t())
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(*gates, c, self.lstm.bias_ih, self.lstm.bias_hh)
        return hy, cy


def test_torchs_fused_cuda_cell_op_translates_to_jax_as_its_math() -> None:
    # the JAX arm traces as Recurrence does: nn.LSTMCell on a GPU (its fused op) is LSTMCell's pointwise math
    torch.manual_seed(0)
    cell = FusedLSTMStep(3, 4)
    x, h, c = torch.randn(5, 3), torch.randn(5, 4), torch.randn(5, 4)
    expected = cell.lstm(x, (h, c))
    step = cell_jax.jax_cell(cell, 5, 3, jax)
    got = step([cell_jax.to_jax(jax, p.detach()) for p in cell.parameters()],
               (cell_jax.to_jax(jax, h), cell_jax.to_jax(jax, c)), cell_jax.to_jax(jax, x))  # fmt: skip
    for value, reference in zip(got, expected, strict=True):
        assert relative_error(torch.tensor(jax.device_get(value)), reference) < 1e-5
