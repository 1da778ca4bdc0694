"""BPPSA over a chain of sparse (CSR) transposed Jacobians with varying sizes (Sec. 3.3, 4.3, 5.3).

:func:`sparse_backprop_scan` is the entry point for layer chains (the dense ``(B, n, d, d)`` and factored
recurrent chains go to :func:`lightning_bppsa.backprop_scan`). A layer chain ``x_i = f_i(x_{i-1})``,
``i = 1..n``, has transposed Jacobians ``J_iᵀ`` of shape ``(d_{i-1}, d_i)`` and back-propagation
``g_{i-1} = J_iᵀ g_i``. The composite of the steps of a *span* ``(i, j)`` is ``C_{ij} = J_{i+1}ᵀ ··· J_jᵀ``
(so ``g_i = C_{ij} g_j``). Every schedule has three phases:

1. **up-sweep**: composites of longer spans from shorter ones (sparse matrix-matrix, ``mm``);
2. **linear scan** over the top composites, which tile ``0..n``, from ``g_n`` (matrix-vector, ``mv``);
3. **down-sweep**: the ``g`` inside every top span, pushed through composites (``mv``).

The algorithms differ in how the top spans are reduced:

- ``"blelloch"`` and ``"auto"``, the paper's level-balanced *tree* (Sec. 5.3): level ``l`` multiplies
  neighbouring composites of level ``l - 1`` (an unpaired last node is carried up), so the top spans
  hold ``2^L`` steps; the down-sweep goes from level ``L`` to 1, every right child pushing the ``g`` at its
  right end through itself. ``"blelloch"`` is ``L = ⌈log2 n⌉ − 1`` (Algorithm 1; its root product is never
  needed); ``"auto"`` chooses ``L`` from the predicted FLOPs of every ``L`` for a number of workers.
- ``"chunked"`` (reduce-then-scan): chunks of ``c`` steps, each reduced by a left fold (step ``t`` makes
  ``C_{a, a+t}`` of every chunk starting at ``a``), a linear scan over the chunk composites, and a linear
  sweep inside every chunk; ``c`` is chosen from predicted FLOPs among powers of two in ``[2, n / 2]``.
- ``"linear"``: no up-sweep (``L = 0``, ``c = 1``), what autograd does.

Products of sparse Jacobians get denser with every product, so a schedule is only as cheap as its
products stay sparse. Because the patterns are fixed by the architecture, every product is planned once
(*symbolic phase*: which pairs of entries meet and where their product lands, :class:`ProductPlan`,
cached by pattern) and each step only runs the *numeric phase*: gather both operands' values,
multiply, ``index_add`` into the product's values. One :class:`ScanSchedule` (the steps and their
operations) is what both :func:`sparse_backprop_scan` runs and :func:`scan_flop_report` counts.

Batched form: each ``J_iᵀ`` is a :class:`~lightning_bppsa.jacobians.BatchedCSR` (values ``(B, nnz)`` per
sample or ``(1, nnz)`` shared by the batch, one pattern) or a ``torch.sparse_csr_tensor`` (2-D: shared;
3-D ``(B, d_{i-1}, d_i)`` with the same pattern in every batch). The gradients have different sizes, so
the result is a list ``[g_0, ..., g_n]`` with ``g_i`` of shape ``(B, d_i)``.

Stored zeros select: a matrix-vector product gives exactly 0 for a stored zero whatever the gradient
it meets (``NaN`` included), and so does a product whose left factor is a stored zero, like torch's
ReLU and max-pooling backward (``threshold_backward``: a select, not a multiply). A matrix shared by
the batch (convolution, linear, average pooling) multiplies like torch's dense backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_bppsa._chains import flush_denormals
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.plan import ALGORITHMS, check_algorithm

__all__ = [
    "ALGORITHMS",
    "ProductPlan",
    "ScanOp",
    "ScanSchedule",
    "ScanStepFlops",
    "plan_schedule",
    "scan_dtype",
    "scan_flop_report",
    "sparse_backprop_scan",
]

SparseJacobian = BatchedCSR | Tensor

#: the schedules :func:`sparse_backprop_scan` runs
#: products whose symbolic phase would pair more entries than this stay out of the up-sweep (memory)
MAX_PAIRS = 50_000_000
#: operations of one scan step that run concurrently in this implementation (one after another)
WORKERS = 1


# --------------------------------------------------------------------------------------------------
# Symbolic phase: plans of products, cached by the patterns.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProductPlan:
    """Symbolic phase of ``C = A @ B`` for CSR patterns ``A`` (``m x k``) and ``B`` (``k x n``).

    Every pair of entries ``A[i, j]``, ``B[j, l]`` contributes ``A.values[left] * B.values[right]`` to
    ``C.values[target]``. Attributes: ``pattern`` of ``C``; ``left``, ``right``, ``target``: ``(pairs,)``
    int64. ``2 · pairs`` is the FLOP count of the numeric phase (per matrix).
    """

    pattern: CSRPattern
    left: Tensor
    right: Tensor
    target: Tensor

    @property
    def pairs(self) -> int:
        return int(self.left.numel())


def _count_pairs(a: CSRPattern, b: CSRPattern) -> int:
    """How many pairs of entries ``A @ B`` multiplies: every entry of ``A`` meets a row of ``B``."""
    return int((b.crow[1:] - b.crow[:-1])[a.col].sum())


# patterns hash by identity and the cache keeps them alive, so a key never refers to a new pattern
@functools.lru_cache(maxsize=64)  # a plan holds 24 bytes per pair: few, large
def _plan_product(a: CSRPattern, b: CSRPattern) -> ProductPlan:
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply patterns of shapes {a.shape} and {b.shape}")
    counts = (b.crow[1:] - b.crow[:-1])[a.col]
    left = torch.repeat_interleave(torch.arange(a.nnz, device=a.col.device), counts)
    first = torch.cumsum(counts, 0) - counts  # first pair of every entry of A
    right = b.crow[a.col][left] + torch.arange(left.numel(), device=left.device) - first[left]
    n = b.shape[1]
    keys, target = torch.unique(a.row[left] * n + b.col[right], return_inverse=True)
    row = keys // n
    counts_per_row = torch.bincount(row, minlength=a.shape[0])
    crow = torch.cat([counts_per_row.new_zeros(1), counts_per_row.cumsum(0)])
    return ProductPlan(CSRPattern(crow, keys % n, (a.shape[0], n)), left, right, target)


# --------------------------------------------------------------------------------------------------
# Schedules: the steps of a scan and their operations, chosen from predicted FLOPs.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanOp:
    """One operation of a schedule.

    Attributes:
        phase: ``"up"``, ``"linear"`` or ``"down"``.
        kind: ``"mm"`` (makes the composite of ``span`` from those of ``(i, split)`` and ``(split, j)``)
            or ``"mv"`` (``g_i = C_{ij} g_j`` for ``span = (i, j)``).
        span: ``(i, j)``: the composite ``C_{ij} = J_{i+1}ᵀ ··· J_jᵀ`` made (``mm``) or read (``mv``).
        pattern: that composite's pattern.
        split: ``mm`` only: where the span is split.
        plan: ``mm`` only: the product's symbolic phase.
    """

    phase: str
    kind: str
    span: tuple[int, int]
    pattern: CSRPattern
    split: int | None = None
    plan: ProductPlan | None = None

    @property
    def flops(self) -> int:
        """``2 ×`` multiply-adds per matrix (``mm``) or per sample (``mv``)."""
        return 2 * (self.plan.pairs if self.plan is not None else self.pattern.nnz)


@dataclass(frozen=True)
class ScanSchedule:
    """The symbolic plan of one scan: what runs, step by step.

    Attributes:
        reduce: ``"tree"`` (``"linear"``, ``"blelloch"``, ``"auto"``) or ``"chunked"``.
        chunk: steps per top span: ``2^L`` for a tree of ``L`` levels, ``c`` for chunked (1: linear).
        steps: operations of one step run concurrently (they do not depend on each other); steps run
            in order.
    """

    reduce: str
    chunk: int
    steps: tuple[tuple[ScanOp, ...], ...]

    @property
    def up_levels(self) -> int:
        """Up-sweep steps: ``L`` for a tree, ``c - 1`` for chunked."""
        return sum(1 for step in self.steps if step[0].phase == "up")


def _step_cost(flops: Iterable[int], workers: int | None) -> float:
    """Time of one step in FLOPs: its costliest operation, or its work shared by ``workers``."""
    flops = list(flops)
    if not flops:
        return 0.0
    return max(max(flops), sum(flops) / workers) if workers else float(max(flops))


class _TooLarge(Exception):
    """An up-sweep step would pair more entries than ``max_pairs``."""


class _Builder:
    """Patterns of the composites planned so far, keyed by span; turns spans into :class:`ScanOp` s."""

    def __init__(self, patterns: Sequence[CSRPattern], max_pairs: int, workers: int | None) -> None:
        self.n, self.max_pairs, self.workers = len(patterns), max_pairs, workers
        self.nodes = {(i, i + 1): p for i, p in enumerate(patterns)}

    def up_cost(self, products: list[tuple[int, int, int]]) -> float:
        """Predicted cost of the up step making ``(i, j)`` from ``(i, m)``, ``(m, j)`` for every ``(i, m, j)``.

        Raises:
            _TooLarge: the step pairs more than ``max_pairs`` entries (its plans would not fit).
        """
        pairs = [_count_pairs(self.nodes[(i, m)], self.nodes[(m, j)]) for i, m, j in products]
        if sum(pairs) > self.max_pairs:
            raise _TooLarge(
                f"{sum(pairs):,} pairs, more than max_pairs={self.max_pairs:,} "
                f"({24 * sum(pairs) / 2**30:.1f} GiB of plans)"
            )
        return _step_cost((2 * p for p in pairs), self.workers)

    def up(self, products: list[tuple[int, int, int]]) -> tuple[ScanOp, ...]:
        ops = []
        for i, m, j in products:
            plan = _plan_product(self.nodes[(i, m)], self.nodes[(m, j)])
            self.nodes[(i, j)] = plan.pattern
            ops.append(ScanOp("up", "mm", (i, j), plan.pattern, m, plan))
        return tuple(ops)

    def mv(self, phase: str, spans: Iterable[tuple[int, int]]) -> tuple[ScanOp, ...]:
        return tuple(ScanOp(phase, "mv", span, self.nodes[span]) for span in spans)

    def cost(self, steps: Iterable[tuple[ScanOp, ...]]) -> float:
        return sum(_step_cost((op.flops for op in step), self.workers) for step in steps)


def _tree_products(n: int, level: int) -> list[tuple[int, int, int]]:
    """Level ``level`` of the tree: neighbouring spans of ``2^(level-1)`` steps paired."""
    s = 2 ** (level - 1)
    return [(2 * k * s, (2 * k + 1) * s, min((2 * k + 2) * s, n)) for k in range(math.ceil(n / s) // 2)]


def _tree_mv(b: _Builder, levels: int) -> list[tuple[ScanOp, ...]]:
    """Linear scan over the level-``levels`` spans, then the down-sweep through the right children."""
    n, top = b.n, 2**levels
    steps = [
        b.mv("linear", [(k * top, min((k + 1) * top, n))]) for k in range(math.ceil(n / top) - 1, -1, -1)
    ]
    for level in range(levels, 0, -1):
        s = 2 ** (level - 1)
        steps.append(b.mv("down", [(j * s, min((j + 1) * s, n)) for j in range(1, math.ceil(n / s), 2)]))
    return steps


def _tree(b: _Builder, up_levels: int | None) -> ScanSchedule:
    """The tree of ``up_levels`` levels (raises :class:`_TooLarge`), or the cheapest one (``None``):
    levels are planned while they fit ``max_pairs`` and the up-sweep stays cheaper than the linear scan."""
    target = _max_levels(b.n) if up_levels is None else up_levels
    up: list[tuple[ScanOp, ...]] = []
    best = (b.cost(_tree_mv(b, 0)), 0)
    linear_cost, up_cost = best[0], 0.0
    while len(up) < target:
        products = _tree_products(b.n, len(up) + 1)
        try:
            up_cost += b.up_cost(products)
        except _TooLarge as error:
            if up_levels is None:
                break
            raise ValueError(
                f"up_levels={up_levels}: level {len(up) + 1} {error}; use fewer levels"
            ) from None
        if up_levels is None and up_cost >= linear_cost:
            break
        up.append(b.up(products))
        best = min(best, (b.cost(up) + b.cost(_tree_mv(b, len(up))), len(up)))
    levels = len(up) if up_levels is not None else best[1]
    return ScanSchedule("tree", 2**levels, (*up[:levels], *_tree_mv(b, levels)))


def _chunked_steps(b: _Builder, c: int, budget: float = math.inf) -> tuple[list[tuple[ScanOp, ...]], float]:
    """Steps of chunks of ``c`` and their predicted cost; stops (cost ``inf``) once past ``budget``.

    Raises:
        _TooLarge: an up step does not fit ``max_pairs``.
    """
    n = b.n
    ends = {a: min(a + c, n) for a in range(0, n, c)}
    steps, cost = [], 0.0
    for t in range(2, c + 1):  # left fold: C_{a, a+t} = C_{a, a+t-1} J_{a+t}ᵀ
        products = [(a, a + t - 1, a + t) for a, end in ends.items() if a + t <= end]
        cost += b.up_cost(products)
        if cost >= budget:
            return steps, math.inf
        steps.append(b.up(products))
    steps += [b.mv("linear", [(a, ends[a])]) for a in reversed(ends)]
    steps += [
        b.mv("down", [(a + t, a + t + 1) for a, end in ends.items() if a + t < end])
        for t in range(c - 1, 0, -1)
    ]
    return steps, b.cost(steps)


def _chunked(b: _Builder, chunk: int | None) -> ScanSchedule:
    """Chunks of ``chunk`` steps (raises :class:`_TooLarge`), or of the cheapest power of two in
    ``[2, n / 2]`` whose products fit ``max_pairs`` (1, the linear scan, when none does)."""
    if chunk is not None:
        return ScanSchedule("chunked", chunk, tuple(_chunked_steps(b, chunk)[0]))
    n = b.n
    candidates = [2**k for k in range(1, int(math.log2(max(n // 2, 1))) + 1)] or [min(2, max(n, 1))]
    best: tuple[float, int, list[tuple[ScanOp, ...]]] | None = None
    for c in candidates:
        try:
            steps, cost = _chunked_steps(b, c, math.inf if best is None else best[0])
        except _TooLarge:
            break  # longer chunks multiply denser composites still
        if best is None or cost < best[0]:
            best = (cost, c, steps)
    if best is None:  # not even chunks of 2 fit: the linear scan, as the schedule's chunk says
        best = (0.0, 1, _chunked_steps(b, 1)[0])
    return ScanSchedule("chunked", best[1], tuple(best[2]))


def _max_levels(n: int) -> int:
    """Blelloch's depth: the most levels that leave >= 2 top nodes (the root product is never needed)."""
    return max(math.ceil(math.log2(n)) - 1, 0) if n > 1 else 0


