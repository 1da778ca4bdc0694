"""Every ``bppsa`` torch.library op: schema, fake (meta) kernels, and the scans' one dispatch by plan.

- ``bppsa::scan_dense(jacobians_t, grad, algorithm, chunk_size) -> Tensor``
- ``bppsa::scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size) -> Tensor``
- ``bppsa::recurrent_forward(cell, x, h0, c0, weights) -> [out, (c_n,) *factors]`` and
  ``bppsa::recurrent_backward(cell, algorithm, x, h0, c0, weights, out, factors, grad_out, grad_hn, grad_cn,
  need_x) -> [grad_x, grad_h0, (grad_c0,) *grad_weights]``: one recurrent layer in one direction, run by
  the backends of :mod:`lightning_bppsa.backends` on its cell's math (:mod:`lightning_bppsa.cells`). An eager
  layer passes its call's plan (:func:`~lightning_bppsa.backends.plan_call`, made once in its forward) to
  the Python implementations; dispatched (traced, profiled), each op plans at run time from its inputs

Both return the ``(B, n + 1, d)`` gradients of :func:`lightning_bppsa.scan.backprop_scan`, the validating
entry point; call the ops directly only with valid inputs. ``algorithm`` may be ``"auto"``: the plan
(:func:`lightning_bppsa.plan.choose`: kernel, algorithm, chunk) is decided inside the op, when it runs with
concrete shapes, device and dtype, never while ``torch.compile`` traces. ``chunk_size > 0`` overrides the
plan's chunk. Being custom ops, they are opaque to ``torch.compile`` (no graph breaks) and callable from
TorchScript as ``torch.ops.bppsa.scan_dense``. They have no autograd formula (``backprop_scan`` refuses
inputs that require grad).

:func:`execute_dense` / :func:`execute_factored` run a plan: the compiled C sweeps on CPU
(:mod:`lightning_bppsa.kernels.cpu`), the CuPy kernels on CUDA (:mod:`lightning_bppsa.kernels.cuda`; CuPy is
imported on the first CUDA call, never at import), the torch implementation
(:mod:`lightning_bppsa.algorithms`) otherwise, on CUDA after one warning saying why.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import Tensor

from lightning_bppsa import algorithms, backends, cells, plan
from lightning_bppsa._chains import Chain, DenseChain
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.kernels import cpu, cuda

__all__ = [
    "execute_dense",
    "execute_factored",
    "recurrent_backward",
    "recurrent_forward",
    "scan_dense",
    "scan_factored",
]


def _empty_out(grad: Tensor, n: int) -> Tensor:
    batch, d = grad.shape[0], grad.shape[-1]
    return grad.new_empty(batch, n + 1, d)


def _device_shared_limit(device: torch.device) -> int | None:
    """The shared memory a block may use on ``device`` where the scan's CUDA kernels run there, else ``None``
    (the plan then asks for torch's current device): a scan on another GPU is planned by its own limit."""
    if device.type != "cuda" or not cuda.available()[0]:
        return None
    return cuda.device_shared_limit(torch.cuda.current_device() if device.index is None else device.index)


def _plan_for(algorithm: str, chunk_size: int, grad: Tensor, n: int, d: int, width: int | None) -> plan.Plan:
    chosen = plan.choose(
        algorithm, n=n, d=d, batch=grad.shape[0], width=width, device=grad.device.type, dtype=grad.dtype,
        shared_limit=_device_shared_limit(grad.device),
    )  # fmt: skip
    return dataclasses.replace(chosen, chunk=chunk_size) if chunk_size > 0 else chosen


@torch.library.custom_op("bppsa::scan_dense", mutates_args=())
def scan_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """Scan a dense ``(B, n, d, d)`` chain of transposed Jacobians; see ``backprop_scan``."""
    n, d = jacobians_t.shape[1], jacobians_t.shape[-1]
    return execute_dense(_plan_for(algorithm, chunk_size, grad, n, d, None), jacobians_t, grad)


@scan_dense.register_fake
def _(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    return _empty_out(grad, jacobians_t.shape[1])


@torch.library.custom_op("bppsa::scan_factored", mutates_args=())
def scan_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """Scan a factored chain ``J_t = diag(u_t) + [diag(s_t)...] W``; see ``FactoredJacobians``."""
    chosen = _plan_for(algorithm, chunk_size, grad, scales.shape[1], weight.shape[1], weight.shape[0])
    return execute_factored(chosen, FactoredJacobians(weight, scales, diagonal), grad)


@scan_factored.register_fake
def _(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    return _empty_out(grad, scales.shape[1])


def execute_dense(chosen: plan.Plan, jacobians_t: Tensor, grad: Tensor) -> Tensor:
    """Run ``chosen`` on a dense chain (inputs already valid)."""
    if chosen.kernel == "cuda":
        return cuda.scan_dense(jacobians_t, grad, chosen.algorithm, chosen.chunk)
    _warn_torch_on_cuda(chosen, grad)
    sweep = _compiled_sweep if chosen.kernel == "c" else algorithms.torch_sweep
    return algorithms.run_dense(jacobians_t, grad, chosen.algorithm, chosen.chunk, sweep)


def execute_factored(chosen: plan.Plan, jac: FactoredJacobians, grad: Tensor) -> Tensor:
    """Run ``chosen`` on a factored chain (inputs already valid)."""
    if chosen.kernel == "cuda":
        return cuda.scan_factored(jac.weight, jac.scales, jac.diagonal, grad, chosen.algorithm, chosen.chunk)
    _warn_torch_on_cuda(chosen, grad)
    sweep = _compiled_sweep if chosen.kernel == "c" else algorithms.torch_sweep
    return algorithms.run_factored(
        jac.weight, jac.scales, jac.diagonal, grad, chosen.algorithm, chosen.chunk, sweep
    )


#: reasons already warned about (the torch implementation on CUDA): once per reason, not per call
_WARNED: set[str] = set()


def _warn_torch_on_cuda(chosen: plan.Plan, grad: Tensor) -> None:
    if grad.device.type == "cuda" and chosen.reason not in _WARNED:
        _WARNED.add(chosen.reason)
        warnings.warn(
            f"lightning_bppsa: {chosen.reason}; the bppsa ops run their torch implementation on CUDA "
            "(same results, slower; `pip install lightning-bppsa[cuda]` installs CuPy)",
            RuntimeWarning,
            stacklevel=3,
        )


def _compiled_sweep(chain: Chain, out: Tensor, direct: Tensor | None) -> None:
    """A :data:`~lightning_bppsa.algorithms.LinearSweep` in one call of the C kernel; the torch loop where
    it cannot run (a dtype / layout it does not take)."""
    if isinstance(chain, DenseChain):
        ran = cpu.linear_dense(chain.transposed_batch_major(), direct, out)
    else:  # the chain's time-major views as they are: the kernel takes strides
        ran = cpu.linear_factored(chain.weight, chain.scales, chain.diagonal, direct, out)
    if not ran:
        algorithms.torch_sweep(chain, out, direct)


# --------------------------------------------------------------------------------------------------
# The layer's two ops: one node each for torch.compile; the plan is the caller's (eager) or made at run time.
# --------------------------------------------------------------------------------------------------


# Defined through torch.library.Library rather than torch.library.custom_op: a custom_op's Python autograd
# layer costs ~17 µs more per call (measured), twice per training step on the recurrent layers' hot path.
_LIBRARY = torch.library.Library("bppsa", "FRAGMENT")
_LIBRARY.define("recurrent_forward(str cell, Tensor x, Tensor h0, Tensor? c0, Tensor[] weights) -> Tensor[]")
_LIBRARY.define(
    "recurrent_backward(str cell, str algorithm, Tensor x, Tensor h0, Tensor? c0, Tensor[] weights, Tensor out, "
    "Tensor[] factors, Tensor? grad_out, Tensor? grad_hn, Tensor? grad_cn, bool need_x) -> Tensor[]"
)


def recurrent_forward(
    cell: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    call: backends.LayerCall | None = None,
) -> list[Tensor]:
    """``[out, (c_n,) *factors]`` of one layer over batch-first ``x``, on ``call``'s forward backend (the
    backend :func:`~lightning_bppsa.backends.forward_backend` gives the inputs where ``None``)."""
    kind = cells.CELLS[cell]
    backend = (
        call.forward
        if call is not None
        else backends.forward_backend(kind, h0.shape[-1], (x, h0, c0, *weights))[0]
    )
    return backend.forward(kind, x, h0, c0, weights)


@torch.library.register_fake("bppsa::recurrent_forward", lib=_LIBRARY)
def _(cell: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor]) -> list[Tensor]:
    kind = cells.CELLS[cell]
    batch, n, hidden = x.shape[0], x.shape[1], h0.shape[-1]
    outputs = [x.new_empty(batch, n, hidden)] + ([x.new_empty(batch, hidden)] if kind.has_cell_state else [])
    return outputs + [x.new_empty(shape) for shape in kind.factor_shapes(batch, n, hidden)]


def recurrent_backward(
    cell: str,
    algorithm: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    out: Tensor,
    factors: list[Tensor],
    grad_out: Tensor | None,
    grad_hn: Tensor | None,
    grad_cn: Tensor | None,
    need_x: bool,
    call: backends.LayerCall | None = None,
) -> list[Tensor]:
    """Every input gradient of one layer (see :func:`lightning_bppsa.backends.backward`), under ``call`` (the
    forward's plan; planned here where ``None``)."""
    grads = backends.backward(cells.CELLS[cell], algorithm, call, x, h0, c0, weights, out, factors, grad_out, grad_hn,
                              grad_cn, need_x)  # fmt: skip
    return [owned(g) for g in grads]  # outputs must not alias each other


def owned(grad: Tensor) -> Tensor:
    """``grad``, copied where it is a view (of the scan's buffer, or of another gradient's)."""
    return grad.clone() if grad._is_view() else grad


@torch.library.register_fake("bppsa::recurrent_backward", lib=_LIBRARY)
def _(cell, algorithm, x, h0, c0, weights, out, factors, grad_out, grad_hn, grad_cn, need_x) -> list[Tensor]:
    states = [h0] + ([c0] if c0 is not None else [])
    grad_x = torch.empty_like(x) if need_x else x.new_empty(0)
    return [grad_x] + [torch.empty_like(s) for s in states] + [torch.empty_like(w) for w in weights]


_LIBRARY.impl("recurrent_forward", recurrent_forward, "CompositeExplicitAutograd")
_LIBRARY.impl("recurrent_backward", recurrent_backward, "CompositeExplicitAutograd")
