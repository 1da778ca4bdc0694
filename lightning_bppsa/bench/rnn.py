"""Recurrent layers: BPPSA (``lightning_bppsa.nn``) vs torch autograd, one grid point at a time.

Per point, with the same weights in one process: forward only, forward + backward with autograd on the
torch module, forward + backward with the BPPSA module (medians of ``torch.utils.benchmark``);
backward = ``loss.backward()`` alone, timed on a graph recorded once (the BPPSA forward, timed
separately, includes the Jacobian preparation). Loss on the last step. Peak memory = resident-set growth
during one forward + backward (:func:`lightning_bppsa.bench.measure.peak_memory_bytes`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_bppsa import nn as bnn
from lightning_bppsa.bench.measure import interleaved_medians, peak_memory_bytes

__all__ = ["BENCH_INPUTS", "GRID_BATCHES", "GRID_LENGTHS", "HIDDEN", "bench_rows", "measure"]

HIDDEN = 20
#: ``bench_rows`` grids (T, B): the full one is Tables 4-5's coarse grid; the quick one runs in seconds
GRID_LENGTHS, GRID_BATCHES = (10, 30, 100, 300, 1000, 3000, 10000), (1, 4, 16, 64, 256)
QUICK_LENGTHS, QUICK_BATCHES = (8, 24), (1, 4)
#: input width per cell: the bitstream (Sec. 4.1) for RNN, Table 6's L config for GRU/LSTM
BENCH_INPUTS = {"RNN": 1, "GRU": 12, "LSTM": 12}


def _pair(cell: str, inputs: int, algorithm: str, hidden: int = HIDDEN) -> tuple[nn.Module, nn.Module]:
    ours = getattr(bnn, cell)(inputs, hidden, batch_first=True, algorithm=algorithm)
    ref = getattr(nn, cell)(inputs, hidden, batch_first=True)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _step(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        module.zero_grad(set_to_none=True)
        output, _ = module(x)
        output[:, -1].pow(2).sum().backward()

    return run


def _backward(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """``loss.backward()`` alone (from its start to all ``.grad`` filled) on a graph recorded once;
    ``retain_graph`` lets the timer repeat it."""
    output, _ = module(x)
    loss = output[:, -1].pow(2).sum()
    return lambda: loss.backward(retain_graph=True)


def measure(
    cell: str, batch: int, length: int, inputs: int, algorithm: str, min_run_time: float, rounds: int = 1,
    hidden: int = HIDDEN,
) -> dict[str, Any]:
    """One grid point of ``cell`` (``"RNN"``, ``"GRU"``, ``"LSTM"``) of ``hidden`` units on ``x: (batch, length,
    inputs)``.

    Returns seconds (``forward``, ``forward_bppsa``, ``autograd`` and ``bppsa``: a whole forward +
    backward, ``bwd_autograd``, ``bwd_bppsa``; each the median over ``rounds`` rounds that time all of them
    in turn), ``bwd_speedups`` (autograd / BPPSA backward of every round), peak bytes (``mem_autograd``,
    ``mem_bppsa``) and what the BPPSA module ran (``path``: ``"scan"`` or ``"autograd"``, ``scan_algorithm``).
    """
    torch.manual_seed(0)
    ours, ref = _pair(cell, inputs, algorithm, hidden)
    x = torch.randn(batch, length, inputs)
    x = (x > 0.5).float() if inputs == 1 else x  # the bitstream task of Sec. 4.1 for the RNN rows
    memory = peak_memory_bytes(_step(ref, x)), peak_memory_bytes(_step(ours, x))
    times = interleaved_medians(
        {
            "forward": lambda: ref(x),
            "forward_bppsa": lambda: ours(x),  # includes the Jacobian preparation
            "autograd": _step(ref, x),
            "bppsa": _step(ours, x),
            "bwd_autograd": _backward(ref, x),
            "bwd_bppsa": _backward(ours, x),
        },
        rounds,
        min_run_time,
    )
    return {
        **{name: statistics.median(values) for name, values in times.items()},
        "bwd_speedups": [a / b for a, b in zip(times["bwd_autograd"], times["bwd_bppsa"], strict=True)],
        "mem_autograd": memory[0],
        "mem_bppsa": memory[1],
        "path": ours.last_stats["path"],
        "decision": ours.last_stats.get("decision", ""),  # why "auto" ran that path
        "scan_algorithm": ours.last_stats.get("scan_algorithm", ""),  # what the scan resolved algorithm to
    }


def bench_rows(
    *,
    quick: bool = False,
    cell: str = "rnn",
    lengths: Sequence[int] | None = None,
    batches: Sequence[int] | None = None,
    inputs: int | None = None,
    algorithm: str = "auto",
    min_run_time: float | None = None,
    rounds: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows for ``lightning-bppsa bench rnn|gru`` (contract: :data:`lightning_bppsa.cli.bench.BENCHMARKS`).

    One :func:`measure` per grid point ``(T, B)`` and two rows from it, ``method`` ``"autograd"`` and
    ``"bppsa"``, each with ``backward_s``, ``forward_s``, ``step_s`` (forward + backward) in seconds,
    ``peak_bytes``, and ``cell``, ``input``, ``algorithm``, ``path`` (what the BPPSA module ran); the
    BPPSA row also ``speedup_min`` / ``speedup_max``, the range of the backward speedup over the rounds.

    Args:
        quick: the small grid ``(8, 24) x (1, 4)`` with short timings.
        cell: ``"rnn"``, ``"gru"`` or ``"lstm"``.
        lengths, batches: the grid (default :data:`GRID_LENGTHS` x :data:`GRID_BATCHES`, or the quick one).
        inputs: input features (default :data:`BENCH_INPUTS` of the cell).
        algorithm: the BPPSA module's ``algorithm``.
        min_run_time: seconds per timing (default 0.1, quick 0.01).
        rounds: rounds timing autograd and BPPSA in turn (default 3, quick 2).
    """
    name = cell.upper()
    if name not in BENCH_INPUTS:
        raise ValueError(f"cell must be one of {', '.join(c.lower() for c in BENCH_INPUTS)}; got {cell!r}")
    lengths = lengths or (QUICK_LENGTHS if quick else GRID_LENGTHS)
    batches = batches or (QUICK_BATCHES if quick else GRID_BATCHES)
    inputs = inputs or BENCH_INPUTS[name]
    min_run_time = min_run_time if min_run_time is not None else (0.01 if quick else 0.1)
    rounds = rounds or (2 if quick else 3)
    for length in lengths:
        for batch in batches:
            r = measure(name, batch, length, inputs, algorithm, min_run_time, rounds)
            point = {"T": length, "B": batch, "cell": name, "input": inputs, "algorithm": algorithm}
            yield {
                "method": "autograd", **point, "path": "autograd", "backward_s": r["bwd_autograd"],
                "forward_s": r["forward"], "step_s": r["autograd"], "peak_bytes": r["mem_autograd"],
            }  # fmt: skip
            yield {
                "method": "bppsa", **point, "path": r["path"], "backward_s": r["bwd_bppsa"],
                "forward_s": r["forward_bppsa"], "step_s": r["bppsa"], "peak_bytes": r["mem_bppsa"],
                "speedup_min": min(r["bwd_speedups"]), "speedup_max": max(r["bwd_speedups"]),
            }  # fmt: skip
