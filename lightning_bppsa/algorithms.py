"""The scan algorithms over chains of step Jacobians (BPPSA Sec. 3): ``linear``, ``blelloch``, ``chunked``.

Used by the ``bppsa::`` ops (:mod:`lightning_bppsa.ops`), which pick a kernel and a plan and call
:func:`run_dense` / :func:`run_factored` here; the public entry point with its checks is
:func:`lightning_bppsa.scan.backprop_scan`. This module never imports the entry point.

Internally gradients are *row* vectors, ``g_{i-1} = g_i J_i + δ_{i-1}``, so that the shared weight of a
factored Jacobian sits on the right of every product and a scan step is one large GEMM; and they are
*time-major*, ``(n + 1, B, d)``, so that one step is one contiguous ``(B, d)`` block.
A segment ``[i..j]`` of steps composes to ``g_{i-1} = g_j C + b`` with ``C = J_j ··· J_i``; segments are
stored as ``X = [C; b]``, a ``(d + 1) x d`` matrix (just ``C`` when the loss reads only ``x_n``: no
affine row is carried then), and two neighbours combine as ``X_{[i..j]} = X_right @ C_left + [0; b_left]``.

- ``"linear"``: the sequential schedule, ``n`` matrix-vector steps (what autograd does), run by a pluggable
  ``sweep`` (the torch loop here; the ops plug in the compiled C kernel on CPU).
- ``"blelloch"``: Algorithm 1 for any ``n``: an up-sweep of matrix-matrix products over a binary tree
  (unpaired nodes are carried up), then a down-sweep of matrix-vector products with reversed operands.
  ``2⌈log2 n⌉`` steps, ``~n`` matrix-matrix products.
- ``"chunked"``: reduce-then-scan. Chunks of ``c`` steps are reduced to one summary each (``c`` steps,
  all chunks at once), the ``p = ⌊n/c⌋`` summaries are scanned the same way (chunked again while
  ``p > 2c``, else linearly), and the chunks are swept down (``c`` steps); the ``n mod c`` leftmost
  steps run linearly. ``Θ(c + n/c)`` steps for one level, ``Θ(c log_c n)`` in all.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Union

import torch
from torch import Tensor

from lightning_bppsa._chains import Chain, DenseChain, flush_denormals, time_major_chain
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["CONCRETE", "LinearSweep", "compute_dtype", "run_dense", "run_factored", "torch_sweep"]

#: the algorithms a plan may resolve to ("auto" is resolved by lightning_bppsa.plan)
CONCRETE = ("linear", "blelloch", "chunked")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a scan computes in: half precision runs in float32 (the one home of this rule)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


#: ``sweep(chain, out, direct)`` fills ``out`` (``(n + 1, B, d)``, ``out[n]`` already set) with
#: ``g_t = g_{t+1} J_t + δ_t`` for ``t = n-1..0`` (``direct``: ``δ`` as ``(n, B, d)`` or ``None``)
LinearSweep = Callable[[Chain, Tensor, Union[Tensor, None]], None]


# --------------------------------------------------------------------------------------------------
# Algorithms. Each takes the chain (:mod:`lightning_bppsa._chains`), ``last = g_n`` ``(B, d)`` and the
# direct gradients ``δ_0..δ_{n-1}`` as ``(n, B, d)`` or ``None`` (a loss on ``x_n`` only: no affine rows
# anywhere), and returns the time-major ``(n + 1, B, d)`` gradients ``g_0..g_n``.
# --------------------------------------------------------------------------------------------------


def torch_sweep(chain: Chain, out: Tensor, direct: Tensor | None) -> None:
    """The :data:`LinearSweep` in torch: ``g_t = g_{t+1} J_t + δ_t`` one step (2 ops) at a time."""
    states = out.unbind(0)
    for t in range(chain.steps - 1, -1, -1):
        chain.step_into(t, states[t + 1], states[t], None if direct is None else direct[t])


def _linear(
    chain: Chain, last: Tensor, direct: Tensor | None, sweep: LinearSweep, out: Tensor | None = None
) -> Tensor:
    """The linear schedule by ``sweep``; ``out`` may be given with ``out[n]`` set."""
    if out is None:  # a time-major view of batch-major memory: _run's result needs no transposing copy
        out = last.new_empty(last.shape[0], chain.steps + 1, *last.shape[1:]).transpose(0, 1)
        out[chain.steps] = last
    if chain.steps:
        sweep(chain, out, direct)
    return out


def _blelloch(chain: Chain, last: Tensor, direct: Tensor | None) -> Tensor:
    n, (batch, d) = chain.steps, last.shape
    if n == 0:
        return last.unsqueeze(0).clone()
    # Up-sweep: a level is (chain of node composites, node offsets or None); node q of a level covers
    # later steps than node q - 1, so a parent is [C; b]_right @ C_left + [0; b_left].
    levels: list[tuple[Chain, Tensor | None]] = [(chain, direct)]
    while levels[-1][0].steps > 1:
        nodes, offsets = levels[-1]
        m = nodes.steps
        pairs = m // 2
        left, right = slice(0, 2 * pairs, 2), slice(1, 2 * pairs, 2)
        right_block = nodes.dense(right)
        if offsets is not None:
            right_block = torch.cat([right_block, offsets[right].unsqueeze(-2)], -2)
        parent = nodes.apply(left, right_block)
        composite = parent[..., :d, :]
        offset = None if offsets is None else parent[..., d, :] + offsets[left]
        if m % 2:  # the unpaired last node is carried up unchanged
            carried = nodes.dense(slice(m - 1, m))
            composite = torch.cat([composite, carried])
            offset = None if offsets is None else torch.cat([offset, offsets[m - 1 :]])
        levels.append((DenseChain(composite), offset))
    # Down-sweep: a node receives g at its right end; its right child gets the same g, its left
    # child gets g pushed through the right child (operands reversed w.r.t. the up-sweep).
    g = last.unsqueeze(0)
    for nodes, offsets in reversed(levels[:-1]):
        m = nodes.steps
        pairs = m // 2
        right = slice(1, 2 * pairs, 2)
        g_pairs = g[:pairs]
        g_left = nodes.apply(right, g_pairs.unsqueeze(-2)).squeeze(-2)
        if offsets is not None:
            g_left = g_left + offsets[right]
        children = torch.stack([g_left, g_pairs], dim=1).reshape(2 * pairs, batch, d)
        g = torch.cat([children, g[pairs:]]) if m % 2 else children
    # the leaves received g_1..g_n; g_0 comes from the first step.
    out = last.new_empty(n + 1, batch, d)
    out[1:] = g
    chain.step_into(0, g[0], out[0], None if direct is None else direct[0])
    return out


def _chunked(chain: Chain, last: Tensor, direct: Tensor | None, chunk_size: int, sweep: LinearSweep) -> Tensor:
    """Reduce-then-scan. The ``n mod c`` leftmost steps stay outside the chunks and run linearly at the end."""
    n, (batch, d) = chain.steps, last.shape
    c = max(1, min(chunk_size, n))
    p, rem = divmod(n, c)
    if p <= 1 or c == 1:  # nothing to reduce
        return _linear(chain, last, direct, sweep)
    position = [slice(rem + i, n, c) for i in range(c)]  # step i of every chunk
    # 1. reduce every chunk to its summary [C; b], all chunks at once, right to left.
    block = chain.dense(position[c - 1])
    if direct is not None:
        block = torch.cat([block, direct[position[c - 1]].unsqueeze(-2)], -2)
    for i in range(c - 2, -1, -1):
        block = chain.apply(position[i], block)
        if direct is not None:
            block[..., d, :] += direct[position[i]]
    # 2. scan the p summaries (recursively, chunked again while they are many): gradients at the
    # chunk boundaries, states rem, rem + c, ..., n.
    summaries = DenseChain(block[..., :d, :])
    offsets = None if direct is None else block[..., d, :]
    if p > 2 * c:
        boundary = _chunked(summaries, last, offsets, c, sweep)
    else:
        boundary = _linear(summaries, last, offsets, sweep)
    # 3. sweep every chunk down from its right boundary, all chunks at once.
    out = last.new_empty(n + 1, batch, d)
    out[rem::c] = boundary
    g = boundary[1:]
    for i in range(c - 1, 0, -1):
        g = chain.apply(position[i], g.unsqueeze(-2)).squeeze(-2)
        if direct is not None:
            g += direct[position[i]]
        out[position[i]] = g
    if rem:  # the steps left of the first chunk
        _linear(chain.head(rem), out[rem], direct, sweep, out[: rem + 1])
    return out


def _run(
    chain_of: Callable[[torch.dtype], Chain], grad: Tensor, n: int, algorithm: str, chunk_size: int, sweep: LinearSweep
) -> Tensor:
    """Upcast half precision to float32, run one algorithm time-major, return ``(B, n + 1, d)``."""
    compute = compute_dtype(grad.dtype)
    chain = chain_of(compute)
    per_step = grad.dim() == 3
    last = (grad[:, n] if per_step else grad).to(compute)
    direct = grad[:, :n].transpose(0, 1).to(compute) if per_step else None
    with flush_denormals() if grad.device.type == "cpu" else nullcontext():
        if algorithm == "linear":
            out = _linear(chain, last, direct, sweep)
        elif algorithm == "blelloch":
            out = _blelloch(chain, last, direct)
        elif algorithm == "chunked":
            out = _chunked(chain, last, direct, chunk_size, sweep)
        else:
            raise ValueError(f"algorithm must be one of {CONCRETE}; got {algorithm!r}")
    # batch-major like the input (inductor assumes custom ops return dense row-major tensors)
    return out.transpose(0, 1).contiguous().to(grad.dtype)


def run_dense(
    jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int, sweep: LinearSweep = torch_sweep
) -> Tensor:
    """Torch kernel of ``bppsa::scan_dense`` (inputs already validated; ``algorithm`` is not ``"auto"``);
    ``sweep`` runs the linear sweeps (:mod:`lightning_bppsa.ops` passes the compiled one on CPU)."""
    n = jacobians_t.shape[1]
    return _run(lambda dt: time_major_chain(jacobians_t, dt), grad, n, algorithm, chunk_size, sweep)


def run_factored(
    weight: Tensor,
    scales: Tensor,
    diagonal: Tensor | None,
    grad: Tensor,
    algorithm: str,
    chunk_size: int,
    sweep: LinearSweep = torch_sweep,
) -> Tensor:
    """Torch kernel of ``bppsa::scan_factored``; as :func:`run_dense`."""
    jac = FactoredJacobians(weight, scales, diagonal)
    return _run(lambda dt: time_major_chain(jac, dt), grad, scales.shape[1], algorithm, chunk_size, sweep)
