"""How the benchmarks measure: median time, peak resident memory, and the machine they ran on."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.utils import benchmark

__all__ = [
    "default_threads",
    "fastest_threads",
    "interleaved_medians",
    "load_average",
    "machine_description",
    "median_seconds",
    "peak_memory_bytes",
    "set_threads",
    "thread_counts",
]

#: glibc's mmap threshold while ``peak_memory_bytes`` measures: every allocation of 64 KiB or more is
#: mmap'ed and unmapped on free, so the resident high-water mark follows torch's CPU allocations.
MEASURE_THRESHOLD = 64 * 2**10
#: The threshold given back afterwards: 32 MiB is the ceiling glibc's adaptive default climbs to (mallopt
#: cannot re-enable the adaptive rule). Left at 64 KiB, every large temporary of a later timing would be a
#: fresh mmap + page faults + munmap (a ~3x slower scan, a 10-175x slower autograd Jacobian baseline).
TIMING_THRESHOLD = 32 * 2**20


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (``os.sched_getaffinity``; all of them where that is missing)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def default_threads(cpus: set[int] | None = None, topology: str = "/sys/devices/system/cpu") -> int:
    """One thread per physical core among ``cpus`` (default :func:`usable_cpus`), never more than ``len(cpus)``.

    Hyper-threads of one core count once (Linux sysfs ``topology/{physical_package_id,core_id}``); where
    the topology cannot be read, every CPU counts as a core.
    """
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        try:
            ids = [
                Path(topology, f"cpu{cpu}", "topology", name).read_text().strip()
                for name in ("physical_package_id", "core_id")
            ]
        except OSError:
            ids = ["cpu", str(cpu)]
        cores.add(tuple(ids))
    return max(1, min(len(cores), len(cpus)))


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads to ``threads`` (default :func:`default_threads`); returns the count.

    OpenMP threads spin at barriers: on cores shared with other work, more threads than free cores make
    every parallel op wait for a descheduled thread (a 2-core machine ran a recipe at 0.4 it/s with 2
    threads under load, 33 it/s with 1).
    """
    if threads is None:
        threads = default_threads()
    if threads < 1:
        raise ValueError(f"threads must be >= 1; got {threads}")
    torch.set_num_threads(threads)
    return threads


def thread_counts(cpus: int) -> list[int]:
    """The thread counts :func:`fastest_threads` tries on ``cpus`` usable CPUs: 1, 2, 4, ... and ``cpus``.

    Doubling, not every count, keeps the measurement to a few counts on a many-core machine.
    """
    if cpus < 1:
        raise ValueError(f"cpus must be >= 1; got {cpus}")
    counts = [1]
    while counts[-1] * 2 < cpus:
        counts.append(counts[-1] * 2)
    return sorted({*counts, cpus})


def fastest_threads(
    seconds_at: Callable[[int], float], counts: Sequence[int], what: str = "step"
) -> tuple[int, str]:
    """The count among ``counts`` whose ``seconds_at(count)`` is least, and one line saying so and why.

    ``seconds_at(n)`` measures ``what`` at ``n`` threads (it sets them). On a tie the fewer threads win.
    The line reads e.g. ``torch threads: 1 (measured autograd step 55 ms at 1 thread, 359 ms at 2;
    --threads to override)``.
    """
    if not counts:
        raise ValueError("counts must name at least one thread count")
    measured = {n: seconds_at(n) for n in sorted(set(counts))}
    best = min(measured, key=measured.__getitem__)
    readings = [f"{1e3 * s:.3g} ms at {n}" for n, s in measured.items()]
    readings[0] += " thread" if next(iter(measured)) == 1 else " threads"
    return best, f"torch threads: {best} (measured {what} {', '.join(readings)}; --threads to override)"


def load_average() -> tuple[float, float, float]:
    """``os.getloadavg()``: runnable processes averaged over 1, 5 and 15 minutes (zeros where unknown)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def median_seconds(fn: Callable[[], object], min_run_time: float = 0.2) -> float:
    """Median wall time of ``fn()`` (one warm-up call excluded) measured by ``torch.utils.benchmark``."""
    fn()  # warm-up
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], rounds: int, min_run_time: float
) -> dict[str, list[float]]:
    """:func:`median_seconds` of every function in ``fns``, ``rounds`` times in turn (A/B/A/B...).

    Returns ``name -> [median of round 1, ...]``. Timing the methods in alternation, not one after the
    other, lets a change of machine load hit all of them alike; the spread over rounds shows it.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_seconds(fn, min_run_time))
    return times


def _mmap_threshold(nbytes: int) -> None:
    """Set glibc's mmap threshold (allocations of at least ``nbytes`` are mmap'ed, unmapped on free)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune, the measurement is then coarser
        return
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2 * nbytes)  # M_TRIM_THRESHOLD: give freed heap tops back
    libc.malloc_trim(0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory added while ``fn()`` runs (Linux: VmHWM reset via /proc/self/clear_refs).

    Large tensors are mmap'ed by the allocator and given back on free, so the high-water mark of the
    resident set follows torch's CPU allocations to page granularity. For that, glibc's mmap threshold
    is lowered to :data:`MEASURE_THRESHOLD` while ``fn()`` runs (otherwise freed heap pages that are
    still resident would be reused unseen) and set to :data:`TIMING_THRESHOLD` afterwards; this is the
    only place the allocator is tuned.
    """
    gc.collect()
    _mmap_threshold(MEASURE_THRESHOLD)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset the resident-set high-water mark
        base = _status_kib("VmRSS")
        fn()
        return max(_status_kib("VmHWM") - base, 0) * 1024
    finally:
        _mmap_threshold(TIMING_THRESHOLD)


def machine_description() -> str:
    """One line naming the CPU, core count, torch version and thread count."""
    cpu = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs ({len(usable_cpus())} usable, {default_threads()} physical cores), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, Python {platform.python_version()}, "
        "load average {:.2f} {:.2f} {:.2f}".format(*load_average())
    )
