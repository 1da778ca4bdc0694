"""The plan of one recurrent layer call: torch's own layer or the scan, decided once per call, in the forward.

:func:`plan_layer` is the one place where ``algorithm="auto"`` chooses between torch's own layer (cuDNN on
CUDA, oneDNN / ATen on CPU; the module then runs exactly torch's code) and the scan, for the built-in layers,
for :class:`~lightning_bppsa.nn.Recurrence` (a user's cell; autograd through its loop is then "torch") and
for :class:`~lightning_bppsa.nn.SparseChain` (measured, no model; unmeasured: cuDNN on CUDA, else the scan):

1. a decision already made for this shape (cached per process: :class:`LayerShape`, ``(cell, layers,
   directions, B, T, input, H, dtype, device)``; a user cell is named by a digest of its traced step);
2. else the model's prediction: :mod:`lightning_bppsa.cuda_step_model` on CUDA (calibrated on H100
   measurements), :func:`lightning_bppsa.cost_model.recurrent_seconds` elsewhere; a caller without a model
   (a user cell) says why instead, and is unsure;
3. where the model is unsure (its two predictions within a factor :data:`UNSURE`, or no model), the call may
   measure (eager, not while ``torch.compile`` traces or a CUDA graph is captured, and only if the
   measurement is predicted to take at most :data:`MEASURE_BUDGET_SECONDS`; without a model the caller
   bounds it): both paths on the call's own data, timed with CUDA events on CUDA (:func:`device_timer`),
   and the scan is kept where it is faster by :data:`SCAN_MARGIN` (a near-tie keeps torch's path: one
   measurement of a host-bound GPU step varies by 5-10%); two paths measured within :data:`RETIME` of each
   other are measured once more (where that fits the budget), the faster of each path's two measurements
   deciding. The measurement syncs once, on that first call; later calls read the cache and
   never sync. A ``measure`` that raises (a cell found drawing random numbers) leaves nothing cached.
   Where the model is unsure and nothing measures, a model's leaning decides; without a model, torch's path.

Where one path has interchangeable kernels (a CUDA layer's linear backward: the fused kernel or the factored
scan), :func:`fastest` times them on the call's own data once per shape, as above, and caches the faster.

On CUDA a measurement also times each path's step queued behind the GPU (:func:`device_timer`'s ``queued``:
the GPU's time alone, what a CUDA graph of the step replays), and the decision keeps, beside the eager one, the
faster path by those times (:attr:`LayerPlan.captured`): calls inside a CUDA graph capture run it. At T ~ 1000
an eager step is bound by the host (cuDNN's and the scan's alike, ~1.2-1.9 ms of CPU on an H200's host), a
captured one by the GPU, where the scan's step took a third of cuDNN's: the two contests differ.

Decisions under tracing or capture are never cached (a model answer there must not freeze a shape that an
eager call could measure). :func:`measurements` turns measuring off or on for the process (tests: to make a
path deterministic), :func:`forget` drops the cache.

**Measured decisions may persist on disk** (off by default: a measurement made on a loaded machine must not
outlive its process unless the user asks; ``BPPSA_PLAN_CACHE=1`` turns it on), so that a later process of
the same setup runs the same path without measuring again: one JSON file per setup,
``layer-plans-<hash>.json`` in the package's private cache directory
(:func:`lightning_bppsa.kernels._build.cache_dir`: ``$BPPSA_CACHE_DIR`` or ``~/.cache/lightning_bppsa``,
``0700``, files another user owns or could write are refused with one warning), written atomically under a
lock (processes of one job merge their decisions). A setup is the device's name, the torch, CUDA and CuPy
versions (torch's thread count on a CPU), the package's version and a digest of its source files (a
kernel edit changes what is faster): any change reads another file, so the shape is measured again. A file
that does not parse, or is not of this setup, is ignored with one warning and rewritten. Only measured
decisions are kept (the model's are recomputed), only where a call would measure (so never while tracing,
nor under ``measurements(False)``), and never for a shape whose key another process could not recognise
(``LayerShape.persist=False``: a user cell that did not trace); ``forget(disk=True)`` deletes the files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_bppsa._random import kept_generators
from lightning_bppsa.kernels import _build, cupy_loader

__all__ = ["LayerPlan", "LayerShape", "MEASURE_BUDGET_SECONDS", "QUEUED", "RETIME", "SCAN_MARGIN", "UNSURE", "capturing",
           "device_timer", "fastest", "forget", "known_fastest", "may_measure", "measurements", "cached", "generation", "plan_layer",
           "time_candidates", "time_training_steps"]  # fmt: skip

#: the model is "unsure" where its two predictions are within this factor of each other
UNSURE = 2.0
#: a measured scan is chosen only where it is faster than torch's path by this factor (a near-tie: torch's)
SCAN_MARGIN = 1.05
#: two measured paths within this factor of each other are measured a second time (the faster of the two
#: measurements of each path decides): an H200 kept cuDNN at d=32 B=64 T=1000 on one measurement, scan 1.66 vs
#: torch 1.68 ms, where the same scan step measured 1.44 ms in the same run
RETIME = 1.15
#: at most this many predicted seconds are spent measuring one shape (each path runs three times, six at a
#: near-tie measured within this budget: :data:`RETIME`): a
#: CPU LSTM at B=64 H=256 T=300 (~1 s a step, where the model is unsure) is measured, shapes of seconds a step are not
MEASURE_BUDGET_SECONDS = 8.0

#: ``timer(fn)``: the seconds one call of ``fn`` takes
Timer = Callable[[Callable[[], object]], float]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerShape:
    """What a layer decision is keyed by. ``persist=False``: the key names something only this process
    knows (a user cell that did not trace, by its object): its decision is never written to disk."""

    cell: str
    layers: int
    directions: int
    batch: int
    steps: int
    input_size: int
    hidden: int
    dtype: torch.dtype
    device: str  # "cuda:0", "cpu"
    persist: bool = True


@dataclass(frozen=True)
class LayerPlan:
    """What one layer call runs: ``path`` ``"scan"`` or ``"autograd"`` (torch's own layer under autograd: cuDNN
    on CUDA), and why (one line); ``captured``: the plan of a call inside a CUDA graph capture, measured on the
    GPU's time alone (a graph replays no host work), ``None`` where a capture runs this plan."""

    path: str
    reason: str
    captured: LayerPlan | None = None


