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
from lightning_bppsa.kernels import cuda

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
    """The scan step's form (host, forward, kernel, elementwise) on the 87 measured scan steps at d <= 32 that
    ran the CUDA forward kernel, forced linear / chunked included: the d = 32 chunked steps measured ~2x their
    kernel alone (a layer's per-step gradient adds a row to the aggregates: two passes of 256 threads instead
    of one). Above d = 32 the H100's grid ran forward kernels since replaced: the H200's grid at a4e83a3
    prices those (:func:`test_the_forward_kernels_above_a_warp_are_fitted_on_the_h200_grid_of_a4e83a3`)."""
    errors = fit.scan_residuals(DATA, model.STEPS, model.KERNELS)
    assert len(errors) == 87
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
    # float32 H <= 32: W_hh in registers, the same a step for every H; float32 above: per H, a lane's
    # share of W_hh in registers (and the rest in shared memory); float64: the generic kernel
    s = model.STEPS
    per_h = [model.forward_seconds(gates=1, hidden=h, n=1000, batch=16) for h in (8, 32)]
    assert per_h[0] == per_h[1] == 1000 * s.forward_step
    generic = [model.forward_seconds(gates=g, hidden=h, n=1000, batch=16, element_bytes=8) for g, h in ((1, 32), (4, 64))]
    assert generic == [1000 * (s.generic_step + s.generic_unit * units) for units in (32, 256)]
    # RNN H = 128: 32 packs of a row in registers; LSTM H = 128: 7 of 16 packs of each of 4 rows, 9 in shared
    assert model.forward_seconds(gates=1, hidden=128, n=1000, batch=16) == pytest.approx(
        1000 * (s.forward_register_step + s.forward_register_unit * 128)
    )
    assert model.forward_seconds(gates=4, hidden=128, n=1000, batch=16) == pytest.approx(
        1000 * (s.forward_register_step + s.forward_register_unit * 4 * 28 + s.forward_register_shared * 4 * 36)
    )


def test_bad_path_is_refused_with_its_name():
    with pytest.raises(ValueError, match="path must be 'torch' or 'scan'; got 'cudnn'"):
        model.step_seconds("cudnn", gates=1, hidden=8, d=8, m=8, batch=1, n=10)


def test_the_fused_backward_is_priced_as_a_launch_and_its_steps_and_its_rows_are_not_fitted_as_the_scan():
    """The fused backward kernel: a launch plus ``n`` steps of its own constants in the forward kernel's form
    (per H in float32 up to 32, else generic: ``G H`` terms), in place of the scan kernel in the scan path's
    step; a calibration row whose plan says the fused kernel ran is not read as a factored scan's."""
    s = model.STEPS
    one = dict(gates=4, hidden=20, n=1000, batch=1)
    assert model.fused_seconds(**one) == pytest.approx(s.fused_launch + 1000 * s.fused_step)
    assert model.fused_seconds(**one, element_bytes=8) == pytest.approx(
        s.fused_launch + 1000 * (s.fused_generic_step + s.fused_generic_unit * 80)
    )
    doubled = dataclasses.replace(s, fused_step=2 * s.fused_step, fused_launch=0.0)
    assert model.fused_seconds(**one, constants=doubled) == pytest.approx(2000 * s.fused_step)
    assert model.forward_seconds(**one, constants=doubled) == 1000 * s.forward_step
    shape = dict(gates=4, hidden=20, d=40, m=200, batch=16, n=1000)
    scan, fused = model.step_seconds("scan", **shape), model.step_seconds("scan", fused=True, **shape)
    name, chunk = model.fastest_kernel("auto", n=1000, d=40, m=200, batch=16)
    kernel = model.kernel_seconds(name, n=1000, d=40, m=200, batch=16, chunk=chunk)
    assert fused - scan == pytest.approx(model.fused_seconds(**one) - kernel)
    assert fit.scan_plan("scan linear [cuda]", 1000) == ("linear", 1000)
    assert fit.scan_plan("scan linear [cuda], fused backward kernel", 1000) is None


H200 = "cuda-calib-h200-a4e83a3.csv"  # the H200's grid at a4e83a3: the kernels above a warp hold W_hh in registers


H200_20DFF7A = "cuda-calib-h200-20dff7a.csv"  # the H200's grid at 20dff7a: RNN steps in groups of 4, d = 256 timed


H200_STEPS = "cuda-step-h200-213b46c.md"  # the H200's whole-step table at 213b46c: the cluster kernels timed


