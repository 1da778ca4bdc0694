"""``SparseChain`` on the GPU: ``algorithm="auto"`` measures cuDNN's autograd against the sparse scan on the first
call of a shape (CUDA events) and keeps the faster; either path, and a named algorithm, give the gradients of
the same ``nn.Sequential``. Emulated (no CUDA) the same bodies run on the CPU, timed by the wall clock."""

import copy

import pytest
import torch
from torch import nn

from lightning_bppsa import layer_plan
from lightning_bppsa.nn import SparseChain

pytestmark = pytest.mark.cuda


def _grads(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(module(x), [x, *module.parameters()], grad_out)


@pytest.mark.parametrize("algorithm", ["auto", "linear"])
def test_chain_measures_once_and_matches_the_sequential(backend, monkeypatch, algorithm):
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    measured, real = [], layer_plan.time_training_steps

    def counted(forwards, wrt, device):
        measured.append(device.type)
        return real(forwards, wrt, device)

    monkeypatch.setattr(layer_plan, "time_training_steps", counted)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 3), nn.ReLU())
    reference = reference.double().to(backend.device)
    chain = SparseChain.from_sequential(copy.deepcopy(reference), algorithm=algorithm)
    x = torch.randn(3, 3, 12, 12, dtype=torch.float64, device=backend.device, requires_grad=True)
    grad_out = torch.randn(3, 5, 3, 3, dtype=torch.float64, device=backend.device)
    with layer_plan.measurements(True):
        for _ in range(2):  # the second call reads the decision the first one measured
            got = _grads(chain, x, grad_out)
            if algorithm == "auto":
                assert chain.last_stats["decision"].startswith("measured: scan ")
                assert chain.last_stats["path"] == ("scan" if chain.last_stats["reason"] is None else "autograd")
            else:
                assert chain.last_stats["path"] == "scan" and "decision" not in chain.last_stats
            for actual, expected in zip(got, _grads(reference, x, grad_out), strict=True):
                torch.testing.assert_close(actual, expected, atol=1e-10, rtol=1e-10)
    assert len(measured) == (1 if algorithm == "auto" else 0)