def plan_schedule(
    patterns: Sequence[CSRPattern],
    up_levels: int | None = None,
    *,
    algorithm: str = "auto",
    chunk: int | None = None,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> ScanSchedule:
    """The schedule of ``algorithm`` over a chain of ``J_iᵀ`` patterns (cached per arguments).

    ``up_levels`` forces a tree of ``L`` levels (whatever ``algorithm`` says, except ``"chunked"``),
    ``chunk`` forces the chunk size of ``"chunked"``. Otherwise the choice (``L`` of ``"auto"``, ``c`` of
    ``"chunked"``) minimises the predicted FLOPs along the schedule's steps (per sample); a step costs
    ``max(costliest operation, step work / workers)``. ``workers=None`` models unbounded workers (the
    critical path of Fig. 10, the paper's setting); this implementation runs the operations of a step
    one after another (each using every thread), which ``workers=1`` models: then the choice minimises
    total work, and a tree only pays where products stay as sparse as their factors. Up-sweep steps are
    planned only while all their products together pair at most ``max_pairs`` entries (the plans' index
    arrays take ``24 · pairs`` bytes).

    Raises:
        ValueError: an unknown ``algorithm``; ``up_levels`` or ``chunk`` out of range or given with the
            other algorithm; a forced schedule needs a step pairing more than ``max_pairs`` entries.
    """
    n = len(patterns)
    check_algorithm(algorithm)
    if up_levels is not None:
        if algorithm == "chunked":
            raise ValueError("up_levels forces a tree schedule; algorithm='chunked' takes chunk=")
        if not 0 <= up_levels <= _max_levels(n):
            raise ValueError(
                f"up_levels must be in [0, {_max_levels(n)}] for a chain of {n} Jacobians; got {up_levels}"
            )
    if chunk is not None:
        if algorithm != "chunked":
            raise ValueError(f"chunk is the chunk size of algorithm='chunked'; got algorithm={algorithm!r}")
        if not 1 <= chunk <= max(n, 1):
            raise ValueError(f"chunk must be in [1, {max(n, 1)}] for a chain of {n} Jacobians; got {chunk}")
    if algorithm == "linear" and up_levels is None:
        up_levels = 0
    elif algorithm == "blelloch" and up_levels is None:
        up_levels = _max_levels(n)
    return _plan(tuple(patterns), up_levels, algorithm == "chunked", chunk, max_pairs, workers)


@functools.lru_cache(maxsize=32)
def _plan(
    patterns: tuple[CSRPattern, ...],
    up_levels: int | None,
    chunked: bool,
    chunk: int | None,
    max_pairs: int,
    workers: int | None,
) -> ScanSchedule:
    builder = _Builder(patterns, max_pairs, workers)
    if not chunked:
        return _tree(builder, up_levels)
    try:
        return _chunked(builder, chunk)
    except _TooLarge as error:
        raise ValueError(f"chunk={chunk}: an up-sweep step {error}; use a smaller chunk") from None


# --------------------------------------------------------------------------------------------------
# Numeric phase.
# --------------------------------------------------------------------------------------------------


def _multiply(plan: ProductPlan, a: BatchedCSR, b: BatchedCSR) -> BatchedCSR:
    """``A @ B`` by gather-multiply-reduce; shared operands stay shared (``V = 1``). A stored zero of
    ``A`` (applied after ``B`` in back-propagation) selects: its products are 0 even against NaN."""
    left = a.values[:, plan.left]
    products = (left * b.values[:, plan.right]).masked_fill_(left == 0, 0)  # (V, pairs)
    values = products.new_zeros(products.shape[0], plan.pattern.nnz).index_add_(1, plan.target, products)
    return BatchedCSR(plan.pattern, values)


def _matvec(matrix: BatchedCSR, g: Tensor) -> Tensor:
    """``(B, rows)``: ``matrix @ g_b`` for every sample of ``g`` (``(B, cols)``)."""
    p = matrix.pattern
    if matrix.shared:  # one matrix for the batch: a library SpMM (multiplies, as torch's dense backward)
        return (matrix.to_sparse_csr() @ g.T).T
    products = (matrix.values * g[:, p.col]).masked_fill_(matrix.values == 0, 0)  # a stored zero selects
    return products.new_zeros(g.shape[0], p.shape[0]).index_add_(1, p.row, products)


def _as_batched(jac: SparseJacobian, index: int) -> BatchedCSR:
    if isinstance(jac, BatchedCSR):
        return jac
    if isinstance(jac, Tensor) and jac.layout == torch.sparse_csr:
        return BatchedCSR.from_sparse_csr(jac)
    kind = f"a {jac.layout} Tensor" if isinstance(jac, Tensor) else type(jac).__name__
    raise TypeError(f"jacobians_t[{index}] must be a BatchedCSR or a torch.sparse_csr_tensor; got {kind}")


def _validate(chain: list[BatchedCSR], grad: Tensor) -> None:
    if not isinstance(grad, Tensor) or grad.dim() not in (1, 2):
        raise ValueError(
            f"grad must be a Tensor of shape (B, d_n) or (d_n,); got {getattr(grad, 'shape', grad)}"
        )
    batch, d_n = (1, grad.shape[0]) if grad.dim() == 1 else grad.shape
    for i, jac in enumerate(chain):
        if i + 1 < len(chain) and jac.shape[1] != chain[i + 1].shape[0]:
            raise ValueError(
                f"jacobians_t[{i}] has shape {jac.shape} but jacobians_t[{i + 1}] has {chain[i + 1].shape}: "
                "J_iᵀ must be (d_{i-1}, d_i)"
            )
        if jac.values.shape[0] not in (1, batch):
            raise ValueError(f"jacobians_t[{i}] holds {jac.values.shape[0]} matrices for a batch of {batch}")
        if not (jac.values.is_floating_point() and grad.is_floating_point()):
            raise TypeError(
                f"jacobians_t[{i}] ({jac.values.dtype}) and grad ({grad.dtype}) must be floating point"
            )
    if chain and chain[-1].shape[1] != d_n:
        raise ValueError(
            f"grad has {d_n} features but the last Jacobian is {chain[-1].shape} (d_{{n-1}}, d_n)"
        )


def scan_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype the scan computes in: the promotion of its operands' dtypes, at least float32.

    Mixed operands (autocast: half-precision activations' Jacobians, float32 weights) meet in one
    dtype, and half precision runs in float32: torch's CPU sparse products have no half kernels.
    """
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def sparse_backprop_scan(
    jacobians_t: Sequence[SparseJacobian],
    grad: Tensor,
    *,
    algorithm: str = "auto",
    up_levels: int | None = None,
    chunk: int | None = None,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> list[Tensor]:
    """Gradients w.r.t. every state of a chain of sparse transposed Jacobians (BPPSA Sec. 3.3, 5.3).

    Args:
        jacobians_t: ``n`` transposed Jacobians in natural order, ``jacobians_t[i-1] = J_iᵀ`` of shape
            ``(d_{i-1}, d_i)``: :class:`~lightning_bppsa.jacobians.BatchedCSR` (values ``(B, nnz)`` or
            ``(1, nnz)``) or ``torch.sparse_csr_tensor`` (2-D shared, or 3-D ``(B, d_{i-1}, d_i)``).
        grad: ``(B, d_n)`` (or ``(d_n,)``), the gradient of the loss w.r.t. the last state ``x_n``.
        algorithm: one of :data:`ALGORITHMS`: ``"linear"`` (``L = 0``), ``"blelloch"``
            (``L = ⌈log2 n⌉ − 1``), ``"auto"`` (the tree's ``L`` from predicted FLOPs) or ``"chunked"``
            (reduce chunks of ``c`` steps, linear scan over them, sweep inside them; see the module).
        up_levels: force the tree's ``L`` (overrides ``algorithm``, except ``"chunked"``).
        chunk: force the chunk size ``c`` of ``"chunked"``.
        max_pairs: memory bound on the pairs of one up-sweep step's symbolic phase, and
        workers: the parallelism the choice assumes (``None``: unbounded); see :func:`plan_schedule`.

    Returns:
        ``[g_0, ..., g_n]``, ``g_i = ∇_{x_i} l`` of shape ``(B, d_i)`` (``(d_i,)`` for a 1-D ``grad``), in
        :func:`scan_dtype` of ``grad`` and the Jacobians' values (float32 for half-precision operands).
        Patterns from :func:`~lightning_bppsa.jacobians.linearize` are cached, so their products are
        planned once; ``torch.sparse_csr_tensor`` inputs are planned on every call.

    Raises:
        ValueError: mismatched shapes, an unknown ``algorithm`` (or as :func:`plan_schedule`).
        TypeError: a Jacobian that is neither CSR form, non-floating-point values.

    Example:
        >>> j = torch.eye(2).to_sparse_csr()
        >>> [g.tolist() for g in sparse_backprop_scan([2 * j, 3 * j], torch.ones(1, 2))]
        [[[6.0, 6.0]], [[3.0, 3.0]], [[1.0, 1.0]]]
    """
    chain = [_as_batched(j, i) for i, j in enumerate(jacobians_t)]
    _validate(chain, grad)
    dtype = scan_dtype([grad.dtype, *(j.values.dtype for j in chain)])
    chain = [j if j.values.dtype == dtype else BatchedCSR(j.pattern, j.values.to(dtype)) for j in chain]
    g_n = (grad.unsqueeze(0) if grad.dim() == 1 else grad).to(dtype)
    schedule = plan_schedule(
        [j.pattern for j in chain],
        up_levels,
        algorithm=algorithm,
        chunk=chunk,
        max_pairs=max_pairs,
        workers=workers,
    )
    device = g_n.device.type
    # one dtype: autocast (when called inside a region) must not recast the products
    with flush_denormals() if device == "cpu" else nullcontext(), torch.autocast(device, enabled=False):
        states = _run(schedule, chain, g_n)
    return [s.squeeze(0) for s in states] if grad.dim() == 1 else states


def _run(schedule: ScanSchedule, chain: list[BatchedCSR], g_n: Tensor) -> list[Tensor]:
    n = len(chain)
    nodes = {(i, i + 1): jac for i, jac in enumerate(chain)}
    g: list[Tensor | None] = [None] * n + [g_n]
    for step in schedule.steps:
        for op in step:
            i, j = op.span
            if op.kind == "mm":
                nodes[op.span] = _multiply(op.plan, nodes[(i, op.split)], nodes[(op.split, j)])
            else:
                g[i] = _matvec(nodes[op.span], g[j])
    return g


# --------------------------------------------------------------------------------------------------
# FLOP and sparsity report (Fig. 10).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanStepFlops:
    """One operation of a backward pass, for the FLOP / sparsity report (BPPSA Fig. 10).

    Attributes:
        method: ``"bppsa"`` (the scan) or ``"bp"`` (plain back-propagation, one ``mv`` per layer).
        step: the sequential step it runs in (1-based; operations of one step may run in parallel).
        phase: ``"up"``, ``"linear"``, ``"down"`` (BPPSA) or ``"bp"``.
        kind: ``"mm"`` (sparse matrix-matrix) or ``"mv"`` (sparse matrix-vector).
        states: ``(i, j)``: the operation involves the composite ``J_{i+1}ᵀ ··· J_jᵀ`` of states ``x_i..x_j``.
        flops: ``2 ×`` multiply-adds per sample (an ``mm`` on shared matrices runs once per batch).
        nnz: non-zeros of the matrix produced (``mm``) or read (``mv``).
        density: ``nnz / (rows · cols)`` of that matrix (``1 - sparsity``).
        shape: ``(rows, cols)`` of that matrix.
        critical: on the critical path: the costliest operation of its step.
    """

    method: str
    step: int
    phase: str
    kind: str
    states: tuple[int, int]
    flops: int
    nnz: int
    density: float
    shape: tuple[int, int]
    critical: bool


def _report_step(method: str, step: int, ops: Sequence[ScanOp]) -> list[ScanStepFlops]:
    worst = max(range(len(ops)), key=lambda k: ops[k].flops)
    return [
        ScanStepFlops(
            method,
            step,
            op.phase,
            op.kind,
            op.span,
            op.flops,
            op.pattern.nnz,
            op.pattern.density,
            op.pattern.shape,
            k == worst,
        )
        for k, op in enumerate(ops)
    ]


def scan_flop_report(
    jacobians_t: Sequence[SparseJacobian | CSRPattern],
    *,
    algorithm: str = "auto",
    up_levels: int | None = None,
    chunk: int | None = None,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> list[ScanStepFlops]:
    """Per-operation FLOPs and sparsity of BPPSA's scan and of plain BP on one chain (BPPSA Fig. 10).

    Only the patterns are read (no values): ``jacobians_t`` is what :func:`sparse_backprop_scan` takes,
    or the :class:`~lightning_bppsa.jacobians.CSRPattern` of each ``J_iᵀ``; the other arguments select
    the schedule exactly as there (the very :class:`ScanSchedule` the scan runs).

    Returns:
        ``list[ScanStepFlops]``: first the scan's operations in execution order (up-sweep ``mm`` steps,
        then the linear ``mv`` steps, then the down-sweep ``mv`` steps; in every step exactly one
        operation has ``critical=True``), then BP's ``n`` layer operations (``method="bp"``, steps ``1..n``,
        all critical). Sum ``flops`` over ``critical`` rows for the critical path of either method.

    Raises:
        ValueError: as :func:`plan_schedule`.

    Example:
        >>> j = torch.eye(3).to_sparse_csr()
        >>> rows = scan_flop_report([j, j, j], algorithm="blelloch")
        >>> [(r.step, r.phase, r.kind, r.flops) for r in rows if r.method == "bppsa"]
        [(1, 'up', 'mm', 6), (2, 'linear', 'mv', 6), (3, 'linear', 'mv', 6), (4, 'down', 'mv', 6)]
    """
    patterns = [
        j if isinstance(j, CSRPattern) else _as_batched(j, i).pattern for i, j in enumerate(jacobians_t)
    ]
    schedule = plan_schedule(
        patterns, up_levels, algorithm=algorithm, chunk=chunk, max_pairs=max_pairs, workers=workers
    )
    report = [row for step, ops in enumerate(schedule.steps, 1) for row in _report_step("bppsa", step, ops)]
    n = len(patterns)
    for step, i in enumerate(range(n, 0, -1), 1):
        report += _report_step("bp", step, [ScanOp("bp", "mv", (i - 1, i), patterns[i - 1])])
    return report
