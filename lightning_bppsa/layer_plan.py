"""The plan of one recurrent layer call: torch's own layer or the scan, decided once per call, in the forward.

:func:`plan_layer` is the one place where ``algorithm="auto"`` chooses between torch's own layer (cuDNN on
CUDA, oneDNN / ATen on CPU; the module then runs exactly torch's code) and the scan:

1. a decision already made for this shape (cached per process: ``(cell, layers, directions, B, T, input,
   H, dtype, device)``);
2. else the model's prediction: :mod:`lightning_bppsa.cuda_step_model` on CUDA (calibrated on H100
   measurements), :func:`lightning_bppsa.cost_model.recurrent_seconds` elsewhere;
3. where the model is unsure (its two predictions within a factor :data:`UNSURE`), the call may measure
   (eager, not while ``torch.compile`` traces or a CUDA graph is captured, and only if the measurement is
   predicted to take at most :data:`MEASURE_BUDGET_SECONDS`): both whole steps, forward and backward, on
   the call's own data, timed with CUDA events on CUDA (:func:`device_timer`), and the faster is kept. The
   measurement syncs once, on that first call; later calls read the cache and never sync.

Decisions under tracing or capture are never cached (a model answer there must not freeze a shape that an
eager call could measure). :func:`measurements` turns measuring off or on for the process (tests: to make a
path deterministic), :func:`forget` drops the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["LayerPlan", "LayerShape", "MEASURE_BUDGET_SECONDS", "UNSURE", "device_timer", "forget", "measurements",
           "cached", "generation", "plan_layer", "time_candidates"]  # fmt: skip

#: the model is "unsure" where its two predictions are within this factor of each other
UNSURE = 2.0
#: at most this many predicted seconds are spent measuring one shape (each path runs three times): a
#: CPU LSTM at B=64 H=256 T=300 (~1 s a step, where the model is unsure) is measured, shapes of seconds a step are not
MEASURE_BUDGET_SECONDS = 8.0

#: ``timer(fn)``: the seconds one call of ``fn`` takes
Timer = Callable[[Callable[[], object]], float]


@dataclass(frozen=True)
class LayerShape:
    """What a layer decision is keyed by."""

    cell: str
    layers: int
    directions: int
    batch: int
    steps: int
    input_size: int
    hidden: int
    dtype: torch.dtype
    device: str  # "cuda:0", "cpu"


@dataclass(frozen=True)
class LayerPlan:
    """What one layer call runs: ``path`` ``"scan"`` or ``"autograd"`` (torch's own layer under autograd: cuDNN
    on CUDA), and why (one line)."""

    path: str
    reason: str


_decisions: dict[LayerShape, LayerPlan] = {}
_measuring = {"on": True}
#: bumped by :func:`forget`: a caller's memo of a decision (``generation()``, plan) is stale once it moves
_generation = [0]


@contextmanager
def measurements(enabled: bool) -> Iterator[None]:
    """Allow (or forbid) measured decisions inside the block; the model decides where they are forbidden."""
    previous, _measuring["on"] = _measuring["on"], enabled
    try:
        yield
    finally:
        _measuring["on"] = previous


def forget() -> None:
    """Drop every cached decision (the next call of each shape decides again)."""
    _decisions.clear()
    _generation[0] += 1


def generation() -> int:
    """The cache's generation: a decision memoised under an older one may have been forgotten."""
    return _generation[0]


def cached(shape: LayerShape) -> bool:
    """Whether a decision for ``shape`` is in the cache (one a caller may memoise)."""
    return shape in _decisions


def device_timer(device: torch.device) -> Timer:
    """A :data:`Timer` for work on ``device``: CUDA events on a CUDA device (the queue drained first, so the
    events also count the host's time where the GPU waits for it), ``time.perf_counter`` elsewhere."""
    if device.type != "cuda":
        def wall(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        return wall

    def events(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return events


def time_candidates(candidates: dict[str, Callable[[], object]], timer: Timer, repeats: int = 2) -> dict[str, float]:
    """The fastest of ``repeats`` timed runs of each candidate, taking turns, after one untimed warm-up run each
    (kernel builds, allocator, caches). A candidate whose warm-up raises gets ``inf`` (e.g. torch's CPU LSTM
    under float16 autocast: oneDNN has no primitive for it), unless every candidate raises."""
    failures: dict[str, Exception] = {}
    for name, run in candidates.items():
        try:
            run()
        except Exception as error:  # noqa: BLE001  (any failure rules the candidate out, the others decide)
            failures[name] = error
    if len(failures) == len(candidates):
        raise next(iter(failures.values()))
    best = dict.fromkeys(candidates, math.inf)
    for _ in range(repeats):
        for name, run in candidates.items():
            if name not in failures:
                best[name] = min(best[name], timer(run))
    return best


def _tracing() -> bool:
    """Whether a graph is being built (``torch.compile`` or a CUDA graph capture): nothing may run or sync."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def plan_layer(
    shape: LayerShape,
    predict: Callable[[], tuple[float, float]],
    measure: Callable[[], dict[str, float]] | None,
) -> LayerPlan:
    """Torch's layer or the scan for one ``algorithm="auto"`` call of ``shape`` (see the module docstring).

    Args:
        predict: the model's ``(scan, autograd)`` seconds of this shape's training step.
        measure: times both paths on the call's data: ``{"scan": s, "autograd": s}`` (``None``: cannot
            measure).
    """
    known = _decisions.get(shape)
    if known is not None:
        return known
    scan, torch_ = predict()
    faster = "scan" if scan < torch_ else "autograd"
    unsure = max(scan, torch_) < UNSURE * min(scan, torch_)
    affordable = 3 * (scan + torch_) <= MEASURE_BUDGET_SECONDS
    if _tracing():
        return LayerPlan(faster, f"cost model (while tracing): scan {_ms(scan)} vs torch {_ms(torch_)} a step")
    if unsure and affordable and measure is not None and _measuring["on"]:
        times = measure()
        faster = min(times, key=times.__getitem__)
        plan = LayerPlan(faster, f"measured: scan {_ms(times['scan'])} vs torch {_ms(times['autograd'])} a step")
    else:
        why = "" if not unsure else " (not measured: " + ("too large to time twice)" if not affordable else "off)")
        plan = LayerPlan(faster, f"cost model: scan {_ms(scan)} vs torch {_ms(torch_)} a step{why}")
    _decisions[shape] = plan
    return plan


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