_decisions: dict[LayerShape, LayerPlan] = {}
#: :func:`fastest`'s measured choices: key -> (the fastest candidate's name, the measurement in words)
_fastest: dict[object, tuple[str, str]] = {}
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


def forget(disk: bool = False) -> None:
    """Drop every cached decision (the next call of each shape decides again); ``disk=True`` also deletes the
    measured decisions kept on disk (every setup's), so that they are measured again."""
    _decisions.clear()
    _fastest.clear()
    _read_files.clear()
    _generation[0] += 1
    if disk:
        for path in _build.cache_dir().glob(f"{_FILE_PREFIX}*.json"):
            path.unlink(missing_ok=True)


def generation() -> int:
    """The cache's generation: a decision memoised under an older one may have been forgotten."""
    return _generation[0]


def cached(shape: LayerShape) -> bool:
    """Whether a decision for ``shape`` is in the cache (one a caller may memoise)."""
    return shape in _decisions


#: :func:`time_training_steps`' key suffix of a path's seconds as the GPU runs the step queued ahead of it
QUEUED = " queued"
#: cycles the GPU waits before a queued measurement, per device (grown where the host needed longer to queue)
_queue_cycles: dict[torch.device, int] = {}


def device_timer(device: torch.device, queued: bool = False) -> Timer:
    """A :data:`Timer` for work on ``device``: CUDA events on a CUDA device (the queue drained first, so the
    events also count the host's time where the GPU waits for it), ``time.perf_counter`` elsewhere.

    ``queued`` (CUDA): the GPU's time alone, what a CUDA graph of the work replays. The GPU first spins
    (``torch.cuda._sleep``) while the host queues the work behind it, then runs it back to back between the
    events; where the spin ended before the host had queued everything (the start event already passed when
    the host is done), the spin is made 4x longer and the work timed again (at most 3 times more; the last
    time is kept either way)."""
    if device.type == "cuda" and queued:
        return functools.partial(_queued_seconds, device)
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


def _queued_seconds(device: torch.device, fn: Callable[[], object]) -> float:
    """:func:`device_timer`'s ``queued`` timer on a CUDA ``device``."""
    torch.cuda.synchronize(device)
    cycles = _queue_cycles.get(device, 4_000_000)  # ~2 ms at ~2 GHz: a step's host time on an H200's host
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        late = start.query()  # the GPU began before the host was done: host time may be in the interval
        end.record()
        end.synchronize()
        if not late:
            break
        cycles = _queue_cycles[device] = 4 * cycles
    return start.elapsed_time(end) / 1e3


