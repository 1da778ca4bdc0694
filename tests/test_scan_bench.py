"""benchmarks/scan.py runs (a tiny row), and its torch-loop arm really plans without the compiled kernel."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from lightning_bppsa.kernels import _native

from lightning_bppsa import plan

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scan.py"


def _script():
    spec = importlib.util.spec_from_file_location("scan_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_a_row_and_its_table():
    bench = _script()
    rows = [bench.measure_row(kind, 2, 10, 4, 0.001) for kind in ("factored", "dense")]
    for row in rows:
        assert row["auto_choice"] in ("linear", "blelloch") or row["auto_choice"].startswith("chunked(c=")
        assert all(row[f"{a}_ms"] > 0 for a in (*bench.ALGORITHMS, "loop"))
    table = bench.to_markdown(rows, ["dense B=64 n=30000"], 4)
    assert "| factored | 2 | 10 |" in table and "| dense | 2 | 10 |" in table and "Skipped" in table


def test_the_torch_loop_arm_plans_the_torch_kernel():
    bench = _script()
    choose = lambda: plan.choose("linear", n=10, d=4, batch=2, width=4, device="cpu", dtype=torch.float32)  # noqa: E731
    before = choose().kernel  # cached from here on
    with bench.torch_loop():
        assert choose().kernel == "torch"
    assert choose().kernel == before == ("c" if _native.build_expected() else "torch")
