"""BPPSA across processes: model-parallel back-propagation as a distributed exclusive scan (Sec. 3, 3.6).

A chain ``x_i = f_i(x_{i-1})``, ``i = 1..N``, is split over the ``p`` ranks of a process group into
contiguous segments: rank ``r`` holds steps ``s_r + 1 .. s_{r+1}`` (``n_r = s_{r+1} - s_r >= 1`` of them,
any lengths) and the states ``x_{s_r} .. x_{s_{r+1}}``. Neighbouring ranks share one boundary state.
Back-propagation (row form, as in :mod:`lightning_bppsa.scan`) is ``g_{i-1} = g_i J_i + δ_{i-1}``.

Three phases, ``Θ(n/p + log p)`` steps and ``O(n/p)`` memory per rank:

1. **Local reduce.** Rank ``r > 0`` folds its segment into one affine summary ``X_r = [C_r; b_r]``
   (``(d + 1) x d`` per sample): for ``h``, the gradient arriving at its right boundary from the ranks
   to its right, ``g_{s_r} = h C_r + b_r`` with ``C_r = J_{s_{r+1}} ··· J_{s_r + 1}`` and ``b_r``
   collecting the rank's own direct gradients (a boundary state's belongs to the rank on its right).
2. **Exclusive scan across ranks** (right to left, Kogge-Stone): in round ``k = 0..⌈log2 p⌉-1`` rank
   ``r`` sends its running composite of ranks ``r .. r + 2^k - 1`` to rank ``r - 2^k`` and receives
   that of ranks ``r + 2^k .. r + 2^{k+1} - 1`` from rank ``r + 2^k``. One ``(B, d + 1, d)`` message per
   rank and round. Composites combine as ``X_{left∘right} = X_right @ C_left + [0; b_left]``. After the
   last round rank ``r`` knows the composite ``E_r`` of ranks ``r + 1 .. p - 1``; the incoming gradient
   is its offset ``h_r = b(E_r)`` (the chain ends at ``x_N``, where nothing arrives from the right).
3. **Local down-sweep.** ``h_r`` is added to the rank's right-boundary direct gradient and the segment
   is scanned with the single-process :func:`lightning_bppsa.scan.backprop_scan`.

Every rank executes a fixed sequence of operations for a fixed ``p`` and split, so the result is
bitwise reproducible run to run; it equals the single-process scan over the concatenated chain up to
rounding (the operations are grouped differently).

Failure: every receive waits at most the process group's timeout (``init_process_group(timeout=...)``);
a peer that died or stalled surfaces as :class:`DistributedScanError` naming the round and the peer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_bppsa._chains import flush_denormals, time_major_chain
from lightning_bppsa.algorithms import compute_dtype
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.scan import backprop_scan as _local_scan

T = TypeVar("T")

__all__ = ["DistributedScanError", "distributed_backprop_scan", "scan_rounds", "segment_summary"]

Jacobians = Tensor | FactoredJacobians


class DistributedScanError(RuntimeError):
    """A peer of the distributed scan failed, exited or did not answer within the group's timeout."""


def scan_rounds(world_size: int) -> int:
    """Rounds of point-to-point messages in the cross-rank scan: ``⌈log2 p⌉``."""
    return math.ceil(math.log2(world_size)) if world_size > 1 else 0


def segment_summary(jacobians_t: Jacobians, direct: Tensor) -> Tensor:
    """The affine summary ``X = [C; b]`` of a segment: ``g_0 = h C + b`` for ``h`` arriving at ``x_n``.

    Args:
        jacobians_t: the segment's ``n`` transposed Jacobians, ``(B, n, d, d)`` or FactoredJacobians.
        direct: ``(B, n + 1, d)`` direct gradients of the segment's states ``x_0..x_n``.

    Returns:
        ``(B, d + 1, d)``: rows ``0..d-1`` are ``C = J_n ··· J_1``, row ``d`` is
        ``b = δ_n C + Σ_{i<n} δ_i J_i ··· J_1`` (all in row form), computed right to left in ``n`` steps.
    """
    batch, n_plus_1, d = direct.shape
    eye = torch.eye(d, dtype=direct.dtype, device=direct.device).expand(batch, d, d)
    block = torch.cat([eye, direct[:, -1:]], dim=1)
    chain = time_major_chain(jacobians_t, direct.dtype)
    with flush_denormals() if direct.device.type == "cpu" else nullcontext():
        for step in range(n_plus_1 - 2, -1, -1):
            block = chain.apply(step, block)
            block[:, d] += direct[:, step]
    return block


