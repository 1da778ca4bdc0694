"""The ``bppsa`` torch.library ops: schema, fake (meta) kernels and the kernels that run the scan.

- ``bppsa::scan_dense(jacobians_t, grad, algorithm, chunk_size) -> Tensor``
- ``bppsa::scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size) -> Tensor``

Both return the ``(B, n + 1, d)`` gradients of :func:`lightning_bppsa.scan.backprop_scan`, which is
the validating front end; call the ops directly only with already valid inputs and a concrete
``algorithm`` (``"linear"``, ``"blelloch"`` or ``"chunked"``). Being custom ops, they are opaque to
``torch.compile`` (no graph breaks) and callable from TorchScript as ``torch.ops.bppsa.scan_dense``.

The default kernel is the torch implementation in :mod:`lightning_bppsa.scan`; it runs on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa import scan

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
