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

- ``"linear"``: the sequential reference, ``n`` matrix-vector steps (what autograd does). On CPU one
  call of a compiled C kernel (:mod:`lightning_bppsa._native`), else a torch loop of 2 ops per step.
- ``"blelloch"``: Algorithm 1 for any ``n``: an up-sweep of matrix-matrix products over a binary tree
  (unpaired nodes are carried up), then a down-sweep of matrix-vector products with reversed operands.
  ``2⌈log2 n⌉`` steps, ``~n`` matrix-matrix products.
- ``"chunked"``: reduce-then-scan. Chunks of ``c`` steps are reduced to one summary each (``c`` steps,
  all chunks at once), the ``p = ⌊n/c⌋`` summaries are scanned the same way (chunked again while
  ``p > 2c``, else linearly), and the chunks are swept down (``c`` steps); the ``n mod c`` leftmost
  steps run linearly. ``Θ(c + n/c)`` steps for one level, ``Θ(c log_c n)`` in all.
- ``"auto"``: whichever :mod:`lightning_bppsa.cost_model` predicts to be fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Union

import torch
from torch import Tensor

from lightning_bppsa import _native, cost_model
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["ALGORITHMS", "backprop_scan", "run_dense", "run_factored"]

ALGORITHMS = ("linear", "blelloch", "chunked", "auto")

Jacobians = Union[Tensor, FactoredJacobians]


# --------------------------------------------------------------------------------------------------
# Chains: the step Jacobians, indexed along a leading step axis (time-major), applied from the right
# to row blocks. Gradients inside the algorithms are time-major too, ``(n + 1, B, d)``, so that one
# step is one contiguous ``(B, d)`` slice.
# --------------------------------------------------------------------------------------------------


class _DenseChain:
    """Step Jacobians stored densely: ``jac[t]`` is the ``(B, d, d)`` row-form ``J`` of step ``t``."""

    def __init__(self, jac: Tensor) -> None:
        self.jac = jac
        self.steps, self.d = jac.shape[0], jac.shape[-1]

    def head(self, steps: int) -> _DenseChain:
        """The first ``steps`` steps."""
        return _DenseChain(self.jac[:steps])

    def dense(self, index: slice) -> Tensor:
        """``J`` of the steps ``index``, ``(steps, B, d, d)`` (a view: never write to it)."""
        return self.jac[index]

    def apply(self, index: int | slice, x: Tensor) -> Tensor:
        """``x @ J`` for the steps ``index`` and row blocks ``x`` of shape ``(*steps, B, r, d)``."""
        return x @ self.jac[index]

    def sweep_native(self, out: Tensor, direct: Tensor | None) -> bool:
        """The whole linear recurrence in the compiled CPU kernel (:mod:`lightning_bppsa._native`)."""
        return _native.linear_dense(self.jac.mT.transpose(0, 1), direct, out)  # (B, n, d, d) Jᵀ

    def step_into(self, t: int, x: Tensor, out: Tensor, add: Tensor | None) -> None:
        """``out = x @ J_t (+ add)`` for one step, ``x`` ``(B, d)``: the linear scan's inner loop."""
        if add is None:
            torch.bmm(x.unsqueeze(1), self.jac[t], out=out.unsqueeze(1))
        else:
            torch.baddbmm(add.unsqueeze(1), x.unsqueeze(1), self.jac[t], out=out.unsqueeze(1))


