"""CUDA-only tests: every test here takes the ``cuda`` fixture and is skipped without a CUDA device."""

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the lent GPU machine)")
    return torch.device("cuda")
