"""The instruction-level CUDA model (:mod:`lightning_bppsa.cuda_cost_model`) of the warp-resident sweep: its
per-step counts against the SASS of the current ``scan.cu`` (slow; needs nvcc, cuobjdump and nvdisasm). Its
band against the H100's measured launches: ``tests/test_cuda_step_model.py``."""

from __future__ import annotations

import pytest
from lightning_bppsa.kernels import cuda_inspect

from lightning_bppsa import cuda_cost_model


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
