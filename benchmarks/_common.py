"""Shared benchmark plumbing: timing with torch.utils.benchmark, peak memory, machine description."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import subprocess
from collections.abc import Callable

import torch
from torch.utils import benchmark


def median_seconds(fn: Callable[[], object], min_run_time: float = 0.2) -> float:
    """Median wall time of ``fn()`` (warm-up excluded) measured by ``torch.utils.benchmark``."""
    fn()  # warm-up
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _fix_mmap_threshold() -> None:
    """Make glibc serve every allocation >= 64 KiB with mmap and give it back on free.

    Otherwise glibc raises its mmap threshold after the first large free and later tensors reuse
    heap pages that are already resident, which hides them from the resident-set high-water mark.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


_fix_mmap_threshold()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory added while ``fn()`` runs (Linux: VmHWM reset via /proc/self/clear_refs).

    Large tensors are mmap'ed by the allocator and given back on free, so the high-water mark of
    the resident set follows torch's CPU allocations to page granularity.
    """
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the resident-set high-water mark
    base = _status_kib("VmRSS")
    fn()
    return max(_status_kib("VmHWM") - base, 0) * 1024


def machine_description() -> str:
    """One line naming the CPU, core count, torch version and thread count."""
    cpu = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}"
    )
