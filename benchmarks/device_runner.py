"""Where, on what and until when a benchmark measures: the :class:`Runner` (device, workloads, deadline,
clock), :func:`interleaved` timing, and the header every results file starts with.

Shared by ``benchmarks/gpu.py`` (its stages) and ``benchmarks/cells.py`` (the user cells, on CPU or a GPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
SKIPPED = "skipped: out of time"
NO_CUDA = "n/a: no CUDA"
WARMUP = 3  # calls of each function before timing: BPPSA's first call per shape compiles / measures once


@dataclass(frozen=True)
class Runner:
    """Where the stages measure, on what, until when, with what clock, and where they write.

    ``shapes`` holds the workloads; :func:`interleaved` reads its ``rounds`` and ``max_steps``. ``clock``
    gives seconds (``time.monotonic`` unless a test injects another): it bounds every stage by ``deadline``
    and, on the CPU, times the calls; on CUDA the calls are timed by CUDA events.
    """

    device: str
    shapes: Any
    deadline: float
    clock: Callable[[], float] = time.monotonic
    results: Path = RESULTS
    command: str = "python benchmarks/gpu.py"

    def left(self) -> float:
        """Seconds left before the deadline (negative once past it)."""
        return self.deadline - self.clock()

    def until(self, seconds: float) -> Runner:
        """This runner with the deadline brought forward to ``seconds`` from now (never later than it was)."""
        return dataclasses.replace(self, deadline=min(self.deadline, self.clock() + seconds))

    def with_rounds(self, rounds: int) -> Runner:
        """This runner with its shapes' interleaved rounds (:func:`interleaved`) set to ``rounds``."""
        return dataclasses.replace(self, shapes=dataclasses.replace(self.shapes, rounds=rounds))

    @property
    def timer(self) -> str:
        """What times the calls, in words."""
        return "CUDA events" if self.device == "cuda" else "the CPU clock"

    def call_seconds(self, fn: Callable[[], object], calls: int) -> list[float]:
        """Seconds of each of ``calls`` calls of ``fn``, each waited for (host time included).

        Where ``fn`` has a ``prepare`` method, it runs before each call, untimed (e.g. the forward whose graph the
        timed backward consumes); on CUDA it is waited for before the call's start."""
        times = []
        prepare = getattr(fn, "prepare", None)
        for _ in range(calls):
            if prepare is not None:
                prepare()
                if self.device == "cuda":
                    torch.cuda.synchronize()
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start_seconds = self.clock()
                fn()
                times.append(self.clock() - start_seconds)
        return times


def interleaved(
    runner: Runner,
    fns: dict[str, Callable[[], object]],
    budget: float,
    estimate: float | None = None,
    *,
    warmup: int = WARMUP,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float | str]:
    """``statistic`` (the median unless given) of the seconds per call of each of ``fns``, or :data:`SKIPPED`
    for all where they do not fit in time.

    After ``warmup`` calls of each (the first call per shape may compile or measure), ``rounds`` rounds
    of N calls of each in turn (A x N, B x N, A x N, ...), so that a drift of the machine hits all alike; N is
    what fits ``budget`` seconds, 1 to ``max_steps``. ``estimate`` (seconds of one call of them all, e.g.
    from committed data) is checked against the deadline before the warm-up, the warm-up's last calls before
    the rounds.
    """
    rounds = runner.shapes.rounds
    if runner.left() <= 0 or (estimate is not None and runner.left() < estimate * (warmup + rounds)):
        return dict.fromkeys(fns, SKIPPED)
    per_round = rounds * sum(runner.call_seconds(fn, max(warmup, 1))[-1] for fn in fns.values())
    steps = max(
        1, min(runner.shapes.max_steps, int(budget / per_round) if per_round > 0 else runner.shapes.max_steps)
    )
    if runner.left() < steps * per_round:
        return dict.fromkeys(fns, SKIPPED)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += runner.call_seconds(fn, steps)
    return {name: statistic(seconds) for name, seconds in times.items()}