def test_the_fused_backward_is_not_priced_beyond_the_widest_hidden_size_measured():
    """Above the widest H a whole step with the fused backward was measured at T >= 1000 (where the forward
    kernel's time shows; 384 since the H200's step table at 213b46c, a GRU run as clusters of 8 blocks; 256
    at 20dff7a, 128 before), the scan's step is not extrapolated: cuDNN's is the pick. At d = 256 it is
    priced, and picked where it was measured faster."""
    widest = model.FUSED_MEASURED_HIDDEN
    grid = max(d for (d, _, n) in fit.load(fit.RESULTS / H200_20DFF7A).fused_steps if n >= 1000)
    table = max(x.hidden for x in fit.load_steps(fit.RESULTS / H200_STEPS) if "fused backward kernel" in x.plan)
    assert widest == max(grid, table) == 384
    shape = dict(gates=1, m=1, batch=16, n=1000)
    assert math.isfinite(model.step_seconds("scan", fused=True, hidden=widest, d=widest, **shape))
    assert model.step_seconds("scan", fused=True, hidden=widest + 1, d=widest + 1, **shape) == math.inf
    assert math.isfinite(model.step_seconds("scan", hidden=256, d=256, **shape))  # the factored scan: measured
    assert model.step_seconds("torch", hidden=256, d=256, **shape) > model.step_seconds(
        "scan", fused=True, hidden=256, d=256, **shape
    )


def test_the_model_picks_within_10_percent_on_the_h200_grid_of_20dff7a():
    """Issue 28, on the H200's grid at 20dff7a (the fused kernel's constants and the float32 forward's above a
    warp fitted on it): at 68 of its 72 shapes the model's pick costs within 10% of the faster measured path;
    the four others are host-bound (T = 100, where two copies of cuDNN's module read up to 15% apart, and
    the layer plan measures where the model is unsure) or the d = 64 B = 16 T = 1000 shape the H200's earlier
    grid missed too. At d = 256 and T >= 1000 the fused kernel's step, measured 1.5-1.7x faster than cuDNN's,
    is picked (it was never priced before: "auto" kept cuDNN there)."""
    data = fit.load(fit.RESULTS / H200_20DFF7A)
    rows = fit.decisions(data)
    assert len(rows) == 72 and len(data.fused_steps) == 72
    misses = [(x.d, x.batch, x.n, round(x.cost, 2)) for x in rows if x.cost > fit.TOLERANCE]
    assert misses == [(20, 256, 100, 1.21), (32, 64, 100, 1.32), (64, 16, 1000, 1.18), (128, 1, 1000, 1.14)]
    for x in rows:
        if x.d == 256 and x.n >= 1000:
            assert x.picked == "scan" and x.scan < x.cudnn / 1.4, x


def test_the_model_picks_within_10_percent_on_the_h200_grid_of_213b46c():
    """Issue 28, on the H200's grid at 213b46c (the chunked kernel's aggregates formed by one warp at d <= 32,
    priced by the block product's constants, not refitted): at 70 of its 72 shapes the model's pick costs
    within 10% of the faster measured path; the two others are host-bound T = 1000 shapes within 15% (the
    layer plan measures there: the model is unsure)."""
    rows = fit.decisions(fit.load(fit.RESULTS / "cuda-calib-h200-213b46c.csv"))
    assert len(rows) == 72
    misses = [(x.d, x.batch, x.n, round(x.cost, 2)) for x in rows if x.cost > fit.TOLERANCE]
    assert misses == [(64, 16, 1000, 1.11), (128, 1, 1000, 1.15)]


H200_LAYOUTS = "cluster-layouts-h200-f9d52e5.md"  # the H200's layout sweep at f9d52e5: the wide kernels alone


def test_the_cluster_kernels_are_priced_from_the_h200_layout_sweep():
    """The 72 launches of the H200's layout sweep at f9d52e5 run as clusters (GRU H = 128 / 192 / 256 / 384,
    LSTM H = 160, B = 16, 2-8 blocks x 2-8 lanes a unit, each kernel alone): the model prices each within
    2.1x, the layouts the package launches within 1.8x, and its cluster constant is the one the fit finds
    on them (SciPy: the fit's)."""
    launches = fit.load_layouts(fit.RESULTS / H200_LAYOUTS)
    clustered = [x for x in launches if x.layout.cluster > 1]
    assert len(launches) == 74 and len(clustered) == 72 and {x.n for x in launches} == {1000}
    assert max(abs(r) for r in fit.cluster_residuals(launches, model.STEPS)) < math.log(2.1)
    for x in clustered:
        if x.layout == model._wide_layout(x.cell, x.hidden, x.direction, x.batch):
            assert abs(math.log(x.predicted() / x.seconds)) < math.log(1.8), x
    pytest.importorskip("scipy")
    assert fit.fit_cluster(launches, model.STEPS).cluster_step == pytest.approx(model.STEPS.cluster_step, rel=0.01)


