"""The tests/gpu fixture's rule, checked on any machine (no GPU needed): skip without CUDA, FAIL on a
CUDA machine where the kernels cannot run (before: skipped when CuPy was absent, launching nothing)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels


def _conftest():
    spec = importlib.util.spec_from_file_location("_gpu_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_cuda_device_skips(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="needs a CUDA device"):
        _conftest().require_kernels()


@pytest.mark.parametrize("reason", ["CuPy is not installed (No module named 'cupy')", "NVRTC not found"])
def test_cuda_without_usable_kernels_fails_with_the_reason(monkeypatch, reason):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "available", lambda: (False, reason))
    with pytest.raises(pytest.fail.Exception, match="cannot run: " + reason.replace("(", r"\(").replace(")", r"\)")):
        _conftest().require_kernels()


def test_cuda_with_kernels_gives_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "available", lambda: (True, ""))
    assert _conftest().require_kernels() == torch.device("cuda")
