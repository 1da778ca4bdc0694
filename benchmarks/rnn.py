"""Recurrent layers on CPU: BPPSA (lightning_bppsa.nn) vs torch autograd, BPPSA Tables 4-6 for this machine.

The measurement lives in :mod:`lightning_bppsa.bench.rnn`; this script writes it up. Per row, with the
same weights in one process: forward only, forward + backward with autograd on the torch module, forward + backward with the BPPSA module (medians of ``torch.utils.benchmark``);
backward = ``loss.backward()`` alone, timed on a graph recorded once (the BPPSA forward, timed
separately, includes the Jacobian preparation). Loss on the last step. Peak memory = resident-set growth
during one forward + backward (``lightning_bppsa.bench.measure.peak_memory_bytes``).

    flock /tmp/bppsa-bench.lock python benchmarks/rnn.py            # writes benchmarks/results/rnn-cpu.md
    flock /tmp/bppsa-bench.lock python benchmarks/rnn.py --quick    # headline rows only
    flock /tmp/bppsa-bench.lock python benchmarks/rnn.py --wide     # results/rnn-cpu-wide.md: "auto" at H 128/256
    lightning-bppsa bench rnn|gru [--quick]                         # the grid of lightning_bppsa.bench.rnn, with plots
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

from lightning_bppsa.bench.measure import machine_description
from lightning_bppsa.bench.rnn import BENCH_INPUTS, GRID_BATCHES, GRID_LENGTHS, HIDDEN, measure

RESULTS = Path(__file__).parent / "results" / "rnn-cpu.md"
WIDE_RESULTS = RESULTS.with_name("rnn-cpu-wide.md")
#: issue 28's CPU shapes, where "auto" once lost to torch's oneDNN LSTM (H=256: B=1 0.61x, B=64 0.87x): (T, input),
#: then every cell at H in WIDE_HIDDEN and B in WIDE_BATCHES
WIDE_LENGTH, WIDE_INPUTS, WIDE_HIDDEN, WIDE_BATCHES = 300, 16, (128, 256), (1, 64)

HEADER = (
    "| cell | B | T | input | algorithm | path | forward ms autograd | forward ms BPPSA "
    "| autograd fwd+bwd ms | BPPSA fwd+bwd ms "
    "| backward autograd ms | backward BPPSA ms | backward speedup | overall speedup "
    "| peak MiB autograd | peak MiB BPPSA |\n|" + " --- |" * 16
)


def row(cell: str, batch: int, length: int, inputs: int, algorithm: str, r: dict) -> str:
    ms, mib = 1e3, 2.0**-20
    return (
        f"| {cell} | {batch} | {length} | {inputs} | {algorithm} | {_path(r)} "
        f"| {r['forward'] * ms:.2f} | {r['forward_bppsa'] * ms:.2f} "
        f"| {r['autograd'] * ms:.2f} | {r['bppsa'] * ms:.2f} | {r['bwd_autograd'] * ms:.2f} "
        f"| {r['bwd_bppsa'] * ms:.2f} | {r['bwd_autograd'] / r['bwd_bppsa']:.2f}x "
        f"| {r['autograd'] / r['bppsa']:.2f}x | {r['mem_autograd'] * mib:.1f} | {r['mem_bppsa'] * mib:.1f} |"
    )


def _path(r: dict) -> str:
    """What the BPPSA module ran, and why where "auto" decided (torch's layer: ``autograd (measured: ...)``)."""
    if r["path"] != "scan":
        return f"{r['path']} ({r['decision']})" if r["decision"] else r["path"]
    return f"scan {r['scan_algorithm']}"


def wide(min_run_time: float) -> list[str]:
    """The wide-layer section: "auto" against torch's layer at issue 28's CPU shapes, one row each."""
    lines = [
        f"## Wide layers, algorithm 'auto' (issue 28): T={WIDE_LENGTH}, input {WIDE_INPUTS}, H in {WIDE_HIDDEN}",
        "",
        "Overall speedup = torch's step / BPPSA's step (>= 1: BPPSA's module no slower); 'path' is what 'auto' chose "
        "and why (measured on the first call where the model is unsure).",
        "",
        "| H " + HEADER.replace("\n|", "\n| --- |", 1),
    ]
    for hidden in WIDE_HIDDEN:
        for cell in ("RNN", "GRU", "LSTM"):
            for batch in WIDE_BATCHES:
                r = measure(cell, batch, WIDE_LENGTH, WIDE_INPUTS, "auto", min_run_time, hidden=hidden)
                lines.append(f"| {hidden} " + row(cell, batch, WIDE_LENGTH, WIDE_INPUTS, "auto", r))
                print(lines[-1], flush=True)
    return lines


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline rows only")
    parser.add_argument("--coarse", action="store_true", help="grid over B in {1, 4, 16, 64, 256} only")
    parser.add_argument(
        "--wide", action="store_true", help=f"only 'auto' at H in {WIDE_HIDDEN} (default file {WIDE_RESULTS.name})"
    )
    parser.add_argument("--min-run-time", type=float, default=0.3)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"markdown file to write (default {RESULTS}, with --wide {WIDE_RESULTS})"
    )
    args = parser.parse_args()
    out = args.out or (WIDE_RESULTS if args.wide else RESULTS)
    start = time.perf_counter()
    title = "wide layers, 'auto' vs torch's layer" if args.wide else "BPPSA Tables 4-6 for this machine"
    lines = [
        f"# Recurrent layers on CPU: BPPSA vs autograd ({title})",
        "",
        f"Machine: {machine_description()}. "
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with `benchmarks/rnn.py` "
        "under `flock /tmp/bppsa-bench.lock`; the machine is shared, other processes "
        "(other engineers' tests) may have been running.",
        "",
        f"Hidden {'as given' if args.wide else HIDDEN}, 1 layer, float32, loss on the last step. backward = `loss.backward()` alone, timed on a graph "
        "recorded once (`retain_graph=True`); forward, fwd+bwd (a whole step) and the overall speedup from "
        "separate timings (the BPPSA forward includes the Jacobian preparation); medians of "
        "torch.utils.benchmark. Peak = resident-set growth during one forward + backward.",
        "",
    ]
    if args.wide:
        lines += wide(args.min_run_time)
    else:
        lines += ["## Headline rows (targets)", "", HEADER]
    for cell, batch, length, inputs, algorithm in () if args.wide else HEADLINE:
        r = measure(cell, batch, length, inputs, algorithm, args.min_run_time)
        lines.append(row(cell, batch, length, inputs, algorithm, r))
        print(lines[-1], flush=True)
    if not args.quick and not args.wide:
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