def time_candidates(
    candidates: dict[str, Callable[[], object]], timer: Timer, repeats: int = 2, warm_up: bool = True
) -> dict[str, float]:
    """The fastest of ``repeats`` timed runs of each candidate, taking turns, after one untimed warm-up run each
    (kernel builds, allocator, caches; ``warm_up=False``: none, the caller ran them). A candidate whose warm-up
    raises gets ``inf`` (e.g. torch's CPU LSTM under float16 autocast: oneDNN has no primitive for it), unless
    every candidate raises; without a warm-up a candidate that raises fails the call."""
    failures: dict[str, Exception] = {}
    for name, run in candidates.items() if warm_up else ():
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


def time_training_steps(
    forwards: dict[str, Callable[[], torch.Tensor]], wrt: list[torch.Tensor], device: torch.device
) -> dict[str, float]:
    """A ``measure`` for :func:`plan_layer`: seconds of each path's forward and the gradients of ``wrt`` (returned,
    not accumulated), timed by :func:`time_candidates` with :func:`device_timer`, on CUDA also as queued
    (``"<path> queued"``: the GPU's time alone, what a CUDA graph of the step replays); the random state
    (dropout) restored, so that the call itself draws what it would have drawn."""

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            out = forward()
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)

        return run

    steps = {name: step(forward) for name, forward in forwards.items()}
    with kept_generators(device):
        times = time_candidates(steps, device_timer(device))
        # torch.cuda._sleep is private: without it no queued times (a capture then runs the eager decision)
        if device.type == "cuda" and hasattr(torch.cuda, "_sleep"):  # a path whose warm-up raised stays out (inf)
            ran = {name: run for name, run in steps.items() if math.isfinite(times[name])}
            queued = time_candidates(ran, device_timer(device, queued=True), warm_up=False)
            times |= {name + QUEUED: queued.get(name, math.inf) for name in steps}
    return times


def may_measure() -> bool:
    """Whether a call may measure now: measurements on (:func:`measurements`) and nothing traced or captured."""
    return _measuring["on"] and not _tracing()


def known_fastest(key: object) -> tuple[str, str] | None:
    """:func:`fastest`'s cached answer for ``key``, or ``None`` where it has not measured ``key``."""
    return _fastest.get(key)


def fastest(
    key: object, candidates: dict[str, Callable[[], object]], device: torch.device
) -> tuple[str, str] | None:
    """The fastest of ``candidates`` (interchangeable runs of the same work on ``device``, e.g. two kernels of one
    backward) for ``key``, and the measurement in words: timed once per ``key`` and process
    (:func:`time_candidates` with :func:`device_timer`: on CUDA it syncs, on this first call only), then cached
    until :func:`forget`. ``None`` where ``key`` is not cached and nothing may measure now
    (:func:`may_measure`): the caller runs its default."""
    known = _fastest.get(key)
    if known is not None or not may_measure():
        return known
    times = time_candidates(candidates, device_timer(device))
    best = min(times, key=times.__getitem__)
    _fastest[key] = best, "measured: " + ", ".join(f"{name} {_ms(t)}" for name, t in times.items())
    log.info("lightning_bppsa: %s runs the %s (%s)", key, best, _fastest[key][1])
    return _fastest[key]


def _tracing() -> bool:
    """Whether a graph is being built (``torch.compile`` or a CUDA graph capture): nothing may run or sync."""
    return torch.compiler.is_compiling() or capturing()


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (a decision's :attr:`LayerPlan.captured`
    applies)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def plan_layer(
    shape: LayerShape,
    predict: Callable[[], tuple[float, float] | str],
    measure: Callable[[], dict[str, float]] | None,
    *,
    timed: str = "a step",
    unmeasured: str = "autograd",
) -> LayerPlan:
    """Torch's layer or the scan for one ``algorithm="auto"`` call of ``shape`` (see the module docstring).

    Args:
        predict: the model's ``(scan, autograd)`` seconds of this shape's training step, or why there is no
            model (a string: the call measures where it may, else runs the ``unmeasured`` path).
        measure: times both paths on the call's data: ``{"scan": s, "autograd": s}``, on CUDA also the GPU's
            time alone (``"scan queued"``, ``"autograd queued"``: :func:`time_training_steps`), which decides
            the calls inside a CUDA graph capture (``None``: cannot measure). What it raises propagates, and
            nothing is cached.
        timed: what the seconds are of, in the reason (``"a step"``: a whole training step).
        unmeasured: the path without a model where nothing measures (torch's, unless the caller says why
            another: a layer chain keeps the scan it was converted to).
    """
    known = _decisions.get(shape)
    if known is not None:
        return known.captured if known.captured is not None and capturing() else known
    predicted = predict()
    modelled = not isinstance(predicted, str)
    if modelled:
        scan, torch_ = predicted
        faster = "scan" if scan < torch_ else "autograd"
        unsure = max(scan, torch_) < UNSURE * min(scan, torch_)
        affordable = _runs(shape) * (scan + torch_) <= MEASURE_BUDGET_SECONDS
        model = f"scan {_ms(scan)} vs torch {_ms(torch_)} {timed}"
    else:  # no model: unsure, and the caller bounds what its measurement costs
        faster, unsure, affordable = unmeasured, True, True
    tracing = _tracing()
    if unsure and affordable and measure is not None and _measuring["on"] and not tracing:
        plan = _measured(shape, measure, timed)
    elif not modelled:
        why = "while tracing" if tracing else "measurements off" if measure is not None else "cannot measure"
        plan = LayerPlan(
            faster,
            f"{predicted}; not measured ({why}): " + ("torch's path" if faster == "autograd" else "the scan"),
        )
    elif tracing:
        plan = LayerPlan(faster, f"cost model (while tracing): {model}")
    else:
        why = (
            "" if not unsure else " (not measured: " + ("off)" if affordable else "too large to time twice)")
        )
        plan = LayerPlan(faster, f"cost model: {model}{why}")
    if not tracing:
        _decisions[shape] = plan
    return plan


