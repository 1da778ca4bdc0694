"""The CUDA LSTM backward kernel (``bppsa_lstm_backward_*`` in ``kernels/recurrent.cu``) on the CPU through the
host emulation: the same source and launch (``recurrent_cuda.prepare_lstm_backward``) as on a GPU.

The gradients are torch autograd's through its own LSTM (``torch._VF.lstm``) in float64: the layer's input
is the gate pre-activation itself (``W_ih = I``, no bias), so that autograd's gradient of the input IS the
kernel's ``d_gates``, beside those of ``h0`` and ``c0``. The forward factors (cells, gates) come from the
emulated CUDA forward kernel. Float32 within ``assert_derived_close`` of the float64 truth, torch's float32
autograd as the baseline. The sanitized launches (ASan, TSan: the double-buffered gate gradients) are in
``recurrent_cuda_sanitize.cpp``; the compile gates in ``test_recurrent_cuda_emulated.py`` cover the kernel.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from lightning_bppsa.kernels import recurrent_cuda
from lightning_bppsa.kernels import recurrent_emulated as emulated

from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")


def _inputs(batch: int, steps: int, hidden: int, seed: int, given: bool) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (2 * torch.rand(*shape, dtype=torch.float64, generator=gen) - 1) * scale

    return {
        "gi": rand(batch, steps, 4 * hidden, scale=1.5),
        "w_hh": rand(4 * hidden, hidden, scale=1.5 / hidden**0.5),
        "h0": rand(batch, hidden),
        "c0": rand(batch, hidden),
        "grad_out": rand(batch, steps, hidden) if given else None,
        "grad_h": rand(batch, hidden) if given else None,
        "grad_cn": rand(batch, hidden) if given else None,
    }


def _autograd(p: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch's ``(d_gates, grad h0, grad c0)`` in ``dtype``; without given gradients, the loss is ``sum(h_T)``
    (what the kernel computes for ``grad_h`` = ones, the other gradients absent: checked beside)."""
    hidden = p["w_hh"].shape[1]
    leaves = [p[k].to(dtype).requires_grad_() for k in ("gi", "h0", "c0")]
    gi, h0, c0 = leaves
    eye = torch.eye(4 * hidden, dtype=dtype, device=p["gi"].device)
    out, h_n, c_n = torch._VF.lstm(gi, (h0[None], c0[None]), [eye, p["w_hh"].to(dtype)], False, 1, 0.0, False,
                                   False, True)  # fmt: skip
    loss = (h_n[0] * _given(p, "grad_h", dtype)).sum()
    if p["grad_out"] is not None:
        loss = loss + (out * p["grad_out"].to(dtype)).sum() + (c_n[0] * p["grad_cn"].to(dtype)).sum()
    return torch.autograd.grad(loss, leaves)


