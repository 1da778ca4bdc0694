"""The compiled CPU kernel of the scan's sequential (``"linear"``) schedule (``linear_scan.c``).

On a CPU the linear schedule is one small product per step, and through torch each step costs a few
op dispatches (~1.5 µs each) however small it is. The C kernel runs the whole recurrence
``g_t = g_{t+1} J_t + δ_t`` in one call, batch elements spread over threads (they are independent):
at ``B = 16, n = 1000, d = 20`` that is ~0.3 ms instead of ~3.7 ms.

``linear_scan.c`` is compiled on first use with the system C compiler (``$CC``, default ``cc``; it may
hold flags, e.g. ``CC="gcc -m64"``) by :func:`lightning_bppsa.kernels._native.load` into
``$BPPSA_CACHE_DIR`` and loaded with :mod:`ctypes`. Without a compiler, when it fails, or with
``BPPSA_NATIVE=0``, nothing is loaded and the scan runs its torch loop (same results up to rounding;
one log message says why). :mod:`lightning_bppsa.ops` decides where this kernel runs.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from lightning_bppsa.kernels import _native
from torch import Tensor

__all__ = ["available", "linear_dense", "linear_factored"]

log = logging.getLogger(__name__)

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_STRIDED = [_PTR, _I64, _I64]  # a (steps, B, width) view: its pointer, then its step and row strides
_SIGNATURES = {
    **{f"bppsa_linear_factored_{s}": [_I64] * 4 + [_PTR] + _STRIDED * 4 + [_INT] for s in _SUFFIX.values()},
    **{f"bppsa_linear_dense_{s}": [_I64] * 3 + [_PTR] + _STRIDED * 2 + [_INT] for s in _SUFFIX.values()},
}

def _load() -> ctypes.CDLL | None:
    fallback = "The linear scan runs its torch loop"
    return _native.load("bppsa_linear", "linear_scan.c", _SIGNATURES, logger=log, fallback=fallback)


_LIBRARY = _native.LazyLibrary(_load)
_library = _LIBRARY.get


def available() -> bool:
    """Whether the compiled kernel can be used (compiles it on the first call).

    While ``torch.compile`` traces (the cost model asks this from inside ``backprop_scan``), it only
    reports what an earlier eager call found, so tracing never touches the compiler or the disk.
    """
    return _LIBRARY.available()


def _usable(out: Tensor) -> ctypes.CDLL | None:
    if out.device.type != "cpu" or out.dtype not in _SUFFIX or out.stride(-1) != 1:
        return None
    return _library()


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_contiguous(t: Tensor | None) -> Tensor | None:
    """``t``, or a copy where its last dimension is not contiguous (the kernels' one layout need)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _strided(t: Tensor | None) -> list:
    """A ``(steps, B, width)`` view (rows contiguous) as the kernels take it: pointer, step and row strides."""
    return [None, 0, 0] if t is None else [t.data_ptr(), t.stride(0), t.stride(1)]


def linear_factored(weight: Tensor, scales: Tensor, diagonal: Tensor | None, add: Tensor | None, out: Tensor) -> bool:
    """Run the linear recurrence of a factored chain into ``out``; ``False`` if the kernel can't.

    Args:
        weight: ``(m, d)`` with ``m = k d``.
        scales: ``(n, B, m)`` per-step scales (any view whose last dimension is contiguous, e.g. the
            time-major transpose of a batch-major tensor: no copy).
        diagonal: ``(n, B, d)`` diagonal terms ``u_t`` of ``J_t = diag(u_t) + S_t W``, or ``None``.
        add: ``(n, B, d)`` direct gradients ``δ_0..δ_{n-1}`` or ``None``.
        out: ``(n + 1, B, d)`` with contiguous rows, ``out[n]`` already holding ``g_n``; filled in place.
    """
    lib = _usable(out)
    if lib is None or any(t is not None and t.dtype != out.dtype for t in (weight, scales, diagonal, add)):
        return False
    n, batch, d = out.shape[0] - 1, out.shape[1], out.shape[2]
    # named, so that any copies live until the call returns
    weight, scales, diagonal, add = weight.contiguous(), *map(_rows_contiguous, (scales, diagonal, add))
    views = [v for t in (scales, diagonal, add, out) for v in _strided(t)]
    fn = getattr(lib, f"bppsa_linear_factored_{_SUFFIX[out.dtype]}")
    fn(n, batch, d, weight.shape[0], _pointer(weight), *views, _native.threads(batch))
    return True


def linear_dense(jacobians_t: Tensor, add: Tensor | None, out: Tensor) -> bool:
    """As :func:`linear_factored` for dense ``(B, n, d, d)`` transposed Jacobians."""
    lib = _usable(out)
    if lib is None or any(t is not None and t.dtype != out.dtype for t in (jacobians_t, add)):
        return False
    n, batch, d = out.shape[0] - 1, out.shape[1], out.shape[2]
    jacobians_t, add = jacobians_t.contiguous(), _rows_contiguous(add)  # named: copies live through the call
    views = [v for t in (add, out) for v in _strided(t)]
    fn = getattr(lib, f"bppsa_linear_dense_{_SUFFIX[out.dtype]}")
    fn(n, batch, d, _pointer(jacobians_t), *views, _native.threads(batch))
    return True
