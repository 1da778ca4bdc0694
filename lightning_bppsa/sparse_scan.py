"""BPPSA over a chain of sparse (CSR) transposed Jacobians with varying sizes (Sec. 3.3, 4.3, 5.3).

A layer chain ``x_i = f_i(x_{i-1})``, ``i = 1..n``, has transposed Jacobians ``J_iᵀ`` of shape
``(d_{i-1}, d_i)`` and back-propagation ``g_{i-1} = J_iᵀ g_i``. A segment of steps ``[i..j]`` composes to
``g_{i-1} = (J_iᵀ ··· J_jᵀ) g_j``. The scan runs the paper's level-balanced schedule (Sec. 5.3):

1. **up-sweep** for ``L`` levels: level ``l`` multiplies neighbouring composites of level ``l - 1``
   (sparse matrix-matrix, ``mm``; an unpaired last node is carried up), so a level-``L`` node covers
   ``2^L`` steps;
2. **linear scan** over the ``⌈n / 2^L⌉`` top nodes, from ``g_n`` (matrix-vector, ``mv``), giving ``g`` at
   every multiple of ``2^L``;
3. **down-sweep** from level ``L`` to 1: every right child of level ``l - 1`` pushes the ``g`` at its right
   end through itself (``mv``), giving ``g`` at every multiple of ``2^{l-1}``.

``L = 0`` is the linear scan (what autograd does), ``L = ⌈log2 n⌉ − 1`` is Blelloch's Algorithm 1
(its root product is never needed). Products of sparse Jacobians get denser level by level, so
``L`` is chosen from the predicted FLOPs of every ``L`` for a given number of workers
(:func:`plan_schedule`; unbounded workers: the critical path of Fig. 10).

Because the patterns are fixed by the architecture, every product is planned once (*symbolic phase*:
which pairs of entries meet and where their product lands, :class:`ProductPlan`, cached by pattern) and
each step only runs the *numeric phase*: gather both operands' values, multiply, ``index_add`` into the
product's values.

Batched form: each ``J_iᵀ`` is a :class:`~lightning_bppsa.jacobians.BatchedCSR` (values ``(B, nnz)`` per
sample or ``(1, nnz)`` shared by the batch, one pattern) or a ``torch.sparse_csr_tensor`` (2-D: shared;
3-D ``(B, d_{i-1}, d_i)`` with the same pattern in every batch). The gradients have different sizes, so
the result is a list ``[g_0, ..., g_n]`` with ``g_i`` of shape ``(B, d_i)``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_bppsa._chains import flush_denormals
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern

__all__ = [
    "ProductPlan",
    "ScanSchedule",
    "ScanStepFlops",
    "plan_schedule",
    "scan_flop_report",
    "sparse_backprop_scan",
]

SparseJacobian = BatchedCSR | Tensor

#: products whose symbolic phase would pair more entries than this stay out of the up-sweep (memory)
MAX_PAIRS = 50_000_000
#: operations of one scan step that run concurrently in this implementation (one after another)
WORKERS = 1


# --------------------------------------------------------------------------------------------------
# Symbolic phase: plans of products, cached by the patterns' keys.
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


def _pair_counts(a: CSRPattern, b: CSRPattern) -> Tensor:
    """``(nnz(A),)``: how many entries of ``B`` each entry of ``A`` meets (the row length of ``B``)."""
    return (b.crow[1:] - b.crow[:-1])[a.col]


def _count_pairs(a: CSRPattern, b: CSRPattern) -> int:
    return int(_pair_counts(a, b).sum())


class _PlanCache:
    """Least-recently-used plans keyed by ``(A.key, B.key)``: the patterns are the same every step."""

    def __init__(self, size: int = 64) -> None:
        self.size, self._plans = size, OrderedDict()

    def get(self, a: CSRPattern, b: CSRPattern) -> ProductPlan:
        key = (a.key, b.key)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan_product(a, b)
            if len(self._plans) > self.size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan


def _plan_product(a: CSRPattern, b: CSRPattern) -> ProductPlan:
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply patterns of shapes {a.shape} and {b.shape}")
    counts = _pair_counts(a, b)
    left = torch.repeat_interleave(torch.arange(a.nnz, device=a.col.device), counts)
    first = torch.cumsum(counts, 0) - counts  # first pair of every entry of A
    right = b.crow[a.col][left] + torch.arange(left.numel(), device=left.device) - first[left]
    n = b.shape[1]
    keys, target = torch.unique(a.row[left] * n + b.col[right], return_inverse=True)
    row = keys // n
    counts_per_row = torch.bincount(row, minlength=a.shape[0])
    crow = torch.cat([counts_per_row.new_zeros(1), counts_per_row.cumsum(0)])
    return ProductPlan(CSRPattern(crow, keys % n, (a.shape[0], n)), left, right, target)


_PLANS = _PlanCache()


# --------------------------------------------------------------------------------------------------
# Schedules: how many up-sweep levels, chosen from predicted FLOPs.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanSchedule:
    """The symbolic plan of one scan.

    Attributes:
        up_levels: ``L``, the number of up-sweep levels.
        levels: ``levels[l]`` are the patterns of the level-``l`` nodes (``levels[0]``: the ``J_iᵀ``).
        plans: ``plans[l][k]`` makes node ``k`` of level ``l + 1`` (``None``: carried up unpaired).
    """

    up_levels: int
    levels: list[list[CSRPattern]]
    plans: list[list[ProductPlan | None]]


def _step_cost(flops: list[int], workers: int | None) -> float:
    """Time of one step in FLOPs: its costliest operation, or its work shared by ``workers``."""
    if not flops:
        return 0.0
    return max(max(flops), sum(flops) / workers) if workers else float(max(flops))


def _predicted_cost(
    levels: list[list[CSRPattern]], up_flops: list[list[int]], top: int, workers: int | None
) -> float:
    """Predicted FLOPs along the steps of the schedule with ``top`` up-sweep levels (per sample)."""
    up = sum(_step_cost(flops, workers) for flops in up_flops[:top])
    linear = sum(2 * p.nnz for p in levels[top])
    down = sum(_step_cost([2 * p.nnz for p in levels[l][1::2]], workers) for l in range(top))
    return up + linear + down


_SCHEDULES: OrderedDict[tuple, ScanSchedule] = OrderedDict()


def plan_schedule(
    patterns: Sequence[CSRPattern],
    up_levels: int | None = None,
    *,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> ScanSchedule:
    """Plan the up-sweep for ``up_levels`` levels, or choose ``L`` when ``up_levels`` is ``None``.

    The choice minimises the predicted FLOPs along the schedule's steps (per sample); a step costs
    ``max(costliest operation, step work / workers)``: the up-sweep levels (``mm``), every ``mv`` of the
    linear scan, the down-sweep levels (``mv``). ``workers=None`` models unbounded workers (the
    critical path of Fig. 10, the paper's setting); this implementation runs the operations of a step
    one after another (each using every thread), which ``workers=1`` models: then the choice minimises
    total work, and the tree only pays where products stay as sparse as their factors.
    Levels are planned only while all products of the level together pair at most ``max_pairs``
    entries (the plans' index arrays take ``24 · pairs`` bytes) and the up-sweep alone stays cheaper
    than the linear scan.

    Raises:
        ValueError: a forced ``up_levels`` needs a level pairing more than ``max_pairs`` entries.
    """
    key = (tuple(p.key for p in patterns), up_levels, max_pairs, workers)
    schedule = _SCHEDULES.get(key)
    if schedule is None:
        schedule = _SCHEDULES[key] = _plan_schedule(patterns, up_levels, max_pairs, workers)
        if len(_SCHEDULES) > 32:
            _SCHEDULES.popitem(last=False)
    return schedule


def _plan_schedule(
    patterns: Sequence[CSRPattern], up_levels: int | None, max_pairs: int, workers: int | None
) -> ScanSchedule:
    n = len(patterns)
    full = _max_levels(n)
    if up_levels is not None and not 0 <= up_levels <= full:
        raise ValueError(f"up_levels must be in [0, {full}] for a chain of {n} Jacobians; got {up_levels}")
    levels: list[list[CSRPattern]] = [list(patterns)]
    plans: list[list[ProductPlan | None]] = []
    up_flops: list[list[int]] = []
    target = full if up_levels is None else up_levels
    linear_cost = _predicted_cost(levels, up_flops, 0, workers)
    while len(levels) - 1 < target:
        nodes = levels[-1]
        pairs = [_count_pairs(nodes[k], nodes[k + 1]) for k in range(0, len(nodes) - 1, 2)]
        up_cost = sum(_step_cost(flops, workers) for flops in [*up_flops, [2 * p for p in pairs]])
        if up_levels is None and (sum(pairs) > max_pairs or up_cost >= linear_cost):
            break
        if sum(pairs) > max_pairs:
            raise ValueError(
                f"up_levels={up_levels}: level {len(levels)} pairs {sum(pairs):,} entries, more than "
                f"max_pairs={max_pairs:,} ({24 * sum(pairs) / 2**30:.1f} GiB of plans); use fewer levels"
            )
        level_plans: list[ProductPlan | None] = [
            _PLANS.get(nodes[k], nodes[k + 1]) for k in range(0, len(nodes) - 1, 2)
        ]
        if len(nodes) % 2:
            level_plans.append(None)
        plans.append(level_plans)
        levels.append([nodes[-1] if p is None else p.pattern for p in level_plans])
        up_flops.append([2 * p for p in pairs])
    if up_levels is None:
        costs = [_predicted_cost(levels, up_flops, top, workers) for top in range(len(levels))]
        chosen = costs.index(min(costs))
        levels, plans = levels[: chosen + 1], plans[:chosen]
    return ScanSchedule(len(levels) - 1, levels, plans)


# --------------------------------------------------------------------------------------------------
# Numeric phase.
# --------------------------------------------------------------------------------------------------


def _multiply(plan: ProductPlan, a: BatchedCSR, b: BatchedCSR) -> BatchedCSR:
    """``A @ B`` by gather-multiply-reduce; shared operands stay shared (``V = 1``)."""
    products = a.values[:, plan.left] * b.values[:, plan.right]  # (V, pairs)
    values = products.new_zeros(products.shape[0], plan.pattern.nnz).index_add_(1, plan.target, products)
    return BatchedCSR(plan.pattern, values)


def _matvec(matrix: BatchedCSR, g: Tensor) -> Tensor:
    """``(B, rows)``: ``matrix @ g_b`` for every sample of ``g`` (``(B, cols)``)."""
    p = matrix.pattern
    if matrix.shared:  # one matrix for the batch: a library SpMM
        return (matrix.to_sparse_csr() @ g.T).T
    products = matrix.values * g[:, p.col]
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
        if jac.values.dtype != grad.dtype:
            raise TypeError(f"jacobians_t[{i}] has dtype {jac.values.dtype} but grad has {grad.dtype}")
    if chain and chain[-1].shape[1] != d_n:
        raise ValueError(
            f"grad has {d_n} features but the last Jacobian is {chain[-1].shape} (d_{{n-1}}, d_n)"
        )


def _max_levels(n: int) -> int:
    """Blelloch's depth: the most levels that leave >= 2 top nodes (the root product is never needed)."""
    return max(math.ceil(math.log2(n)) - 1, 0) if n > 1 else 0


def _up_levels(algorithm: str, up_levels: int | None, n: int) -> int | None:
    if up_levels is not None:
        return up_levels
    if algorithm == "linear":
        return 0
    if algorithm == "blelloch":
        return _max_levels(n)
    if algorithm in ("auto", "chunked"):
        return None
    raise ValueError(f"algorithm must be one of 'linear', 'blelloch', 'chunked', 'auto'; got {algorithm!r}")


def sparse_backprop_scan(
    jacobians_t: Sequence[SparseJacobian],
    grad: Tensor,
    *,
    algorithm: str = "auto",
    up_levels: int | None = None,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> list[Tensor]:
    """Gradients w.r.t. every state of a chain of sparse transposed Jacobians (BPPSA Sec. 3.3, 5.3).

    Args:
        jacobians_t: ``n`` transposed Jacobians in natural order, ``jacobians_t[i-1] = J_iᵀ`` of shape
            ``(d_{i-1}, d_i)``: :class:`~lightning_bppsa.jacobians.BatchedCSR` (values ``(B, nnz)`` or
            ``(1, nnz)``) or ``torch.sparse_csr_tensor`` (2-D shared, or 3-D ``(B, d_{i-1}, d_i)``).
        grad: ``(B, d_n)`` (or ``(d_n,)``), the gradient of the loss w.r.t. the last state ``x_n``.
        algorithm: ``"linear"`` (``L = 0``), ``"blelloch"`` (``L = ⌈log2 n⌉ − 1``), ``"auto"`` or
            ``"chunked"`` (``L`` from predicted FLOPs: the paper's up-sweep / linear / down-sweep
            schedule, chunks of ``2^L`` steps reduced by a tree and scanned linearly).
        up_levels: force ``L`` (overrides ``algorithm``).
        max_pairs: memory bound on the pairs of one up-sweep level's symbolic phase, and
        workers: the parallelism ``"auto"`` assumes (``None``: unbounded); see :func:`plan_schedule`.

    Returns:
        ``[g_0, ..., g_n]``, ``g_i = ∇_{x_i} l`` of shape ``(B, d_i)`` (``(d_i,)`` for a 1-D ``grad``).
        Patterns from :func:`~lightning_bppsa.jacobians.linearize` are cached, so their products are
        planned once; ``torch.sparse_csr_tensor`` inputs are planned on every call.

    Example:
        >>> j = torch.eye(2).to_sparse_csr()
        >>> [g.tolist() for g in sparse_backprop_scan([2 * j, 3 * j], torch.ones(1, 2))]
        [[[6.0, 6.0]], [[3.0, 3.0]], [[1.0, 1.0]]]
    """
    chain = [_as_batched(j, i) for i, j in enumerate(jacobians_t)]
    _validate(chain, grad)
    squeeze = grad.dim() == 1
    g_n = grad.unsqueeze(0) if squeeze else grad
    n = len(chain)
    levels = _up_levels(algorithm, up_levels, n)
    schedule = plan_schedule([j.pattern for j in chain], levels, max_pairs=max_pairs, workers=workers)
    with flush_denormals() if g_n.device.type == "cpu" else nullcontext():
        states = _run(schedule, chain, g_n)
    return [s.squeeze(0) for s in states] if squeeze else states


def _run(schedule: ScanSchedule, chain: list[BatchedCSR], g_n: Tensor) -> list[Tensor]:
    n = len(chain)
    nodes = [chain]
    for level_plans in schedule.plans:  # 1. up-sweep (mm)
        below = nodes[-1]
        nodes.append(
            [
                below[-1] if p is None else _multiply(p, below[2 * k], below[2 * k + 1])
                for k, p in enumerate(level_plans)
            ]
        )
    g: list[Tensor | None] = [None] * (n + 1)
    g[n] = g_n
    top = schedule.up_levels
    span = 2**top
    for k in range(len(nodes[top]) - 1, -1, -1):  # 2. linear scan over the top nodes (mv)
        g[k * span] = _matvec(nodes[top][k], g[min((k + 1) * span, n)])
    for level in range(top, 0, -1):  # 3. down-sweep (mv): right children of level - 1
        span = 2 ** (level - 1)
        for j in range(1, len(nodes[level - 1]), 2):
            g[j * span] = _matvec(nodes[level - 1][j], g[min((j + 1) * span, n)])
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


def _row(
    method: str, step: int, phase: str, kind: str, states: tuple[int, int], flops: int, p: CSRPattern
) -> dict:
    return dict(
        method=method,
        step=step,
        phase=phase,
        kind=kind,
        states=states,
        flops=flops,
        nnz=p.nnz,
        density=p.density,
        shape=p.shape,
    )


def scan_flop_report(
    jacobians_t: Sequence[SparseJacobian | CSRPattern],
    *,
    algorithm: str = "auto",
    up_levels: int | None = None,
    max_pairs: int = MAX_PAIRS,
    workers: int | None = WORKERS,
) -> list[ScanStepFlops]:
    """Per-operation FLOPs and sparsity of BPPSA's scan and of plain BP on one chain (BPPSA Fig. 10).

    Only the patterns are read (no values): ``jacobians_t`` is what :func:`sparse_backprop_scan` takes,
    or the :class:`~lightning_bppsa.jacobians.CSRPattern` of each ``J_iᵀ``; ``algorithm``, ``up_levels``,
    ``max_pairs`` and ``workers`` select the schedule exactly as there.

    Returns:
        ``list[ScanStepFlops]``: first the scan's operations in execution order (up-sweep ``mm`` steps
        ``1..L``, then the linear ``mv`` steps, then the down-sweep ``mv`` steps; in every step exactly one
        operation has ``critical=True``), then BP's ``n`` layer operations (``method="bp"``, steps ``1..n``,
        all critical). Sum ``flops`` over ``critical`` rows for the critical path of either method.

    Raises:
        ValueError: as :func:`plan_schedule`, when the forced schedule's products are too large to plan.

    Example:
        >>> j = torch.eye(3).to_sparse_csr()
        >>> rows = scan_flop_report([j, j, j], algorithm="blelloch")
        >>> [(r.step, r.phase, r.kind, r.flops) for r in rows if r.method == "bppsa"]
        [(1, 'up', 'mm', 6), (2, 'linear', 'mv', 6), (3, 'linear', 'mv', 6), (4, 'down', 'mv', 6)]
    """
    patterns = [
        j if isinstance(j, CSRPattern) else _as_batched(j, i).pattern for i, j in enumerate(jacobians_t)
    ]
    n = len(patterns)
    schedule = plan_schedule(
        patterns, _up_levels(algorithm, up_levels, n), max_pairs=max_pairs, workers=workers
    )
    steps: list[list[dict]] = []
    for level, level_plans in enumerate(schedule.plans):
        span = 2**level
        steps.append(
            [
                _row(
                    "bppsa", 0, "up", "mm", (2 * k * span, min((2 * k + 2) * span, n)), 2 * p.pairs, p.pattern
                )
                for k, p in enumerate(level_plans)
                if p is not None
            ]
        )
    top, span = schedule.up_levels, 2**schedule.up_levels
    for k in range(len(schedule.levels[top]) - 1, -1, -1):
        p = schedule.levels[top][k]
        steps.append([_row("bppsa", 0, "linear", "mv", (k * span, min((k + 1) * span, n)), 2 * p.nnz, p)])
    for level in range(top, 0, -1):
        span = 2 ** (level - 1)
        nodes = schedule.levels[level - 1]
        steps.append(
            [
                _row("bppsa", 0, "down", "mv", (j * span, min((j + 1) * span, n)), 2 * nodes[j].nnz, nodes[j])
                for j in range(1, len(nodes), 2)
            ]
        )
    for i in range(n, 0, -1):
        steps.append([_row("bp", 0, "bp", "mv", (i - 1, i), 2 * patterns[i - 1].nnz, patterns[i - 1])])
    report, step, method = [], 0, "bppsa"
    for ops in steps:
        if not ops:
            continue
        step = 1 if ops[0]["method"] != method else step + 1
        method = ops[0]["method"]
        worst = max(range(len(ops)), key=lambda k: ops[k]["flops"])
        report.extend(ScanStepFlops(**{**op, "step": step}, critical=k == worst) for k, op in enumerate(ops))
    return report
