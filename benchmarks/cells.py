"""User-written recurrent cells on CPU: autograd through the Python loop vs ``lightning_bppsa.nn.Recurrence``.

Five cells written here the way a researcher would (a GRU-like gated cell, an IndRNN-style diagonal
cell, an LSTM variant with a tuple state, and two written gate block first as torch's own formulas are:
an LSTM and a leaky-memory cell with a tuple state), looped over time in Python. Per row, same weights, both arms
(the scan forced with ``algorithm="linear"``; and what ``"auto"`` picks)
interleaved in one process: forward (the loop recorded by autograd vs ``Recurrence``'s unrecorded loop),
backward alone (``torch.autograd.grad`` on a graph recorded once, ``retain_graph=True``) and a whole step
(forward + backward), medians of ``torch.utils.benchmark``; the Recurrence backward's split into
Jacobians and scan from ``last_stats``, with the Jacobians' form (factored from the traced step, or dense
from batched cell gradients); peak = resident-set growth during one step. Loss on every step's output, float32, input size 8.

    OMP_NUM_THREADS=1 flock /tmp/bppsa-bench.lock python benchmarks/cells.py          # the grid
    OMP_NUM_THREADS=1 flock /tmp/bppsa-bench.lock python benchmarks/cells.py --quick  # headline rows

Headline rows also run the same cells in JAX (``jax.jit(jax.value_and_grad(...))`` over
``lax.scan``, the cell's math written in ``jax.numpy``, same weights and loss), interleaved with
``Recurrence``'s whole step; with ``OMP_NUM_THREADS=1`` XLA runs on one thread too
(``XLA_FLAGS``). Without JAX (``pip install 'lightning-bppsa[bench]'``) the section says so.

Writes ``benchmarks/results/cells-cpu.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
from torch import nn

from lightning_bppsa.bench.measure import machine_description, median_seconds, peak_memory_bytes
from lightning_bppsa.nn import Recurrence

RESULTS = Path(__file__).parent / "results" / "cells-cpu.md"
INPUTS = 8


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


class BlockLSTMCell(nn.Module):
    """torch's LSTMCell formula written by hand, gate block first: ``gates = ih(x) + hh(h)``, then
    ``chunk(4, 1)`` (the bias and the sum on the whole ``(B, 4H)`` block)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.ih, self.hh = nn.Linear(inputs, 4 * hidden), nn.Linear(hidden, 4 * hidden)

    def forward(self, x, state):
        h, c = state
        i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
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


CELLS = {"gated": GatedCell, "indrnn": IndRNNCell, "lstm": LSTMVariant, "lstm-block": BlockLSTMCell, "leaky": LeakyMemoryCell}

ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def jax_step(kind: str, hidden: int, jax):
    """``jit(value_and_grad(loss))(params, xs)`` of the ``kind`` cell over time-major ``xs`` in jax.numpy: the
    torch cell's equations (``params`` named as its ``named_parameters``), zero state, mean square of every
    step's output."""
    jnp, sigmoid = jax.numpy, jax.nn.sigmoid

    def gated(p, h, x):
        z, r, n = jnp.split(x @ p["ih.weight"].T + p["ih.bias"], 3, -1)
        hz, hr, hn = jnp.split(h @ p["hh.weight"].T, 3, -1)
        z, r = sigmoid(z + hz), sigmoid(r + hr)
        return (1 - z) * jnp.tanh(n + r * hn) + z * h

    def indrnn(p, h, x):
        return jax.nn.relu(x @ p["lin.weight"].T + p["lin.bias"] + p["u"] * h)

    def lstm(p, state, x):
        h, c = state
        f, g, o = jnp.split(jnp.concatenate([x, h], -1) @ p["gates.weight"].T + p["gates.bias"], 3, -1)
        f = sigmoid(f)
        c = f * c + (1 - f) * jnp.tanh(g)
        return sigmoid(o) * jnp.tanh(c), c

    def lstm_block(p, state, x):
        h, c = state
        gates = x @ p["ih.weight"].T + p["ih.bias"] + h @ p["hh.weight"].T + p["hh.bias"]
        i, f, g, o = jnp.split(gates, 4, -1)
        c = sigmoid(f) * c + sigmoid(i) * jnp.tanh(g)
        return sigmoid(o) * jnp.tanh(c), c

    def leaky(p, state, x):
        h, m = state
        a, g, o = jnp.split(sigmoid(jnp.concatenate([x, h], -1) @ p["gates.weight"].T + p["gates.bias"]), 3, -1)
        decay = sigmoid(p["leak"])
        m = decay * m + (1 - decay) * g * (2 * a - 1)
        return o * jnp.tanh(m), m

    cell = {"gated": gated, "indrnn": indrnn, "lstm": lstm, "lstm-block": lstm_block, "leaky": leaky}[kind]
    pair = isinstance(CELLS[kind](INPUTS, hidden).state_size, tuple)  # (h, c): the output is h

    def loss(params, xs):
        h0 = jnp.zeros((xs.shape[1], hidden), xs.dtype)

        def body(state, x):
            state = cell(params, state, x)
            return state, state[0] if pair else state

        _, outs = jax.lax.scan(body, (h0, h0) if pair else h0, xs)
        return jnp.mean(outs**2)

    return jax.jit(jax.value_and_grad(loss))