def test_the_cluster_layers_whole_steps_are_picked_conservatively():
    """The whole steps of the H200's table at 213b46c whose kernels ran as clusters of 4 and 8 blocks (GRU H =
    256 / 384, LSTM B = 32 H = 256; 4.0-8.6 ms against cuDNN's 34.5-36.7; the 2-block rows of that table, GRU H =
    192 and LSTM H = 160, now spread over 4 blocks): the model picks the scan at each, by a ratio over cuDNN
    below the measured one (both underpriced, cuDNN more)."""
    steps = fit.cluster_steps(fit.load_steps(fit.RESULTS / H200_STEPS))
    assert sorted((x.cell, x.hidden, x.batch) for x in steps) == [("gru", 256, 16), ("gru", 384, 16), ("lstm", 256, 32)]
    for x in steps:
        scan, torch_ = x.predicted("scan"), x.predicted("torch")
        assert scan < torch_ and torch_ / scan < x.cudnn / x.bppsa, x
        assert 0.5 < scan / x.bppsa < 1, x


def test_the_model_picks_within_10_percent_on_the_h200_grid_of_a4e83a3():
    """Issue 28, on the H200's grid at a4e83a3 (the fused kernel's constants and the float32 forward's above a
    warp fitted on it, the rest on the H100's): at each of the 64 shapes with cuDNN's step and a scan step
    measured, the model's pick costs within 10% of the faster measured path, but at d = 64 B = 16 T = 1000
    (1.18x), a host-bound shape where the measurements disagree: the forced scan's step 1.22 ms, "auto"'s own
    timing of it 1.45 ms, cuDNN's 1.44 and 1.57 ms. Where a scan's step beat cuDNN's by 1.4-2.7x (d = 64 and
    128 at T = 10000, the fused kernel's but at d = 64 B = 1, the chunked scan's) the model picks the scan."""
    data = fit.load(fit.RESULTS / H200)
    rows = fit.decisions(data)
    assert len(rows) == 64 and len(data.fused_steps) == 61
    misses = [(x.d, x.batch, x.n, round(x.cost, 2)) for x in rows if x.cost > fit.TOLERANCE]
    assert misses == [(64, 16, 1000, 1.18)]
    picks = {(x.d, x.batch, x.n): x.picked for x in rows}
    for key in [(d, b, 10000) for d in (64, 128) for b in (1, 16, 64, 256)]:
        scans = [x.seconds for x in data.scans if (x.d, x.batch, x.n) == key] + [data.fused_steps.get(key, math.inf)]
        assert min(scans) < data.cudnn[key] / 1.4, key
        assert picks[key] == "scan", key


def test_the_register_kernels_waves_follow_the_blocks_an_sm_holds_by_registers():
    """A block of the RNN's fused kernel at H = 256 takes a whole SM's registers (256 threads near ptxas's bound
    of 255): B = 256 rows run in two waves on 132 SMs, measured 2.0x B = 64's time on the H200; at H = 128
    (128 threads, two blocks an SM) one wave, measured 1.1x."""
    from lightning_bppsa.kernels import recurrent_cuda

    launches = {(x.d, x.batch, x.n): x.seconds for x in fit.load(fit.RESULTS / H200).fused}
    for hidden, blocks, waves in ((256, 1, 2), (128, 2, 1)):
        assert recurrent_cuda.wide_blocks_per_sm("rnn_tanh", hidden, "backward") == blocks
        ratio = launches[(hidden, 256, 10000)] / launches[(hidden, 64, 10000)]
        assert (ratio > 1.8) if waves == 2 else (ratio < 1.2), (hidden, ratio)
        one = model.fused_seconds(gates=1, hidden=hidden, n=10000, batch=64) - model.STEPS.fused_launch
        many = model.fused_seconds(gates=1, hidden=hidden, n=10000, batch=256) - model.STEPS.fused_launch
        assert many == pytest.approx(waves * one)


