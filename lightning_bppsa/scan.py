"""Back-propagation as an exclusive scan (BPPSA, Wang, Bai, Pekhimenko, MLSys 2020, Sec. 3).

For a chain ``x_i = f_i(x_{i-1})``, ``i = 1..n``, with Jacobians ``J_i = ∂x_i/∂x_{i-1}``, back-propagation is

    g_n = ∇_{x_n} l,        g_{i-1} = J_iᵀ g_i + δ_{i-1}                                   (Eq. 1, affine form)

where ``δ_i`` is the *direct* gradient of the loss w.r.t. ``x_i`` (zero except at ``x_n`` when the loss
only reads the last state). Every ``g_i`` is a suffix product of affine maps, so it is an exclusive scan
(Eq. 3-4) and can run in Θ(log n) steps (Algorithm 1) instead of Θ(n).

Internally gradients are *row* vectors, ``g_{i-1} = g_i J_i + δ_{i-1}``, so that the shared weight of a
factored Jacobian sits on the right of every product and a scan step is one large GEMM; and they are
*time-major*, ``(n + 1, B, d)``, so that one step is one contiguous ``(B, d)`` block.
A segment ``[i..j]`` of steps composes to ``g_{i-1} = g_j C + b`` with ``C = J_j ··· J_i``; segments are
stored as ``X = [C; b]``, a ``(d + 1) x d`` matrix (just ``C`` when the loss reads only ``x_n``: no
affine row is carried then), and two neighbours combine as ``X_{[i..j]} = X_right @ C_left + [0; b_left]``.

The algorithms (all give the same result up to rounding):

- ``"linear"``: the sequential schedule, ``n`` matrix-vector steps (what autograd does): a torch loop
  of 2 ops per step. Every schedule runs its linear sweeps through a pluggable ``sweep``; on CPU
  :mod:`lightning_bppsa.ops` plugs in one call of the compiled C kernel
  (:mod:`lightning_bppsa.kernels.cpu`) instead of the loop.
- ``"blelloch"``: Algorithm 1 for any ``n``: an up-sweep of matrix-matrix products over a binary tree
  (unpaired nodes are carried up), then a down-sweep of matrix-vector products with reversed operands.
  ``2⌈log2 n⌉`` steps, ``~n`` matrix-matrix products.
- ``"chunked"``: reduce-then-scan. Chunks of ``c`` steps are reduced to one summary each (``c`` steps,
  all chunks at once), the ``p = ⌊n/c⌋`` summaries are scanned the same way (chunked again while
  ``p > 2c``, else linearly), and the chunks are swept down (``c`` steps); the ``n mod c`` leftmost
  steps run linearly. ``Θ(c + n/c)`` steps for one level, ``Θ(c log_c n)`` in all.
- ``"auto"``: whichever :mod:`lightning_bppsa.cost_model` predicts to be fastest.

:func:`scan_ref` is the float64 reference beside them: the plain loop, sharing no code with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Union, overload

import torch
from torch import Tensor

from lightning_bppsa import cost_model
from lightning_bppsa._chains import Chain, DenseChain, flush_denormals, time_major_chain
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.sparse_scan import SparseJacobian, sparse_backprop_scan

__all__ = ["ALGORITHMS", "LinearSweep", "backprop_scan", "run_dense", "run_factored", "scan_ref", "torch_sweep"]

ALGORITHMS = ("linear", "blelloch", "chunked", "auto")

Jacobians = Union[Tensor, FactoredJacobians]

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
    if out is None:
        out = last.new_empty(chain.steps + 1, *last.shape)
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


# --------------------------------------------------------------------------------------------------
# Kernels behind the torch.library ops (lightning_bppsa.ops) and the public entry point.
# --------------------------------------------------------------------------------------------------


def _run(
    chain_of: Callable[[torch.dtype], Chain], grad: Tensor, n: int, algorithm: str, chunk_size: int, sweep: LinearSweep
) -> Tensor:
    """Upcast half precision to float32, run one algorithm time-major, return ``(B, n + 1, d)``."""
    compute = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
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
            raise ValueError(f"algorithm must be one of 'linear', 'blelloch', 'chunked'; got {algorithm!r}")
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


def _check_grad(grad: Tensor, batch: int, n: int, d: int, like: Tensor, jac_name: str) -> None:
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a Tensor of shape (B, d) or (B, n + 1, d); got {type(grad).__name__}")
    if grad.dtype != like.dtype:
        raise TypeError(f"grad has dtype {grad.dtype} but {jac_name} has {like.dtype}; they must match")
    if grad.device != like.device:
        raise ValueError(f"grad is on {grad.device} but {jac_name} is on {like.device}; they must match")
    if tuple(grad.shape) not in ((batch, d), (batch, n + 1, d)):
        raise ValueError(
            f"grad must have shape (B, d) = {(batch, d)} or (B, n + 1, d) = {(batch, n + 1, d)} "
            f"to match {jac_name}; got {tuple(grad.shape)}"
        )


def _check_floating(t: Tensor, name: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype; got {t.dtype}")


def _validate_dense(jacobians_t: Tensor, grad: Tensor) -> tuple[int, int, int]:
    if jacobians_t.dim() != 4 or jacobians_t.shape[-1] != jacobians_t.shape[-2]:
        raise ValueError(f"jacobians_t must have shape (B, n, d, d); got {tuple(jacobians_t.shape)}")
    _check_floating(jacobians_t, "jacobians_t")
    batch, n, d, _ = jacobians_t.shape
    _check_grad(grad, batch, n, d, jacobians_t, "jacobians_t")
    return batch, n, d


def _validate_factored(jac: FactoredJacobians, grad: Tensor) -> tuple[int, int, int, int]:
    weight, scales, diagonal = jac.weight, jac.scales, jac.diagonal
    if weight.dim() != 2 or weight.shape[1] == 0 or weight.shape[0] % weight.shape[1]:
        raise ValueError(f"FactoredJacobians.weight must have shape (k * d, d); got {tuple(weight.shape)}")
    _check_floating(weight, "FactoredJacobians.weight")
    m, d = weight.shape
    if scales.dim() != 3 or scales.shape[2] != m:
        raise ValueError(f"FactoredJacobians.scales must have shape (B, n, {m}); got {tuple(scales.shape)}")
    batch, n, _ = scales.shape
    parts = [("scales", scales)] + ([("diagonal", diagonal)] if diagonal is not None else [])
    if diagonal is not None and tuple(diagonal.shape) != (batch, n, d):
        raise ValueError(f"FactoredJacobians.diagonal must have shape {(batch, n, d)}; got {tuple(diagonal.shape)}")
    for name, t in parts:
        if t.dtype != weight.dtype or t.device != weight.device:
            raise TypeError(f"FactoredJacobians.{name} must match weight's dtype and device ({weight.dtype}, {weight.device})")
    _check_grad(grad, batch, n, d, weight, "FactoredJacobians")
    return batch, n, d, m


def _promote_factored(jac: FactoredJacobians, grad: Tensor) -> FactoredJacobians:
    """Under autocast the factors may come in mixed floating dtypes: compute in ``grad``'s dtype."""
    parts = [jac.weight, jac.scales] + ([jac.diagonal] if jac.diagonal is not None else [])
    if not isinstance(grad, Tensor) or not all(t.is_floating_point() for t in [*parts, grad]):
        return jac
    if all(t.dtype == grad.dtype for t in parts):
        return jac
    diagonal = None if jac.diagonal is None else jac.diagonal.to(grad.dtype)
    return FactoredJacobians(jac.weight.to(grad.dtype), jac.scales.to(grad.dtype), diagonal)