def measure_jax(kind: str, hidden: int, batch: int, steps: int, min_run_time: float, jax) -> dict:
    """Whole-step medians (seconds) of ``Recurrence`` and of JAX for one row, interleaved (ours, JAX, ours,
    JAX), and the largest norm-wise relative difference of JAX's loss and gradients from ours."""
    torch.manual_seed(0)
    cell = CELLS[kind](INPUTS, hidden)
    x = torch.randn(steps, batch, INPUTS, requires_grad=True)
    leaves = [x, *cell.parameters()]
    scan = Recurrence(cell, algorithm="linear")
    step = jax_step(kind, hidden, jax)
    params = {name: jax.numpy.asarray(p.detach().numpy()) for name, p in cell.named_parameters()}
    xs = jax.numpy.asarray(x.detach().numpy())
    start = time.perf_counter()
    value, grads = jax.block_until_ready(step(params, xs))
    compile_seconds = time.perf_counter() - start
    loss = scan(x)[0].pow(2).mean()
    names = ["loss", "x", *(n for n, _ in cell.named_parameters())]
    ours = dict(zip(names, [loss, *torch.autograd.grad(loss, leaves)], strict=True))
    theirs = {"loss": value, **grads}
    differences = [
        float((torch.tensor(jax.device_get(theirs[name])) - ours[name].detach()).norm() / ours[name].detach().norm())
        for name in theirs
    ]
    result = {"compile": compile_seconds, "diff": max(differences)}
    arms = {
        "ours": lambda: torch.autograd.grad(scan(x)[0].pow(2).mean(), leaves),
        "jax": lambda: jax.block_until_ready(step(params, xs)),
    }
    for _ in range(2):  # two rounds, alternating: a change of load hits both
        for name, fn in arms.items():
            result.setdefault(name, []).append(median_seconds(fn, min_run_time))
    return {**result, "ours": min(result["ours"]), "jax": min(result["jax"])}
HEADLINE = [
    ("gated", 32, 16, 1000), ("indrnn", 32, 16, 1000), ("lstm", 32, 16, 1000), ("lstm-block", 32, 16, 1000),
    ("leaky", 32, 16, 1000), ("gated", 32, 1, 1000),
]
GRID = [(c, h, b, t) for c in CELLS for h in (16, 32, 64) for b in (1, 16) for t in (100, 1000)]


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


