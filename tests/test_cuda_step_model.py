"""The calibrated CUDA model (and the instruction-level model's warp sweep) against the committed H100
measurements (no GPU needed).

Data: ``benchmarks/results/calib-h100-2026-11-26-eeeac3a.csv`` (package commit eeeac3a), read by
``benchmarks/fit_cuda_model.py``, which also fitted the constants under test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from lightning_bppsa import cuda_cost_model
from lightning_bppsa import cuda_step_model as model

_FIT = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_cuda_model.py"


def _fit_module():
    spec = importlib.util.spec_from_file_location("fit_cuda_model", _FIT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fit = _fit_module()
DATA = fit.load()

#: (d, B, T) -> why the model's pick there costs more than 10% over the faster measured path. Only rows whose
#: miss is explained by the data itself, with a bound on how far the pick may be off.
KNOWN_MISSES = {
    # The model picks the scan (predicted 1.42 ms vs cuDNN 1.52); the grid measured cuDNN 1.379 ms and the scan
    # 1.563 (chunked) / 1.754 (linear), 1.13x. Repeated measurements of the same shape in the same run spread
    # wider than that margin: the layer plan's own paired measurement (the step_bppsa row's plan note) read
    # scan 1.38 ms vs torch 1.25 ms, and the d = 20 scan steps at B = 16 / 64, T = 1000 measured 0.3-0.5 ms
    # above those at d = 8 and d = 32 while their kernels alone did not (0.20-0.22 ms vs 0.22-0.24 at d = 32)
    # and the T = 10000 steps did not either: no term proportional to d, B or T can carry that.
    (20, 64, 1000): 1.15,
}


def test_the_model_picks_a_path_within_10_percent_of_the_faster_measured_on_every_row():
    """Issue 28/29: on every shape where cuDNN's step and a scan step were measured, the path the model picks
    costs within 10% of the faster measured path (cuDNN vs the best measured scan), but for the known misses."""
    rows = fit.decisions(DATA)
    assert len(rows) == 59  # 72 shapes less the 13 where no scan step was measured (over 50 ms, or refused)
    misses = {(x.d, x.batch, x.n): x.cost for x in rows if x.cost > fit.TOLERANCE}
    assert misses.keys() == KNOWN_MISSES.keys(), misses
    for key, cost in misses.items():
        assert cost <= KNOWN_MISSES[key], (key, cost)
    # the calls that matter most: T = 10000 with d <= 32 (the scan measured 1.6-4x faster) and d = 64, B = 1
    # (1.26x); T = 100 (cuDNN faster at every shape)
    picks = {(x.d, x.batch, x.n): x.picked for x in rows}
    assert all(picks[(d, b, 10000)] == "scan" for d in (8, 20, 32) for b in (1, 16, 64, 256))
    assert picks[(64, 1, 10000)] == "scan"
    assert all(pick == "torch" for (_, _, n), pick in picks.items() if n == 100)


def test_the_h100_fitted_model_picks_within_10_percent_on_the_h200_grid_too():
    """The same grid measured on an H200 (957acb0; not fitted on): at each of its 59 shapes with cuDNN's step and
    a scan step measured, the model's pick costs within 10% of the faster measured path."""
    rows = fit.decisions(fit.load(fit.RESULTS / "cuda-calib-h200.csv"))
    assert len(rows) == 59
    assert [(x.d, x.batch, x.n, round(x.cost, 2)) for x in rows if x.cost > fit.TOLERANCE] == []
    assert {(x.d, x.batch) for x in rows if x.n == 10000 and x.picked == "scan"} >= {
        (d, b) for d in (8, 20, 32) for b in (1, 16, 64, 256)
    }


def test_the_model_keeps_the_scan_where_it_measured_several_times_faster():
    # T = 10000, d = 8 / 20, B = 16: the scan measured 3.0-3.4x cuDNN's step
    common = dict(batch=16, n=10000)
    assert all(fit.step("scan", d, **common) < fit.step("torch", d, **common) for d in (8, 20))
    # d = 128 / 256 at B = 16, T = 1000: the scan measured 17x slower (d = 256 not measured: ~50 ms alone)
    assert all(fit.step("scan", d, 16, 1000) > 5 * fit.step("torch", d, 16, 1000) for d in (128, 256))


