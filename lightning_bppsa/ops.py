"""The ``bppsa`` torch.library ops: schema, fake (meta) kernels, and which kernel runs on each device.

- ``bppsa::scan_dense(jacobians_t, grad, algorithm, chunk_size) -> Tensor``
- ``bppsa::scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size) -> Tensor``

Both return the ``(B, n + 1, d)`` gradients of :func:`lightning_bppsa.scan.backprop_scan`, which is
the validating front end; call the ops directly only with already valid inputs and a concrete
``algorithm`` (``"linear"``, ``"blelloch"`` or ``"chunked"``). Being custom ops, they are opaque to
``torch.compile`` (no graph breaks) and callable from TorchScript as ``torch.ops.bppsa.scan_dense``.
They have no autograd formula (``backprop_scan`` refuses inputs that require grad).

This module is the one place where kernels are chosen:

- default (any device): the torch implementation in :mod:`lightning_bppsa.scan`;
- ``"cpu"``: the same, with every linear sweep (the ``"linear"`` schedule, the chunk summaries and
  leftover steps of ``"chunked"``) in one call of the compiled C kernel
  (:mod:`lightning_bppsa.kernels.cpu`) where it is available, else the torch loop;
- ``"cuda"``: :mod:`lightning_bppsa.kernels.cuda` (CuPy is imported on the first CUDA call, never at
  import); where the kernels are unavailable (no CuPy, no device) the torch implementation runs after
  one warning that says why, and so does a state too wide for their shared memory (a warning per call).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from lightning_bppsa import scan
from lightning_bppsa._chains import Chain, DenseChain
from lightning_bppsa.kernels import cpu, cuda

__all__ = ["scan_dense", "scan_factored"]


def _empty_out(grad: Tensor, n: int) -> Tensor:
    batch, d = grad.shape[0], grad.shape[-1]
    return grad.new_empty(batch, n + 1, d)


@torch.library.custom_op("bppsa::scan_dense", mutates_args=())
def scan_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """Scan a dense ``(B, n, d, d)`` chain of transposed Jacobians; see ``backprop_scan``."""
    return scan.run_dense(jacobians_t, grad, algorithm, chunk_size)


@scan_dense.register_fake
def _(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    return _empty_out(grad, jacobians_t.shape[1])


@torch.library.custom_op("bppsa::scan_factored", mutates_args=())
def scan_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """Scan a factored chain ``J_t = diag(u_t) + [diag(s_t)...] W``; see ``FactoredJacobians``."""
    return scan.run_factored(weight, scales, diagonal, grad, algorithm, chunk_size)


@scan_factored.register_fake
def _(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    return _empty_out(grad, scales.shape[1])


# --------------------------------------------------------------------------------------------------
# CPU: the torch implementation with its linear sweeps in the compiled C kernel.
# --------------------------------------------------------------------------------------------------


def _compiled_sweep(chain: Chain, out: Tensor, direct: Tensor | None) -> None:
    """A :data:`~lightning_bppsa.scan.LinearSweep` in one call of the C kernel; the torch loop where it
    cannot run (no compiler, or a dtype / layout it does not take)."""
    if not cpu.available():
        ran = False
    elif isinstance(chain, DenseChain):
        ran = cpu.linear_dense(chain.transposed_batch_major(), direct, out)
    else:
        scales, weight = chain.augmented()
        ran = cpu.linear_factored(weight, scales, direct, out)
    if not ran:
        scan.torch_sweep(chain, out, direct)


@scan_dense.register_kernel("cpu")
def _(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    return scan.run_dense(jacobians_t, grad, algorithm, chunk_size, sweep=_compiled_sweep)


@scan_factored.register_kernel("cpu")
def _(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    return scan.run_factored(weight, scales, diagonal, grad, algorithm, chunk_size, sweep=_compiled_sweep)


# --------------------------------------------------------------------------------------------------
# CUDA: the CuPy kernels (importing lightning_bppsa never touches CuPy or CUDA).
# --------------------------------------------------------------------------------------------------

#: ``"ok"``: whether the CUDA kernels run here, decided (and warned about) once
_CUDA: dict[str, bool] = {}


def _cuda_kernels_run(grad: Tensor) -> bool:
    """Whether :mod:`lightning_bppsa.kernels.cuda` runs this scan; else the torch implementation, after a warning."""
    if "ok" not in _CUDA:
        ok, reason = cuda.available()
        if not ok:
            warnings.warn(
                f"lightning_bppsa: CUDA scan kernels unavailable: {reason}; the bppsa ops run their torch "
                "implementation on CUDA instead (same results, slower; `pip install lightning-bppsa[cuda]` "
                "installs CuPy)",
                RuntimeWarning,
                stacklevel=3,
            )
        _CUDA["ok"] = ok
    if not _CUDA["ok"]:
        return False
    fits, reason = cuda.fits(grad.shape[-1], 8 if grad.dtype == torch.float64 else 4)
    if not fits:
        warnings.warn(f"lightning_bppsa CUDA scan: {reason}; running the torch implementation", RuntimeWarning, stacklevel=3)
    return fits


@scan_dense.register_kernel("cuda")
def _(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    if _cuda_kernels_run(grad):
        return cuda.scan_dense(jacobians_t, grad, algorithm, chunk_size)
    return scan.run_dense(jacobians_t, grad, algorithm, chunk_size)


@scan_factored.register_kernel("cuda")
def _(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    if _cuda_kernels_run(grad):
        return cuda.scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size)
    return scan.run_factored(weight, scales, diagonal, grad, algorithm, chunk_size)