def measure(kind: str, hidden: int, batch: int, steps: int, budget: int, min_run_time: float) -> dict:
    """Timings (seconds) and peaks (bytes) of the loop and of the forced scan for one row, and what
    ``"auto"`` picks; the scan arm is skipped (``None``) where its dense Jacobians exceed ``budget`` bytes
    (the cell does not factor: two steps of the scan tell)."""
    torch.manual_seed(0)
    cell = CELLS[kind](INPUTS, hidden)
    x = torch.randn(steps, batch, INPUTS, requires_grad=True)
    leaves = [x, *cell.parameters()]
    scan = Recurrence(cell, algorithm="linear")  # on CPU "auto" resolves the scan itself to "linear"
    d = hidden * (2 if isinstance(cell.state_size, tuple) else 1)
    scan(x[:2])[0].sum().backward(inputs=[x])  # traces the cell for this batch shape
    fits = scan.last_stats["jacobians"] == "factored" or batch * steps * d * d * 4 <= budget
    x.grad = None
    arms = {"loop": lambda: python_loop(cell, x), "scan": lambda: scan(x)[0]} if fits else {"loop": lambda: python_loop(cell, x)}
    result: dict = {"d": d}

    def step(forward):
        torch.autograd.grad(forward().pow(2).mean(), leaves)

    for name, forward in arms.items():  # interleaved: each quantity for both arms before the next
        result[f"fwd_{name}"] = median_seconds(forward, min_run_time)
    for name, forward in arms.items():
        loss = forward().pow(2).mean()
        result[f"bwd_{name}"] = median_seconds(
            lambda loss=loss: torch.autograd.grad(loss, leaves, retain_graph=True), min_run_time
        )
        del loss
    for name, forward in arms.items():
        result[f"step_{name}"] = median_seconds(lambda forward=forward: step(forward), min_run_time)
    for name, forward in arms.items():
        result[f"peak_{name}"] = peak_memory_bytes(lambda forward=forward: step(forward))
    if fits:
        step(arms["scan"])  # one more for the split of its backward
        stats = scan.last_stats
        form = stats["jacobians"] + (", compiled loop" if stats["cell_kernel"] else "")
        result.update(jac=stats["jacobian_seconds"], scan=stats["scan_seconds"], form=form)
    auto = Recurrence(cell, memory_budget=budget)
    step(lambda: auto(x)[0])
    result.update(auto=auto.last_stats["path"], auto_reason=auto.last_stats["reason"])
    return result


HEADER = (
    "| cell | H | B | T | d | fwd ms loop | fwd ms scan | bwd ms loop | bwd ms scan | bwd speedup "
    "| step ms loop | step ms scan | step speedup | Jacobians | Jacobians ms | scan ms | peak MiB loop "
    "| peak MiB scan | auto picks |\n|" + " --- |" * 19
)