def test_every_measured_launch_is_predicted_within_1_5x_but_one_anomalous_shape():
    """The kernel model's form: every measured launch within 1.5x, but those of d=20 B=1 T=100, where the
    sweep of 100 steps measured longer than the same sweep of 1000 steps (0.265 vs 0.195 ms: not the kernel's
    cost, the measurement's)."""
    alone = {(x.algorithm, x.d, x.batch, x.n): x.seconds for x in DATA.launches if x.algorithm == "linear"}
    assert alone[("linear", 20, 1, 100)] > alone[("linear", 20, 1, 1000)]
    errors = fit.kernel_residuals(DATA, model.KERNELS)
    off = {(x.d, x.batch, x.n) for x, r in zip(DATA.launches, errors, strict=True) if abs(r) > math.log(1.5)}
    assert off == {(20, 1, 100)}
    assert sorted(abs(r) for r in errors)[len(errors) // 2] < math.log(1.1)  # median error under 10%


def test_the_kernel_picked_among_the_measured_launches_is_within_10_percent_of_the_fastest():
    """What :func:`fastest_kernel` decides, on the launches the grid measured at each shape (linear and chunk 16 /
    64 / 256): the one the model predicts fastest measured within 10% of the fastest, but at d=20 B=1 T=100 (the
    anomalous shape above)."""
    shapes = defaultdict(list)
    for x in DATA.launches:
        shapes[(x.d, x.batch, x.n)].append(x)
    off = {}
    for key, launches in shapes.items():
        picked = min(launches, key=lambda x: fit.predicted_kernel(x.algorithm, *key, x.chunk))
        cost = picked.seconds / min(x.seconds for x in launches)
        if cost > fit.TOLERANCE:
            off[key] = cost
    assert off.keys() == {(20, 1, 100)}, off


def test_every_scan_step_is_predicted_within_1_5x_with_its_kernel_as_measured():
    """The scan step's form (host, forward, kernel, elementwise) on all 121 measured scan steps that ran the
    CUDA forward kernel, forced linear / chunked included: the d = 32 chunked steps measured ~2x their kernel
    alone (a layer's per-step gradient adds a row to the aggregates: two passes of 256 threads instead of one)."""
    errors = fit.scan_residuals(DATA, model.STEPS, model.KERNELS)
    assert len(errors) == 121
    assert max(abs(r) for r in errors) < math.log(1.5)


def test_the_per_step_gradient_row_doubles_the_chunked_aggregates_at_d_32_only():
    common = dict(n=10000, m=32, batch=256, chunk=64)
    ratio = model.kernel_seconds("chunked", d=32, **common) / model.kernel_seconds(
        "chunked", d=32, affine=False, **common
    )
    assert 1.8 < ratio < 2.1
    common["m"] = 20
    ratio = model.kernel_seconds("chunked", d=20, **common) / model.kernel_seconds(
        "chunked", d=20, affine=False, **common
    )
    assert ratio < 1.1


def test_the_instruction_models_warp_sweep_band_middle_is_within_25_percent_of_every_measured_sweep():
    """:func:`lightning_bppsa.cuda_cost_model.cuda_kernel_seconds` (SASS counts, one measured issue rate) on
    the sweeps alone with d <= 32 and T >= 1000 (at T = 100 the launch dominates)."""
    sweeps = [x for x in DATA.launches if x.algorithm == "linear" and x.d <= 32 and x.n >= 1000]
    assert len(sweeps) == 24  # d in {8, 20, 32} x B in {1, 16, 64, 256} x T in {1000, 10000}
    for x in sweeps:
        predicted = cuda_cost_model.cuda_kernel_seconds(
            "linear", n=x.n, d=x.d, batch=x.batch, width=x.d, chunk_size=x.n
        )
        assert 0.8 < predicted / x.seconds < 1.25, (x, predicted)


def test_a_chunked_launch_that_does_not_fit_is_predicted_and_planned_as_the_sweep():
    assert not model.runs_chunked(n=1000, d=256, m=256, chunk=16)
    assert model.fastest_kernel("chunked", n=1000, d=256, m=256, batch=16) == ("linear", 1)
    sweep = model.kernel_seconds("linear", n=1000, d=256, m=256, batch=16, chunk=1)
    assert model.kernel_seconds("chunked", n=1000, d=256, m=256, batch=16, chunk=16) == sweep


def test_the_forward_kernel_family_follows_the_kernels_compiled_per_hidden_size():
    # float32 H <= 32: one warp, W_hh in registers: the same a step for every H; else the generic kernel
    per_h = [model.forward_seconds(gates=1, hidden=h, n=1000) for h in (8, 32)]
    assert per_h[0] == per_h[1] == 1000 * model.STEPS.forward_step
    generic = [
        model.forward_seconds(gates=1, hidden=32, n=1000, element_bytes=8),
        model.forward_seconds(gates=1, hidden=33, n=1000),
        model.forward_seconds(gates=4, hidden=64, n=1000),
    ]
    s = model.STEPS
    assert generic == [1000 * (s.generic_step + s.generic_unit * units) for units in (32, 33, 256)]


def test_bad_path_is_refused_with_its_name():
    with pytest.raises(ValueError, match="path must be 'torch' or 'scan'; got 'cudnn'"):
        model.step_seconds("cudnn", gates=1, hidden=8, d=8, m=8, batch=1, n=10)


def test_the_fused_backward_is_priced_as_a_launch_and_its_steps_and_its_rows_are_not_fitted_as_the_scan():
    """The fused backward kernel: a launch plus ``n`` steps of its own constants in the forward kernel's form
    (per H in float32 up to 32, else generic: ``G H`` terms), in place of the scan kernel in the scan path's
    step; a calibration row whose plan says the fused kernel ran is not read as a factored scan's."""
    s = model.STEPS
    assert model.fused_seconds(gates=4, hidden=20, n=1000) == pytest.approx(s.fused_launch + 1000 * s.fused_step)
    assert model.fused_seconds(gates=4, hidden=20, n=1000, element_bytes=8) == pytest.approx(
        s.fused_launch + 1000 * (s.fused_generic_step + s.fused_generic_unit * 80)
    )
    doubled = dataclasses.replace(s, fused_step=2 * s.fused_step, fused_launch=0.0)
    assert model.fused_seconds(gates=4, hidden=20, n=1000, constants=doubled) == pytest.approx(2000 * s.fused_step)
    assert model.forward_seconds(gates=4, hidden=20, n=1000, constants=doubled) == 1000 * s.forward_step
    shape = dict(gates=4, hidden=20, d=40, m=200, batch=16, n=1000)
    scan, fused = model.step_seconds("scan", **shape), model.step_seconds("scan", fused=True, **shape)
    name, chunk = model.fastest_kernel("auto", n=1000, d=40, m=200, batch=16)
    kernel = model.kernel_seconds(name, n=1000, d=40, m=200, batch=16, chunk=chunk)
    assert fused - scan == pytest.approx(model.fused_seconds(gates=4, hidden=20, n=1000) - kernel)
    assert fit.scan_plan("scan linear [cuda]", 1000) == ("linear", 1000)
    assert fit.scan_plan("scan linear [cuda], fused backward kernel", 1000) is None


def test_the_fused_backward_is_not_priced_beyond_the_widest_hidden_size_measured():
    """Above the widest H a fused launch was measured at, the scan's step is not extrapolated: cuDNN's is the
    pick (at d = 256 T = 1000 B = 16 the fitted constants alone would pick the scan)."""
    widest = model.FUSED_MEASURED_HIDDEN
    assert widest == max(x.d for x in fit.load(fit.RESULTS / "cuda-calib-h200-be3c8e9.csv").fused)
    shape = dict(gates=1, m=1, batch=16, n=1000)
    assert math.isfinite(model.step_seconds("scan", fused=True, hidden=widest, d=widest, **shape))
    assert model.step_seconds("scan", fused=True, hidden=widest + 1, d=widest + 1, **shape) == math.inf
    assert math.isfinite(model.step_seconds("scan", hidden=256, d=256, **shape))  # the factored scan: measured
    assert model.step_seconds("torch", hidden=256, d=256, **shape) < math.inf


def test_with_the_fused_kernels_constants_the_model_picks_within_10_percent_on_the_h200_grid_of_be3c8e9():
    """Issue 28: the H200's grid at be3c8e9, where "auto" ran the fused backward kernel on 12 shapes (its
    constants fitted on that grid's launches alone, the rest on the H100's): at each of the 61 shapes with
    cuDNN's step and a scan step measured (the fused kernel's steps included), the model's pick costs within
    10% of the faster measured path; where only the fused kernel's step beat cuDNN's (B = 256 at T = 1000,
    d = 64 at T = 10000) the model picks the scan."""
    data = fit.load(fit.RESULTS / "cuda-calib-h200-be3c8e9.csv")
    rows = fit.decisions(data)
    assert len(rows) == 61 and len(data.fused_steps) == 50
    assert [(x.d, x.batch, x.n, round(x.cost, 2)) for x in rows if x.cost > fit.TOLERANCE] == []
    picks = {(x.d, x.batch, x.n): x.picked for x in rows}
    for key in ((20, 256, 1000), (32, 256, 1000), (64, 256, 1000), (64, 64, 10000), (64, 256, 10000)):
        factored = [x.seconds for x in data.scans if (x.d, x.batch, x.n) == key]
        assert data.fused_steps[key] < data.cudnn[key] < min(factored, default=math.inf), key
        assert picks[key] == "scan", key


def test_the_fit_recovers_the_fused_kernels_constants_from_its_launches_and_keeps_the_forwards_without_them():
    """``fused_kernel`` rows (the fused RNN backward alone, per d, B, T) generated from known constants, with
    +-3% of alternating noise: the fit finds the launch and the constants of both families within 5%; a grid
    without such rows (the H100's) leaves them as given, one without a family's rows that family's. The fit needs SciPy (JAX of the bench extra brings it; the torch-floor
    CI leg installs the dev extra alone)."""
    pytest.importorskip("scipy")
    truth = dataclasses.replace(
        model.STEPS, fused_launch=2.5e-5, fused_step=1.3e-7, fused_generic_step=9e-8, fused_generic_unit=2.2e-9
    )
    rows = [
        fit.Launch("fused", d, batch, n, n, model.fused_seconds(gates=1, hidden=d, n=n, constants=truth) * noise)
        for (d, batch, n), noise in zip(
            [(d, b, n) for d in (8, 20, 32, 64, 128, 256) for b in (1, 16) for n in (100, 1000, 10000)],
            [1.03, 0.97] * 18,
            strict=True,
        )
    ]
    data = dataclasses.replace(DATA, fused=rows)
    fitted = fit.fit_fused(data, model.STEPS)
    for name in fit.FUSED_FIELDS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.fit_fused(DATA, model.STEPS) == model.STEPS  # no launch measured: the constants given
    only_generic = dataclasses.replace(DATA, fused=[x for x in rows if x.d > 32])
    kept = fit.fit_fused(only_generic, model.STEPS)
    assert kept.fused_step == model.STEPS.fused_step and kept.fused_generic_unit == pytest.approx(
        truth.fused_generic_unit, rel=0.05
    )


def test_the_fused_kernels_launches_are_read_from_a_calibration_file(tmp_path):
    """``benchmarks/gpu.py``'s calibration rows of the fused kernel alone (``what = fused_kernel``) are loaded as
    its launches; a row without a time (skipped, refused) is not."""
    path = tmp_path / "cuda-calib.csv"
    path.write_text(
        "# provenance\nwhat,cell,d,B,T,algorithm,chunk,ms,plan,note\n"
        "fused_kernel,RNN,20,16,1000,fused,1000,0.2500,,\n"
        "fused_kernel,RNN,256,16,1000,fused,1000,,,refused: no room\n"
        "kernel,RNN,20,16,1000,linear,1000,0.4000,,\n"
    )
    data = fit.load(path)
    assert data.fused == [fit.Launch("fused", 20, 16, 1000, 1000, 0.25e-3)]
    assert data.launches == [fit.Launch("linear", 20, 16, 1000, 1000, 0.4e-3)]
