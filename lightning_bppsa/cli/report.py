"""What the CLI writes: runs read back from TensorBoard, the comparison and benchmark tables, the plots.

The clock: :class:`~lightning_bppsa.callbacks.BackwardTimer` logs ``time/step``, the time of every
training step (forward, backward, optimizer and hooks; not data loading, validation or logging). The
comparison table reports its medians, and the loss-vs-time plot draws the loss against its running
sum, so both use the same clock. The one-time warm-up before the first step
(:class:`~lightning_bppsa.bench.trial.WarmUp`: kernel builds) is in neither; the table gives it a row.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_bppsa.bench.trial import WARM_UP_KEY
from lightning_bppsa.callbacks.gradient_check import DEFAULT_KEY as GRAD_REL_DIFF
from lightning_bppsa.callbacks.gradient_check import SECONDS_KEY as CHECK_SECONDS

__all__ = [
    "CHECK_SECONDS",
    "FELL_BACK",
    "GRAD_REL_DIFF",
    "TIMING_KEYS",
    "WARM_UP_KEY",
    "Conditions",
    "LossPlot",
    "RunSummary",
    "block_speedups",
    "loss_plot_data",
    "smoothing_window",
    "format_bench_table",
    "format_comparison",
    "plot_bench_grid",
    "plot_loss_curves",
    "read_scalars",
    "speedup_rows",
    "speedups",
    "summarise_run",
]

TIMING_KEYS = ("forward", "backward", "jacobian", "step")
"""The ``time/<key>`` scalars of :class:`~lightning_bppsa.callbacks.BackwardTimer`, in table order."""
SPEEDUP_KEYS = ("backward", "step")


@dataclass
class RunSummary:
    """What ``compare`` keeps of one training run.

    ``seconds``: median seconds per step of each :data:`TIMING_KEYS` entry (warm-up steps and steps
    with a gradient check excluded);
    ``loss_curve``: ``(step, training seconds up to and including that step, training loss)`` per
    logged step, the seconds being the running sum of ``time/step`` less the gradient checks' time;
    ``final``: final metrics (``train/loss`` averaged over the last steps, ``val/loss``, ``val/acc``);
    ``grad_rel_diff``: ``(step, value)`` of every gradient check (:data:`GRAD_REL_DIFF`);
    ``per_step``: ``key -> {step: seconds}`` for ``backward`` and ``step`` (the medians' steps);
    ``check_seconds``: the seconds those checks took in all;
    ``warm_up_seconds``: the one-time warm-up before the first step (:data:`WARM_UP_KEY`), ``None`` if
    there was none.
    """

    label: str
    log_dir: str
    seconds: dict[str, float] = field(default_factory=dict)
    loss_curve: list[tuple[int, float, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    grad_rel_diff: list[tuple[int, float]] = field(default_factory=list)
    per_step: dict[str, dict[int, float]] = field(default_factory=dict)
    check_seconds: float = 0.0
    warm_up_seconds: float | None = None


@dataclass
class Conditions:
    """The conditions a comparison ran under, written into its table.

    ``threads``: torch's intra-op threads; ``load_start`` / ``load_end``: ``os.getloadavg()`` (1, 5 and 15
    minutes) when the runs started and ended; ``block_steps``: the runs took turns every that many steps.
    """

    threads: int
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    block_steps: int


def read_scalars(log_dir: str) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar of a TensorBoard run as ``tag -> [(wall_time, step, value), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def summarise_run(label: str, log_dir: str, final: Mapping[str, float], warmup: int = 5) -> RunSummary:
    """Build a :class:`RunSummary` from a run's TensorBoard scalars (logged by ``BackwardTimer``).

    The first ``min(warmup, steps // 5)`` steps are left out of the medians, and so are the steps with a
    gradient check (:data:`CHECK_SECONDS`: their step time holds two extra backward passes); the clock
    of the loss curve subtracts the checks' seconds. The warm-up (:data:`WARM_UP_KEY`) is kept apart, in
    ``warm_up_seconds``: it is no step's time. Loss points of steps without a ``time/step`` value
    (none when ``log_every_n_steps=1``) are left out of the curve.
    """
    scalars = read_scalars(log_dir)
    summary = RunSummary(label, log_dir, final=dict(final))
    checks = {step: value for _, step, value in scalars.get(CHECK_SECONDS, [])}
    summary.check_seconds = sum(checks.values())
    warm_up = scalars.get(WARM_UP_KEY)
    summary.warm_up_seconds = warm_up[-1][2] if warm_up else None
    for key in TIMING_KEYS:
        values = sorted((step, v) for _, step, v in scalars.get(f"time/{key}", []))
        kept = [(step, v) for step, v in values[min(warmup, len(values) // 5) :] if step not in checks]
        if kept:
            summary.seconds[key] = statistics.median(v for _, v in kept)
            if key in SPEEDUP_KEYS:
                summary.per_step[key] = dict(kept)
    step_times = sorted(
        (step, value - checks.get(step, 0.0)) for _, step, value in scalars.get("time/step", [])
    )
    clock = dict(zip((step for step, _ in step_times), accumulate(v for _, v in step_times), strict=True))
    losses = scalars.get("train/loss", [])
    summary.loss_curve = [(step, clock[step], value) for _, step, value in losses if step in clock]
    if losses:
        tail = [value for _, _, value in losses[-10:]]
        summary.final.setdefault("train/loss", sum(tail) / len(tail))
    summary.grad_rel_diff = [(step, value) for _, step, value in scalars.get(GRAD_REL_DIFF, [])]
    return summary


def speedups(baseline: RunSummary, bppsa: RunSummary) -> dict[str, float]:
    """``baseline / bppsa`` median time per step for ``backward`` and ``step`` (where both were logged)."""
    return {
        key: baseline.seconds[key] / bppsa.seconds[key]
        for key in SPEEDUP_KEYS
        if baseline.seconds.get(key) and bppsa.seconds.get(key)
    }


def block_speedups(baseline: RunSummary, bppsa: RunSummary, key: str, block_steps: int) -> list[float]:
    """``baseline / bppsa`` median ``time/<key>`` within each block of ``block_steps`` steps.

    The runs of ``compare`` take turns block by block, so both medians of a block were measured under
    nearly the same machine load: the spread of these ratios is how much the load moved the speedup.
    """
    blocks: list[float] = []
    ours, theirs = bppsa.per_step.get(key, {}), baseline.per_step.get(key, {})
    for first in range(0, max([*ours, *theirs], default=-1) + 1, block_steps):
        a = [theirs[s] for s in range(first, first + block_steps) if s in theirs]
        b = [ours[s] for s in range(first, first + block_steps) if s in ours]
        if a and b and statistics.median(b) > 0:
            blocks.append(statistics.median(a) / statistics.median(b))
    return blocks


def smoothing_window(points: int) -> int:
    """Steps in the running mean of the loss curves: 1/50 of the run, at least 1."""
    return max(1, points // 50)


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at every position (fewer at the start)."""
    total, out = 0.0, []
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


SAME_LOSS = 1e-4
"""Train losses closer than this at the same step count as the same in the comparison table."""
TARGET_SHARE = 0.8
"""How far down the loss range the common target of :func:`loss_plot_data` lies (not the noisy floor)."""


@dataclass
class LossPlot:
    """What :func:`plot_loss_curves` draws, per run (in ``runs`` order).

    ``window``: steps of the running mean; ``smooth``: the smoothed losses; ``target``: a smoothed loss
    every run reaches, :data:`TARGET_SHARE` of the way from the runs' common top (the lowest of their
    highest) down to their common floor (the highest of their lowest); ``reached``: ``(step, seconds)``
    where each run's smoothed loss first gets to ``target``.
    """

    window: int
    smooth: list[list[float]]
    target: float | None
    reached: list[tuple[int, float] | None]


def loss_plot_data(runs: Sequence[RunSummary]) -> LossPlot:
    """The smoothed curves and the time each run takes to reach a common loss (:class:`LossPlot`)."""
    window = smoothing_window(max((len(run.loss_curve) for run in runs), default=0))
    smooth = [_running_mean([loss for _, _, loss in run.loss_curve], window) for run in runs]
    target = None
    if smooth and all(smooth):
        top, floor = min(max(s) for s in smooth), max(min(s) for s in smooth)
        target = top - TARGET_SHARE * (top - floor)
    reached: list[tuple[int, float] | None] = []
    for run, curve in zip(runs, smooth, strict=True):
        first = next((i for i, loss in enumerate(curve) if target is not None and loss <= target), None)
        reached.append(None if first is None else run.loss_curve[first][:2])
    return LossPlot(window, smooth, target, reached)


def format_comparison(baseline: RunSummary, bppsa: RunSummary, conditions: Conditions | None = None) -> str:
    """The comparison as a markdown table: per-step times (ms), speedups and their spread over the blocks,
    the time to a common loss, the one-time warm-up, final losses, accuracies, the agreement of the two
    runs (loss gap at the same step, gradient checks) and the conditions (threads, load average)."""

    def ms(summary: RunSummary, key: str) -> str:
        return f"{1000 * summary.seconds[key]:.2f}" if key in summary.seconds else "-"

    ratio = speedups(baseline, bppsa)
    names = {
        "forward": "forward ms/step",
        "backward": "backward ms/step",
        "jacobian": "Jacobian overhead ms/step",
        "step": "total ms/step",
    }
    rows = [("", "autograd", "bppsa", "speedup"), ("---", "---:", "---:", "---:")]
    for key in TIMING_KEYS:
        speedup = f"{ratio[key]:.2f}x" if key in ratio else ""
        rows.append((names[key], ms(baseline, key), ms(bppsa, key), speedup))
    if conditions is not None:
        for key in SPEEDUP_KEYS:
            blocks = block_speedups(baseline, bppsa, key, conditions.block_steps)
            if len(blocks) > 1:
                spread = f"{statistics.median(blocks):.2f}x ({min(blocks):.2f}-{max(blocks):.2f}x)"
                label = f"{names[key].split()[0]} speedup per block of {conditions.block_steps} steps: median (range of {len(blocks)})"
                rows.append((label, "", "", spread))
    plot = loss_plot_data((baseline, bppsa))
    if plot.target is not None and all(plot.reached):
        (_, slow), (_, fast) = plot.reached  # type: ignore[misc]
        rows.append((
            f"seconds to smoothed train/loss <= {plot.target:.3f}", f"{slow:.3g}", f"{fast:.3g}",
            f"{slow / fast:.2f}x" if fast > 0 else "",
        ))  # fmt: skip
    if baseline.warm_up_seconds is not None or bppsa.warm_up_seconds is not None:
        warm_ups = [
            f"{s.warm_up_seconds:.3g}" if s.warm_up_seconds is not None else "-" for s in (baseline, bppsa)
        ]
        rows.append(("one-time warm-up s (kernel builds: a forward + backward before step 0, outside the "
                     "medians and the clock)", *warm_ups, ""))  # fmt: skip
    for metric in ("train/loss", "val/loss", "val/acc"):
        values = [f"{s.final[metric]:.4f}" if metric in s.final else "-" for s in (baseline, bppsa)]
        rows.append((f"final {metric}", *values, ""))
    ours = {step: loss for step, _, loss in bppsa.loss_curve}
    gaps = [(step, abs(loss - ours[step])) for step, _, loss in baseline.loss_curve if step in ours]
    if gaps:
        rows.append(("max train-loss gap at the same step", "", f"{max(gap for _, gap in gaps):.2e}", ""))
        # a run that learns amplifies float32 rounding (~1e-7) step by step: past some step the two
        # curves agree only statistically (any change of summation order does the same; see README)
        split = next((step for step, gap in gaps if gap > SAME_LOSS), None)
        rows.append(
            (
                f"first step with a train-loss gap > {SAME_LOSS:g}",
                "",
                "none" if split is None else str(split),
                "",
            )
        )
    if bppsa.grad_rel_diff:
        worst = max(value for _, value in bppsa.grad_rel_diff)
        checks = len(bppsa.grad_rel_diff)
        rows.append((
            f"max gradient rel. diff vs autograd ({checks} checks, {bppsa.check_seconds:.2f} s: "
            "left out of the medians and the clock)", "", f"{worst:.2e}", "",
        ))  # fmt: skip
    if conditions is not None:
        load = "; ".join(
            " ".join(f"{v:.2f}" for v in avg) for avg in (conditions.load_start, conditions.load_end)
        )
        rows.append(("torch threads", str(conditions.threads), str(conditions.threads), ""))
        rows.append(("load average (1, 5, 15 min) at start; at end", load, "", ""))
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend (imported here: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(
    fig: Any, axes: Sequence[Any], path: Path, title: str, legend_size: int | None = None
) -> Path:
    """Legend every axis, title ``fig``, write it to ``path`` (format from the suffix) and close it."""
    for ax in axes:
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


#: how each run is drawn (in ``runs`` order): the baseline wide and pale underneath, BPPSA dashed on top, so
#: that two identical curves both stay visible; markers offset by half their spacing
_RUN_STYLES = (
    {"color": "tab:blue", "linewidth": 4.0, "alpha": 0.45, "linestyle": "-", "marker": "o"},
    {"color": "tab:orange", "linewidth": 1.3, "alpha": 1.0, "linestyle": "--", "marker": "x"},
    {"color": "tab:green", "linewidth": 1.3, "alpha": 1.0, "linestyle": ":", "marker": "+"},
)


def plot_loss_curves(runs: Sequence[RunSummary], path: Path, title: str) -> Path:
    """Training loss against training time (paper Fig. 7, log time axis) and against the step (Fig. 6).

    The time axis is the running sum of ``time/step`` (the clock of the table's ``total ms/step``, less
    the gradient checks), logarithmic so that a run N times faster is a shift by log N, not a squeeze.
    The curves are running means over :func:`smoothing_window` steps (named in the axis label), the
    faint lines the per-step losses. A dotted line marks the loss every run reaches and where each
    reaches it (:func:`loss_plot_data`). Returns ``path``.
    """
    data = loss_plot_data(runs)
    fig, (by_time, by_step) = _pyplot().subplots(1, 2, figsize=(12, 4.5))
    for index, (run, smooth, style) in enumerate(zip(runs, data.smooth, _RUN_STYLES, strict=False)):
        if not run.loss_curve:
            continue
        steps, seconds, losses = zip(*run.loss_curve, strict=True)
        every = max(1, len(steps) // 12)
        marks = {"marker": style["marker"], "markevery": (index * every // 2 % every, every)}
        line = {k: style[k] for k in ("color", "linewidth", "alpha", "linestyle")}
        for ax, x in ((by_time, seconds), (by_step, steps)):
            ax.plot(x, losses, color=style["color"], linewidth=0.5, alpha=0.2)
            ax.plot(x, smooth, **line, **marks, label=f"{run.label} (mean of {data.window} steps)")
        if data.reached[index] is not None:
            by_time.axvline(data.reached[index][1], color=style["color"], linestyle=":", linewidth=1)
    if data.target is not None:
        for ax in (by_time, by_step):
            ax.axhline(data.target, color="grey", linestyle=":", linewidth=1, label=f"loss {data.target:.3f}")
    ylabel = f"training loss: mean of {data.window} steps (faint: per step)"
    by_time.set(
        xscale="log", xlabel="training time (s, log scale): sum of time/step, the table's clock",
        ylabel=ylabel, title="loss vs training time",
    )  # fmt: skip
    by_step.set(
        xlabel="step", ylabel=ylabel, title="loss vs step (autograd wide and pale, BPPSA dashed on top)"
    )
    return _save_figure(fig, (by_time, by_step), path, title, legend_size=8)


def speedup_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pair the autograd and BPPSA rows of every grid point ``(T, B)``: backward latencies and speedup.

    A point also takes the BPPSA row's ``path`` (``"scan"``, or ``"autograd"`` where BPPSA fell back to
    autograd: then ``speedup`` is ``None``, both columns having timed autograd) and, when given, its
    ``speedup_min`` / ``speedup_max`` (the range over the rounds).
    """
    points: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        point = points.setdefault((row.get("T"), row.get("B")), {"T": row.get("T"), "B": row.get("B")})
        point[f"{row['method']}_backward_s"] = float(row["backward_s"])
        if row["method"] == "bppsa":
            point["path"] = row.get("path") or "scan"
            point.update(
                {k: float(row[k]) for k in ("speedup_min", "speedup_max") if row.get(k) not in (None, "")}
            )
    paired = [p for p in points.values() if "autograd_backward_s" in p and "bppsa_backward_s" in p]
    for point in paired:
        ran_scan = point["path"] != "autograd"
        point["speedup"] = point["autograd_backward_s"] / point["bppsa_backward_s"] if ran_scan else None
    return sorted(paired, key=lambda p: (p["B"] is None, p["B"] or 0, p["T"] is None, p["T"] or 0))


FELL_BACK = "n/a*"
FELL_BACK_NOTE = (
    f'{FELL_BACK} BPPSA fell back to autograd at this point (path=autograd: `"auto"` judged the scan not '
    "worth it), so both columns timed autograd and no speedup is claimed."
)


def format_bench_table(name: str, points: Sequence[Mapping[str, Any]], conditions: str = "") -> str:
    """The markdown table of :func:`speedup_rows`' points: backward ms of both methods, the path BPPSA
    took, the speedup with its range over the rounds; ``conditions`` (machine, threads, load) above it."""
    lines = [f"# bench {name}", ""]
    if conditions:
        lines += [conditions, ""]
    lines += [
        "| T | B | path | autograd backward ms | bppsa backward ms | speedup | range over rounds |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for p in points:
        spread = f"{p['speedup_min']:.2f}-{p['speedup_max']:.2f}x" if "speedup_min" in p else ""
        speedup = f"{p['speedup']:.2f}x" if p["speedup"] is not None else FELL_BACK
        lines.append(
            f"| {p['T']} | {p['B']} | {p['path']} | {1e3 * p['autograd_backward_s']:.3f} "
            f"| {1e3 * p['bppsa_backward_s']:.3f} | {speedup} | {spread if p['speedup'] is not None else ''} |"
        )
    if any(p["speedup"] is None for p in points):
        lines += ["", FELL_BACK_NOTE]
    return "\n".join(lines)


def plot_bench_grid(points: Sequence[Mapping[str, Any]], x: str, line: str, path: Path, title: str) -> Path:
    """Latency (both methods) and speedup against ``x`` (``"T"`` or ``"1/B"``); a line per ``line`` value.

    Each ``line`` value keeps one colour in both panels (autograd dashed, BPPSA solid); points where BPPSA
    fell back to autograd are left out of the speedup panel.
    """
    key = "B" if x == "1/B" else x
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for point in points:
        groups.setdefault(point[line], []).append(point)
    fig, (latency, speed) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for index, (value, group) in enumerate(sorted(groups.items())):
        color = f"C{index % 10}"
        group = sorted(group, key=lambda p: 1 / p[key] if x == "1/B" else p[key])
        xs = [1 / p[key] if x == "1/B" else p[key] for p in group]
        latency.plot(
            xs,
            [p["autograd_backward_s"] * 1e3 for p in group],
            "--o",
            color=color,
            label=f"autograd {line}={value}",
        )
        latency.plot(
            xs, [p["bppsa_backward_s"] * 1e3 for p in group], "-s", color=color, label=f"bppsa {line}={value}"
        )
        scanned = [(xv, p["speedup"]) for xv, p in zip(xs, group, strict=True) if p["speedup"] is not None]
        if scanned:
            speed.plot(*zip(*scanned, strict=True), "-s", color=color, label=f"{line}={value}")
    latency.set(xscale="log", yscale="log", xlabel=x, ylabel="backward latency (ms)")
    speed.set(
        xscale="log", xlabel=x, ylabel="backward speedup (autograd / bppsa)",
        title="points where BPPSA ran autograd left out" if any(p["speedup"] is None for p in points) else None,
    )  # fmt: skip
    speed.axhline(1.0, color="grey", linewidth=0.8)
    return _save_figure(fig, (latency, speed), path, title, legend_size=7)
