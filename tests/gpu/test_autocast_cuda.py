"""CUDA autocast (float16 and bfloat16): gradients do not depend on where ``backward()`` is called.

The checks of ``tests/nn/test_autocast.py`` (same helpers, same derived tolerances) on the GPU, where
``16-mixed`` / ``bf16-mixed`` with manual optimization call ``manual_backward`` inside the autocast region.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_bppsa.nn import Recurrence

pytestmark = pytest.mark.cuda


def _load_checks():
    path = Path(__file__).resolve().parents[1] / "nn" / "test_autocast.py"
    spec = importlib.util.spec_from_file_location("_autocast_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKS = _load_checks()
DTYPES = [torch.float16, torch.bfloat16]
#: inside and outside run the same kernels on the same inputs; a reduction's order may still differ on a GPU
SAME = 64 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", CHECKS.ALGORITHMS)
@pytest.mark.parametrize("cell", list(CHECKS.LAYERS))
def test_recurrent_layer_gradients_do_not_depend_on_where_backward_runs(cuda, cell, algorithm, dtype):
    ours, reference = CHECKS.layer_pair(cell, algorithm, cuda)
    x = torch.randn(4, 40, 3, device=cuda)
    # "auto" may pick torch's layer on a GPU (its cost model): the gradients must hold either way
    path = None if algorithm == "auto" else lambda: ours.last_stats["path"]
    CHECKS.check_autocast_gradients(ours, reference, x, ("cuda", dtype), path=path, same_tolerance=SAME)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
def test_recurrence_gradients_do_not_depend_on_where_backward_runs(cuda, algorithm, dtype):
    torch.manual_seed(0)
    cell = CHECKS.GatedCell().to(cuda)
    ours = Recurrence(copy.deepcopy(cell), batch_first=True, algorithm=algorithm)
    CHECKS.check_autocast_gradients(
        ours, CHECKS.Loop(cell), torch.randn(4, 40, 3, device=cuda), ("cuda", dtype),
        path=lambda: ours.last_stats["path"], same_tolerance=SAME,
    )  # fmt: skip
