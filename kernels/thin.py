"""The compiled CPU backward of a product with a thin side (``thin_backward.c``): ``out = [a | 1] @ [b ; bias]``.

:class:`lightning_bppsa.gemm` computes a narrow input's projection over all ``B T`` rows as that one product;
its backward is two thin GEMMs (``grad @ bᵀ`` and ``[a | 1]ᵀ grad``) that torch's CPU GEMM runs far below
its peak. The kernel makes both in one pass over ``grad`` (16000 rows, 96 columns, 8 inputs, one thread:
~0.5 ms against ~1.35 ms). Built on first use like the other C kernels (:func:`lightning_bppsa.kernels._native.load`);
without a compiler, or with ``BPPSA_NATIVE=0``, :func:`affine_backward` answers ``None`` and torch's GEMMs run.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from lightning_bppsa.kernels import _native
from torch import Tensor

__all__ = ["MAX_INPUTS", "affine_backward", "available"]

log = logging.getLogger(__name__)

#: ``a``'s columns the kernel takes, at most (``KMAX`` in ``thin_backward.c``)
MAX_INPUTS = 16
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    f"bppsa_thin_backward_{s}": [_I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT]
    for s in _SUFFIX.values()
}


def _load() -> ctypes.CDLL | None:
    fallback = "The backward of a thin input projection runs torch's GEMMs"
    return _native.load(  # contracted: fused multiply-adds (C99 mode would keep them apart)
        "bppsa_thin", "thin_backward.c", _SIGNATURES, logger=log, fallback=fallback, extra_flags=("-ffp-contract=fast",)
    )


_LIBRARY = _native.LazyLibrary(_load)


def available() -> bool:
    """Whether the compiled kernel can be used (compiles it on the first call; never while tracing)."""
    return _LIBRARY.available()


def affine_backward(
    grad: Tensor, a: Tensor, b: Tensor, want_a: bool, want_b: bool
) -> tuple[Tensor | None, Tensor | None] | None:
    """``(grad @ bᵀ, [a | 1]ᵀ grad)`` (``None`` for one not wanted) of ``out = [a | 1] @ [b ; bias]``: ``grad``
    ``(rows, n)``, ``a`` ``(rows, k)``, ``b`` ``(k, n)``; the second result is ``(k + 1, n)``, ``b``'s gradient
    then the bias's row. ``None`` where the kernel does not take them (not CPU float32 / float64 tensors of one
    dtype, ``k`` beyond :data:`MAX_INPUTS`, not built, or while ``torch.compile`` traces: a graph cannot hold
    the call) and the caller runs torch's products."""
    rows, k = a.shape
    if (
        grad.device.type != "cpu" or grad.dtype not in _SUFFIX or a.dtype != grad.dtype or b.dtype != grad.dtype
        or a.device.type != "cpu" or b.device.type != "cpu" or not 1 <= k <= MAX_INPUTS
        or torch.compiler.is_compiling() or not available()
    ):  # fmt: skip
        return None
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()  # e.g. a weight's transpose: k n values
    n = grad.shape[1]
    grad_a = grad.new_empty(rows, k) if want_a else None
    grad_ab = grad.new_empty(k + 1, n) if want_b else None
    status = getattr(_LIBRARY.get(), f"bppsa_thin_backward_{_SUFFIX[grad.dtype]}")(
        rows, n, k, grad.data_ptr(), grad.stride(0), a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
        None if grad_a is None else grad_a.data_ptr(), None if grad_ab is None else grad_ab.data_ptr(),
        _native.threads(rows),
    )  # fmt: skip
    if status != 0:
        return None
    return grad_a, grad_ab