def _runs(shape: LayerShape) -> int:
    """How many times a measurement runs each path: a warm-up and two timed runs, on CUDA two more queued."""
    return 5 if shape.device.startswith("cuda") else 3


def _measured(shape: LayerShape, measure: Callable[[], dict[str, float]], timed: str) -> LayerPlan:
    """The faster path as measured: by this call, or by an earlier process of the same setup (on disk); with
    queued times, the faster of those for calls inside a CUDA graph capture."""
    disk = shape.persist and _disk_on()
    times = _disk_read(shape) if disk else None
    where = " (on-disk plan cache)"
    if times is None:
        times, where = measure(), ""
        near_tie = max(times["scan"], times["autograd"]) < RETIME * min(times["scan"], times["autograd"])
        if near_tie and _runs(shape) * (times["scan"] + times["autograd"]) <= MEASURE_BUDGET_SECONDS:
            again = measure()  # once more, the faster of two
            times, where = {path: min(times[path], again[path]) for path in times}, " (a near-tie: timed twice)"
        if disk:
            _disk_write(shape, times)
    captured = None
    if "scan" + QUEUED in times:
        scan, torch_ = times["scan" + QUEUED], times["autograd" + QUEUED]
        captured = LayerPlan(
            _faster(scan, torch_),
            f"measured, inside a CUDA graph capture (the GPU's time alone): scan {_ms(scan)} vs torch "
            f"{_ms(torch_)} {timed}{where}",
        )
    return LayerPlan(
        _faster(times["scan"], times["autograd"]),
        f"measured: scan {_ms(times['scan'])} vs torch {_ms(times['autograd'])} {timed}{where}",
        captured,
    )


def _faster(scan: float, torch_: float) -> str:
    """The path kept of two measured: a near-tie keeps torch's layer (one measurement of host-bound GPU steps
    varies by ~5-10%: an H200 chose a scan that then ran 0.93x cuDNN), and the scan must never be the slower
    path it was chosen as."""
    return "scan" if scan * SCAN_MARGIN < torch_ else "autograd"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


# --------------------------------------------------------------------------------------------------
# Measured decisions on disk (see the module docstring).
# --------------------------------------------------------------------------------------------------

_FILE_PREFIX = "layer-plans-"
_FORMAT = 1
_PATHS = ("scan", "autograd")
#: the keys of an entry: the paths' seconds, and on CUDA their queued seconds too
_ENTRY_KEYS = (frozenset(_PATHS), frozenset((*_PATHS, *(path + QUEUED for path in _PATHS))))
#: plan file -> its entries as read once by this process, with what it wrote since
_read_files: dict[Path, dict[str, dict[str, float]]] = {}
_warned: set[str] = set()  # one warning per problem and file


def _disk_on() -> bool:
    """Whether the user asked for the on-disk cache (``BPPSA_PLAN_CACHE=1``; off by default)."""
    return os.environ.get("BPPSA_PLAN_CACHE", "0").strip().lower() in ("1", "on", "true", "yes")


