"""The calibrated CUDA model against the committed H100 measurements (no GPU needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_bppsa import cuda_step_model as model

_FIT = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_cuda_model.py"


def _load_data():
    spec = importlib.util.spec_from_file_location("fit_cuda_model", _FIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load()


def _pick(d: int, batch: int, steps: int) -> str:
    common = dict(gates=1, hidden=d, d=d, m=d, batch=batch, n=steps)
    return "scan" if model.step_seconds("scan", **common) < model.step_seconds("torch", **common) else "torch"


def test_the_model_picks_a_path_within_10_percent_of_the_faster_measured_on_every_row():
    _, steps, plans = _load_data()
    rows = sorted({key[1:] for key in steps})
    assert len(rows) == 72
    misses = []
    for d, batch, length in rows:
        cudnn = steps[("step_cudnn", d, batch, length)]
        # BPPSA's step measured the scan only where that commit's plan ran it (else it ran cuDNN too)
        scan = steps[("step_bppsa", d, batch, length)] if plans[(d, batch, length)][0] == "scan" else None
        best = min(cudnn, scan if scan is not None else cudnn)
        picked = _pick(d, batch, length)
        got = cudnn if picked == "torch" else scan
        if got is None or got > 1.1 * best:  # a scan never measured at this shape counts as a miss
            misses.append((d, batch, length, picked, got, best))
    assert not misses


def test_the_model_keeps_the_scan_where_it_measured_several_times_faster():
    # T = 10000, d = 8 / 20: the scan measured 1.6-2.3x cuDNN's step
    assert [_pick(d, 16, 10000) for d in (8, 20)] == ["scan", "scan"]
    # d = 128 / 256 at B = 16, T = 1000: the scan measured 19x / 11x slower
    assert [_pick(d, 16, 1000) for d in (128, 256)] == ["torch", "torch"]


def test_a_chunked_launch_that_does_not_fit_is_predicted_and_planned_as_the_sweep():
    assert not model.runs_chunked(n=1000, d=256, m=256, chunk=16)
    assert model.fastest_kernel("chunked", n=1000, d=256, m=256, batch=16) == ("linear", 1)
    sweep = model.kernel_seconds("linear", n=1000, d=256, m=256, batch=16, chunk=1)
    assert model.kernel_seconds("chunked", n=1000, d=256, m=256, batch=16, chunk=16) == sweep


def test_bad_path_is_refused_with_its_name():
    with pytest.raises(ValueError, match="path must be 'torch' or 'scan'; got 'cudnn'"):
        model.step_seconds("cudnn", gates=1, hidden=8, d=8, m=8, batch=1, n=10)