def row(kind: str, hidden: int, batch: int, steps: int, r: dict) -> str:
    ms, mib = 1e3, 2.0**-20
    auto = r["auto"] if r["auto_reason"] is None else f"{r['auto']} ({r['auto_reason']})"
    head = f"| {kind} | {hidden} | {batch} | {steps} | {r['d']} "
    if "bwd_scan" not in r:
        return (
            head + f"| {r['fwd_loop'] * ms:.1f} | not run | {r['bwd_loop'] * ms:.1f} | not run | - "
            f"| {r['step_loop'] * ms:.1f} | not run | - | - | - | - | {r['peak_loop'] * mib:.1f} | - | {auto} |"
        )
    return (
        head + f"| {r['fwd_loop'] * ms:.1f} | {r['fwd_scan'] * ms:.1f} "
        f"| {r['bwd_loop'] * ms:.1f} | {r['bwd_scan'] * ms:.1f} | {r['bwd_loop'] / r['bwd_scan']:.2f}x "
        f"| {r['step_loop'] * ms:.1f} | {r['step_scan'] * ms:.1f} | {r['step_loop'] / r['step_scan']:.2f}x "
        f"| {r['form']} | {r['jac'] * ms:.1f} | {r['scan'] * ms:.1f} | {r['peak_loop'] * mib:.1f} | {r['peak_scan'] * mib:.1f} | {auto} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline rows only")
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument(
        "--memory-budget", type=int, default=2**28,
        help="Recurrence(memory_budget=...) in bytes: rows whose Jacobians (dense, or their factors) exceed it run autograd "
        "(default 256 MiB, to keep the grid under ~8 minutes; the module's default is 1 GiB)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    start, load_before = time.perf_counter(), os.getloadavg()
    if os.environ.get("OMP_NUM_THREADS") == "1":  # XLA reads its flags at start-up: set before the import
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_XLA_FLAGS}".strip()
    try:
        import jax

        jax.config.update("jax_platforms", "cpu")
    except ImportError:
        jax = None
    lines = []
    sections = [("Headline rows (targets: backward >= 10x, step >= 3x at B=16 T=1000 H=32)", HEADLINE)]
    for title, rows in sections + ([] if args.quick else [("Grid", GRID)]):
        lines += ["", f"## {title}", "", HEADER]
        for kind, hidden, batch, steps in rows:
            result = measure(kind, hidden, batch, steps, args.memory_budget, args.min_run_time)
            lines.append(row(kind, hidden, batch, steps, result))
            print(lines[-1], flush=True)
    lines += ["", "## Against JAX (headline rows, whole training step)", ""]
    if jax is None:
        lines.append("JAX is not installed (`pip install 'lightning-bppsa[bench]'`): not measured.")
    else:
        lines += [
            f"JAX {jax.__version__}, `jit(value_and_grad)` over `lax.scan`; XLA_FLAGS=`{os.environ.get('XLA_FLAGS', '')}`. "
            "Step ms: the better of two interleaved medians per arm. Rel. diff: the largest norm-wise relative "
            "difference of JAX's loss and gradients from `Recurrence`'s (float32).",
            "",
            "| cell | H | B | T | step ms Recurrence | step ms JAX | Recurrence vs JAX | JAX compile s | rel. diff |",
            "|" + " --- |" * 9,
        ]
        for kind, hidden, batch, steps in HEADLINE:
            r = measure_jax(kind, hidden, batch, steps, args.min_run_time, jax)
            lines.append(
                f"| {kind} | {hidden} | {batch} | {steps} | {r['ours'] * 1e3:.1f} | {r['jax'] * 1e3:.1f} "
                f"| {r['jax'] / r['ours']:.2f}x | {r['compile']:.1f} | {r['diff']:.1e} |"
            )
            print(lines[-1], flush=True)
    load_after = os.getloadavg()
    head = [
        "# User-written recurrent cells on CPU: autograd through the Python loop vs `Recurrence`",
        "",
        f"Machine: {machine_description()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}). "
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `benchmarks/cells.py"
        f"{' --quick' if args.quick else ''}` under `flock /tmp/bppsa-bench.lock`; load average (1, 5, 15 min) "
        f"{tuple(round(v, 2) for v in load_before)} before, {tuple(round(v, 2) for v in load_after)} after "
        "(this VM's load average reads ~1 while idle; above ~1 + the thread count, other work ran beside it).",
        "",
        "Input size 8, float32, loss = mean of the squared outputs of every step. `d` = the flat state size. "
        "loop = autograd through the Python loop; scan = `Recurrence(cell, algorithm='linear')` (the scan forced; "
        "not run where the cell does not factor and its dense Jacobians exceed --memory-budget = "
        f"{args.memory_budget / 2**20:.0f} MiB). Forward, backward (alone, on a graph recorded once) and whole "
        "step: medians of torch.utils.benchmark, both arms interleaved. Jacobians: their form (factored from the "
        "traced step, or dense from batched cell gradients; 'compiled loop': the traced step generated as C, "
        "whose forward writes the factors with the states); Jacobians ms / scan ms: the scan backward's two main "
        "parts (`last_stats`; compiled loop: ~0, the factors come from the forward / the scan fused with the "
        "parameter VJP's products, plus that VJP; factored in torch: one pass of the traced step over all rows, "
        "which also records the parameter VJP / the scan and that VJP). Peak: resident-set growth during one step. "
        f"auto picks: what `Recurrence(cell, memory_budget={args.memory_budget})` (algorithm 'auto', which "
        "scans where the Jacobians factor and otherwise measures both backwards on the batch's first steps) chose "
        "for the row.",
    ]
    lines = head + lines + ["", f"Total benchmark time: {time.perf_counter() - start:.0f} s.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
