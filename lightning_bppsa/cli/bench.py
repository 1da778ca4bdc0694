"""``lightning-bppsa bench rnn|gru|vgg [--quick] [--out DIR]``: a benchmark grid -> CSV, markdown, plots.

The grids ship in the package (:mod:`lightning_bppsa.bench`), so the command works from any folder and
from an installed wheel. The plots are the latency / speedup curves of paper Fig. 8.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_bppsa.bench import rnn, vgg
from lightning_bppsa.bench.measure import load_average, machine_description, set_threads
from lightning_bppsa.cli.config import CLIError
from lightning_bppsa.cli.report import format_bench_table, plot_bench_grid, speedup_rows

__all__ = ["BENCHMARKS", "DEFAULT_OUT", "bench", "main"]

DEFAULT_OUT = "runs/bench"

BENCHMARKS: dict[str, tuple[Callable[..., Iterable[dict[str, Any]]], dict[str, Any]]] = {
    "rnn": (rnn.bench_rows, {"cell": "rnn"}),
    "gru": (rnn.bench_rows, {"cell": "gru"}),
    "vgg": (vgg.bench_rows, {}),
}
"""``bench`` name -> (its ``bench_rows`` function, the keyword arguments it is called with).

The contract a ``bench_rows`` follows:

- ``bench_rows(*, quick: bool = False, **options) -> Iterable[dict]``; ``quick=True`` runs a small grid
  in seconds;
- each row is one measurement: ``method`` (``"autograd"`` or ``"bppsa"``), ``backward_s`` (median
  seconds of one backward), and its grid point: ``T`` (sequence length / chain length) and ``B``
  (batch size); optional ``forward_s``, ``peak_bytes`` and any other column, all copied to the CSV;
- a BPPSA row says what ran in ``path`` (``"scan"``, or ``"autograd"`` where BPPSA fell back: no speedup
  is then reported) and may give ``speedup_min`` / ``speedup_max``, the range over rounds that timed the
  two methods in turn.
"""


def bench(name: str, *, quick: bool = False, out: str = DEFAULT_OUT, threads: int | None = None) -> Path:
    """Run benchmark ``name`` (a key of :data:`BENCHMARKS`); write ``bench-<name>.{csv,md}`` and plots.

    Prints each grid point as it is measured and the files it wrote. The table names the machine, torch's
    threads (``threads``, default one per physical core: :func:`~lightning_bppsa.bench.measure.set_threads`)
    and the load average before and after. Plots (paper Fig. 8): ``bench-<name>-vs-T.png`` (one line per
    B) and ``bench-<name>-vs-invB.png`` (one line per T), each with backward latency and speedup; written
    when the grid varies that axis. Returns the output folder.
    """
    if name not in BENCHMARKS:
        raise CLIError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    if threads is not None and threads < 1:
        raise CLIError(f"--threads must be >= 1; got {threads}")
    threads = set_threads(threads)
    bench_rows, options = BENCHMARKS[name]
    load_start = load_average()
    print(f"bench {name}{' --quick' if quick else ''}: {threads} torch thread(s)", flush=True)
    rows: list[dict[str, Any]] = []
    for row in bench_rows(quick=quick, **options):
        rows.append(dict(row))
        _print_progress(rows)
    if not rows:
        raise CLIError(f"benchmark {name!r} measured no rows")
    conditions = (
        f"{machine_description()}; load average before: "
        + " ".join(f"{v:.2f}" for v in load_start)
        + "; after: "
        + " ".join(f"{v:.2f}" for v in load_average())
    )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / f"bench-{name}.csv", folder / f"bench-{name}.md"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(written[0], "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    points = speedup_rows(rows)
    table = format_bench_table(name, points, conditions)
    written[1].write_text(table + "\n")
    print(table)
    for x, line, suffix in (("T", "B", "vs-T"), ("1/B", "T", "vs-invB")):
        key = "B" if x == "1/B" else x
        if len({p[key] for p in points if p[key] is not None}) > 1 and all(p[key] for p in points):
            written.append(
                plot_bench_grid(
                    points, x, line, folder / f"bench-{name}-{suffix}.png", f"bench {name}: backward vs {x}"
                )
            )
    print("written: " + ", ".join(map(str, written)), flush=True)
    return folder


def _print_progress(rows: Sequence[dict[str, Any]]) -> None:
    """One line per grid point, once both of its rows (autograd, bppsa) are in."""
    last = rows[-1]
    pair = [r for r in rows if (r.get("T"), r.get("B")) == (last.get("T"), last.get("B"))]
    if len(pair) != 2:
        return
    times = ", ".join(f"{r['method']} {1e3 * float(r['backward_s']):.3f} ms" for r in pair)
    path = next((r.get("path") for r in pair if r["method"] == "bppsa"), None)
    fell_back = " (BPPSA fell back to autograd)" if path == "autograd" else ""
    print(
        f"  [{len(rows) // 2}] T={last.get('T')} B={last.get('B')}: backward {times}{fell_back}", flush=True
    )


def main(argv: Sequence[str]) -> None:
    """``lightning-bppsa bench ...``: parse ``argv`` and run :func:`bench`."""
    parser = argparse.ArgumentParser(
        prog="lightning-bppsa bench",
        description="Run a benchmark grid; write its CSV, markdown table and plots.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="a small grid that runs in seconds")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"where the CSV, markdown and PNGs go ({DEFAULT_OUT})"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: one per physical core this process may use)",
    )
    args = parser.parse_args(argv)
    bench(args.name, quick=args.quick, out=args.out, threads=args.threads)
