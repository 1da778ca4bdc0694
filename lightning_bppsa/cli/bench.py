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
  (batch size); optional ``forward_s``, ``peak_bytes`` and any other column, all copied to the CSV.
"""


def bench(name: str, *, quick: bool = False, out: str = DEFAULT_OUT) -> Path:
    """Run benchmark ``name`` (a key of :data:`BENCHMARKS`); write ``bench-<name>.{csv,md}`` and plots.

    Plots (paper Fig. 8): ``bench-<name>-vs-T.png`` (one line per B) and ``bench-<name>-vs-invB.png``
    (one line per T), each with backward latency and speedup; written when the grid varies that axis.
    Returns the output folder.
    """
    if name not in BENCHMARKS:
        raise CLIError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    bench_rows, options = BENCHMARKS[name]
    rows = [dict(row) for row in bench_rows(quick=quick, **options)]
    if not rows:
        raise CLIError(f"benchmark {name!r} measured no rows")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(folder / f"bench-{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    points = speedup_rows(rows)
    table = format_bench_table(name, points)
    (folder / f"bench-{name}.md").write_text(table + "\n")
    print(table)
    for x, line, suffix in (("T", "B", "vs-T"), ("1/B", "T", "vs-invB")):
        key = "B" if x == "1/B" else x
        if len({p[key] for p in points if p[key] is not None}) > 1 and all(p[key] for p in points):
            plot_bench_grid(
                points, x, line, folder / f"bench-{name}-{suffix}.png", f"bench {name}: backward vs {x}"
            )
    return folder


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
    args = parser.parse_args(argv)
    bench(args.name, quick=args.quick, out=args.out)
