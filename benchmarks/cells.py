"""User-written recurrent cells: autograd through the Python loop vs ``lightning_bppsa.nn.Recurrence`` vs JAX.

Cells: four written here the way a researcher would (a GRU-like gated cell, an IndRNN-style diagonal cell,
an LSTM variant with a tuple state, a leaky-memory cell with a tuple state and a gate block split after its
sigmoid), then every factorable cell of the style corpus (``tests/nn/test_cell_corpus.py``'s ``FACTORED``:
torch's LSTM / GRU formulas by hand gate block first, minGRU, minLSTM, LiGRU, IndRNN, a peephole LSTM, ...;
``HandLSTM`` is the row once called ``lstm-block``; read from the test module, so a cell added there is benchmarked
too). Per cell, same weights, one process, on one device:

- loop: the cell called in a Python loop, recorded by autograd;
- Recurrence: ``Recurrence(cell, algorithm="linear")`` (the scan forced; its compiled loop, C on the CPU and
  NVRTC kernels on CUDA, where it builds: the "Recurrence path" column says which ran);
- JAX: ``jax.jit`` over ``jax.lax.scan`` of the same cell math on the same device: the cell's traced aten
  graph interpreted in ``jax.numpy`` (``benchmarks/cell_jax.py``), the torch weights copied.

Quantities: forward (gradients recorded; JAX: ``jit(vjp)``, which keeps the residuals), backward alone (on a
graph recorded just before each call, untimed; JAX: the jitted VJP on the residuals of a forward run just
before, untimed) and the whole step
(forward + backward; JAX: ``jit(value_and_grad)``). For each quantity the three arms run interleaved
(:func:`device_runner.interleaved`: a warm-up call each, then rounds of N calls of each in turn), timed by
the CPU clock or CUDA events around each call (each waited for; JAX's with ``block_until_ready``); the CPU
table gives the min of the N x rounds calls, the GPU table the median. Gradient error: the largest norm-wise
relative error of the input's and every parameter's gradient against autograd through the loop in float64.
Peak memory: what one whole step of the torch arms adds at its peak (CPU: the resident set's high-water mark;
CUDA: torch's allocator); not JAX's, whose XLA allocator keeps a pool of its own. Loss: mean square of every step's output (the first state tensor), float32, input size 8; "auto picks": what ``Recurrence(cell)``
(algorithm "auto") ran for one step.

    OMP_NUM_THREADS=1 flock -x /tmp/bppsa-bench.lock python benchmarks/cells.py          # CPU, every cell
    OMP_NUM_THREADS=1 flock -x /tmp/bppsa-bench.lock python benchmarks/cells.py --quick  # five: cells-cpu-quick.md
    python benchmarks/cells.py --device cuda          # GPU: writes benchmarks/results/cells-gpu.md
    python benchmarks/cells.py --device cpu --tiny    # smoke mode: tiny sizes, seconds

``benchmarks/gpu.py --all`` runs the GPU table as one of its stages (:func:`device_table`). With
``OMP_NUM_THREADS=1`` XLA runs on one thread too (``XLA_FLAGS``, read at JAX's start-up); on CUDA JAX
allocates on demand (``XLA_PYTHON_CLIENT_PREALLOCATE=false``) beside torch. Without JAX
(``pip install 'lightning-bppsa[bench]'``) its columns say so.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import os
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also where loaded by path
import cell_jax
from device_runner import (
    RESULTS,
    ROOT,
    SKIPPED,
    Backward,
    Runner,
    cuda_peak_bytes,
    header,
    interleaved,
    markdown_table,
    ratio_text,
    uncommitted,
    write,
)

from lightning_bppsa.bench.measure import load_average, machine_description, peak_memory_bytes
from lightning_bppsa.nn import Recurrence
from lightning_bppsa.testing import relative_error

INPUTS = 8
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
ARMS = ("loop", "Recurrence", "JAX")
QUANTITIES = ("fwd", "bwd", "step")


class GatedCell(nn.Module):
    """A minimal GRU-like cell: update and reset gates, ``h' = (1 - z) n + z h``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.ih, self.hh = nn.Linear(inputs, 3 * hidden), nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, h):
        z, r, n = self.ih(x).chunk(3, -1)
        hz, hr, hn = self.hh(h).chunk(3, -1)
        z, r = torch.sigmoid(z + hz), torch.sigmoid(r + hr)
        return (1 - z) * torch.tanh(n + r * hn) + z * h