def _given(p: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    return p[name].to(dtype) if p[name] is not None else torch.ones_like(p["h0"], dtype=dtype)


def _kernel(p: dict, dtype: torch.dtype, **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    t = {k: None if v is None else v.to(dtype) for k, v in p.items()}
    _, cells, gates = emulated.lstm_forward(t["gi"], t["w_hh"], t["h0"], t["c0"])
    grad_h = _given(p, "grad_h", dtype)
    return emulated.lstm_backward(gates, cells, t["c0"], t["w_hh"], t["grad_out"], t["grad_cn"], grad_h=grad_h,
                                  **options)  # fmt: skip


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize(("batch", "steps"), [(1, 1), (3, 6)])
@pytest.mark.parametrize("hidden", [1, 7, 20, 33, 70])  # one warp; several (H = 70: three, __syncthreads)
def test_float64_matches_autograd(hidden, batch, steps, given):
    p = _inputs(batch, steps, hidden, seed=hidden * 10 + steps, given=given)
    actual = _kernel(p, torch.float64, resident=1)
    assert actual is not None, "the kernel declined to run"
    for name, a, r in zip(("d_gates", "grad_h0", "grad_c0"), actual, _autograd(p, torch.float64), strict=True):
        assert_derived_close(a, r, floor=1e-12, name=f"H={hidden} {name}")


@pytest.mark.parametrize("hidden", [5, 32, 40])
def test_float32_within_derived_tolerance(hidden):
    p = _inputs(2, 37, hidden, seed=hidden, given=True)
    actual = _kernel(p, torch.float32)
    reference, baseline = _autograd(p, torch.float64), _autograd(p, torch.float32)
    for name, a, r, b in zip(("d_gates", "grad_h0", "grad_c0"), actual, reference, baseline, strict=True):
        assert a.dtype == torch.float32
        assert_derived_close(a, r, b, floor=1e-6, name=f"H={hidden} {name}")


def test_no_step_passes_the_given_gradients_through():
    p = _inputs(2, 0, 3, seed=1, given=True)
    t = {k: v for k, v in p.items() if k not in ("gi", "h0")}
    d_gates, gh0, gc0 = emulated.lstm_backward(p["gi"], p["gi"][..., :3], t["c0"], t["w_hh"], t["grad_out"],
                                               t["grad_cn"], grad_h=t["grad_h"])  # fmt: skip
    assert d_gates.shape == (2, 0, 12) and torch.equal(gh0, t["grad_h"]) and torch.equal(gc0, t["grad_cn"])


def test_declines_what_it_cannot_run():
    """``None`` (the layer's scan runs instead) for other dtypes, mixed dtypes, another device, a block beyond
    the shared memory or the threads; :func:`recurrent_cuda.backward_refusal` says why, in one line."""
    p = _inputs(2, 3, 4, seed=2, given=True)
    gates, cells = torch.rand(2, 3, 16, dtype=torch.float64), torch.rand(2, 3, 4, dtype=torch.float64)
    args = (gates, cells, p["c0"], p["w_hh"], p["grad_out"], p["grad_cn"])
    assert emulated.lstm_backward(*args) is not None
    assert emulated.lstm_backward(*(a.half() for a in args)) is None
    assert emulated.lstm_backward(gates.float(), *args[1:]) is None
    assert emulated.lstm_backward(gates.to("meta"), *args[1:]) is None
    assert emulated.lstm_backward(*args, shared_limit=recurrent_cuda.lstm_backward_shared_bytes(4, 8) - 1) is None
    assert "shared memory" in recurrent_cuda.backward_refusal(4, torch.float64, 100)
    assert "float32 / float64" in recurrent_cuda.backward_refusal(4, torch.float16, 1 << 20)
    assert "at most 256" in recurrent_cuda.backward_refusal(257, torch.float32, 1 << 30)
    assert recurrent_cuda.backward_refusal(4, torch.float32, 1 << 20) is None


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (0, torch.zeros(2, 3, 15), "gates must be"),
        (1, torch.zeros(2, 3, 5), "cells must be"),
        (2, torch.zeros(3, 4), "c0 must be"),
        (3, torch.zeros(4, 4), "w_hh must be"),
        (4, torch.zeros(2, 4, 4), "grad_out must be"),
        (5, torch.zeros(2, 5), "grad_cn must be"),
    ],
)
def test_bad_shapes_name_the_argument(index, bad, message):
    args = [torch.zeros(2, 3, 16), torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(16, 4),
            torch.zeros(2, 3, 4), torch.zeros(2, 4)]  # fmt: skip
    args[index] = bad
    with pytest.raises(ValueError, match=message):
        emulated.lstm_backward(*args)


def test_sums_are_refused():
    with pytest.raises(ValueError, match="sums=None"):
        emulated.lstm_backward(*(torch.zeros(2, 3, 16), torch.zeros(2, 3, 4), torch.zeros(2, 4)),
                               torch.zeros(16, 4), None, None, sums=object())  # fmt: skip
