"""The tests/gpu fixtures' rule, checked on any machine (no GPU needed): FAIL on a CUDA machine where the
kernels cannot run (before: skipped when CuPy was absent, launching nothing); without CUDA the host
emulation (skipped without g++)."""

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels
from lightning_bppsa.kernels import recurrent_cuda, recurrent_emulated


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


def test_without_cuda_the_backend_is_the_host_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    backend = _conftest().make_backend("emulated")
    assert (backend.name, backend.device, backend.accelerator) == ("emulated", torch.device("cpu"), "cpu")
    assert backend.recurrent is recurrent_emulated and backend.size(cuda=160, emulated=3) == 3


def test_without_cuda_or_gpp_the_backend_skips(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="no g\\+\\+"):
        _conftest().make_backend("emulated")


def test_cuda_backend_fails_where_the_recurrent_kernels_cannot_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "available", lambda: (True, ""))
    monkeypatch.setattr(recurrent_cuda, "available", lambda: (False, "NVRTC not found"))
    with pytest.raises(pytest.fail.Exception, match="recurrent CUDA kernels cannot run: NVRTC not found"):
        _conftest().make_backend("cuda")
