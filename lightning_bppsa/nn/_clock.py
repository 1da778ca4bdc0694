"""Timings for the modules' ``last_stats``, taken in eager mode only.

Code traced by torch.compile has no wall clock and may not mutate the stats dict from inside an
``autograd.Function``; there both helpers do nothing, and the compiled module's ``last_stats`` keep zeros.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["clock", "record"]


def clock() -> float:
    """``time.perf_counter()`` in eager mode, ``0.0`` while torch.compile traces."""
    return 0.0 if torch.compiler.is_compiling() else time.perf_counter()


def record(stats: dict[str, Any], key: str, value: Any, *, add: bool = False) -> None:
    """``stats[key] = value`` (``+= value`` with ``add``) in eager mode; nothing while compiling."""
    if torch.compiler.is_compiling():
        return
    stats[key] = stats.get(key, 0.0) + value if add else value
