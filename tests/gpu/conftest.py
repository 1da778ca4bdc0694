"""CUDA-only tests: every test here takes the ``cuda`` fixture.

Without a CUDA device they are skipped. On a CUDA machine they FAIL (never skip) when the BPPSA CUDA
kernels cannot run there, with the reason (CuPy missing or too old, NVRTC missing, a compile or load
error): a GPU run that silently fell back to the torch implementation would launch no kernel.
"""

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels


def require_kernels() -> torch.device:
    """The CUDA device, after checking that the kernels load on it: skip without CUDA, fail without kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the lent GPU machine)")
    ok, reason = kernels.available()
    if not ok:
        pytest.fail(f"this machine has CUDA but the BPPSA CUDA kernels cannot run: {reason}")
    return torch.device("cuda")


@pytest.fixture
def cuda() -> torch.device:
    return require_kernels()
