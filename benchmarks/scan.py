"""Every scan algorithm against the sequential ``"linear"`` reference, dense and factored Jacobians.

    python benchmarks/scan.py [--quick] [--out benchmarks/results/scan-cpu.md]

Grid: n in {10 ... 30000}, B in {1, 16, 64}, d = 20. Each row: median time of every algorithm
(torch.utils.benchmark, warm-up excluded), speedup over "linear", which algorithm "auto" chose, and the
peak memory of each algorithm. Dense rows whose (B, n, d, d) input alone exceeds --max-dense-mib are
skipped (and listed as skipped).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, median_seconds, peak_memory_bytes  # noqa: E402
from lightning_bppsa.kernels import cpu as cpu_kernel  # noqa: E402

from lightning_bppsa import FactoredJacobians, backprop_scan, plan  # noqa: E402

ALGORITHMS = ("linear", "blelloch", "chunked", "auto")


def make_inputs(kind: str, batch: int, n: int, d: int):
    if kind == "dense":
        jac = torch.randn(batch, n, d, d)
        return jac * (0.95 / torch.linalg.matrix_norm(jac, ord=2, keepdim=True)), d
    weight = torch.randn(d, d)
    weight = weight * (0.95 / torch.linalg.matrix_norm(weight, ord=2))
    return FactoredJacobians(weight, torch.rand(batch, n, d)), d


@contextmanager
def torch_loop() -> Iterator[None]:
    """The linear schedule as a loop of torch ops (the compiled kernel switched off): op-bound like a GPU.
    The plans are cached per shape: forgotten on the way in and out, so both sides plan afresh."""
    available = cpu_kernel.available
    cpu_kernel.available = lambda: False
    plan._choose.cache_clear()
    try:
        yield
    finally:
        cpu_kernel.available = available
        plan._choose.cache_clear()


def measure_row(kind: str, batch: int, n: int, d: int, min_run_time: float) -> dict:
    jac, d = make_inputs(kind, batch, n, d)
    grad = torch.randn(batch, d)
    row = {"kind": kind, "B": batch, "n": n}
    for algorithm in ALGORITHMS:
        fn = lambda a=algorithm: backprop_scan(jac, grad, algorithm=a)  # noqa: E731
        row[f"{algorithm}_ms"] = median_seconds(fn, min_run_time) * 1e3
        row[f"{algorithm}_mib"] = peak_memory_bytes(fn) / 2**20
    with torch_loop():
        row["loop_ms"] = median_seconds(lambda: backprop_scan(jac, grad, algorithm="linear"), min_run_time) * 1e3
    width = None if kind == "dense" else d
    chosen = plan.choose("auto", n=n, d=d, batch=batch, width=width, device="cpu", dtype=torch.float32)
    row["auto_choice"] = f"chunked(c={chosen.chunk})" if chosen.algorithm == "chunked" else chosen.algorithm
    return row


def to_markdown(rows: list[dict], skipped: list[str], d: int) -> str:
    head = (
        "| Jacobians | B | n | linear ms | blelloch ms (×) | chunked ms (×) | auto ms (×) | auto chose | "
        "linear as torch loop ms | chunked vs torch loop | peak MiB lin / blel / chunk |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        base = r["linear_ms"]
        cells = [f"{r[a + '_ms']:.2f} ({base / r[a + '_ms']:.1f}×)" for a in ("blelloch", "chunked", "auto")]
        mem = " / ".join(f"{r[a + '_mib']:.1f}" for a in ("linear", "blelloch", "chunked"))
        loop = f"{r['loop_ms']:.2f} | {r['loop_ms'] / r['chunked_ms']:.1f}×"
        lines.append(f"| {r['kind']} | {r['B']} | {r['n']} | {base:.2f} | " + " | ".join(cells)
                     + f" | {r['auto_choice']} | {loop} | {mem} |")
    note = f"\nSkipped (input too large for this machine): {', '.join(skipped)}\n" if skipped else ""
    return (
        f"# Scan algorithms on CPU (d = {d}, float32)\n\nMachine: {machine_description()}\n\n"
        "Times are medians of `torch.utils.benchmark` (warm-up excluded), one process, speedup (×) over "
        "`linear`, which on CPU is one call of the compiled kernel (`kernels/linear_scan.c`); "
        "`auto` ran what `auto chose`, so its ratio to `linear` shows the timing noise. "
        "`linear as torch loop`: the same schedule as a loop of torch ops (kernel switched off): op-bound, "
        "the regime of a GPU or of a machine without a C compiler, where the parallel scans pay. Peak memory: resident-set growth during one call (`benchmarks/_common.peak_memory_bytes`). "
        "`grad` is the last-state gradient `(B, d)`; factored = `diag(s_t) W` with `W` of spectral norm "
        "0.95, dense = random matrices of spectral norm 0.95. "
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC under "
        "`flock /tmp/bppsa-bench.lock`.\n\n"
        + head + "\n".join(lines) + "\n" + note
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small grid (smoke test)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "scan-cpu.md")
    parser.add_argument("--max-dense-mib", type=float, default=600.0)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    args = parser.parse_args()
    d = 20
    lengths = [10, 100, 1000] if args.quick else [10, 30, 100, 300, 1000, 3000, 10000, 30000]
    batches = [1, 16] if args.quick else [1, 16, 64]
    grid = [(k, b, n) for k in ("factored", "dense") for b in batches for n in lengths]
    rows, skipped = [], []
    for kind, batch, n in tqdm(grid, desc="scan benchmark"):
        if kind == "dense" and batch * n * d * d * 4 / 2**20 > args.max_dense_mib:
            skipped.append(f"dense B={batch} n={n}")
            continue
        rows.append(measure_row(kind, batch, n, d, args.min_run_time))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_markdown(rows, skipped, d))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
