"""The whole training step (forward + backward) of a recurrent layer against every peer, on this machine.

Arms, with the same weights, timed in interleaved rounds in one process (A B C D E, then B C D E A, ...:
a change of machine load hits every arm alike):

- ``autograd``: ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` forward + ``loss.backward()``;
- ``torch.compile``: the same torch module under ``torch.compile`` (``torch._dynamo.config.allow_rnn`` for
  its calls, so the recurrence is traced rather than left to eager torch);
- ``lightning_bppsa``: ``lightning_bppsa.nn.convert`` of the torch module, eager, ``algorithm="auto"``;
- ``lightning_bppsa + compile``: ``torch.compile`` of the converted module (default settings: no
  ``allow_rnn``);
- ``JAX``: ``jax.jit(jax.value_and_grad(loss))`` over ``jax.lax.scan`` of the same cell written in
  ``jax.numpy`` (torch's gate order and both biases, the torch weights copied), float32.

The compiled arms must compile (their first calls) within ``--compile-budget`` seconds, or the row says so.
Per arm: forward (the loss with gradients recorded, no backward; JAX: ``jit(loss)``), whole step
(median and IQR), compile time, peak memory (resident-set growth during one step,
:func:`lightning_bppsa.bench.measure.peak_memory_bytes`), torch ops dispatched by one eager backward, the
cores used (CPU time / wall time over the step rounds), and once per workload the loss and gradients
against torch autograd (norm-wise relative difference) and against a float64 torch reference (the derived
rule of :func:`lightning_bppsa.testing.assert_derived_close`: a peer computing something else is not a peer).

Each thread count runs in its own subprocess (``torch.set_num_threads``, ``OMP_NUM_THREADS``,
``TORCHINDUCTOR_COMPILE_THREADS=1`` so no compile worker outlives a compile cut off by the budget; for one
thread ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``, which XLA only
reads at start-up; with more threads XLA keeps its default pool of every core).

    flock /tmp/bppsa-bench.lock python benchmarks/peers.py            # writes benchmarks/results/peers-cpu.md
    flock /tmp/bppsa-bench.lock python benchmarks/peers.py --quick    # RNN B=16 T=1000 and GRU L only
    python benchmarks/peers.py --smoke                                # tiny sizes, prints the table only
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_bppsa import nn as bnn
from lightning_bppsa.bench.measure import machine_description, peak_memory_bytes
from lightning_bppsa.testing import assert_derived_close, relative_error

RESULTS = Path(__file__).parent / "results" / "peers-cpu.md"
HIDDEN = 20
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


class Workload(NamedTuple):
    """One benchmark row: ``cell`` on ``x: (batch, length, inputs)``, hidden :data:`HIDDEN`."""

    cell: str
    batch: int
    length: int
    inputs: int
    label: str

    @property
    def name(self) -> str:
        return f"{self.label} B={self.batch} T={self.length} input {self.inputs}"


#: every row ``--rows`` can name; a full run is the non-smoke ones
WORKLOADS = {
    "rnn-b1-t1000": Workload("RNN", 1, 1000, 1, "RNN"),
    "rnn-b16-t1000": Workload("RNN", 16, 1000, 1, "RNN"),
    "rnn-b1-t10000": Workload("RNN", 1, 10000, 1, "RNN"),
    "rnn-b16-t10000": Workload("RNN", 16, 10000, 1, "RNN"),
    "gru-s": Workload("GRU", 16, 259, 38, "GRU S"),  # BPPSA Table 6's configurations
    "gru-m": Workload("GRU", 16, 517, 24, "GRU M"),
    "gru-l": Workload("GRU", 16, 1034, 12, "GRU L"),
    "lstm": Workload("LSTM", 16, 1034, 12, "LSTM"),
    "smoke-rnn": Workload("RNN", 2, 9, 1, "RNN smoke"),
    "smoke-gru": Workload("GRU", 1, 7, 3, "GRU smoke"),
    "smoke-lstm": Workload("LSTM", 3, 5, 2, "LSTM smoke"),
}
FULL = [key for key in WORKLOADS if not key.startswith("smoke")]
QUICK = ["rnn-b16-t1000", "gru-l"]
SMOKE = [key for key in WORKLOADS if key.startswith("smoke")]

ARMS = {  # key: label in the table
    "autograd": "torch autograd",
    "compile": "torch.compile",
    "ours": "lightning_bppsa",
    "ours_compile": "lightning_bppsa + compile",
    "jax": "JAX jit",
}
COMPILED = ("compile", "ours_compile", "jax")  # arms whose first calls compile (jit for JAX)
PEERS = ("autograd", "compile", "ours_compile", "jax")  # what our eager arm is compared with


class OverBudget(Exception):
    """A compiled arm's first calls took longer than the compile budget."""