class _FactoredChain:
    """Step Jacobians ``J = diag(u) + [diag(s^1)..diag(s^k)] W`` with ``W`` shared by every step;
    ``scales`` ``(n, B, k d)`` and ``diagonal`` ``(n, B, d)`` or ``None``."""

    def __init__(self, weight: Tensor, scales: Tensor, diagonal: Tensor | None) -> None:
        self.weight, self.scales, self.diagonal = weight, scales, diagonal
        self.steps, self.d = scales.shape[0], weight.shape[1]
        self.tiles = weight.shape[0] // self.d
        self._per_step: tuple | None = None

    def head(self, steps: int) -> _FactoredChain:
        """The first ``steps`` steps."""
        diagonal = None if self.diagonal is None else self.diagonal[:steps]
        return _FactoredChain(self.weight, self.scales[:steps], diagonal)

    def dense(self, index: slice) -> Tensor:
        """``J`` of the steps ``index``, ``(steps, B, d, d)``: ``I @ J``."""
        return self.apply(index, _identity(self.d, self.weight, *self.scales[index].shape[:2]))

    def apply(self, index: int | slice, x: Tensor) -> Tensor:
        """``x @ J`` for the steps ``index`` and row blocks ``x`` of shape ``(*steps, B, r, d)``:
        one GEMM with the shared ``W``."""
        scales = self.scales[index].unsqueeze(-2)
        if self.tiles > 1:  # (.., r, k, d) * (.., 1, k, d): every tile of the row scaled by its own s^k
            scaled = (x.unsqueeze(-2) * scales.unflatten(-1, (self.tiles, self.d))).flatten(-2)
        else:
            scaled = x * scales
        out = scaled @ self.weight
        if self.diagonal is not None:
            out.addcmul_(x, self.diagonal[index].unsqueeze(-2))
        return out

    def step_into(self, t: int, x: Tensor, out: Tensor, add: Tensor | None) -> None:
        """``out = x @ J_t (+ add)`` for one step, ``x`` ``(B, d)``: two torch ops, no allocation.

        A diagonal term joins the GEMM as one more tile: ``x J = [x u, x s^1, ..] @ [I; W]``.
        """
        if self._per_step is None:  # made once: Python indexing and a third op would cost ~1 µs each
            self._per_step = self._step_factors(x)
        scales, weight, tmp, rows = self._per_step
        if rows is None:  # one tile: no broadcast (a broadcasting mul costs ~1 µs more)
            torch.mul(x, scales[t], out=tmp)
        else:
            torch.mul(x.unsqueeze(1), scales[t], out=tmp)
        if add is None:
            torch.mm(rows if rows is not None else tmp, weight, out=out)
        else:
            torch.addmm(add, rows if rows is not None else tmp, weight, out=out)

    def _augmented(self) -> tuple[Tensor, Tensor]:
        """``(scales, weight)`` with a diagonal term folded in as one more tile: ``[u, s] @ [I; W]``."""
        if self.diagonal is None:
            return self.scales, self.weight
        eye = torch.eye(self.d, dtype=self.weight.dtype, device=self.weight.device)
        return torch.cat([self.diagonal, self.scales], -1), torch.cat([eye, self.weight])

    def sweep_native(self, out: Tensor, direct: Tensor | None) -> bool:
        """The whole linear recurrence in the compiled CPU kernel (:mod:`lightning_bppsa._native`)."""
        scales, weight = self._augmented()
        return _native.linear_factored(weight, scales, direct, out)

    def _step_factors(self, like: Tensor) -> tuple:
        """Per-step scales, the (augmented) weight, a scratch block and its ``(B, k d)`` view or ``None``."""
        steps, batch = self.scales.shape[:2]
        scales, weight = self._augmented()
        if scales.shape[-1] == self.d:
            return scales.contiguous().unbind(0), weight, like.new_empty(batch, self.d), None
        tiled = scales.reshape(steps, batch, -1, self.d)
        tmp = like.new_empty(tiled.shape[1:])
        return tiled.unbind(0), weight, tmp, tmp.view(batch, -1)


_Chain = Union[_DenseChain, _FactoredChain]


def _identity(d: int, like: Tensor, *shape: int) -> Tensor:
    return torch.eye(d, dtype=like.dtype, device=like.device).expand(*shape, d, d)


# --------------------------------------------------------------------------------------------------
# Algorithms. Each takes the chain, ``last = g_n`` ``(B, d)`` and the direct gradients ``δ_0..δ_{n-1}``
# as ``(n, B, d)`` or ``None`` (a loss on ``x_n`` only: no affine rows anywhere), and returns the
# time-major ``(n + 1, B, d)`` gradients ``g_0..g_n``.
# --------------------------------------------------------------------------------------------------


