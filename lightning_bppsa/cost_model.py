"""The cost model behind ``algorithm="auto"``: predicted seconds of each scan algorithm.

On small shapes a scan is bound by the fixed cost of each torch op (Python, dispatch, kernel launch),
on large ones by its FLOPs, so the model charges every sequential step its ops plus its FLOPs at a rate
that depends on how the FLOPs are shaped (one ``(B, d)`` row block per step, or one large GEMM):

    time = ops * op_seconds + flops / rate

- ``"linear"``: on CPU one call of the compiled kernel (:mod:`lightning_bppsa.kernels.cpu`, FLOP-bound);
  elsewhere, or without a C compiler, ``n`` steps of one ``(B, d)`` block each (2-3 torch ops).
- ``"blelloch"``: ``2 ⌈log2 n⌉`` levels of ~10 ops; ``~n`` ``d x d x d`` products in the up-sweep.
- ``"chunked"`` with chunk size ``c``, ``p = ⌊n / c⌋``: ``c`` reduce steps of ``p B d`` rows (the
  ``~n B d³`` FLOPs the scan adds to back-propagation), ``c - 1`` down-sweep steps of ``p B`` rows, the
  ``p`` dense summaries scanned the same way (chunked again while ``p > 2c``, else linearly) and the
  ``n mod c`` leftover steps linearly.

The CPU constants were fitted on the 2-core development machine (AMD EPYC, torch 2.13) from
``run_factored`` / ``run_dense`` timings over ``n ∈ {30, 300, 3000}``, ``B ∈ {1, 16, 64}``,
``d ∈ {20, 40}``; the CUDA ones are estimates (kernel launches ~10 µs, no FLOP bound at these sizes).
They only have to rank the algorithms, not predict absolute time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["CellCost", "MACHINES", "Machine", "best_chunk", "fastest", "predict_seconds", "recurrent_seconds"]


@dataclass(frozen=True)
class Machine:
    """Speed constants of one device type."""

    op_seconds: float  # fixed cost of one torch op
    rowblock_flops: float  # FLOP/s of one step of a (B, d) block: factored (one small GEMM)
    rowblock_dense_flops: float  # ... and dense (B independent matrix-vector products)
    gemm_flops: float  # FLOP/s of a large GEMM against a shared weight (factored chunk steps)
    gemm_dense_flops: float  # FLOP/s of batched small d x d products (dense chunk steps, Blelloch)
    autograd_op_seconds: float  # one op of autograd's backward (graph node + kernel)
    native_flops: float = 0.0  # FLOP/s of the compiled linear kernel, factored (0: none on this device)
    native_dense_flops: float = 0.0  # ... and dense (it streams a d x d matrix per step and row)
    native_call_seconds: float = 0.0  # fixed cost of one call (layout copies, thread start)


MACHINES = {
    "cpu": Machine(
        op_seconds=1.5e-6, rowblock_flops=1.2e10, rowblock_dense_flops=3e9, gemm_flops=3e10, gemm_dense_flops=1.2e10,
        autograd_op_seconds=6e-6,
        native_flops=2e10,
        native_dense_flops=5e9,
        native_call_seconds=3e-5,
    ),
    "cuda": Machine(
        op_seconds=1.0e-5, rowblock_flops=1e12, rowblock_dense_flops=5e11, gemm_flops=2e13, gemm_dense_flops=5e12,
        autograd_op_seconds=1.5e-5,
    ),
}


def _linear_seconds(mach: Machine, n: int, d: int, batch: int, width: int | None, native: bool) -> float:
    if native and mach.native_flops and n:  # one call of the compiled kernel
        rate = mach.native_dense_flops if width is None else mach.native_flops
        return mach.native_call_seconds + n * batch * 2 * d * (width or d) / rate
    if width is None:
        return n * (2 * mach.op_seconds + 2 * batch * d * d / mach.rowblock_dense_flops)
    ops = 2 if width == d else 3  # one more op for a diagonal term / tiled scales
    return n * (ops * mach.op_seconds + 2 * batch * d * width / mach.rowblock_flops)


def _blelloch_seconds(mach: Machine, n: int, d: int, batch: int, width: int | None) -> float:
    levels = max(1, math.ceil(math.log2(max(n, 1))))
    flops = n * batch * 2 * d * d * (d + (width or d)) + n * batch * 2 * d * d
    return levels * 16 * mach.op_seconds + flops / mach.gemm_dense_flops


def _chunked_seconds(mach: Machine, n: int, d: int, batch: int, width: int | None, c: int, native: bool) -> float:
    c = max(1, min(c, n))
    p, rem = divmod(n, c)
    if p <= 1 or c == 1:
        return _linear_seconds(mach, n, d, batch, width, native)
    w = d if width is None else width
    rate = mach.gemm_dense_flops if width is None else mach.gemm_flops
    reduce = c * (3 * mach.op_seconds + 2 * p * batch * d * d * w / rate)
    down = (c - 1) * (4 * mach.op_seconds + 2 * p * batch * d * w / rate)
    if p > 2 * c:
        summaries = _chunked_seconds(mach, p, d, batch, None, c, native)
    else:
        summaries = _linear_seconds(mach, p, d, batch, None, native)
    return reduce + down + summaries + _linear_seconds(mach, rem, d, batch, width, native) + 10 * mach.op_seconds


def predict_seconds(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, device: str, chunk_size: int = 0,
    native: bool = False,
) -> float:
    """Predicted time of one scan. ``width`` is the factored weight's rows ``m`` (``None`` = dense);
    ``native``: the linear sweeps run in the compiled C kernel."""
    mach = MACHINES.get(device, MACHINES["cuda"])
    # a diagonal-only chain (m = 0) still costs its diagonal, about one tile's d per row and step
    width = None if width is None else max(width, 1)
    if algorithm == "linear":
        return _linear_seconds(mach, n, d, batch, width, native)
    if algorithm == "blelloch":
        return _blelloch_seconds(mach, n, d, batch, width)
    if algorithm == "chunked":
        return _chunked_seconds(mach, n, d, batch, width, chunk_size, native)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def best_chunk(*, n: int, d: int, batch: int, width: int | None, device: str, native: bool) -> int:
    """The chunk size of ``"chunked"`` predicted fastest, ``2 <= c <= n / 2`` (1 for ``n < 4``): ``c = 1`` or
    ``c >= n`` would silently run the linear schedule."""
    candidates = [2**k for k in range(1, int(math.log2(max(n // 2, 1))) + 1)] or [1]
    seconds = [
        predict_seconds("chunked", n=n, d=d, batch=batch, width=width, device=device, chunk_size=c, native=native)
        for c in candidates
    ]
    return candidates[seconds.index(min(seconds))]


def fastest(*, n: int, d: int, batch: int, width: int | None, device: str, native: bool, chunk: int) -> str:
    """The algorithm predicted fastest (``"linear"`` for ``n <= 1``: nothing to parallelise)."""
    if n <= 1:
        return "linear"
    costs = {
        name: predict_seconds(
            name, n=n, d=d, batch=batch, width=width, device=device, chunk_size=chunk, native=native
        )
        for name in ("linear", "blelloch", "chunked")
    }
    return min(costs, key=costs.__getitem__)


# --------------------------------------------------------------------------------------------------
# Recurrent layers: scan backward vs. autograd through torch's own forward.
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CellCost:
    """A recurrent cell's row of the model (each cell of :mod:`lightning_bppsa.cells` owns one).

    ``autograd_ops_per_step``: torch ops per step in autograd's backward of torch's own layer; ``gates``: G
    (``W_hh`` is ``G H x H``); ``state_factor``: the scan state is ``state_factor * H``. The whole training
    step of one layer on CPU (fitted on the 2-core development machine, one thread, B in {1, 16, 64, 256},
    T in {10, 1000}, H in {20, 64}):

    - torch's layer under autograd: ``n (step + B (row + row_mac · G H²))`` (``autograd_*``);
    - the compiled cell kernels (forward with factors, fused backward, GEMMs): ``n B (row + row_mac · G H²)``
      (``native_*``) plus a fixed ~0.5 ms per call; re-fitted 2026-11-24 after the kernels' four-row steps
      (B=256, T=300, H in {20, 64}; at 1 thread the kernels then beat autograd on every B in {1, 16, 64, 256}
      x H in {20, 64} at T=300).

    ``autograd_call``: the fixed cost of one call of torch's layer under autograd (its loss and bookkeeping
    included, as the kernels' fixed cost). Measured at B=1 H=20, one thread, 2026-11-24 ~14:00 UTC, after
    the layers' Python per call was cut: RNN T=2 / 3 / 5 torch 386 / 445 / 543 µs vs the kernels 457 / 467
    / 462; GRU T=2 603 vs 479; LSTM T=3 / 6 545 / 552 vs 518 / 518 (torch's LSTM costs more per call).
    """

    autograd_ops_per_step: float
    gates: int
    state_factor: int
    autograd_step: float = 0.0
    autograd_row: float = 0.0
    autograd_row_mac: float = 0.0
    native_row: float = 0.0
    native_row_mac: float = 0.0
    autograd_call: float = 3e-4


_SCAN_FIXED_OPS = 170  # autograd.Function, Jacobian data, validation, parameter GEMMs: ~0.25 ms whatever n
_ELEMENTWISE_BYTES_PER_S = 5e9  # element-wise passes over (B, n, G H) in the forward and backward
_NATIVE_CALL_SECONDS = 5e-4  # the two ops, their GEMMs and autograd's bookkeeping, per layer call


@lru_cache(maxsize=1024)  # asked once per shape by the layer plan; shapes repeat from batch to batch
def recurrent_seconds(
    cost: CellCost, *, n: int, hidden: int, batch: int, width: int, device: str, native: bool, fused: bool = False
) -> tuple[float, float]:
    """Predicted seconds ``(scan, autograd)`` of one recurrent layer's training step on CPU (or the backward
    alone, ``fused=False``), what :func:`lightning_bppsa.layer_plan.plan_layer` compares off CUDA.

    ``fused``: the compiled cell kernels run the whole layer (CPU): whole steps are compared with the
    fitted rows of :class:`CellCost`. Otherwise the predicted backward of autograd (``n`` steps of a few
    small ops each) is compared with the scan's (best algorithm of :func:`predict_seconds` over the factored
    Jacobians of ``width`` rows, plus the element-wise passes over the gates, linear in ``B n H G``).
    """
    macs = cost.gates * hidden * hidden
    if fused:
        ours = _NATIVE_CALL_SECONDS + n * batch * (cost.native_row + cost.native_row_mac * macs)
        autograd = cost.autograd_call + n * (
            cost.autograd_step + batch * (cost.autograd_row + cost.autograd_row_mac * macs)
        )
        return ours, autograd
    mach = MACHINES.get(device, MACHINES["cuda"])
    d, gates = cost.state_factor * hidden, cost.gates
    autograd = n * (cost.autograd_ops_per_step * mach.autograd_op_seconds + 4 * batch * macs / mach.rowblock_flops)
    chunk = best_chunk(n=n, d=d, batch=batch, width=width, device=device, native=native)
    algorithm = fastest(n=n, d=d, batch=batch, width=width, device=device, native=native, chunk=chunk)
    scan = predict_seconds(algorithm, n=n, d=d, batch=batch, width=width, device=device, chunk_size=chunk, native=native)
    extra = _SCAN_FIXED_OPS * mach.op_seconds + 12 * 4 * batch * n * gates * hidden / _ELEMENTWISE_BYTES_PER_S
    return scan + extra, autograd
