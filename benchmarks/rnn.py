"""Recurrent layers on CPU: BPPSA (lightning_bppsa.nn) vs torch autograd, BPPSA Tables 4-6 for this machine.

Per row, with the same weights in one process: forward only, forward + backward with autograd on the
torch module, forward + backward with the BPPSA module (medians of ``torch.utils.benchmark``);
backward = ``loss.backward()`` alone, timed on a graph recorded once (the BPPSA forward, timed
separately, includes the Jacobian preparation). Loss on the last step. Peak memory = resident-set growth
during one forward + backward (``benchmarks/_common.peak_memory_bytes``).

    flock /tmp/bppsa-bench.lock python benchmarks/rnn.py            # writes benchmarks/results/rnn-cpu.md
    flock /tmp/bppsa-bench.lock python benchmarks/rnn.py --quick    # headline rows only
    lightning-bppsa bench rnn|gru [--quick]                         # the grid via bench_rows, with plots
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import machine_description, median_seconds, peak_memory_bytes
from torch import nn

from lightning_bppsa import nn as bnn

HIDDEN = 20
RESULTS = Path(__file__).parent / "results" / "rnn-cpu.md"


def _pair(cell: str, inputs: int, algorithm: str) -> tuple[nn.Module, nn.Module]:
    ours = getattr(bnn, cell)(inputs, HIDDEN, batch_first=True, algorithm=algorithm)
    ref = getattr(nn, cell)(inputs, HIDDEN, batch_first=True)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _step(module: nn.Module, x: torch.Tensor):
    def run() -> None:
        module.zero_grad(set_to_none=True)
        output, _ = module(x)
        output[:, -1].pow(2).sum().backward()

    return run


def _backward(module: nn.Module, x: torch.Tensor):
    """``loss.backward()`` alone (the issue's definition: from its start to all ``.grad`` filled) on a
    graph recorded once; ``retain_graph`` lets the timer repeat it."""
    output, _ = module(x)
    loss = output[:, -1].pow(2).sum()
    return lambda: loss.backward(retain_graph=True)


def measure(cell: str, batch: int, length: int, inputs: int, algorithm: str, min_run_time: float) -> dict:
    """One row: times in seconds, memory in bytes, and the path the BPPSA module took."""
    torch.manual_seed(0)
    ours, ref = _pair(cell, inputs, algorithm)
    x = torch.randn(batch, length, inputs)
    x = (x > 0.5).float() if inputs == 1 else x  # the bitstream task of Sec. 4.1 for the RNN rows
    memory = peak_memory_bytes(_step(ref, x)), peak_memory_bytes(_step(ours, x))
    forward = median_seconds(lambda: ref(x), min_run_time)
    forward_bppsa = median_seconds(lambda: ours(x), min_run_time)  # includes the Jacobian preparation
    auto = median_seconds(_step(ref, x), min_run_time)
    scan = median_seconds(_step(ours, x), min_run_time)
    bwd_autograd = median_seconds(_backward(ref, x), min_run_time)
    bwd_bppsa = median_seconds(_backward(ours, x), min_run_time)
    return {
        "forward": forward,
        "forward_bppsa": forward_bppsa,
        "autograd": auto,
        "bppsa": scan,
        "bwd_autograd": bwd_autograd,
        "bwd_bppsa": bwd_bppsa,
        "mem_autograd": memory[0],
        "mem_bppsa": memory[1],
        "path": ours.last_stats["path"],
        "scan_algorithm": ours.last_stats.get("scan_algorithm", ""),  # what the scan resolved algorithm to
    }


HEADER = (
    "| cell | B | T | input | algorithm | path | forward ms autograd | forward ms BPPSA "
    "| autograd fwd+bwd ms | BPPSA fwd+bwd ms "
    "| backward autograd ms | backward BPPSA ms | backward speedup | overall speedup "
    "| peak MiB autograd | peak MiB BPPSA |\n|" + " --- |" * 16
)


def row(cell: str, batch: int, length: int, inputs: int, algorithm: str, r: dict) -> str:
    ms, mib = 1e3, 2.0**-20
    return (
        f"| {cell} | {batch} | {length} | {inputs} | {algorithm} | {r['path']} {r['scan_algorithm']} "
        f"| {r['forward'] * ms:.2f} | {r['forward_bppsa'] * ms:.2f} "
        f"| {r['autograd'] * ms:.2f} | {r['bppsa'] * ms:.2f} | {r['bwd_autograd'] * ms:.2f} "
        f"| {r['bwd_bppsa'] * ms:.2f} | {r['bwd_autograd'] / r['bwd_bppsa']:.2f}x "
        f"| {r['autograd'] / r['bppsa']:.2f}x | {r['mem_autograd'] * mib:.1f} | {r['mem_bppsa'] * mib:.1f} |"
    )


HEADLINE = [  # (cell, B, T, input, algorithm): the targets, forced scan and "auto"
    ("RNN", 16, 1000, 1, "chunked"),
    ("RNN", 1, 1000, 1, "chunked"),
    ("RNN", 16, 1000, 1, "auto"),
    ("RNN", 1, 1000, 1, "auto"),
    ("RNN", 16, 10000, 1, "chunked"),
    ("RNN", 16, 10000, 1, "auto"),
    ("GRU", 16, 259, 38, "chunked"),  # Table 6 S / M / L
    ("GRU", 16, 517, 24, "chunked"),
    ("GRU", 16, 1034, 12, "chunked"),
    ("GRU", 16, 1034, 12, "auto"),
    ("LSTM", 16, 1034, 12, "chunked"),
    ("LSTM", 16, 1034, 12, "auto"),
]


#: ``bench_rows`` grids (T, B): the full one is Tables 4-5's coarse grid; the quick one runs in seconds
GRID_LENGTHS, GRID_BATCHES = (10, 30, 100, 300, 1000, 3000, 10000), (1, 4, 16, 64, 256)
QUICK_LENGTHS, QUICK_BATCHES = (8, 24), (1, 4)
#: input width per cell in ``bench_rows``: the bitstream (Sec. 4.1) for RNN, Table 6's L config for GRU/LSTM
BENCH_INPUTS = {"RNN": 1, "GRU": 12, "LSTM": 12}


def bench_rows(
    *,
    quick: bool = False,
    cell: str = "rnn",
    lengths: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    inputs: int | None = None,
    algorithm: str = "auto",
    min_run_time: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows for ``lightning-bppsa bench rnn|gru`` (contract: ``lightning_bppsa.cli.BENCHMARKS``).

    One :func:`measure` per grid point ``(T, B)`` and two rows from it, ``method`` ``"autograd"`` and
    ``"bppsa"``, each with ``backward_s``, ``forward_s``, ``step_s`` (forward + backward) in seconds,
    ``peak_bytes``, and ``cell``, ``input``, ``algorithm``, ``path`` (what the BPPSA module ran).

    Args:
        quick: the small grid :data:`QUICK_LENGTHS` x :data:`QUICK_BATCHES` with short timings.
        cell: ``"rnn"``, ``"gru"`` or ``"lstm"``.
        lengths, batches: the grid (default :data:`GRID_LENGTHS` x :data:`GRID_BATCHES`, or the quick one).
        inputs: input features (default :data:`BENCH_INPUTS` of the cell).
        algorithm: the BPPSA module's ``algorithm``.
        min_run_time: seconds per timing (default 0.1, quick 0.01).
    """
    name = cell.upper()
    lengths = lengths or (QUICK_LENGTHS if quick else GRID_LENGTHS)
    batches = batches or (QUICK_BATCHES if quick else GRID_BATCHES)
    inputs = inputs or BENCH_INPUTS[name]
    min_run_time = min_run_time if min_run_time is not None else (0.01 if quick else 0.1)
    for length in lengths:
        for batch in batches:
            r = measure(name, batch, length, inputs, algorithm, min_run_time)
            point = {"T": length, "B": batch, "cell": name, "input": inputs, "algorithm": algorithm}
            yield {
                "method": "autograd", **point, "path": "autograd", "backward_s": r["bwd_autograd"],
                "forward_s": r["forward"], "step_s": r["autograd"], "peak_bytes": r["mem_autograd"],
            }  # fmt: skip
            yield {
                "method": "bppsa", **point, "path": r["path"], "backward_s": r["bwd_bppsa"],
                "forward_s": r["forward_bppsa"], "step_s": r["bppsa"], "peak_bytes": r["mem_bppsa"],
            }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline rows only")
    parser.add_argument("--coarse", action="store_true", help="grid over B in {1, 4, 16, 64, 256} only")
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown file to write (default {RESULTS})")
    args = parser.parse_args()
    start = time.perf_counter()
    lines = [
        "# Recurrent layers on CPU: BPPSA vs autograd (BPPSA Tables 4-6 for this machine)",
        "",
        f"Machine: {machine_description()}. "
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `benchmarks/rnn.py` "
        "under `flock /tmp/bppsa-bench.lock`; the machine is shared, other processes "
        "(other engineers' tests) may have been running.",
        "",
        f"Hidden {HIDDEN}, 1 layer, float32, loss on the last step. backward = `loss.backward()` alone, timed on a graph "
        "recorded once (`retain_graph=True`); forward, fwd+bwd (a whole step) and the overall speedup from "
        "separate timings (the BPPSA forward includes the Jacobian preparation); medians of "
        "torch.utils.benchmark. Peak = resident-set growth during one forward + backward.",
        "",
        "## Headline rows (targets)",
        "",
        HEADER,
    ]
    for cell, batch, length, inputs, algorithm in HEADLINE:
        r = measure(cell, batch, length, inputs, algorithm, args.min_run_time)
        lines.append(row(cell, batch, length, inputs, algorithm, r))
        print(lines[-1], flush=True)
    if not args.quick:
        # the RNN over the whole grid of the issue; GRU and LSTM over its coarse B grid (time)
        full_batches = GRID_BATCHES if args.coarse else (1, 2, 4, 8, 16, 32, 64, 128, 256)
        for cell, batches in (("RNN", full_batches), ("GRU", GRID_BATCHES), ("LSTM", GRID_BATCHES)):
            lines += ["", f"## {cell} grid, algorithm 'auto' (Tables 4-5)", "", HEADER]
            for length in GRID_LENGTHS:
                for batch in batches:
                    r = measure(cell, batch, length, BENCH_INPUTS[cell], "auto", min_run_time=0.1)
                    lines.append(row(cell, batch, length, BENCH_INPUTS[cell], "auto", r))
                    print(lines[-1], flush=True)
    lines += ["", f"Total benchmark time: {time.perf_counter() - start:.0f} s.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