def _compose(left: Tensor, right: Tensor) -> Tensor:
    """Composite of two adjacent segments (``left`` nearer ``x_0``): ``X_right @ C_left + [0; b_left]``."""
    d = left.shape[-1]
    out = right @ left[:, :d]
    out[:, d] += left[:, d]
    return out


def _exclusive_scan(summary: Tensor | None, direct: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``h_r: (B, d)``, the offset of the composite of ranks ``r + 1 .. p - 1`` (zeros on the last rank).

    ``summary`` is this rank's ``(B, d + 1, d)`` ``X_r``, or ``None`` on rank 0, whose composite no
    rank needs; ``direct`` (``(B, n + 1, d)``) gives the batch, width, dtype and device.
    """
    batch, _, d = direct.shape
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    running = summary  # composite of ranks r .. r + 2^k - 1
    beyond: Tensor | None = None  # composite of ranks r + 1 .. r + 2^k - 1 (None: empty)
    for k in range(scan_rounds(world)):
        span = 1 << k
        sent = None
        if rank - span >= 0:
            dst = dist.get_global_rank(group, rank - span) if group is not None else rank - span
            # gloo may raise when the op is posted (peer already gone), not only on wait
            post = partial(dist.isend, running.contiguous(), dst=dst, group=group)
            sent = _guarded(post, f"sending to rank {dst}", k)
        if rank + span < world:
            src = dist.get_global_rank(group, rank + span) if group is not None else rank + span
            incoming = direct.new_empty(batch, d + 1, d)
            what = f"receiving from rank {src}"
            request = _guarded(partial(dist.irecv, incoming, src=src, group=group), what, k)
            _guarded(request.wait, what, k)
            beyond = incoming if beyond is None else _compose(beyond, incoming)
            if summary is not None:
                running = _compose(summary, beyond)
        if sent is not None:
            _guarded(sent.wait, f"sending to rank {dst}", k)
    return direct.new_zeros(batch, d) if beyond is None else beyond[:, d]


def _guarded(call: Callable[[], T], what: str, round_: int) -> T:
    """``call()``, with a dead or silent peer's RuntimeError turned into a DistributedScanError."""
    try:
        return call()
    except RuntimeError as error:  # gloo / NCCL report a dead or silent peer as RuntimeError
        raise DistributedScanError(
            f"distributed BPPSA scan, rank {dist.get_rank()}: {what} failed in round {round_} "
            f"(the peer died or did not answer within the process group's timeout): {error}"
        ) from error


def _local_direct(grad: Tensor | None, n: int, d: int, like: Tensor, last: bool) -> Tensor:
    batch = like.shape[0]
    if grad is None:
        return like.new_zeros(batch, n + 1, d)
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a Tensor or None; got {type(grad).__name__}")
    if grad.dtype != like.dtype or grad.device != like.device:
        raise TypeError(f"grad must have the Jacobians' dtype and device ({like.dtype}, {like.device})")
    if tuple(grad.shape) == (batch, n + 1, d):
        if not last and bool(grad[:, n].any()):
            raise ValueError(
                "grad[:, -1] must be zero on every rank but the last: the shared boundary state belongs to "
                "the next rank, whose grad[:, 0] carries its direct gradient"
            )
        return grad
    if tuple(grad.shape) == (batch, d):
        if not last:
            raise ValueError("a (B, d) last-state gradient is only accepted on the last rank of the group")
        direct = grad.new_zeros(batch, n + 1, d)
        direct[:, n] = grad
        return direct
    raise ValueError(
        f"grad must be None, (B, n_local + 1, d) = {(batch, n + 1, d)} or, on the last rank, "
        f"(B, d) = {(batch, d)}; got {tuple(grad.shape)}"
    )


def _shape(jacobians_t: Jacobians) -> tuple[Tensor, int, int]:
    """``(a tensor with the batch, dtype and device, n_local, d)`` after validating ``jacobians_t``."""
    if isinstance(jacobians_t, FactoredJacobians):
        return jacobians_t.scales, jacobians_t.length, jacobians_t.state_size
    if not isinstance(jacobians_t, Tensor):
        raise TypeError(
            f"jacobians_t must be a Tensor or FactoredJacobians; got {type(jacobians_t).__name__}"
        )
    if jacobians_t.dim() != 4 or jacobians_t.shape[-1] != jacobians_t.shape[-2]:
        raise ValueError(f"jacobians_t must have shape (B, n_local, d, d); got {tuple(jacobians_t.shape)}")
    return jacobians_t, jacobians_t.shape[1], jacobians_t.shape[-1]


def distributed_backprop_scan(
    jacobians_t_local: Jacobians,
    grad: Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
    algorithm: str = "linear",
) -> Tensor:
    """Gradients w.r.t. this rank's states of a chain split over the ranks of ``group``.

    Rank ``r`` holds steps ``s_r + 1 .. s_{r+1}`` of a chain of ``N = Σ n_r`` steps, in rank order.

    Args:
        jacobians_t_local: this rank's ``(B, n_local, d, d)`` transposed Jacobians,
            ``[:, j] = (∂x_{s_r+j+1}/∂x_{s_r+j})ᵀ``, or a
            :class:`~lightning_bppsa.jacobians.FactoredJacobians` (same ``weight`` on every rank).
            ``n_local >= 1``; lengths may differ between ranks; ``B``, ``d``, dtype must agree.
        grad: the direct gradients ``δ`` of this rank's states ``x_{s_r} .. x_{s_{r+1}}``,
            ``(B, n_local + 1, d)``. A boundary state ``x_{s_r}`` (``r > 0``) appears on ranks ``r - 1``
            (last row) and ``r`` (first row); it belongs to rank ``r``: its direct gradient is rank
            ``r``'s first row and rank ``r - 1``'s last row must be zero (checked). So the global direct
            gradients are ``cat([δ_0[:, :-1], δ_1[:, :-1], ..., δ_{p-1}], dim=1)``. ``None`` means zeros.
            On the last rank ``(B, d)`` is the gradient of the loss w.r.t. ``x_N`` alone.
        group: the process group (default: the world).
        algorithm: the single-process algorithm for the local down-sweep (see ``scan.backprop_scan``);
            ``"linear"`` (matrix-vector steps) is the cheapest for one core per rank.

    Returns:
        ``(B, n_local + 1, d)`` with ``out[:, j] = ∇_{x_{s_r+j}} l``. The shared boundary state is
        returned by both neighbours (equal up to rounding); the global result is
        ``cat([out_0, out_1[:, 1:], ..., out_{p-1}[:, 1:]], dim=1)``.

    Raises:
        DistributedScanError: a peer died or did not answer within the process group's timeout.

    Example (on each of 2 ranks of an initialised group; chain of 4 steps split 3 + 1)::

        jt = 0.5 * torch.eye(3).expand(2, 3 if rank == 0 else 1, 3, 3)
        g = distributed.distributed_backprop_scan(jt, torch.ones(2, 3) if rank == 1 else None)
        # rank 0: g[0, :, 0] = [0.0625, 0.125, 0.25, 0.5]; rank 1: [0.5, 1.0]
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "lightning_bppsa.distributed.distributed_backprop_scan needs torch.distributed.init_process_group"
        )
    like, n, d = _shape(jacobians_t_local)
    if n < 1:
        raise ValueError("every rank must hold at least one step (n_local >= 1)")
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    direct = _local_direct(grad, n, d, like, last)
    # without per-step gradients only the segment's last state receives one: the local scan then
    # takes the cheaper (B, d) last-state form (no affine rows)
    state_only = grad is None or grad.dim() == 2
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return _local_scan(jacobians_t_local, direct[:, n] if state_only else direct, algorithm=algorithm)
    compute = compute_dtype(direct.dtype)
    direct_c = direct.to(compute)
    summary = segment_summary(_cast(jacobians_t_local, compute), direct_c) if rank > 0 else None
    incoming = _exclusive_scan(summary, direct_c, group).to(direct.dtype)
    if state_only:
        return _local_scan(jacobians_t_local, direct[:, n] + incoming, algorithm=algorithm)
    direct = direct.clone()
    direct[:, n] += incoming
    return _local_scan(jacobians_t_local, direct, algorithm=algorithm)


def _cast(jac: Jacobians, dtype: torch.dtype) -> Jacobians:
    if isinstance(jac, FactoredJacobians):
        diagonal = None if jac.diagonal is None else jac.diagonal.to(dtype)
        return FactoredJacobians(jac.weight.to(dtype), jac.scales.to(dtype), diagonal)
    return jac.to(dtype)
