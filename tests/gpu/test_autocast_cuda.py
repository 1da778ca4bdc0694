"""Autocast on the backend's device (float16 and bfloat16 on a GPU): gradients do not depend on where
``backward()`` is called.

The checks of ``tests/nn/test_autocast.py`` (same helpers, same derived tolerances) on the GPU, where
``16-mixed`` / ``bf16-mixed`` with manual optimization call ``manual_backward`` inside the autocast region.
Where the kernels are emulated the bodies run on the CPU (a test mistake shows there first).
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
#: inside and outside run the same kernels on the same inputs; a reduction's order may still differ on a GPU
SAME = 64 * torch.finfo(torch.float32).eps


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=str)
def autocast(request, backend) -> tuple[str, torch.dtype]:
    """``(device type, dtype)`` of the autocast region on the backend's device."""
    return backend.device.type, request.param


@pytest.mark.parametrize("algorithm", CHECKS.ALGORITHMS)
@pytest.mark.parametrize("cell", list(CHECKS.LAYERS))
def test_recurrent_layer_gradients_do_not_depend_on_where_backward_runs(backend, autocast, cell, algorithm):
    ours, reference = CHECKS.layer_pair(cell, algorithm, backend.device)
    x = torch.randn(4, 40, 3, device=backend.device)
    # "auto" may pick torch's layer on a GPU (its cost model): the gradients must hold either way
    path = None if algorithm == "auto" else lambda: ours.last_stats["path"]
    with CHECKS.modelled_plans():
        CHECKS.check_autocast_gradients(ours, reference, x, autocast, path=path, same_tolerance=SAME)


@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
def test_recurrence_gradients_do_not_depend_on_where_backward_runs(backend, autocast, algorithm):
    torch.manual_seed(0)
    cell = CHECKS.GatedCell().to(backend.device)
    ours = Recurrence(copy.deepcopy(cell), batch_first=True, algorithm=algorithm)
    CHECKS.check_autocast_gradients(
        ours, CHECKS.Loop(cell), torch.randn(4, 40, 3, device=backend.device), autocast,
        path=lambda: ours.last_stats["path"], same_tolerance=SAME,
    )  # fmt: skip


@pytest.mark.parametrize("cell", list(CHECKS.LAYERS))
def test_recurrent_layer_returns_torchs_dtypes_under_autocast(backend, autocast, cell):
    # torch's cuDNN layers compute in float16 under bfloat16 autocast too: the outputs' dtypes must match
    ours, reference = CHECKS.layer_pair(cell, "linear", backend.device)
    x = torch.randn(4, 40, 3, device=backend.device, requires_grad=True)
    with torch.autocast(*autocast):
        got = ours(x)
        try:
            want = reference(x)
        except RuntimeError:  # oneDNN refuses torch's LSTM under CPU float16 autocast (the emulated backend)
            assert (backend.device.type, cell) == ("cpu", "LSTM")
            want = got
    flat = [t.dtype for t in (got[0], *(got[1] if cell == "LSTM" else (got[1],)))]
    expected = [t.dtype for t in (want[0], *(want[1] if cell == "LSTM" else (want[1],)))]
    assert flat == expected
