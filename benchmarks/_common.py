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


def _mmap_threshold(nbytes: int) -> None:
    """Set glibc's mmap threshold (allocations of at least ``nbytes`` are mmap'ed and unmapped on free)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2 * nbytes)  # M_TRIM_THRESHOLD: give freed heap tops back
    libc.malloc_trim(0)


#: Timing runs with a high threshold: a low one makes every large temporary a fresh mmap + page faults
#: + munmap (~3x slower scans), which glibc's default adaptive threshold avoids.
_TIMING_THRESHOLD = 32 * 2**20
_mmap_threshold(_TIMING_THRESHOLD)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory added while ``fn()`` runs (Linux: VmHWM reset via /proc/self/clear_refs).

    Large tensors are mmap'ed by the allocator and given back on free, so the high-water mark of
    the resident set follows torch's CPU allocations to page granularity. For that, glibc's mmap
    threshold is lowered to 64 KiB while ``fn()`` runs (otherwise freed heap pages that are still
    resident would be reused unseen) and raised back for timing afterwards.
    """
    gc.collect()
    _mmap_threshold(64 * 2**10)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the resident-set high-water mark
        base = _status_kib("VmRSS")
        fn()
        return max(_status_kib("VmHWM") - base, 0) * 1024
    finally:
        _mmap_threshold(_TIMING_THRESHOLD)


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