def _disk_read(shape: LayerShape) -> dict[str, float] | None:
    """The measured times of ``shape`` kept on disk for this setup, or ``None``."""
    try:
        environment = _environment(shape.device)
        path = _build.trusted_path(_file_name(environment))
        entries = _read_files.get(path)
        if entries is None:
            entries = _read_files[path] = _read(path, environment)
        return entries.get(_entry_key(shape))
    except Exception as err:  # noqa: BLE001  (a cache must never fail a model: it measures instead)
        _warn(
            "read",
            f"lightning_bppsa: the layer plan cache cannot be read ({type(err).__name__}: {err}); measuring",
        )
        return None


def _disk_write(shape: LayerShape, times: dict[str, float]) -> None:
    """Add ``shape``'s measured ``times`` to this setup's file, merged with what other processes wrote."""
    try:
        environment = _environment(shape.device)
        path = _build.trusted_path(_file_name(environment))
        with _build.exclusive(path.with_name(path.name + ".lock")):
            entries = _read(path, environment)
            entries[_entry_key(shape)] = {name: float(times[name]) for name in _ENTRY_KEYS[-1] if name in times}
            document = {"format": _FORMAT, "environment": environment, "decisions": entries}
            _build.write_private(path, json.dumps(document, indent=1, sort_keys=True))
        _read_files[path] = entries
    except Exception as err:  # noqa: BLE001  (a read-only or full disk: the decision stays in this process)
        _warn(
            "write", f"lightning_bppsa: the layer plan cache cannot be written ({type(err).__name__}: {err})"
        )


def _read(path: Path, environment: dict[str, str]) -> dict[str, dict[str, float]]:
    """The valid entries of ``path``; a file that does not parse or is not of ``environment``: none, with one
    warning (its next write replaces it)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        _warn(str(path), f"lightning_bppsa: ignoring the layer plan cache {path}: it does not parse ({err})")
        return {}
    if not isinstance(document, dict) or document.get("format") != _FORMAT:
        _warn(str(path), f"lightning_bppsa: ignoring the layer plan cache {path}: not format {_FORMAT}")
        return {}
    if document.get("environment") != environment:
        _warn(str(path), f"lightning_bppsa: ignoring the layer plan cache {path}: written for another setup")
        return {}
    decisions = document.get("decisions")
    entries = (
        {key: times for key, times in decisions.items() if _valid(times)}
        if isinstance(decisions, dict)
        else {}
    )
    if not isinstance(decisions, dict) or len(entries) < len(decisions):
        _warn(str(path), f"lightning_bppsa: ignoring malformed entries of the layer plan cache {path}")
    return entries


def _valid(times: object) -> bool:
    """An entry is the two paths' seconds (on CUDA their queued ones too): numbers, not NaN, not negative
    (``inf``: that path raised)."""
    return (
        isinstance(times, dict)
        and set(times) in _ENTRY_KEYS
        and all(type(t) in (int, float) and t >= 0 for t in times.values())  # NaN >= 0 is False
    )


def _warn(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _entry_key(shape: LayerShape) -> str:
    """``shape`` without the device's index (the file is per device name)."""
    return (
        f"{shape.cell} layers={shape.layers} directions={shape.directions} B={shape.batch} T={shape.steps} "
        f"input={shape.input_size} H={shape.hidden} {shape.dtype}"
    )


def _file_name(environment: dict[str, str]) -> str:
    digest = hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()[:16]
    return f"{_FILE_PREFIX}{digest}.json"


def _environment(device: str) -> dict[str, str]:
    """What a measured decision depends on beside its shape (see the module docstring)."""
    kind = torch.device(device).type
    environment = {
        "package": _package_version(),
        "code": _code_digest(),
        "torch": str(torch.__version__),
        "device": _device_name(device),
    }
    if kind == "cuda":
        environment |= {"cuda": str(torch.version.cuda), "cupy": cupy_loader.cupy_version()}
    else:  # torch's CPU kernels run on its intra-op threads: another count, another contest
        environment["threads"] = str(torch.get_num_threads())
    return environment


@functools.cache
def _device_name(device: str) -> str:
    device_ = torch.device(device)
    if device_.type == "cuda":
        return torch.cuda.get_device_name(device_)
    if device_.type == "cpu":
        return _build.cpu_name().partition(":")[2].strip() or "cpu"
    return device_.type


@functools.cache
def _package_version() -> str:
    from lightning_bppsa import __version__

    return __version__


@functools.cache
def _code_digest() -> str:
    """A digest of the package's Python and kernel sources (an edit changes the plan file; ~25 ms, once)."""
    digest = hashlib.sha256()
    for root in (Path(__file__).resolve().parent, _build.kernel_path("")):
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".cu", ".h", ".c") and "__pycache__" not in path.parts:
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
