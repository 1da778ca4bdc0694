"""Back-propagation as an exclusive scan (BPPSA, Wang, Bai, Pekhimenko, MLSys 2020, Sec. 3).

For a chain ``x_i = f_i(x_{i-1})``, ``i = 1..n``, with Jacobians ``J_i = ∂x_i/∂x_{i-1}``, back-propagation is

    g_n = ∇_{x_n} l,        g_{i-1} = J_iᵀ g_i + δ_{i-1}                                   (Eq. 1, affine form)

where ``δ_i`` is the *direct* gradient of the loss w.r.t. ``x_i`` (zero except at ``x_n`` when the loss
only reads the last state). Every ``g_i`` is a suffix product of affine maps, so it is an exclusive scan
(Eq. 3-4) and can run in Θ(log n) steps (Algorithm 1) instead of Θ(n).

Internally gradients are *row* vectors, ``g_{i-1} = g_i J_i + δ_{i-1}``, so that the shared weight of a
factored Jacobian sits on the right of every product and a scan step is one large GEMM.
A segment ``[i..j]`` of steps composes to ``g_{i-1} = g_j C + b`` with ``C = J_j ··· J_i``; segments are
stored as ``X = [C; b]``, a ``(d + 1) x d`` matrix, and two neighbours combine as
``X_{[i..j]} = X_right @ C_left + [0; b_left]``.

The algorithms (all give the same result up to rounding):

- ``"linear"``: the sequential reference, ``n`` matrix-vector steps (what autograd does).
- ``"blelloch"``: Algorithm 1 for any ``n``: an up-sweep of matrix-matrix products over a binary tree
  (unpaired nodes are carried up), then a down-sweep of matrix-vector products with reversed operands.
  ``2⌈log2 n⌉`` steps, ``~n`` matrix-matrix products.
- ``"chunked"``: reduce-then-scan. Chunks of ``c`` steps are reduced to one summary each (``c`` steps,
  all chunks at once), the summaries are scanned with Blelloch, and the chunks are swept down
  (``c`` steps). ``Θ(n/p + log p)`` steps for ``p = n/c`` workers.
- ``"auto"``: whichever :mod:`lightning_bppsa.cost_model` predicts to be fastest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import torch
from torch import Tensor

from lightning_bppsa import cost_model
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["ALGORITHMS", "backprop_scan", "run_dense", "run_factored"]

ALGORITHMS = ("linear", "blelloch", "chunked", "auto")

Jacobians = Union[Tensor, FactoredJacobians]


# --------------------------------------------------------------------------------------------------
# Chains: the step Jacobians, indexable along their step axes, applied from the right to row blocks.
# --------------------------------------------------------------------------------------------------


class _DenseChain:
    """Step Jacobians ``J`` stored densely: ``jac`` is ``(B, *steps, d, d)``."""

    def __init__(self, jac: Tensor) -> None:
        self.jac = jac

    def select(self, index: tuple) -> _DenseChain:
        return _DenseChain(self.jac[(slice(None), *index)])

    def reshape_steps(self, shape: tuple[int, ...]) -> _DenseChain:
        return _DenseChain(self.jac.reshape(self.jac.shape[0], *shape, *self.jac.shape[-2:]))

    def pad_front(self, count: int) -> _DenseChain:
        batch, d = self.jac.shape[0], self.jac.shape[-1]
        eye = torch.eye(d, dtype=self.jac.dtype, device=self.jac.device).expand(batch, count, d, d)
        return _DenseChain(torch.cat([eye, self.jac], dim=1))

    def right_apply(self, x: Tensor) -> Tensor:
        """``x @ J`` for row blocks ``x`` of shape ``(B, *steps, r, d)``."""
        return x @ self.jac


class _FactoredChain:
    """Step Jacobians ``J = diag(u) + [diag(s^1)..diag(s^k)] W`` with ``W`` shared by every step."""

    def __init__(self, weight: Tensor, scales: Tensor, diagonal: Tensor | None) -> None:
        self.weight, self.scales, self.diagonal = weight, scales, diagonal
        self.tiles = weight.shape[0] // weight.shape[1]

    def select(self, index: tuple) -> _FactoredChain:
        full = (slice(None), *index)
        diagonal = None if self.diagonal is None else self.diagonal[full]
        return _FactoredChain(self.weight, self.scales[full], diagonal)

    def reshape_steps(self, shape: tuple[int, ...]) -> _FactoredChain:
        batch = self.scales.shape[0]
        scales = self.scales.reshape(batch, *shape, self.scales.shape[-1])
        diagonal = None if self.diagonal is None else self.diagonal.reshape(batch, *shape, -1)
        return _FactoredChain(self.weight, scales, diagonal)

    def pad_front(self, count: int) -> _FactoredChain:
        # identity steps: u = 1, s = 0
        batch, d = self.scales.shape[0], self.weight.shape[1]
        scales = torch.cat([self.scales.new_zeros(batch, count, self.scales.shape[-1]), self.scales], 1)
        diagonal = self.diagonal if self.diagonal is not None else self.scales.new_zeros(batch, self.scales.shape[1], d)
        diagonal = torch.cat([diagonal.new_ones(batch, count, d), diagonal], 1)
        return _FactoredChain(self.weight, scales, diagonal)

    def right_apply(self, x: Tensor) -> Tensor:
        """``x @ J`` for row blocks ``x`` of shape ``(B, *steps, r, d)``: one GEMM with the shared ``W``."""
        tiled = x.repeat(*([1] * (x.dim() - 1)), self.tiles) if self.tiles > 1 else x
        out = (tiled * self.scales.unsqueeze(-2)) @ self.weight
        if self.diagonal is not None:
            out = out + x * self.diagonal.unsqueeze(-2)
        return out


_Chain = Union[_DenseChain, _FactoredChain]


def _materialise(chain: _Chain, batch: int, steps: tuple[int, ...], d: int, like: Tensor) -> Tensor:
    """Dense ``J`` for every step of ``chain``: ``I @ J``."""
    eye = torch.eye(d, dtype=like.dtype, device=like.device).expand(batch, *steps, d, d)
    return chain.right_apply(eye)


def _augment(composite: Tensor, offset: Tensor) -> Tensor:
    """``[C; b]``: stack a ``(.., d, d)`` composite and its ``(.., d)`` offset into ``(.., d + 1, d)``."""
    return torch.cat([composite, offset.unsqueeze(-2)], dim=-2)


# --------------------------------------------------------------------------------------------------
# Algorithms. ``direct`` is always (B, n + 1, d); every function returns a new (B, n + 1, d) tensor.
# --------------------------------------------------------------------------------------------------


def _linear(chain: _Chain, direct: Tensor) -> Tensor:
    n = direct.shape[1] - 1
    out = torch.empty_like(direct)
    g = direct[:, n]
    out[:, n] = g
    for i in range(n, 0, -1):
        g = chain.select((i - 1,)).right_apply(g.unsqueeze(-2)).squeeze(-2) + direct[:, i - 1]
        out[:, i - 1] = g
    return out


def _blelloch(chain: _Chain, direct: Tensor) -> Tensor:
    batch, n_plus_1, d = direct.shape
    n = n_plus_1 - 1
    if n == 0:
        return direct.clone()
    # Up-sweep: level l holds the composites of its nodes as a chain plus offsets b (B, m, d).
    levels: list[tuple[_Chain, Tensor]] = [(chain, direct[:, :n])]
    while levels[-1][1].shape[1] > 1:
        nodes, offsets = levels[-1]
        m = offsets.shape[1]
        pairs = m // 2
        left, right = (slice(0, 2 * pairs, 2),), (slice(1, 2 * pairs, 2),)
        right_block = _augment(_materialise(nodes.select(right), batch, (pairs,), d, direct), offsets[:, right[0]])
        parent = nodes.select(left).right_apply(right_block)
        composite, offset = parent[..., :d, :], parent[..., d, :] + offsets[:, left[0]]
        if m % 2:  # the unpaired last node is carried up unchanged
            last = (slice(m - 1, m),)
            composite = torch.cat([composite, _materialise(nodes.select(last), batch, (1,), d, direct)], 1)
            offset = torch.cat([offset, offsets[:, last[0]]], 1)
        levels.append((_DenseChain(composite), offset))
    # Down-sweep: a node receives g at its right end; its right child gets the same g, its left
    # child gets g pushed through the right child (operands reversed w.r.t. the up-sweep).
    g = direct[:, n:]
    for nodes, offsets in reversed(levels[:-1]):
        m = offsets.shape[1]
        pairs = m // 2
        right = (slice(1, 2 * pairs, 2),)
        g_pairs = g[:, :pairs]
        g_left = nodes.select(right).right_apply(g_pairs.unsqueeze(-2)).squeeze(-2) + offsets[:, right[0]]
        children = torch.stack([g_left, g_pairs], dim=2).reshape(batch, 2 * pairs, d)
        g = torch.cat([children, g[:, pairs:]], 1) if m % 2 else children
    # leaves received g_1..g_n; g_0 comes from the first step.
    g_0 = chain.select((slice(0, 1),)).right_apply(g[:, :1].unsqueeze(-2)).squeeze(-2) + direct[:, :1]
    return torch.cat([g_0, g], 1)


def _chunked(chain: _Chain, direct: Tensor, chunk_size: int) -> Tensor:
    batch, n_plus_1, d = direct.shape
    n = n_plus_1 - 1
    if n == 0:
        return direct.clone()
    c = max(1, min(chunk_size, n))
    p = math.ceil(n / c)
    pad = p * c - n  # identity steps in front make every chunk full
    chunks = chain.pad_front(pad).reshape_steps((p, c)) if pad else chain.reshape_steps((p, c))
    padded = torch.cat([direct.new_zeros(batch, pad, d), direct], 1) if pad else direct
    inner = padded[:, : p * c].reshape(batch, p, c, d)  # δ at the left state of each step
    # 1. reduce every chunk to its summary [C; b], all chunks at once, right to left.
    eye = torch.eye(d, dtype=direct.dtype, device=direct.device)
    block = _augment(eye.expand(batch, p, d, d), direct.new_zeros(batch, p, d))
    for j in range(c - 1, -1, -1):
        block = chunks.select((slice(None), j)).right_apply(block)
        block[..., d, :] += inner[:, :, j]
    # 2. scan the p summaries: gradients at the chunk boundaries.
    boundary_direct = torch.cat([block[..., d, :], padded[:, p * c :]], 1)
    boundary = _blelloch(_DenseChain(block[..., :d, :]), boundary_direct)
    # 3. sweep every chunk down from its right boundary, all chunks at once.
    states = torch.empty(batch, p, c, d, dtype=direct.dtype, device=direct.device)
    states[:, :, 0] = boundary[:, :p]
    g = boundary[:, 1:]
    for j in range(c - 1, 0, -1):
        g = chunks.select((slice(None), j)).right_apply(g.unsqueeze(-2)).squeeze(-2) + inner[:, :, j]
        states[:, :, j] = g
    out = torch.cat([states.reshape(batch, p * c, d), boundary[:, p:]], 1)
    return out[:, pad:].contiguous()


# --------------------------------------------------------------------------------------------------
# Kernels behind the torch.library ops (lightning_bppsa.ops) and the public entry point.
# --------------------------------------------------------------------------------------------------


@contextmanager
def _flush_denormals() -> Iterator[None]:
    """Long products of contracting Jacobians underflow into denormals, ~10-100x slower on x86."""
    probe = torch.tensor(1e-39, dtype=torch.float32)
    was_on = bool((probe * 1.0).item() == 0.0)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was_on)


def _run(chain_of: callable, direct: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """Upcast half precision to float32, run one algorithm, cast back."""
    compute = torch.float32 if direct.dtype in (torch.float16, torch.bfloat16) else direct.dtype
    chain = chain_of(compute)
    direct_c = direct.to(compute)
    with _flush_denormals() if direct.device.type == "cpu" else _no_op():
        if algorithm == "linear":
            out = _linear(chain, direct_c)
        elif algorithm == "blelloch":
            out = _blelloch(chain, direct_c)
        elif algorithm == "chunked":
            out = _chunked(chain, direct_c, chunk_size)
        else:
            raise ValueError(f"algorithm must be one of 'linear', 'blelloch', 'chunked'; got {algorithm!r}")
    return out.to(direct.dtype)


@contextmanager
def _no_op() -> Iterator[None]:
    yield


def _as_direct(grad: Tensor, n: int) -> Tensor:
    """``(B, d)`` last-state gradient -> ``(B, n + 1, d)`` direct gradients (zeros before ``x_n``)."""
    if grad.dim() == 3:
        return grad
    direct = grad.new_zeros(grad.shape[0], n + 1, grad.shape[1])
    direct[:, n] = grad
    return direct


def run_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """Kernel of ``bppsa::scan_dense`` (inputs already validated; ``algorithm`` is not ``"auto"``)."""
    direct = _as_direct(grad, jacobians_t.shape[1])
    return _run(lambda dt: _DenseChain(jacobians_t.to(dt).mT), direct, algorithm, chunk_size)


def run_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """Kernel of ``bppsa::scan_factored`` (inputs already validated; ``algorithm`` is not ``"auto"``)."""
    direct = _as_direct(grad, scales.shape[1])

    def chain_of(dt: torch.dtype) -> _FactoredChain:
        return _FactoredChain(weight.to(dt), scales.to(dt), None if diagonal is None else diagonal.to(dt))

    return _run(chain_of, direct, algorithm, chunk_size)


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


def backprop_scan(jacobians_t: Jacobians, grad: Tensor, *, algorithm: str = "auto") -> Tensor:
    """Gradients w.r.t. every state of a chain, computed as a (parallel) scan. BPPSA Eq. 3-5.

    Args:
        jacobians_t: ``(B, n, d, d)`` tensor with ``jacobians_t[:, i-1] = (∂x_i/∂x_{i-1})ᵀ`` for
            ``i = 1..n`` (natural order), or a :class:`~lightning_bppsa.jacobians.FactoredJacobians`.
        grad: ``(B, d)``, the gradient of the loss w.r.t. the last state ``x_n``; or ``(B, n + 1, d)``,
            the direct gradient ``δ_i`` w.r.t. every state ``x_0..x_n`` (per-step losses:
            ``g_i = δ_i + J_{i+1}ᵀ g_{i+1}``).
        algorithm: ``"linear"``, ``"blelloch"``, ``"chunked"`` or ``"auto"`` (see the module docstring).

    Returns:
        ``(B, n + 1, d)`` tensor with ``out[:, i] = ∇_{x_i} l`` for ``i = 0..n``.

    Example:
        >>> jt = 0.5 * torch.eye(3).expand(2, 4, 3, 3)       # B=2, n=4, d=3
        >>> backprop_scan(jt, torch.ones(2, 3))[0, :, 0]     # g_i = 0.5^(4-i)
        tensor([0.0625, 0.1250, 0.2500, 0.5000, 1.0000])
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    if isinstance(jacobians_t, (list, tuple)):  # a chain of CSR transposed Jacobians (layer chains)
        from lightning_bppsa.sparse_scan import sparse_backprop_scan

        return sparse_backprop_scan(jacobians_t, grad, algorithm=algorithm)
    if isinstance(jacobians_t, FactoredJacobians):
        jacobians_t = _promote_factored(jacobians_t, grad)
        batch, n, d, m = _validate_factored(jacobians_t, grad)
        algorithm, chunk = cost_model.choose(algorithm, n=n, d=d, batch=batch, width=m, device=grad.device.type)
        jac = jacobians_t
        return torch.ops.bppsa.scan_factored(jac.weight, jac.scales, jac.diagonal, grad, algorithm, chunk)
    if not isinstance(jacobians_t, Tensor):
        raise TypeError(
            "jacobians_t must be a (B, n, d, d) Tensor or a FactoredJacobians; "
            f"got {type(jacobians_t).__name__}"
        )
    batch, n, d = _validate_dense(jacobians_t, grad)
    algorithm, chunk = cost_model.choose(algorithm, n=n, d=d, batch=batch, width=None, device=grad.device.type)
    return torch.ops.bppsa.scan_dense(jacobians_t, grad, algorithm, chunk)
