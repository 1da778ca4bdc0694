"""Every layout of the wide recurrent kernels at a few shapes, timed alone on a GPU: which cluster of blocks and
which lanes a unit a batch row should take.

The float32 forward and fused backward kernels of H > 32 run a batch row on one block, or, on sm_90, on a
cluster of Q blocks where one block cannot hold ``W_hh`` (``recurrent_cuda.launch_layout``: the smallest Q
that fits, in it ``wide_layout``'s fewest lanes a unit whose share of ``W_hh`` fits in registers; a small
batch's GRU / LSTM of 2 blocks on 4 blocks of 4 lanes). A larger
cluster or more lanes a unit shortens a lane's dependent chain of multiply-adds a step, and adds cluster
barrier, peer stores and lane reductions: which wins is a measurement. For each shape and direction this
times the default launch and every feasible (Q, split) with Q >= 2 (the kernel alone, CUDA events, median of
interleaved calls), checks each one's outputs against the default's, and writes ``cluster-layouts.md``.

    python benchmarks/cluster_layouts.py --within 150 --results /tmp/r   # on an sm_90 GPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
from device_runner import RESULTS, Runner, header, markdown_table
from lightning_bppsa.kernels import cupy_loader, recurrent_cuda

#: (cell, H, B), most wanted first (the deadline may stop the sweep): the one-block hybrids (GRU H = 128, whose
#: backward now spreads over 4 blocks at B <= 16, measured 1.26x at f9d52e5; LSTM H = 128, unmeasured: would its
#: backward gain alike?), the cluster layers of the H200's step table at 213b46c
SHAPES = (("gru", 128, 16), ("lstm", 128, 16), ("gru", 256, 16), ("lstm", 160, 16), ("gru", 384, 16), ("gru", 192, 16))
STEPS = 1000
CLUSTERS = (2, 4, 8)
SPLITS = (2, 4, 8)
CALLS, ROUNDS = 3, 3
COLUMNS = ("cell", "H", "B", "direction", "layout", "threads", "packs in registers / a lane's", "shared KB", "ms",
           "default / this", "max |diff| vs default")  # fmt: skip


def inputs(cell: str, hidden: int, batch: int, steps: int, device: torch.device) -> dict[str, torch.Tensor | None]:
    """A layer's kernel inputs (float32, ``W_hh`` scaled as torch initialises it) and a gradient of its outputs."""
    gates = recurrent_cuda.CELLS[cell]
    scale = hidden**-0.5
    return {
        "gi": torch.randn(batch, steps, gates * hidden, device=device),
        "w_hh": (torch.rand(gates * hidden, hidden, device=device) * 2 - 1) * scale,
        "b_hh": (torch.rand(gates * hidden, device=device) * 2 - 1) * scale if cell == "gru" else None,
        "h0": torch.randn(batch, hidden, device=device),
        "c0": torch.randn(batch, hidden, device=device) if cell == "lstm" else None,
        "grad_out": torch.randn(batch, steps, hidden, device=device),
    }


def forward(cell: str, x: dict, kernels: ModuleType = recurrent_cuda, **options) -> tuple[torch.Tensor, ...]:
    """The forward kernel of ``cell`` (GRU / LSTM) on ``x``: ``kernels`` the CUDA ones, or their host emulation
    (``recurrent_emulated``, with its ``options``)."""
    if cell == "gru":
        return kernels.gru_forward(x["gi"], x["w_hh"], x["b_hh"], x["h0"], **options)
    return kernels.lstm_forward(x["gi"], x["w_hh"], x["h0"], x["c0"], **options)


def backward(
    cell: str, x: dict, factors: tuple[torch.Tensor, ...], kernels: ModuleType = recurrent_cuda, **options
) -> tuple[torch.Tensor, ...]:
    """The fused backward kernel of ``cell`` on the ``factors`` its forward returned (as :func:`forward`)."""
    if cell == "gru":  # (out, scales, z, dn)
        return kernels.gru_backward(*factors[1:], x["w_hh"], x["grad_out"], **options)
    out, cells, gates = factors
    return kernels.lstm_backward(gates, cells, x["c0"], x["w_hh"], x["grad_out"], None, **options)


@contextlib.contextmanager
def forced(cell: str, hidden: int, direction: str, layout: recurrent_cuda.WideLayout | None) -> Iterator[None]:
    """The kernels launched with ``layout`` for ``direction`` (``None``: the default), recompiled for it."""
    chosen = recurrent_cuda.launch_layout

    def launch_layout(c: str, h: int, d: str, shared_limit: int, cluster_limit: int, spread: bool):
        if layout is not None and (c, h, d) == (cell, hidden, direction):
            return layout
        return chosen(c, h, d, shared_limit, cluster_limit, spread)

    def forget() -> None:
        for cached in (recurrent_cuda.refusal, recurrent_cuda.backward_refusal, recurrent_cuda._kernel_and_block):
            cached.cache_clear()
        prefix = f"bppsa_{cell}_{direction}_f32_h{hidden}"
        for functions in recurrent_cuda._KERNELS_ON.values():  # per (H, Q) names: a split is a module option
            for name in [n for n in functions if n.startswith(prefix)]:
                del functions[name]

    recurrent_cuda.launch_layout = launch_layout
    forget()
    try:
        yield
    finally:
        recurrent_cuda.launch_layout = chosen
        forget()