class IndRNNCell(nn.Module):
    """IndRNN: ``h' = relu(x W + u ⊙ h + b)``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = hidden
        self.lin = nn.Linear(inputs, hidden)
        self.u = nn.Parameter(torch.rand(hidden))

    def forward(self, x, h):
        return torch.relu(self.lin(x) + self.u * h)


class LSTMVariant(nn.Module):
    """An LSTM with coupled input and forget gates (``i = 1 - f``) and a tuple state ``(h, c)``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.gates = nn.Linear(inputs + hidden, 3 * hidden)

    def forward(self, x, state):
        h, c = state
        f, g, o = self.gates(torch.cat([x, h], -1)).chunk(3, -1)
        f = torch.sigmoid(f)
        c = f * c + (1 - f) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class LeakyMemoryCell(nn.Module):
    """A gated cell with a leaky memory and a tuple state ``(h, m)``, gate block first: the sigmoid of the
    whole ``(B, 3H)`` block of ``cat([x, h])``'s projection, split afterwards."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.gates = nn.Linear(inputs + hidden, 3 * hidden)
        self.leak = nn.Parameter(torch.rand(hidden))

    def forward(self, x, state):
        h, m = state
        a, g, o = torch.sigmoid(self.gates(torch.cat([x, h], -1))).chunk(3, -1)
        decay = torch.sigmoid(self.leak)
        m = decay * m + (1 - decay) * g * (2 * a - 1)
        return o * torch.tanh(m), m


def _corpus() -> list[type[nn.Module]]:
    """The style corpus's factorable cells (``FACTORED`` of ``tests/nn/test_cell_corpus.py``, where they are
    defined and checked factored and exact)."""
    path = ROOT / "tests" / "nn" / "test_cell_corpus.py"
    spec = importlib.util.spec_from_file_location("_cell_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.FACTORED)


OWN = {"gated": GatedCell, "indrnn": IndRNNCell, "lstm": LSTMVariant, "leaky": LeakyMemoryCell}
CELLS: dict[str, type[nn.Module]] = {**OWN, **{cell.__name__: cell for cell in _corpus()}}
#: ``--quick``: the cells of the tables before the corpus (``HandLSTM`` was ``lstm-block``)
QUICK = ("gated", "indrnn", "lstm", "leaky", "HandLSTM")

Row = tuple[str, int, int, int]  # (cell, H, B, T)


@dataclass(frozen=True)
class CellRows:
    """What one table measures: its rows, which quantities, and how many timed calls (``rounds`` x up to
    ``max_steps`` per arm, :func:`device_runner.interleaved`)."""

    rows: tuple[Row, ...]
    quantities: tuple[str, ...] = QUANTITIES
    rounds: int = 5
    max_steps: int = 2


def rows_of(names: Sequence[str], hidden: int, batch: int, steps: int) -> tuple[Row, ...]:
    """One row per cell name at ``(hidden, batch, steps)``; an unknown name is an error naming the known ones."""
    unknown = [name for name in names if name not in CELLS]
    if unknown:
        raise ValueError(f"unknown cells {', '.join(unknown)}; known: {', '.join(CELLS)}")
    return tuple((name, hidden, batch, steps) for name in names)


#: the smoke mode (``--tiny``): two cells (a single and a tuple state), tiny sizes, two rounds of one call
TINY = CellRows(rows_of(("gated", "HandLSTM"), 3, 2, 5), rounds=2, max_steps=1)


def python_loop(cell: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The baseline: the loop a user writes, recorded by autograd; per-step outputs ``(T, B, H)``."""
    size = cell.state_size
    sizes = size if isinstance(size, tuple) else (size,)
    zeros = tuple(x.new_zeros(x.shape[1], s) for s in sizes)
    state, outs = zeros if isinstance(size, tuple) else zeros[0], []
    for x_t in x:
        state = cell(x_t, state)
        outs.append(state[0] if isinstance(state, tuple) else state)
    return torch.stack(outs)


