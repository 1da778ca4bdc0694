"""Analytic CSR transposed-Jacobian generation vs column-by-column autograd (BPPSA Table 1, last column).

    flock /tmp/bppsa-bench.lock python benchmarks/jacobians.py [--columns 256] [--out FILE.md]

Operators: VGG-11's first convolution (3→64, 3x3, padding 1), its ReLU and its 2x2 max-pooling on one
32x32 sample, float32. Columns: analytic generation cold (pattern built: the first step of a shape) and
warm (pattern cached, values only: every later step), both medians from torch.utils.benchmark; and
autograd generating ``Jᵀ`` one column (one ``∂y_j/∂x`` backward) at a time. Autograd over all
``y.numel()`` columns takes minutes, so it is timed over ``--columns`` evenly spaced columns and
**extrapolated** linearly to all of them (every column costs the same backward; the median per
column over groups of 16 columns is used, which resists bursts of contention on the shared CPU).
Peak memory of one warm generation is reported too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, median_seconds, peak_memory_bytes  # noqa: E402

from lightning_bppsa.jacobians import CSRPattern, conv, pooling, transposed_jacobian  # noqa: E402

GROUP = 16  # columns per timed group
PAPER_SPEEDUP = {"Conv2d": 8.3e3, "ReLU": 1.2e6, "MaxPool2d": 1.5e5}


def clear_pattern_caches() -> None:
    conv._full_pattern.cache_clear()
    pooling._window_pattern.cache_clear()
    CSRPattern.identity.cache_clear()


def autograd_seconds_per_column(module: nn.Module, x: torch.Tensor, columns: int) -> float:
    """Median seconds per column of ``Jᵀ`` by autograd (one backward of ``y_j`` w.r.t. ``x`` each)."""
    x = x.clone().requires_grad_()
    y = module(x).reshape(-1)
    picks = torch.linspace(0, y.numel() - 1, columns).long().tolist()
    out = torch.empty(x.numel(), columns)
    seed = torch.zeros_like(y)
    for _ in range(3):  # warm-up: the first backwards pay one-off allocation and thread start-up
        torch.autograd.grad(y, x, seed, retain_graph=True)
    group_seconds = []
    for first in range(0, columns, GROUP):  # the median over groups resists bursts of contention
        start = time.perf_counter()
        for k in range(first, min(first + GROUP, columns)):
            seed[picks[k]] = 1.0
            (column,) = torch.autograd.grad(y, x, seed, retain_graph=True)
            out[:, k] = column.reshape(-1)
            seed[picks[k]] = 0.0
        group_seconds.append((time.perf_counter() - start) / (min(first + GROUP, columns) - first))
    return statistics.median(group_seconds)


def measure(name: str, module: nn.Module, x: torch.Tensor, columns: int) -> dict:
    def cold() -> torch.Tensor:
        clear_pattern_caches()
        return transposed_jacobian(module, x)

    jt = transposed_jacobian(module, x)
    rows, cols = jt.shape
    cold_s = median_seconds(cold, min_run_time=1.0)
    warm_s = median_seconds(lambda: transposed_jacobian(module, x), min_run_time=0.5)
    per_column = autograd_seconds_per_column(module, x, columns)
    autograd_s = per_column * cols
    return {
        "operator": name,
        "shape": f"{rows} x {cols}",
        "nnz": jt._nnz(),
        "sparsity": 1 - jt._nnz() / (rows * cols),
        "cold_ms": cold_s * 1e3,
        "warm_ms": warm_s * 1e3,
        "autograd_s": autograd_s,
        "speedup_cold": autograd_s / cold_s,
        "speedup_warm": autograd_s / warm_s,
        "paper": PAPER_SPEEDUP[name],
        "peak_mib": peak_memory_bytes(lambda: transposed_jacobian(module, x)) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--columns", type=int, default=256, help="autograd columns timed (then extrapolated)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "jacobians-cpu.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    operators = [
        ("Conv2d", nn.Conv2d(3, 64, 3, padding=1), torch.randn(3, 32, 32)),
        ("ReLU", nn.ReLU(), torch.randn(64, 32, 32)),
        ("MaxPool2d", nn.MaxPool2d(2, 2), torch.randn(64, 32, 32)),
    ]
    results = [measure(name, module, x, args.columns) for name, module, x in operators]
    lines = [
        "# Analytic transposed-Jacobian generation vs column-by-column autograd (CPU)",
        "",
        f"Machine: {machine_description()}.",
        "Command: `flock /tmp/bppsa-bench.lock python benchmarks/jacobians.py"
        f" --columns {args.columns}`. The CPU is shared with other engineers' jobs: timings may include"
        " contention.",
        "",
        "VGG-11's first conv (3→64, 3x3, pad 1), ReLU and 2x2 max-pool on one 32x32 sample, float32.",
        f"**Autograd is extrapolated**: {args.columns} evenly spaced columns of Jᵀ (one backward each) are",
        "timed in groups of 16 and the median time per column is scaled to all `y.numel()` columns.",
        "*Cold*: the pattern is built (first step for a shape);",
        "*warm*: the pattern is cached and only values are filled (every later training step). Paper:",
        "Table 1, Threadripper 1950X, averaged over 1000 trials (its generation has no pattern cache, so",
        "compare it with *cold*).",
        "",
        "| operator | Jᵀ shape | nnz | sparsity | cold ms | warm ms | autograd s (extrap.) "
        "| speedup cold | speedup warm | paper | peak MiB (warm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['operator']} | {r['shape']} | {r['nnz']} | {r['sparsity']:.5f} | {r['cold_ms']:.2f} "
            f"| {r['warm_ms']:.3f} | {r['autograd_s']:.1f} | {r['speedup_cold']:.2e} "
            f"| {r['speedup_warm']:.2e} | {r['paper']:.1e} | {r['peak_mib']:.1f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
