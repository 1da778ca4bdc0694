"""Per-step interval timing shared by the timing callbacks: ``perf_counter`` on CPU, CUDA events on GPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["Stopwatch"]


class Stopwatch:
    """Named time marks within one training step; intervals are read once the step is over.

    On CUDA the marks are recorded events, so nothing synchronises until :meth:`seconds` is called
    (at the end of the step); on CPU they are ``time.perf_counter()`` readings, or with
    ``cpu_time=True`` ``time.process_time()`` (CPU seconds of all the process's threads: insensitive to
    other processes competing for the cores). ``clock`` replaces the CPU clock (tests inject one).
    """

    def __init__(self, cpu_time: bool = False, clock: Callable[[], float] | None = None) -> None:
        self._marks: dict[str, float | torch.cuda.Event] = {}
        self._clock = clock or (time.process_time if cpu_time else time.perf_counter)

    def clear(self) -> None:
        """Forget every mark (call at the start of a step)."""
        self._marks.clear()

    def mark(self, name: str, device: torch.device) -> None:
        """Record the current time (on ``device``'s stream when it is a CUDA device) under ``name``."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = self._clock()

    def has(self, name: str) -> bool:
        """Whether ``name`` was marked since the last :meth:`clear`."""
        return name in self._marks

    def seconds(self, start: str, end: str) -> float:
        """Seconds from mark ``start`` to mark ``end`` (waits for the CUDA event ``end``)."""
        first, last = self._marks[start], self._marks[end]
        if not isinstance(last, torch.cuda.Event):
            return float(last - first)
        last.synchronize()
        return first.elapsed_time(last) / 1000.0
