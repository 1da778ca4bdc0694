"""The fused CUDA LSTM backward kernel (``bppsa_lstm_backward_*``) on the ``backend`` (tests/gpu/conftest.py).

The cases of ``tests/kernels/test_lstm_backward_cuda_emulated.py`` (torch autograd through its own LSTM in
float64, the pre-activations as the layer's input), on the GPU at its sizes; and on a GPU the layer itself:
``bnn.LSTM(algorithm="linear")`` plans the fused kernel, launches it, and its gradients are as exact as
cuDNN's. On a CUDA machine where the kernels cannot load these tests FAIL (never skipped there).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import lightning_bppsa.nn as bnn
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda


def _load_cases():
    path = Path(__file__).resolve().parents[1] / "kernels" / "test_lstm_backward_cuda_emulated.py"
    spec = importlib.util.spec_from_file_location("_lstm_backward_emulated_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _load_cases()
NAMES = ("d_gates", "grad_h0", "grad_c0")


def run_kernel(p: dict, dtype: torch.dtype, backend) -> list[torch.Tensor]:
    """The forward kernel's factors, then the fused backward, on ``backend``: its outputs on the CPU."""
    t = dict(zip(p, backend.to(*p.values(), dtype=dtype), strict=True))
    (grad_h,) = backend.to(CASES._given(p, "grad_h", dtype))
    _, cells, gates = backend.recurrent.lstm_forward(t["gi"], t["w_hh"], t["h0"], t["c0"])
    result = backend.recurrent.lstm_backward(gates, cells, t["c0"], t["w_hh"], t["grad_out"], t["grad_cn"],
                                             grad_h=grad_h)  # fmt: skip
    assert result is not None, "the kernel declined to run"
    assert all(r.device.type == backend.device.type for r in result)
    return [r.cpu() for r in result]


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("hidden", [1, 20, 33, 70])
def test_float64_matches_autograd(backend, hidden, given):
    p = CASES._inputs(3, 37, hidden, seed=hidden, given=given)
    reference = CASES._autograd(p, torch.float64)
    for name, a, r in zip(NAMES, run_kernel(p, torch.float64, backend), reference, strict=True):
        assert_derived_close(a, r, floor=1e-12, name=f"H={hidden} {name}")


def test_long_sequence_float32_as_exact_as_torch(backend):
    """B = 16, T = 1000, H = 20 on a GPU (smaller emulated): float32 within the derived tolerance of torch's
    own float32 autograd (cuDNN on a GPU)."""
    batch, steps = backend.size(16, 3), backend.size(1000, 50)
    p = CASES._inputs(batch, steps, 20, seed=7, given=True)
    reference = CASES._autograd(p, torch.float64)
    baseline = CASES._autograd({k: None if v is None else v.to(backend.device) for k, v in p.items()},
                               torch.float32)  # fmt: skip
    for name, a, r, b in zip(NAMES, run_kernel(p, torch.float32, backend), reference, baseline, strict=True):
        assert_derived_close(a, r, b.cpu(), floor=1e-6, name=name)


def test_the_layer_plans_and_runs_the_fused_kernel(backend):
    """``bnn.LSTM(algorithm="linear")`` on the GPU: the plan names the fused kernel, and the gradients of every
    parameter and input equal float64 autograd as closely as cuDNN's float32 ones."""
    if not backend.is_cuda:
        pytest.skip("the layer's CUDA plan needs a CUDA device (tests/test_backends.py runs it emulated)")
    torch.manual_seed(0)
    ours = bnn.LSTM(12, 20, batch_first=True, algorithm="linear").to(backend.device)
    cudnn = torch.nn.LSTM(12, 20, batch_first=True).to(backend.device)
    cudnn.load_state_dict(ours.state_dict())
    exact = torch.nn.LSTM(12, 20, batch_first=True).double()
    exact.load_state_dict(ours.state_dict())
    x = torch.randn(16, 300, 12)
    grads = []
    for module, inputs in ((ours, x.to(backend.device)), (cudnn, x.to(backend.device)), (exact, x.double())):
        inputs = inputs.clone().requires_grad_()
        out, (h_n, c_n) = module(inputs)
        (out.square().mean() + h_n.sum() + c_n.sum()).backward()
        grads.append([inputs.grad.cpu(), *(p.grad.cpu() for p in module.parameters())])
    assert ours.last_stats["plan"].endswith(", fused LSTM backward kernel"), ours.last_stats
    for i, (a, b, r) in enumerate(zip(*grads, strict=True)):
        assert_derived_close(a, r, b, floor=1e-6, name=f"gradient {i}")