class Backward:
    """The backward alone: :meth:`prepare` (untimed, :meth:`device_runner.Runner.call_seconds`) runs ``forward``
    and keeps what the backward needs; a call runs ``backward`` on it, once. A fresh graph per call: a graph
    reused with ``retain_graph`` would leave out what a backward computes once per graph and keeps."""

    def __init__(self, forward: Callable[[], Any], backward: Callable[[Any], object]) -> None:
        self.forward, self.backward, self.recorded = forward, backward, None

    def prepare(self) -> None:
        self.recorded = self.forward()

    def __call__(self) -> object:
        recorded, self.recorded = self.recorded, None
        return self.backward(recorded)


def train_step(module: torch.nn.Module, x: torch.Tensor, set_to_none: bool = True) -> Callable[[], None]:
    """One whole training step of a recurrent module: zero the gradients (``set_to_none=False`` keeps their
    buffers, as a CUDA graph capture needs), forward, loss = sum of the last output step, backward."""

    def step() -> None:
        module.zero_grad(set_to_none=set_to_none)
        output, _ = module(x)
        output[:, -1].sum().backward()

    return step


def cuda_peak_bytes(fn: Callable[[], object]) -> tuple[int, int]:
    """``(peak, before)``: torch's CUDA allocator's peak while ``fn()`` runs (its queue drained, the peak reset
    first) and what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), before


def ms_text(value: float | str, digits: int = 3) -> str:
    """Seconds as milliseconds, or the reason there is no figure."""
    return value if isinstance(value, str) else f"{value * 1e3:.{digits}f}"


def ratio_text(baseline: float | str, ours: float | str) -> str:
    """``baseline / ours`` as a speedup, "-" where either is missing."""
    return f"{baseline / ours:.2f}x" if isinstance(baseline, float) and isinstance(ours, float) else "-"


@functools.cache
def commit() -> str:
    """``$BPPSA_COMMIT``, else ``git rev-parse --short HEAD`` of this checkout, else "unknown"."""
    if os.environ.get("BPPSA_COMMIT"):
        return os.environ["BPPSA_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def uncommitted(paths: Sequence[str] = ("lightning_bppsa", "kernels")) -> str:
    """The files under ``paths`` that differ from the commit (``git status``): what a measurement ran beyond
    :func:`commit` ("none", or "unknown" without git)."""
    try:
        done = subprocess.run(["git", "status", "--porcelain", "--", *paths], capture_output=True, text=True,
                              cwd=ROOT, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    files = [line[3:] for line in done.stdout.splitlines() if line.strip()]
    return ", ".join(files) if files else "none"


@functools.cache
def cupy_version() -> str:
    """CuPy's version, or "not installed"."""
    try:
        import cupy
    except ImportError:
        return "not installed"
    return cupy.__version__


def header(runner: Runner, title: str, versions: Iterable[str] = ()) -> str:
    """A results file's title, then one line: device, torch, cuDNN, CuPy, ``versions`` (e.g. ``"JAX 0.10.2"``),
    commit, date and time (UTC), command."""
    device = torch.cuda.get_device_name() if runner.device == "cuda" else f"CPU ({platform.machine()})"
    now = datetime.datetime.now(datetime.timezone.utc)
    more = "".join(f"{v}; " for v in versions)
    return (
        f"# {title}\n\nDevice {device}; torch {torch.__version__}; cuDNN {torch.backends.cudnn.version() or 'none'}; "
        f"CuPy {cupy_version()}; {more}commit {commit()}; {now:%Y-%m-%d %H:%M} UTC; `{runner.command}`.\n\n"
    )


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the column names, the rule, one line per row."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return "".join(line + "\n" for line in [*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def write(runner: Runner, name: str, text: str) -> None:
    """``text`` into ``name`` under the runner's results folder."""
    runner.results.mkdir(parents=True, exist_ok=True)
    (runner.results / name).write_text(text)