@contextlib.contextmanager
def _deadline(seconds: float, clock: Callable[[], float]) -> Iterator[None]:
    """Raise :class:`OverBudget` once ``seconds`` have passed: in the main thread by SIGALRM, again every
    0.5 s (a compiler may swallow one exception), and at the end if the block outlasted the budget
    uninterrupted (a signal waits while C++ runs, e.g. XLA's compiler)."""

    def expire(signum: int, frame: Any) -> None:
        raise OverBudget(f"compile exceeded the budget of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.5)
    start = clock()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if clock() - start > seconds:
        expire(signal.SIGALRM, None)


def _over_budget(error: BaseException) -> OverBudget | None:
    """The :class:`OverBudget` behind ``error``, also where the compiler wrapped it in its own error."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OverBudget):
        cause = cause.__cause__ or cause.__context__
    return cause


class _OpCounter(TorchDispatchMode):
    """Counts the torch (aten) ops dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Arm:
    """One way to compute the loss and its gradients.

    ``forward()`` computes the loss (torch: recording the graph, no backward); ``step()`` the loss and every
    parameter gradient, finished when it returns; ``gradients()`` runs a step and returns the loss and the
    gradients (float32 torch tensors keyed by torch's parameter names); ``backward_ops()`` counts the torch
    ops of one eager backward (``None``: not countable, e.g. a compiled backward).
    """

    key: str
    forward: Callable[[], object]
    step: Callable[[], object]
    gradients: Callable[[], dict[str, Tensor]]
    backward_ops: Callable[[], int] | None = None
    path: Callable[[], str] = field(default=lambda: "")


def _last_step_loss(output: Tensor) -> Tensor:
    return output[:, -1].pow(2).sum()


def _torch_arm(key: str, module: nn.Module, x: Tensor, call: Callable[[Tensor], Any] | None = None) -> Arm:
    """An arm over ``module`` (``call``: a compiled wrapper of it) on batch-first ``x``."""
    call = module if call is None else call

    def loss() -> Tensor:
        return _last_step_loss(call(x)[0])

    def step() -> Tensor:
        module.zero_grad(set_to_none=True)
        value = loss()
        value.backward()
        return value

    def gradients() -> dict[str, Tensor]:
        value = step()
        return {"loss": value.detach(), **{name: p.grad.clone() for name, p in module.named_parameters()}}

    def backward_ops() -> int:
        module.zero_grad(set_to_none=True)
        value = loss()
        with _OpCounter() as counter:
            value.backward()
        return counter.count

    def path() -> str:
        stats = getattr(module, "last_stats", None)
        if not stats:
            return ""
        return " ".join(filter(None, (stats["path"], stats.get("scan_algorithm", ""))))

    return Arm(key, loss, step, gradients, None if key in COMPILED else backward_ops, path)


def _jax_loss(cell: str, jax: Any) -> Callable[[dict[str, Any], Any], Any]:
    """``loss(params, xs)`` of one torch ``cell`` layer over time-major ``xs: (T, B, I)`` in jax.numpy.

    Torch's equations and gate orders (``weight_ih_l0`` rows: RNN ``h``; GRU ``r, z, n``; LSTM
    ``i, f, g, o``), both biases, zero initial state; the loss is ``sum(h_T ** 2)`` as in the torch arms.
    The input projection of all steps is one GEMM before the scan, as torch's fused layers do.
    """
    jnp, sigmoid = jax.numpy, jax.nn.sigmoid

    def loss(params: dict[str, Any], xs: Any) -> Any:
        w_hh, b_hh = params["weight_hh_l0"], params["bias_hh_l0"]
        projected = xs @ params["weight_ih_l0"].T + params["bias_ih_l0"]  # (T, B, gates * H)
        h0 = jnp.zeros((xs.shape[1], w_hh.shape[1]), xs.dtype)

        def rnn(h: Any, p: Any) -> tuple[Any, None]:
            return jnp.tanh(p + h @ w_hh.T + b_hh), None

        def gru(h: Any, p: Any) -> tuple[Any, None]:
            x_r, x_z, x_n = jnp.split(p, 3, axis=-1)
            h_r, h_z, h_n = jnp.split(h @ w_hh.T + b_hh, 3, axis=-1)
            r, z = sigmoid(x_r + h_r), sigmoid(x_z + h_z)
            n = jnp.tanh(x_n + r * h_n)
            return (1 - z) * n + z * h, None

        def lstm(state: tuple[Any, Any], p: Any) -> tuple[tuple[Any, Any], None]:
            h, c = state
            i, f, g, o = jnp.split(p + h @ w_hh.T + b_hh, 4, axis=-1)
            c = sigmoid(f) * c + sigmoid(i) * jnp.tanh(g)
            return (sigmoid(o) * jnp.tanh(c), c), None

        step, init = {"RNN": (rnn, h0), "GRU": (gru, h0), "LSTM": (lstm, (h0, h0))}[cell]
        last, _ = jax.lax.scan(step, init, projected)
        h_last = last[0] if cell == "LSTM" else last
        return jnp.sum(h_last**2)

    return loss


def _jax_arm(cell: str, module: nn.Module, x: Tensor, jax: Any) -> Arm:
    """The JAX/XLA arm: ``jit(value_and_grad(loss))`` with ``module``'s weights copied, on ``x``'s values."""
    params = {name: jax.numpy.asarray(p.detach().numpy()) for name, p in module.named_parameters()}
    xs = jax.numpy.asarray(x.transpose(0, 1).contiguous().numpy())  # time-major for the scan
    loss = _jax_loss(cell, jax)
    forward = jax.jit(loss)
    value_and_grad = jax.jit(jax.value_and_grad(loss))

    def step() -> Any:
        return jax.block_until_ready(value_and_grad(params, xs))

    def gradients() -> dict[str, Tensor]:
        value, grads = step()
        as_torch = {name: torch.tensor(jax.device_get(g)) for name, g in grads.items()}
        return {"loss": torch.tensor(jax.device_get(value)), **as_torch}

    return Arm("jax", lambda: jax.block_until_ready(forward(params, xs)), step, gradients)


def _import_jax() -> Any:
    """``jax``, or ``None`` (and one line saying so) where it is not installed."""
    try:
        import jax
    except ImportError:
        print("jax is not installed (pip install 'lightning-bppsa[bench]'): no JAX arm", file=sys.stderr)
        return None
    return jax


def _inputs(workload: Workload) -> tuple[nn.Module, Tensor]:
    """The torch module (seed 0) and its input: the bitstream of BPPSA Sec. 4.1 for one input feature."""
    torch.manual_seed(0)
    module = getattr(nn, workload.cell)(workload.inputs, HIDDEN, batch_first=True)
    x = torch.randn(workload.batch, workload.length, workload.inputs)
    return module, (x > 0.5).float() if workload.inputs == 1 else x


def _build_arms(workload: Workload, module: nn.Module, x: Tensor, backend: str, jax: Any) -> dict[str, Arm]:
    """Every arm on the same weights (each torch arm on its own copy of ``module``)."""
    compiled = copy.deepcopy(module)
    ours = bnn.convert(copy.deepcopy(module))
    ours_compiled = bnn.convert(copy.deepcopy(module))
    torch_compiled = torch.compile(compiled, backend=backend)

    def with_allow_rnn(inputs: Tensor) -> Any:  # dynamo reads the flag when it traces (the first calls)
        with torch._dynamo.config.patch(allow_rnn=True):
            return torch_compiled(inputs)

    arms = {
        "autograd": _torch_arm("autograd", module, x),
        "compile": _torch_arm("compile", compiled, x, with_allow_rnn),
        "ours": _torch_arm("ours", ours, x),
        "ours_compile": _torch_arm(
            "ours_compile", ours_compiled, x, torch.compile(ours_compiled, backend=backend)
        ),
    }
    if jax is not None:
        arms["jax"] = _jax_arm(workload.cell, module, x, jax)
    return arms


def _reference(module: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Loss and gradients of torch autograd in float64: the truth the arms are checked against."""
    module64 = copy.deepcopy(module).double()
    return _torch_arm("reference", module64, x.double()).gradients()


def _accuracy(
    actual: dict[str, Tensor], autograd: dict[str, Tensor], reference: dict[str, Tensor]
) -> tuple[float, str]:
    """(max relative difference to torch autograd over the loss and every gradient, the derived check)."""
    difference = max(relative_error(actual[name], autograd[name]) for name in autograd)
    try:
        for name in reference:
            assert_derived_close(actual[name], reference[name], autograd[name], name=name)
    except AssertionError as error:
        return difference, f"FAIL ({error})"
    return difference, "ok"


def _interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], float],
    cpu_clock: Callable[[], float],
    block: int = 1,
) -> dict[str, tuple[list[float], float]]:
    """Per key: the wall time per call of ``rounds`` turns of ``block`` consecutive calls, and the cores used
    (CPU time / wall time over them).

    Round ``r`` starts at the ``r``-th function (rotation), so no arm always runs right after another.
    """
    keys = list(fns)
    times: dict[str, list[float]] = {key: [] for key in keys}
    cpu = dict.fromkeys(keys, 0.0)
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start, cpu_start = clock(), cpu_clock()
            for _ in range(block):
                fns[key]()
            times[key].append((clock() - start) / block)
            cpu[key] += cpu_clock() - cpu_start
    return {key: (times[key], cpu[key] / max(sum(times[key]) * block, 1e-12)) for key in keys}


def _warm_up(
    key: str,
    arm: Arm,
    workload: Workload,
    compile_budget: float,
    backend: str,
    over_budget: dict[str, list[Any]],
    clock: Callable[[], float],
    compile_seconds: dict[str, float],
) -> str | None:
    """Run ``arm``'s first calls (for a compiled arm: its compile, within the budget) and record their
    seconds in ``compile_seconds``; returns why the arm cannot be timed, or ``None``."""
    if key in COMPILED and key != "jax" and compile_budget <= 0:
        return "not run (--compile-budget 0)"
    if workload.length >= over_budget.get(key, [sys.maxsize])[0]:
        length, where = over_budget[key]
        return f"skipped: compile exceeded the budget at T={length} ({where})"
    budget = compile_budget if key in COMPILED else 0
    start = clock()
    try:
        with _deadline(budget, clock) if budget > 0 else contextlib.nullcontext():
            arm.forward(), arm.step(), arm.step()
    except Exception as error:  # a compiler that fails: the row says so, the other arms go on
        if key not in COMPILED:
            raise
        failure = _failure(error, key, backend, workload, over_budget)
    else:
        compile_seconds[key] = clock() - start
        return None
    # An abandoned compile leaves its half-built graphs (an unrolled T-step trace) to the collector;
    # measured, they slowed the eager arms timed after it by 10-40%.
    torch._dynamo.reset()
    gc.collect()
    return failure


def _failure(
    error: Exception, key: str, backend: str, workload: Workload, over_budget: dict[str, list[Any]]
) -> str:
    """Why a compiled arm's first calls failed (an over-budget compile is recorded in ``over_budget``)."""
    what = ARMS[key] if key == "jax" else f"{ARMS[key]}, {backend}"
    budget_error = _over_budget(error)
    if budget_error is not None:
        over_budget[key] = [workload.length, workload.label]
        return f"{budget_error} ({what})"
    first_line = (str(error).splitlines() or [""])[0][:100].replace("|", "/")  # it goes in a table cell
    return f"compile failed ({what}): {type(error).__name__}: {first_line}"


def measure_workload(
    workload: Workload,
    *,
    rounds: int = 15,
    block: int = 5,
    compile_budget: float = 120.0,
    backend: str = "inductor",
    over_budget: dict[str, list[Any]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
    jax: Any = None,
) -> dict[str, Any]:
    """One row: every arm on ``workload`` at the current torch thread count.

    Args:
        workload: the layer and its input sizes.
        rounds: interleaved turns per arm, for the forward and for the whole step (at least 2).
        block: consecutive calls per turn, timed together (a training loop's steady state: a lone call
            after another arm's runs from cold caches; each step is also timed that way, ``cold_step_ms``).
        compile_budget: seconds a compiled arm's first calls may take; 0 skips the compiled torch arms.
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` compiles without C++).
        over_budget: arm key -> ``[T, workload label]`` of the first row whose compile of that arm ran over
            the budget; the arm is not compiled again at that T or longer, for any cell: with
            ``allow_rnn`` its graph is unrolled over T, so the compile grows with T (a heuristic: a GRU
            step has more ops than an RNN step). Updated in place.
        clock, cpu_clock: wall and CPU clocks (injectable, for tests).
        jax: the ``jax`` module, or ``None`` for no JAX arm.

    Returns:
        ``{"workload", "threads", "load_before", "load_after", "arms": [...]}``; each arm has ``key``,
        ``label``, ``status`` (``"ok"`` or why it has no times) and, when timed, ``forward_ms``, ``step_ms``,
        ``iqr_ms``, ``cold_step_ms``, ``compile_s`` (compiled arms), ``peak_mib``, ``backward_ops``, ``cores``, ``rel_diff``,
        ``check``, ``path`` (what the lightning_bppsa module ran).
    """
    if rounds < 2:
        raise ValueError(f"rounds must be at least 2 (for an IQR); got {rounds}")
    over_budget = {} if over_budget is None else over_budget
    load_before = os.getloadavg()
    module, x = _inputs(workload)
    status: dict[str, str] = {}
    compile_seconds: dict[str, float] = {}
    arms = _build_arms(workload, module, x, backend, jax)
    for key, arm in list(arms.items()):
        failure = _warm_up(key, arm, workload, compile_budget, backend, over_budget, clock, compile_seconds)
        if failure is not None:
            status[key] = failure
            del arms[key]
    autograd = arms["autograd"].gradients()
    reference = _reference(module, x)
    accuracy = {key: _accuracy(arm.gradients(), autograd, reference) for key, arm in arms.items()}
    ops = {key: arm.backward_ops() for key, arm in arms.items() if arm.backward_ops is not None}
    peaks = {key: peak_memory_bytes(arm.step) for key, arm in arms.items()}
    forward = _interleaved({key: arm.forward for key, arm in arms.items()}, rounds, clock, cpu_clock)
    steps = _interleaved({key: arm.step for key, arm in arms.items()}, rounds, clock, cpu_clock, block)
    cold = _interleaved({key: arm.step for key, arm in arms.items()}, rounds, clock, cpu_clock)
    rows = []
    for key, label in ARMS.items():
        row: dict[str, Any] = {"key": key, "label": label, "status": status.get(key, "ok")}
        if key in arms:
            forward_median, step_times = statistics.median(forward[key][0]), steps[key][0]
            step_median = statistics.median(step_times)
            q1, _, q3 = statistics.quantiles(step_times, n=4, method="inclusive")
            row.update(
                forward_ms=forward_median * 1e3,
                step_ms=step_median * 1e3,
                iqr_ms=(q3 - q1) * 1e3,
                cold_step_ms=statistics.median(cold[key][0]) * 1e3,
                # the warm-up (one forward, two steps) less what those calls take once compiled
                compile_s=max(compile_seconds[key] - forward_median - 2 * step_median, 0.0)
                if key in COMPILED
                else None,
                peak_mib=peaks[key] / 2**20,
                backward_ops=ops.get(key),
                cores=steps[key][1],
                rel_diff=accuracy[key][0],
                check=accuracy[key][1],
                path=arms[key].path(),
            )
        elif key == "jax" and jax is None:
            row["status"] = "jax not installed"
        rows.append(row)
    torch._dynamo.reset()  # the compiled graphs of this row are not needed again
    del arms
    gc.collect()
    return {
        "workload": workload.name,
        "threads": torch.get_num_threads(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "arms": rows,
    }


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(results: Sequence[dict[str, Any]], header: Sequence[str]) -> str:
    """The markdown table of ``results`` (rows of :func:`measure_workload`) under the ``header`` lines."""
    lines = [*header, "", "## Every arm", ""]
    columns = [
        "workload", "threads", "arm", "forward ms", "step ms", "step IQR ms", "cold step ms", "compile s", "peak MiB",
        "backward ops", "cores used", "rel. diff vs autograd", "float64 check",
    ]  # fmt: skip
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for result in results:
        for arm in result["arms"]:
            label = arm["label"] + (f" ({arm['path']})" if arm.get("path") else "")
            head = f"| {result['workload']} | {result['threads']} | {label} "
            if arm["status"] != "ok":
                lines.append(head + f"| {arm['status']} |" + " |" * (len(columns) - 4))
                continue
            lines.append(
                head
                + f"| {arm['forward_ms']:.2f} | {arm['step_ms']:.2f} | {arm['iqr_ms']:.2f} | {arm['cold_step_ms']:.2f} "
                f"| {_cell(arm['compile_s'], '.1f')} | {arm['peak_mib']:.1f} | {_cell(arm['backward_ops'], 'd')} "
                f"| {arm['cores']:.2f} | {arm['rel_diff']:.1e} | {arm['check']} |"
            )
    peers = [ARMS[key] for key in PEERS]
    columns = [
        "workload", "threads", *(f"vs {label}" for label in peers), f"vs {ARMS['autograd']}, cold steps",
        "load before", "load after",
    ]  # fmt: skip
    lines += [
        "",
        f"## Speedup of {ARMS['ours']} (eager) on the whole step: a peer's step median / ours",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
    ]
    for result in results:
        step = {arm["key"]: arm.get("step_ms") for arm in result["arms"]}
        ours = step["ours"]
        speedups = [f"{step[key] / ours:.2f}x" if ours and step[key] else "—" for key in PEERS]
        cold = {arm["key"]: arm.get("cold_step_ms") for arm in result["arms"]}
        speedups.append(f"{cold['autograd'] / cold['ours']:.2f}x" if cold["ours"] else "—")
        loads = [
            " / ".join(f"{value:.2f}" for value in result[when]) for when in ("load_before", "load_after")
        ]
        lines.append(f"| {result['workload']} | {result['threads']} | " + " | ".join(speedups + loads) + " |")
    return "\n".join(lines) + "\n"


def _header(
    args: argparse.Namespace, machines: Sequence[str], jax_version: str | None, seconds: float
) -> list[str]:
    command = " ".join(["python benchmarks/peers.py", *args.argv])
    return [
        "# The whole training step against every peer (CPU)",
        "",
        *(f"Machine: {machine}." for machine in dict.fromkeys(machines)),
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `{command}` in {seconds:.0f} s; "
        f"torch {torch.__version__}, "
        + (f"jax/jaxlib {jax_version}" if jax_version else "jax not installed (no JAX arm)")
        + f", Python {platform.python_version()}. Load = `os.getloadavg()` (1 / 5 / 15 min) before and "
        "after each row: the machine is shared, a load above the row's threads means other processes ran.",
        "",
        f"Hidden {HIDDEN}, one layer, float32, loss `sum(h_T ** 2)` on the last step, zero initial state. "
        f"Medians of {args.rounds} interleaved rounds (rotating the order); in a round every arm runs "
        f"{args.block} calls in a row, timed together (the steady state of a training loop); IQR of the step "
        "times. Cold step = the step timed alone, one call per round right after other arms (from cold "
        "caches: this costs the short steps most). Forward = the loss with autograd recording (JAX: `jit(loss)`), step = forward + "
        "backward with every parameter gradient ready. Each thread count runs in its own process: "
        "`torch.set_num_threads(n)`, `OMP_NUM_THREADS=n`; for 1 thread "
        f"`XLA_FLAGS='{ONE_THREAD_XLA_FLAGS}'`, for more XLA's default pool (all cores). Cores used = CPU "
        "time / wall time over the step rounds. torch.compile: backend "
        f"`{args.compile_backend}`, torch's module with `allow_rnn=True` (the recurrence unrolled over T), the "
        "converted one with default settings; budget "
        f"{args.compile_budget:g} s for the first calls (once an arm ran over it, rows at that T or longer skip "
        "it, rows run shortest T first); compile s = the warm-up (one forward, two steps) "
        "less those calls' steady time. Peak = resident-set growth during one step (JAX's allocator may keep "
        "buffers from the warm-up). Backward ops = torch ops dispatched by one eager `loss.backward()`. "
        "Rel. diff = max over the loss and every gradient of ‖arm − torch autograd‖ / ‖torch autograd‖; "
        "float64 check: every one within 2× torch float32's own error vs a float64 torch reference + 1e-5.",
    ]


def _worker(args: argparse.Namespace) -> None:
    """Measure ``args.rows`` at one thread count in this process; write the rows as JSON to ``args.json``."""
    torch.set_num_threads(args.threads[0])
    jax = _import_jax()
    over_budget = json.loads(args.over_budget)
    results = []
    for key in sorted(args.rows, key=lambda key: WORKLOADS[key].length):  # short first: budget skips
        result = measure_workload(
            WORKLOADS[key],
            rounds=args.rounds,
            block=args.block,
            compile_budget=args.compile_budget,
            backend=args.compile_backend,
            over_budget=over_budget,
            jax=jax,
        )
        result["key"] = key
        results.append(result)
        print(render([result], []), file=sys.stderr, flush=True)
    output = {
        "results": results,
        "over_budget": over_budget,
        "machine": machine_description(),
        "jax": None if jax is None else jax.__version__,
    }
    Path(args.json).write_text(json.dumps(output))


def _run_threads(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """One worker subprocess per thread count, in order; returns their rows, machines and jax version."""
    results, machines, jax_version, over_budget = [], [], None, {}
    for threads in args.threads:
        # inductor compiles in this process (no pool of compile workers): a compile cut off by the budget
        # must not keep compiling in the background while the next rows are timed
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   TORCHINDUCTOR_COMPILE_THREADS="1")  # fmt: skip
        if threads == 1:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {ONE_THREAD_XLA_FLAGS}".strip()
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "rows.json"
            command = [
                sys.executable, __file__, "--worker", "--threads", str(threads), "--rows", ",".join(args.rows),
                "--rounds", str(args.rounds), "--block", str(args.block), "--compile-budget", str(args.compile_budget),
                "--compile-backend", args.compile_backend, "--over-budget", json.dumps(over_budget),
                "--json", str(out),
            ]  # fmt: skip
            subprocess.run(command, env=env, check=True)
            output = json.loads(out.read_text())
        order = {key: i for i, key in enumerate(args.rows)}
        results += sorted(output["results"], key=lambda result: order[result["key"]])
        machines.append(output["machine"])
        over_budget.update(output["over_budget"])
        jax_version = output["jax"]
    return results, machines, jax_version


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"the headline rows only ({', '.join(QUICK)})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 rounds: checks the script runs")
    parser.add_argument("--rows", help=f"comma-separated rows, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per arm (default 15; --smoke 3)")
    parser.add_argument(
        "--block", type=int, default=5, help="consecutive calls per arm and round (default 5)"
    )
    parser.add_argument("--compile-budget", type=float, default=120.0, help="seconds per compile (0: skip)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--out", type=Path, help=f"markdown file (default {RESULTS}; --smoke: print only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--over-budget", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(argv)
    rows = args.rows.split(",") if args.rows else SMOKE if args.smoke else QUICK if args.quick else FULL
    unknown = [row for row in rows if row not in WORKLOADS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; known: {', '.join(WORKLOADS)}")
    args.rows = rows
    try:
        args.threads = [int(n) for n in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads must be comma-separated integers; got {args.threads!r}")
    if not all(n >= 1 for n in args.threads):
        parser.error(f"--threads must be positive; got {args.threads}")
    args.rounds = args.rounds or (3 if args.smoke else 15)
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2 (for an IQR); got {args.rounds}")
    if args.block < 1:
        parser.error(f"--block must be at least 1; got {args.block}")
    if args.compile_budget < 0:
        parser.error(f"--compile-budget must be >= 0; got {args.compile_budget}")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark (see the module docstring); returns the markdown it wrote or printed."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.worker:
        _worker(args)
        return ""
    start = time.perf_counter()
    results, machines, jax_version = _run_threads(args)
    table = render(results, _header(args, machines, jax_version, time.perf_counter() - start))
    out = args.out or (None if args.smoke else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table)
    print(table)
    return table


if __name__ == "__main__":
    main()