def import_jax(device: str) -> tuple[Any, str | None]:
    """(jax, None) set up for ``device``, or (None, why not): JAX missing, or no GPU backend for CUDA.

    Sets XLA's one-thread flags where ``OMP_NUM_THREADS=1`` and on-demand GPU memory, before JAX starts."""
    if os.environ.get("OMP_NUM_THREADS") == "1" and "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_XLA_FLAGS}".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch holds the GPU's memory too
    try:
        import jax
    except ImportError:
        return None, "n/a: JAX not installed (pip install 'lightning-bppsa[bench]')"
    try:
        jax.devices("gpu" if device == "cuda" else "cpu")
    except RuntimeError as error:
        return (
            None,
            f"n/a: JAX has no {'GPU' if device == 'cuda' else 'CPU'} backend ({str(error).splitlines()[0]})",
        )
    # float32 products as torch computes them by default (XLA's default on a GPU is TF32: faster, less exact)
    jax.config.update("jax_default_matmul_precision", "highest")
    return jax, None


def _jax_device(jax: Any, device: str) -> Any:
    return jax.devices("gpu" if device == "cuda" else "cpu")[0]


def _gradients(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [g.detach() for g in torch.autograd.grad(loss, leaves)]


ZERO_GRADIENT = "n/a: every float64 gradient is 0"


def _error(grads: Sequence[Any], reference: Sequence[torch.Tensor]) -> float | str:
    """The largest norm-wise relative error of ``grads`` (torch or JAX arrays) against ``reference``, or
    :data:`ZERO_GRADIENT` where there is nothing to compare (an output that stays 0 from the zero state)."""
    if all(not r.any() for r in reference):
        return ZERO_GRADIENT
    return max(
        relative_error(torch.as_tensor(_host(g)), r.cpu()) for g, r in zip(grads, reference, strict=True)
    )


def _host(value: Any) -> Any:
    return value.cpu() if isinstance(value, torch.Tensor) else np.array(value)  # a copy torch may write


def _path(stats: dict) -> str:
    """How ``Recurrence`` ran: its Jacobians' form and where its compiled loop ran, or why none."""
    form = stats.get("jacobians") or stats.get("path", "?")
    if stats.get("cell_kernel"):
        return f"{form}, compiled loop ({stats['cell_kernel']})"
    reason = stats.get("cell_kernel_reason") or stats.get("dense_reason") or stats.get("reason")
    return f"{form}, torch path" + (f" ({reason})" if reason else "")


def _jax_check(
    cell: nn.Module,
    x: torch.Tensor,
    jax: Any,
    reference: list[torch.Tensor],
    quantities: Sequence[str],
    result: dict,
) -> tuple[dict[str, Callable[..., Any]], list[Any], Any]:
    """JAX's jitted functions of ``cell``, its parameters and input on ``x``'s device; fills ``result`` with its
    step's compile seconds and the gradient error of its step (and of its VJP where ``quantities`` time it)."""
    steps = cell_jax.jax_steps(cell, x.shape[1], x.shape[2], jax)
    where = _jax_device(jax, x.device.type)
    params = [cell_jax.to_jax(jax, p, where) for p in cell.parameters()]
    xs = cell_jax.to_jax(jax, x, where)
    start = time.perf_counter()
    _, (param_grads, x_grad) = jax.block_until_ready(steps["step"](params, xs))
    result["compile"] = time.perf_counter() - start
    result["err_JAX"] = _error([x_grad, *param_grads], reference)
    if {"fwd", "bwd"} & set(quantities):
        value, vjp = steps["forward"](params, xs)
        param_grads, x_grad = steps["backward"](vjp, value)
        vjp_error = _error([x_grad, *param_grads], reference)
        result["err_JAX"] = vjp_error if isinstance(vjp_error, str) else max(result["err_JAX"], vjp_error)
    return steps, params, xs


def _arms(
    cell: nn.Module,
    x: torch.Tensor,
    jax: Any,
    jax_reason: str | None,
    quantities: Sequence[str],
    result: dict,
) -> dict:
    """Each arm's callables per quantity (``fwd``, ``bwd``, ``step``); fills ``result`` with the gradient
    errors against the float64 loop (JAX's: of its step, and of its VJP where ``quantities`` time it), how
    ``Recurrence`` ran and JAX's compile seconds (its step's)."""
    leaves = [x, *cell.parameters()]
    scan = Recurrence(cell, algorithm="linear")
    forwards = {"loop": lambda: python_loop(cell, x), "Recurrence": lambda: scan(x)[0]}
    cell64, x64 = copy.deepcopy(cell).double(), x.detach().double().requires_grad_()
    reference = _gradients(python_loop(cell64, x64).pow(2).mean(), [x64, *cell64.parameters()])
    arms: dict[str, dict[str, Callable[[], object]]] = {}
    for name, forward in forwards.items():
        loss = forward().pow(2).mean()  # the first call: a warm-up (Recurrence traces and builds its loop)
        result[f"err_{name}"] = _error(_gradients(loss, leaves), reference)
        arms[name] = {
            "fwd": forward,
            "bwd": Backward(
                lambda forward=forward: forward().pow(2).mean(),
                lambda loss: torch.autograd.grad(loss, leaves),
            ),
            "step": lambda forward=forward: torch.autograd.grad(forward().pow(2).mean(), leaves),
        }
    result["path"] = _path(scan.last_stats)
    auto = Recurrence(cell)
    torch.autograd.grad(auto(x)[0].pow(2).mean(), leaves)
    result["auto"] = auto.last_stats["path"] + (
        f" ({auto.last_stats['reason']})" if auto.last_stats.get("reason") else ""
    )
    if jax is None:
        result["err_JAX"] = result["compile"] = jax_reason
        return arms
    try:
        steps, params, xs = _jax_check(cell, x, jax, reference, quantities, result)
    except Exception as error:  # noqa: BLE001 - JAX's failure (an op, XLA on this device) leaves the torch arms
        result["err_JAX"] = result["compile"] = (
            f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        )
        return arms
    arms["JAX"] = {
        "fwd": lambda: jax.block_until_ready(steps["forward"](params, xs)),
        "bwd": Backward(
            lambda: jax.block_until_ready(steps["forward"](params, xs)),
            lambda f: jax.block_until_ready(steps["backward"](f[1], f[0])),
        ),
        "step": lambda: jax.block_until_ready(steps["step"](params, xs)),
    }
    return arms


def measure_row(runner: Runner, row: Row, jax: Any, jax_reason: str | None, budget: float) -> dict:
    """One row: per quantity of ``runner.shapes.quantities``, each arm's seconds (or why none), in ``budget``
    seconds; the gradient errors, Recurrence's path, JAX's compile seconds, what "auto" ran."""
    kind, hidden, batch, steps = row
    start = runner.clock()
    torch.manual_seed(0)
    cell = CELLS[kind](INPUTS, hidden).to(runner.device)
    x = torch.randn(steps, batch, INPUTS, device=runner.device, requires_grad=True)
    result: dict = {"d": sum(cell.state_size) if isinstance(cell.state_size, tuple) else cell.state_size}
    quantities = runner.shapes.quantities
    arms = _arms(cell, x, jax, jax_reason, quantities, result)
    statistic = min if runner.device == "cpu" else statistics.median
    for index, quantity in enumerate(quantities):
        left = budget - (runner.clock() - start)
        fns = {name: calls[quantity] for name, calls in arms.items()}
        times = interleaved(runner, fns, left / (len(quantities) - index), warmup=1, statistic=statistic)
        for name in ARMS:  # JAX's reason where it has no arm
            result[f"{quantity}_{name}"] = times.get(name, result["err_JAX"])
    for name in ARMS:
        result[f"peak_{name}"] = (
            _peak_bytes(arms[name]["step"], runner.device, name) if name in arms else result["err_JAX"]
        )
    return result


def _peak_bytes(step: Callable[[], object], device: str, arm: str) -> float | str:
    """The memory one whole torch step (forward + backward) adds at its peak: on the CPU the resident set's
    high-water mark (:func:`~lightning_bppsa.bench.measure.peak_memory_bytes`), on CUDA torch's allocator. Not
    JAX's: XLA keeps its own pool (on the CPU its reused pages do not raise the resident set: a JAX step read
    0.2-41 MiB there, against 13-46 MiB for the loop), so its column says so."""
    if arm == "JAX":
        return "n/a: XLA's allocator"
    if device == "cpu":
        return float(peak_memory_bytes(step))
    peak, before = cuda_peak_bytes(step)
    return float(peak - before)


COLUMNS = (
    "cell", "H", "B", "T", "d", "Recurrence path",
    *(f"{q} ms {a}" for q in QUANTITIES for a in ARMS),
    "bwd vs loop", "bwd vs JAX", "step vs loop", "step vs JAX",
    *(f"grad err {a}" for a in ARMS), *(f"peak MiB {a}" for a in ARMS), "JAX compile s", "auto picks",
)  # fmt: skip


def _cell_text(value: float | str | None, spec: str, scale: float = 1.0) -> str:
    """A figure (times ``scale``) as ``spec`` formats it, the reason there is none, or "-" where not measured."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value * scale, spec)


def table_row(row: Row, r: dict) -> list[str]:
    """The cells of one table row (:data:`COLUMNS`) from :func:`measure_row`'s result."""
    times = [_cell_text(r.get(f"{q}_{a}"), ".2f", scale=1e3) for q in QUANTITIES for a in ARMS]
    speedups = [ratio_text(r.get(f"{q}_{base}", "-"), r.get(f"{q}_Recurrence", "-")) for q in ("bwd", "step")
                for base in ("loop", "JAX")]  # fmt: skip
    errors = [_cell_text(r.get(f"err_{a}"), ".1e") for a in ARMS]
    peaks = [_cell_text(r.get(f"peak_{a}"), ".1f", scale=2**-20) for a in ARMS]
    return [
        *map(str, row),
        str(r["d"]),
        r["path"],
        *times,
        *speedups,
        *errors,
        *peaks,
        _cell_text(r.get("compile"), ".1f"),
        r["auto"],
    ]


def skipped_row(row: Row, why: str = SKIPPED) -> list[str]:
    """A row with no figures, and why (it did not fit before the deadline, unless ``why`` says otherwise)."""
    return [*map(str, row), "-", why, *["-"] * (len(COLUMNS) - 6)]


def _measured_row(runner: Runner, row: Row, jax: Any, jax_reason: str | None, budget: float) -> list[str]:
    """:func:`measure_row` as a table row; a row that fails says why and the next rows still run."""
    try:
        return table_row(row, measure_row(runner, row, jax, jax_reason, budget))
    except Exception as error:  # noqa: BLE001 - one cell's failure must not lose the others' (nor gpu.py's stages)
        traceback.print_exc()
        return skipped_row(row, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")


def device_table(
    runner: Runner, jax: Any = None, jax_reason: str | None = None, name: str | None = None
) -> list[list[str]]:
    """Every row of ``runner.shapes`` (:class:`CellRows`) before ``runner.deadline``; the results file
    (``cells-gpu.md`` / ``cells-cpu.md`` unless ``name``) rewritten after each row. JAX is imported for the
    runner's device where ``jax`` is not given."""
    if jax is None and jax_reason is None:
        jax, jax_reason = import_jax(runner.device)
    name = name or f"cells-{'gpu' if runner.device == 'cuda' else 'cpu'}.md"
    rows, done = runner.shapes.rows, []
    load_before, changed_before = load_average(), uncommitted()
    for index, row in enumerate(rows):
        budget = max(runner.left(), 0) / (len(rows) - index)
        done.append(_measured_row(runner, row, jax, jax_reason, budget) if budget > 0 else skipped_row(row))
        print("cells " + " | ".join(done[-1]), flush=True)
        write(runner, name, _table(runner, done, jax, load_before, changed_before))
    return done


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown"
            )
    except OSError:
        return "unknown"


#: issue 30's targets per device: (quantity, baseline, least speedup of Recurrence over it)
TARGETS = {
    "cpu": (("bwd", "loop", 10.0), ("step", "loop", 8.0)),
    "cuda": (("step", "loop", 10.0), ("step", "JAX", 1.0)),
}


def summary(done: list[list[str]], device: str) -> str:
    """One line per target of :data:`TARGETS`: how many measured rows meet it, and the speedups of those below."""
    lines = []
    for quantity, base, least in TARGETS[device]:
        column = COLUMNS.index(f"{quantity} vs {base}")
        measured = [(row[0], float(row[column][:-1])) for row in done if row[column].endswith("x")]
        below = [f"{name} {speedup:.2f}x" for name, speedup in measured if speedup < least]
        lines.append(
            f"- {quantity} >= {least:g}x {base}: {len(measured) - len(below)} of {len(measured)} measured rows"
            + (f"; below: {', '.join(below)}" if below else "")
        )
    return "".join(line + "\n" for line in lines)


def _table(
    runner: Runner, done: list[list[str]], jax: Any, load_before: tuple[float, ...], changed_before: str
) -> str:
    s = runner.shapes
    versions = [
        f"JAX {jax.__version__} (jaxlib {__import__('jaxlib').__version__})" if jax else "JAX not installed"
    ]
    where = "GPU" if runner.device == "cuda" else "CPU"
    text = header(
        runner,
        f"User-written recurrent cells on the {where}: autograd through the loop vs `Recurrence` vs JAX",
        versions,
    )
    if runner.device == "cpu":
        text += (
            f"Machine: {_cpu_model()} (/proc/cpuinfo); {machine_description()}; OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, XLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`. Load average "
            f"(1, 5, 15 min) {tuple(round(v, 2) for v in load_before)} before, "
            f"{tuple(round(v, 2) for v in load_average())} after (this VM's reads ~1 while idle). Files differing from the "
            f"commit under lightning_bppsa/ and kernels/: {changed_before} at the start, {uncommitted()} at the end.\n\n"
        )
    statistic = "min" if runner.device == "cpu" else "median"
    text += (
        "Cells and arms: `benchmarks/cells.py`'s docstring. Input size 8, float32, loss = mean square of every step's "
        "output; `d` = the flat state size. ms: the "
        f"{statistic} of {s.rounds} interleaved rounds of up to {s.max_steps} calls per arm after a warm-up call, "
        f"{runner.timer} (host time included; JAX waited for with block_until_ready). fwd = forward with gradients "
        "recorded (JAX: jit(vjp), residuals kept; its matrix products in full float32, `jax_default_matmul_precision='highest'`, as torch's), bwd = backward alone on a fresh graph recorded untimed before each call (JAX: the jitted VJP on fresh residuals), "
        "step = both (JAX: jit(value_and_grad)). Speedups: loop / Recurrence and JAX / Recurrence. Grad err: largest "
        "norm-wise relative error of the input's and parameters' gradients against autograd through the loop in "
        "float64. Peak MiB: what one whole step of the torch arms adds at its peak (" + (
            "the resident set's high-water mark" if runner.device == "cpu" else "torch's allocator"
        ) + "); not JAX's, whose XLA allocator keeps a pool of its own.\n\n"
        f"Rows done: {len(done)} of {len(s.rows)} (a skipped row says why).\n\n"
        + markdown_table(COLUMNS, done)
        + "\nIssue 30's targets (at B=16 T=1000 H=32):\n\n" + summary(done, runner.device)
    )  # fmt: skip
    return text


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (module docstring)."""
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tiny", action="store_true", help="smoke mode: two cells at H=3 B=2 T=5")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--cells", help="comma-separated cell names (default: every cell)")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds per quantity (default: %(default)s)"
    )
    parser.add_argument(
        "--calls", type=int, default=2, help="timed calls per arm and round, at most (default: %(default)s)"
    )
    parser.add_argument(
        "--within", type=float, default=900.0, metavar="SECONDS", help="the run's time budget"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where the table goes (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/cells.py: no CUDA device here; run it on a GPU machine (or --device cpu --tiny)")
    if args.within <= 0:
        parser.error(f"--within must be > 0 seconds; got {args.within}")
    names = args.cells.split(",") if args.cells else QUICK if args.quick else tuple(CELLS)
    if args.tiny:
        shapes = dataclasses.replace(TINY, rows=rows_of(names, 3, 2, 5) if args.cells else TINY.rows)
    else:
        shapes = CellRows(
            rows_of(names, args.hidden, args.batch, args.steps), rounds=args.rounds, max_steps=args.calls
        )
    clock = time.perf_counter  # the CPU arms' timer: the finest clock there is
    runner = Runner(args.device, shapes, deadline=clock() + args.within, clock=clock, results=args.results,
                    command=shlex.join(["python", "benchmarks/cells.py", *(sys.argv[1:] if argv is None else argv)]))  # fmt: skip
    suffix = "-tiny" if args.tiny else "-quick" if args.quick else ""
    device_table(runner, name=f"cells-{'gpu' if args.device == 'cuda' else 'cpu'}{suffix}.md")
    print(f"cells: {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