def _check_not_differentiated(*tensors: Tensor | None) -> None:
    """The ops have no autograd formula: refuse now rather than fail (or give ``None``) in backward."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "backprop_scan is not differentiable with respect to jacobians_t or grad, and one of them "
            "requires grad: call it on .detach()ed tensors or under torch.no_grad(), or, to differentiate "
            "through the scan, use autograd on plain torch ops (e.g. lightning_bppsa.scan_ref)"
        )


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")


@overload
def backprop_scan(jacobians_t: Jacobians, grad: Tensor, *, algorithm: str = "auto") -> Tensor: ...


@overload
def backprop_scan(
    jacobians_t: Sequence[SparseJacobian], grad: Tensor, *, algorithm: str = "auto"
) -> list[Tensor]: ...


def backprop_scan(
    jacobians_t: Jacobians | Sequence[SparseJacobian], grad: Tensor, *, algorithm: str = "auto"
) -> Tensor | list[Tensor]:
    """Gradients w.r.t. every state of a chain, computed as a (parallel) scan. BPPSA Eq. 3-5.

    Args:
        jacobians_t: ``(B, n, d, d)`` tensor with ``jacobians_t[:, i-1] = (∂x_i/∂x_{i-1})ᵀ`` for
            ``i = 1..n`` (natural order), or a :class:`~lightning_bppsa.jacobians.FactoredJacobians`,
            or a list of sparse CSR transposed Jacobians of layers of different widths (a layer chain;
            forwarded to :func:`~lightning_bppsa.sparse_scan.sparse_backprop_scan`, which returns the
            list ``[g_0, ..., g_n]`` instead of one tensor).
        grad: ``(B, d)``, the gradient of the loss w.r.t. the last state ``x_n``; or ``(B, n + 1, d)``,
            the direct gradient ``δ_i`` w.r.t. every state ``x_0..x_n`` (per-step losses:
            ``g_i = δ_i + J_{i+1}ᵀ g_{i+1}``).
        algorithm: ``"linear"``, ``"blelloch"``, ``"chunked"`` or ``"auto"`` (see the module docstring).

    Returns:
        ``(B, n + 1, d)`` tensor with ``out[:, i] = ∇_{x_i} l`` for ``i = 0..n`` (a list for a list input).

    Raises:
        RuntimeError: an input requires grad while grad mode is on: the scan has no autograd formula
            (detach the inputs, or differentiate through :func:`scan_ref`).

    Example:
        >>> jt = 0.5 * torch.eye(3).expand(2, 4, 3, 3)       # B=2, n=4, d=3
        >>> backprop_scan(jt, torch.ones(2, 3))[0, :, 0]     # g_i = 0.5^(4-i)
        tensor([0.0625, 0.1250, 0.2500, 0.5000, 1.0000])
    """
    _check_algorithm(algorithm)
    if isinstance(jacobians_t, (list, tuple)):  # a chain of CSR transposed Jacobians (layer chains)
        return sparse_backprop_scan(jacobians_t, grad, algorithm=algorithm)
    if isinstance(jacobians_t, FactoredJacobians):
        jacobians_t = _promote_factored(jacobians_t, grad)
        batch, n, d, m = _validate_factored(jacobians_t, grad)
        _check_not_differentiated(jacobians_t.weight, jacobians_t.scales, jacobians_t.diagonal, grad)
        algorithm, chunk = cost_model.choose(algorithm, n=n, d=d, batch=batch, width=m, device=grad.device.type)
        jac = jacobians_t
        return torch.ops.bppsa.scan_factored(jac.weight, jac.scales, jac.diagonal, grad, algorithm, chunk)
    if not isinstance(jacobians_t, Tensor):
        raise TypeError(
            "jacobians_t must be a (B, n, d, d) Tensor or a FactoredJacobians; "
            f"got {type(jacobians_t).__name__}"
        )
    batch, n, d = _validate_dense(jacobians_t, grad)
    _check_not_differentiated(jacobians_t, grad)
    algorithm, chunk = cost_model.choose(algorithm, n=n, d=d, batch=batch, width=None, device=grad.device.type)
    return torch.ops.bppsa.scan_dense(jacobians_t, grad, algorithm, chunk)


def scan_ref(jacobians_t: Jacobians, grad: Tensor, *, algorithm: str = "auto") -> Tensor:
    """The float64 reference of :func:`backprop_scan`: the plain loop ``g_{i-1} = J_iᵀ g_i + δ_{i-1}``.

    Takes the same arguments and raises the same errors as :func:`backprop_scan` for dense
    ``(B, n, d, d)`` and factored Jacobians, so that the two can be swapped; ``algorithm`` is checked
    and otherwise ignored: the reference always runs the ``n`` sequential steps, in float64 and in plain
    torch ops (differentiable by autograd), sharing no code with the scan algorithms.

    Returns:
        ``(B, n + 1, d)`` **float64** on ``grad``'s device, whatever the inputs' dtype: the truth a fast
        path in any dtype is compared with (e.g. by :func:`lightning_bppsa.testing.assert_derived_close`).

    Example:
        >>> jt = 0.5 * torch.eye(3).expand(2, 4, 3, 3)
        >>> scan_ref(jt, torch.ones(2, 3))[0, :, 0]
        tensor([0.0625, 0.1250, 0.2500, 0.5000, 1.0000], dtype=torch.float64)
    """
    _check_algorithm(algorithm)
    if isinstance(jacobians_t, FactoredJacobians):
        jacobians_t = _promote_factored(jacobians_t, grad)
        _validate_factored(jacobians_t, grad)
        jac = jacobians_t
        diagonal = None if jac.diagonal is None else jac.diagonal.double()
        jt = FactoredJacobians(jac.weight.double(), jac.scales.double(), diagonal).dense()
    elif isinstance(jacobians_t, Tensor):
        _validate_dense(jacobians_t, grad)
        jt = jacobians_t.double()
    else:
        raise TypeError(
            "jacobians_t must be a (B, n, d, d) Tensor or a FactoredJacobians (scan_ref has no sparse "
            f"layer-chain form); got {type(jacobians_t).__name__}"
        )
    grad, n = grad.double(), jt.shape[1]
    per_step = grad.dim() == 3
    states = [grad[:, n] if per_step else grad]  # g_n, g_{n-1}, ..., g_0
    for i in range(n, 0, -1):
        g = (jt[:, i - 1] @ states[-1].unsqueeze(-1)).squeeze(-1)
        states.append(g + grad[:, i - 1] if per_step else g)
    return torch.stack(states[::-1], 1)
