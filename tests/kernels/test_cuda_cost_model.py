"""The instruction-level CUDA model (:mod:`lightning_bppsa.cuda_cost_model`) of the warp-resident sweep: its
per-step counts against the SASS of the current ``scan.cu`` (slow; needs nvcc, cuobjdump and nvdisasm) and its
band against the H100's measured launches (``benchmarks/results/calib-h100-2026-11-26-eeeac3a.csv``)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning_bppsa.kernels import cuda, cuda_inspect

from lightning_bppsa import cuda_cost_model

_DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "calib-h100-2026-11-26-eeeac3a.csv"


def _measured_warp_sweeps() -> list[tuple[int, int, int, float]]:
    """(d, B, T, seconds) of the sweeps alone with d <= 32 and T >= 1000 (at T = 100 the launch dominates)."""
    with open(_DATA) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return [
        (int(r["d"]), int(r["B"]), int(r["T"]), float(r["ms"]) * 1e-3)
        for r in rows
        if r["what"] == "kernel" and r["algorithm"] == "linear" and r["ms"]
        if int(r["d"]) <= cuda.WARP and int(r["T"]) >= 1000
    ]


def test_the_warp_sweep_band_middle_is_within_25_percent_of_every_measured_sweep():
    sweeps = _measured_warp_sweeps()
    assert len(sweeps) == 24  # d in {8, 20, 32} x B in {1, 16, 64, 256} x T in {1000, 10000}
    for d, batch, length, seconds in sweeps:
        predicted = cuda_cost_model.cuda_kernel_seconds(
            "linear", n=length, d=d, batch=batch, width=d, chunk_size=length
        )
        assert 0.8 < predicted / seconds < 1.25, (d, batch, length, seconds, predicted)


@pytest.mark.slow  # ~3 s of nvcc + cuobjdump per module
@pytest.mark.parametrize(("d", "k"), [(8, 3), (20, 1), (32, 1)])
def test_warp_step_counts_are_those_of_the_sass(d, k):
    """``StepInstructions.warp_*`` (a linear fit) against the main loop of each warp sweep of the module of
    ``(d, k)`` (sm_90, float32): within 5 instructions a step."""
    try:
        loops = cuda_inspect.sass_loops("sm_90", warp_shape=(d, k))
    except FileNotFoundError as err:
        pytest.skip(
            f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}"
        )
    for factored in (True, False):
        name = f"bppsa_warpsweep_{'factored' if factored else 'dense'}_f32"
        step = cuda_inspect.warp_step_counts(max(loops[name], key=lambda loop: loop.instructions))
        modelled = cuda_cost_model._warp_step_instructions(
            d=d, tiles=k if factored else 1, factored=factored, counts=cuda_cost_model.SASS_COUNTS
        )
        assert abs(modelled - step.instructions) <= 5, (name, step, modelled)