def candidates(cell: str, hidden: int, direction: str, shared_limit: int) -> list[recurrent_cuda.WideLayout]:
    """Every cluster layout (Q >= 2) of the kernel that fits: each block owns a unit, a block's threads and
    shared memory within the device's."""
    rows = recurrent_cuda.CELLS[cell] if direction == "forward" else 1
    found = []
    for q in CLUSTERS:
        if (q - 1) * math.ceil(hidden / q) >= hidden:
            continue
        for split in SPLITS:
            layout = recurrent_cuda.wide_layout(cell, hidden, direction, q, splits=(split,))
            if layout is not None and recurrent_cuda._wide_bytes(layout, hidden, rows) <= shared_limit:
                found.append(layout)
    return found


def timed(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds of each call, ``ROUNDS`` interleaved rounds of ``CALLS`` (CUDA events), after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            for _ in range(CALLS):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _describe(
    cell: str, hidden: int, batch: int, direction: str, layout: recurrent_cuda.WideLayout | None, shared: int
) -> list:
    """The layout columns of a row; ``None``: the default launch (what ``_kernel_and_block`` gives)."""
    spread, limit = batch <= recurrent_cuda.SPREAD_BATCH, cupy_loader.cluster_limit(torch.cuda.current_device())
    kernel, threads, nbytes, _, q = recurrent_cuda._kernel_and_block(
        cell, torch.float32, hidden, direction, shared, limit, spread
    )
    if layout is None:
        one = recurrent_cuda.wide_layout(cell, hidden, direction)
        layout = recurrent_cuda.launch_layout(cell, hidden, direction, shared, limit, spread) or one
        name = f"default: Q={q} x {layout.split} lanes"
    else:
        name = f"Q={layout.cluster} x {layout.split} lanes"
    return [name, str(threads), f"{layout.register_packs} / {layout.lane_packs}", f"{nbytes / 1024:.0f}"]


def sweep(deadline: float) -> list[list[str]]:
    device = torch.device("cuda", torch.cuda.current_device())
    shared = cupy_loader.shared_limit(device.index)
    rows = []
    for cell, hidden, batch in SHAPES:
        torch.manual_seed(0)
        x = inputs(cell, hidden, batch, STEPS, device)
        reference = forward(cell, x)
        for direction in ("forward", "backward"):
            run = (
                functools.partial(forward, cell, x)
                if direction == "forward"
                else functools.partial(backward, cell, x, reference)
            )
            default_out = run()
            default_ms = timed({"default": run})["default"]
            rows.append([cell, str(hidden), str(batch), direction, *_describe(cell, hidden, batch, direction, None, shared),
                         f"{default_ms * 1e3:.3f}", "1.00x", "0"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
            for layout in candidates(cell, hidden, direction, shared):
                if time.monotonic() > deadline:
                    rows.append([cell, str(hidden), str(batch), direction, f"Q={layout.cluster} x {layout.split} lanes",
                                 "-", "-", "-", "skipped: past the deadline", "-", "-"])  # fmt: skip
                    continue
                with forced(cell, hidden, direction, layout):
                    try:
                        out = run()
                        if out is None:
                            raise RuntimeError("the kernel declined the layout")
                        seconds = timed({"this": run})["this"]
                        described = _describe(cell, hidden, batch, direction, layout, shared)
                    except Exception as error:  # a layout the device refuses: say which, go on
                        rows.append([cell, str(hidden), str(batch), direction, f"Q={layout.cluster} x {layout.split}",
                                     "-", "-", "-", f"failed: {type(error).__name__}: {error}"[:120], "-", "-"])  # fmt: skip
                        continue
                diff = max((a - b).abs().max().item() for a, b in zip(out, default_out, strict=True))
                rows.append([cell, str(hidden), str(batch), direction, *described, f"{seconds * 1e3:.3f}",
                             f"{default_ms / seconds:.2f}x", f"{diff:.1e}"])  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--within", type=float, default=150.0, help="seconds; later layouts are written as skipped")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.monotonic()
    command = f"python benchmarks/cluster_layouts.py --within {args.within:g}"
    runner = Runner("cuda", None, started + args.within, results=args.results, command=command)
    rows = sweep(started + args.within)
    text = header(runner, "The wide recurrent kernels' layouts, each timed alone") + (
        f"float32, T={STEPS}; each kernel alone (the forward; the fused backward on that forward's factors), median "
        f"of {ROUNDS} rounds of {CALLS} calls after a warm-up, CUDA events. Layout: blocks a row (Q) x lanes a "
        "unit; default: what the package launches. max |diff|: the largest difference of any output from the "
        "default launch's (the same sums in another order).\n\n" + markdown_table(COLUMNS, rows)
    )
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "cluster-layouts.md").write_text(text)


if __name__ == "__main__":
    main()
