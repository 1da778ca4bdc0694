"""The cost model behind ``algorithm="auto"``: predicted seconds of each scan algorithm.

On small shapes a scan is bound by the fixed cost of each torch op (dispatch, kernel launch), not by
FLOPs, so the model charges every sequential step a number of ops plus its FLOPs at a rate that
depends on how the FLOPs are shaped:

    time = ops * op_seconds + flops / rate

- ``"linear"``: ``n`` steps of matrix-vector products (rate ``small_flops``).
- ``"blelloch"``: ``2 ⌈log2 n⌉`` levels; ``~n`` ``(d+1) x d x d`` matrix-matrix products in the up-sweep.
- ``"chunked"`` with chunk size ``c``, ``p = ⌈n / c⌉``: ``2c`` steps over all chunks at once plus a
  Blelloch scan of ``p`` summaries; its ``~n`` matrix-matrix products run as one large GEMM per step
  when the Jacobians are factored (``gemm_flops``), as batched small products when dense.

The constants were fitted on the 2-core development CPU and on an H100 (see ``benchmarks/scan.py``);
they only have to rank the algorithms, not predict absolute time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Machine", "MACHINES", "choose", "predict_seconds", "recurrent_path"]


@dataclass(frozen=True)
class Machine:
    """Speed constants of one device type."""

    op_seconds: float  # fixed cost of one torch op
    small_flops: float  # FLOP/s of batched small (d x d) products and matrix-vector products
    gemm_flops: float  # FLOP/s of one large GEMM against a shared weight


MACHINES = {
    "cpu": Machine(op_seconds=6e-6, small_flops=1.0e10, gemm_flops=6e10),
    "cuda": Machine(op_seconds=1.2e-5, small_flops=2e12, gemm_flops=2e13),
}

_OPS_PER_STEP = {"linear": 4, "up": 10, "down": 7, "chunk": 5}


def _blelloch_seconds(mach: Machine, n: int, d: int, batch: int) -> float:
    levels = max(1, math.ceil(math.log2(max(n, 1))))
    ops = levels * (_OPS_PER_STEP["up"] + _OPS_PER_STEP["down"])
    flops = n * batch * 2 * (d + 1) * d * d + n * batch * 2 * d * d
    return ops * mach.op_seconds + flops / mach.small_flops


def predict_seconds(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, device: str, chunk_size: int = 0
) -> float:
    """Predicted time of one scan. ``width`` is the factored weight's rows ``m`` (``None`` = dense)."""
    mach = MACHINES.get(device, MACHINES["cuda"])
    w = d if width is None else width
    if algorithm == "linear":
        return n * (_OPS_PER_STEP["linear"] * mach.op_seconds + 2 * batch * d * w / mach.small_flops)
    if algorithm == "blelloch":
        return _blelloch_seconds(mach, n, d, batch)
    if algorithm == "chunked":
        c = max(1, min(chunk_size, n))
        p = math.ceil(n / c)
        rate = mach.small_flops if width is None else mach.gemm_flops
        flops = p * c * batch * 2 * (d + 2) * d * w
        steps = 2 * c * _OPS_PER_STEP["chunk"] * mach.op_seconds
        return steps + flops / rate + _blelloch_seconds(mach, p, d, batch)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _best_chunk(n: int, d: int, batch: int, width: int | None, device: str) -> int:
    candidates = sorted({min(2**k, n) for k in range(int(math.log2(max(n, 1))) + 1)} | {1})
    return min(
        candidates,
        key=lambda c: predict_seconds(
            "chunked", n=n, d=d, batch=batch, width=width, device=device, chunk_size=c
        ),
    )


def choose(algorithm: str, *, n: int, d: int, batch: int, width: int | None, device: str) -> tuple[str, int]:
    """Resolve ``algorithm`` (possibly ``"auto"``) to a concrete algorithm and chunk size."""
    chunk = _best_chunk(n, d, batch, width, device) if n > 0 else 1
    if algorithm != "auto":
        return algorithm, chunk
    if n <= 1:
        return "linear", chunk
    costs = {
        name: predict_seconds(name, n=n, d=d, batch=batch, width=width, device=device, chunk_size=chunk)
        for name in ("linear", "blelloch", "chunked")
    }
    return min(costs, key=costs.__getitem__), chunk


# --------------------------------------------------------------------------------------------------
# Recurrent layers: scan backward vs. autograd through torch's own forward.
# --------------------------------------------------------------------------------------------------

#: (torch ops per step in autograd's backward, gates G, scan state size / H, factored?) per cell mode.
#: CPU LSTM's autograd backward is one fused op per step; RNN / GRU record several ops per step.
_CELLS = {
    "RNN_TANH": (3.5, 1, 1, True),
    "RNN_RELU": (3.5, 1, 1, True),
    "GRU": (16.0, 3, 1, True),
    "LSTM": (1.0, 4, 2, False),
}
_SCAN_FIXED_OPS = 40  # Jacobian recompute, direct gradients, parameter GEMMs: independent of n
_ELEMENTWISE_BYTES_PER_S = 2e9  # element-wise passes over (B, n, G H) in the forward and backward


@lru_cache(maxsize=1024)  # called on every forward; shapes repeat from batch to batch
def recurrent_path(mode: str, *, n: int, hidden: int, batch: int, device: str) -> str:
    """``"scan"`` or ``"autograd"``: which backward a recurrent layer should use (``algorithm="auto"``).

    Compares the predicted backward of autograd (``n`` steps of a few small ops each) with the scan's
    (best algorithm of :func:`predict_seconds` plus the Jacobian preparation, linear in ``B n H G``).
    """
    ops, gates, state, factored = _CELLS[mode]
    mach = MACHINES.get(device, MACHINES["cuda"])
    d = state * hidden
    autograd = n * (ops * mach.op_seconds + 4 * batch * hidden * gates * hidden / mach.small_flops)
    width = gates * hidden if factored and gates > 1 else (hidden if factored else None)
    algorithm, chunk = choose("auto", n=n, d=d, batch=batch, width=width, device=device)
    scan = predict_seconds(algorithm, n=n, d=d, batch=batch, width=width, device=device, chunk_size=chunk)
    # element-wise passes over the gates (and, for a dense chain, building the d x d Jacobians)
    elements = batch * n * (gates * hidden + (0 if factored else d * d))
    extra = _SCAN_FIXED_OPS * mach.op_seconds + 12 * 4 * elements / _ELEMENTWISE_BYTES_PER_S
    return "scan" if scan + extra < autograd else "autograd"