def test_the_fit_recovers_the_fused_kernels_constants_from_its_launches_and_keeps_the_forwards_without_them():
    """``fused_kernel`` rows (the fused RNN backward alone, per d, B, T) generated from known constants, with
    +-3% of alternating noise: the fit finds the launch and the constants of both float32 families (per H up to
    32; above, W_hh in registers and, at d = 256, partly in shared memory) within 5%; a grid without such rows
    (the H100's) leaves them as given, one without a family's rows that family's. The fit needs SciPy (JAX of
    the bench extra brings it; the torch-floor CI leg installs the dev extra alone)."""
    pytest.importorskip("scipy")
    truth = dataclasses.replace(
        model.STEPS, fused_launch=2.5e-5, fused_step=1.3e-7, fused_register_step=5e-8, fused_register_unit=3e-9,
        fused_register_shared=1e-8,
    )  # fmt: skip
    shapes = [(d, b, n) for d in (8, 20, 32, 64, 128, 256) for b in (1, 16) for n in (100, 1000, 10000)]
    rows = [
        fit.Launch("fused", d, b, n, n, model.fused_seconds(gates=1, hidden=d, n=n, batch=b, constants=truth) * noise)
        for (d, b, n), noise in zip(shapes, [1.03, 0.97] * 18, strict=True)
    ]
    data = dataclasses.replace(DATA, fused=rows)
    fitted = fit.fit_fused(data, model.STEPS)
    for name in fit.FUSED_FIELDS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.fit_fused(DATA, model.STEPS) == model.STEPS  # no launch measured: the constants given
    only_wide = dataclasses.replace(DATA, fused=[x for x in rows if x.d > 32])
    kept = fit.fit_fused(only_wide, model.STEPS)
    assert kept.fused_step == model.STEPS.fused_step and kept.fused_register_unit == pytest.approx(
        truth.fused_register_unit, rel=0.05
    )


def test_the_forward_kernels_above_a_warp_are_fitted_on_the_h200_grid_of_a4e83a3():
    """The float32 forward kernels above a warp, priced on the H200's 45 scan steps at d > 32 with their backward
    as measured alone (the factored scan's kernel or the fused kernel's launch): every one within 1.5x; the fit
    leaves the constants alone on a grid without such steps (the H100's, whose d > 32 steps ran the kernels
    since replaced). No SciPy needed: the fit is not run."""
    data = fit.load(fit.RESULTS / H200)
    errors = fit.register_forward_residuals(data, model.STEPS, model.KERNELS)
    assert len(errors) == 45
    assert max(abs(r) for r in errors) < math.log(1.5)
    assert fit.fit_register_forward(dataclasses.replace(DATA, scans=[], fused_steps={}), model.STEPS, model.KERNELS) == model.STEPS


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


@pytest.mark.parametrize("predict", [model.kernel_seconds, cuda_cost_model.cuda_kernel_seconds], ids=["fit", "sass"])
def test_a_chunked_launch_one_warp_aggregates_is_priced_as_the_block_product_until_measured(monkeypatch, predict):
    """Where one warp forms the chunk aggregates (float32, d <= 32: its launch takes a 32-thread block) neither
    model has been fitted on its times yet: both price the block product the launch took before (measured),
    not the block it takes now, so "auto" picks as measured until a GPU times the new kernel."""
    shape = dict(n=10000, d=20, batch=16)
    args = {**shape, "m": 60, "chunk": 256} if predict is model.kernel_seconds else {**shape, "width": 60, "chunk_size": 256}
    launch = cuda.launch_config(factored=True, element_bytes=4, m=60, affine=True, algorithm="chunked", chunk_size=256, **shape)
    assert launch.block == cuda.WARP
    one_warp = predict("chunked", affine=True, **args)
    try:
        monkeypatch.setattr(cuda, "warp_aggregates", lambda warp, element_bytes: False)
        cuda.launch_config.cache_clear()
        cuda.warp_layout.cache_clear()
        assert cuda.launch_config(factored=True, element_bytes=4, m=60, affine=True, algorithm="chunked", chunk_size=256,
                                  **shape).block == cuda.product_threads(21, 20) > cuda.WARP  # fmt: skip
        assert predict("chunked", affine=True, **args) == pytest.approx(one_warp, rel=1e-12)
    finally:
        monkeypatch.undo()
        cuda.launch_config.cache_clear()
        cuda.warp_layout.cache_clear()