def _linear(chain: _Chain, last: Tensor, direct: Tensor | None, out: Tensor | None = None) -> Tensor:
    """``g_{t} = g_{t+1} J_t + δ_t`` one step at a time; ``out`` may be given with ``out[n]`` set."""
    n = chain.steps
    if out is None:
        out = last.new_empty(n + 1, *last.shape)
        out[n] = last
    native = n and out.device.type == "cpu" and _native.available()
    if not (native and chain.sweep_native(out, direct)):
        states = out.unbind(0)
        for t in range(n - 1, -1, -1):
            chain.step_into(t, states[t + 1], states[t], None if direct is None else direct[t])
    return out


def _blelloch(chain: _Chain, last: Tensor, direct: Tensor | None) -> Tensor:
    n, (batch, d) = chain.steps, last.shape
    if n == 0:
        return last.unsqueeze(0).clone()
    # Up-sweep: a level is (chain of node composites, node offsets or None); node q of a level covers
    # later steps than node q - 1, so a parent is [C; b]_right @ C_left + [0; b_left].
    levels: list[tuple[_Chain, Tensor | None]] = [(chain, direct)]
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
        levels.append((_DenseChain(composite), offset))
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


def _chunked(chain: _Chain, last: Tensor, direct: Tensor | None, chunk_size: int) -> Tensor:
    """Reduce-then-scan. The ``n mod c`` leftmost steps stay outside the chunks and run linearly at the end."""
    n, (batch, d) = chain.steps, last.shape
    c = max(1, min(chunk_size, n))
    p, rem = divmod(n, c)
    if p <= 1 or c == 1:  # nothing to reduce
        return _linear(chain, last, direct)
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
    summaries = _DenseChain(block[..., :d, :])
    offsets = None if direct is None else block[..., d, :]
    if p > 2 * c:
        boundary = _chunked(summaries, last, offsets, c)
    else:
        boundary = _linear(summaries, last, offsets)
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
        _linear(chain.head(rem), out[rem], direct, out[: rem + 1])
    return out


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


def _run(chain_of: Callable[[torch.dtype], _Chain], grad: Tensor, n: int, algorithm: str, chunk_size: int) -> Tensor:
    """Upcast half precision to float32, run one algorithm time-major, return ``(B, n + 1, d)``."""
    compute = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    chain = chain_of(compute)
    per_step = grad.dim() == 3
    last = (grad[:, n] if per_step else grad).to(compute)
    direct = grad[:, :n].transpose(0, 1).to(compute) if per_step else None
    with _flush_denormals() if grad.device.type == "cpu" else nullcontext():
        if algorithm == "linear":
            out = _linear(chain, last, direct)
        elif algorithm == "blelloch":
            out = _blelloch(chain, last, direct)
        elif algorithm == "chunked":
            out = _chunked(chain, last, direct, chunk_size)
        else:
            raise ValueError(f"algorithm must be one of 'linear', 'blelloch', 'chunked'; got {algorithm!r}")
    # batch-major like the input (inductor assumes custom ops return dense row-major tensors)
    return out.transpose(0, 1).contiguous().to(grad.dtype)


def _time_major_chain(jac: Jacobians, dtype: torch.dtype) -> _Chain:
    """``jac`` (``(B, n, d, d)`` transposed Jacobians or factored) as a chain of time-major views in ``dtype``."""
    if isinstance(jac, FactoredJacobians):
        # the linear steps copy these views once into the layout they need
        diagonal = None if jac.diagonal is None else jac.diagonal.to(dtype).transpose(0, 1)
        return _FactoredChain(jac.weight.to(dtype), jac.scales.to(dtype).transpose(0, 1), diagonal)
    return _DenseChain(jac.to(dtype).transpose(0, 1).mT)


def run_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """Kernel of ``bppsa::scan_dense`` (inputs already validated; ``algorithm`` is not ``"auto"``)."""
    n = jacobians_t.shape[1]
    return _run(lambda dt: _time_major_chain(jacobians_t, dt), grad, n, algorithm, chunk_size)


def run_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """Kernel of ``bppsa::scan_factored`` (inputs already validated; ``algorithm`` is not ``"auto"``)."""
    jac = FactoredJacobians(weight, scales, diagonal)
    return _run(lambda dt: _time_major_chain(jac, dt), grad, scales.shape[1], algorithm, chunk_size)


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
