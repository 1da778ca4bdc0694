"""What the CLI writes: runs read back from TensorBoard, the comparison and benchmark tables, the plots.

The clock: :class:`~lightning_bppsa.callbacks.BackwardTimer` logs ``time/step``, the time of every
training step (forward, backward, optimizer and hooks; not data loading, validation or logging). The
comparison table reports its medians, and the loss-vs-time plot draws the loss against its running
sum, so both use the same clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_bppsa.callbacks.gradient_check import DEFAULT_KEY as GRAD_REL_DIFF

__all__ = [
    "GRAD_REL_DIFF",
    "TIMING_KEYS",
    "RunSummary",
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

    ``seconds``: median seconds per step of each :data:`TIMING_KEYS` entry (warm-up steps excluded);
    ``loss_curve``: ``(step, training seconds up to and including that step, training loss)`` per
    logged step, the seconds being the running sum of ``time/step``;
    ``final``: final metrics (``train/loss`` averaged over the last steps, ``val/loss``, ``val/acc``);
    ``grad_rel_diff``: ``(step, value)`` of every gradient check (:data:`GRAD_REL_DIFF`).
    """

    label: str
    log_dir: str
    seconds: dict[str, float] = field(default_factory=dict)
    loss_curve: list[tuple[int, float, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    grad_rel_diff: list[tuple[int, float]] = field(default_factory=list)


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

    The first ``min(warmup, steps // 5)`` steps are left out of the medians. Loss points of steps
    without a ``time/step`` value (none when ``log_every_n_steps=1``) are left out of the curve.
    """
    scalars = read_scalars(log_dir)
    summary = RunSummary(label, log_dir, final=dict(final))
    for key in TIMING_KEYS:
        values = [v for _, _, v in scalars.get(f"time/{key}", [])]
        if values:
            summary.seconds[key] = statistics.median(values[min(warmup, len(values) // 5) :])
    step_times = sorted((step, value) for _, step, value in scalars.get("time/step", []))
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


def format_comparison(baseline: RunSummary, bppsa: RunSummary) -> str:
    """The comparison as a markdown table: per-step times (ms), speedups, final losses, accuracies, and
    the agreement of the two runs (loss gap at the same step, gradient checks)."""

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
    for metric in ("train/loss", "val/loss", "val/acc"):
        values = [f"{s.final[metric]:.4f}" if metric in s.final else "-" for s in (baseline, bppsa)]
        rows.append((f"final {metric}", *values, ""))
    ours = {step: loss for step, _, loss in bppsa.loss_curve}
    gaps = [abs(loss - ours[step]) for step, _, loss in baseline.loss_curve if step in ours]
    if gaps:
        rows.append(("max train-loss gap at the same step", "", f"{max(gaps):.2e}", ""))
    if bppsa.grad_rel_diff:
        worst = max(value for _, value in bppsa.grad_rel_diff)
        checks = len(bppsa.grad_rel_diff)
        rows.append((f"max gradient rel. diff vs autograd ({checks} checks)", "", f"{worst:.2e}", ""))
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at every position (fewer at the start)."""
    total, out = 0.0, []
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


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


def plot_loss_curves(runs: Sequence[RunSummary], path: Path, title: str) -> Path:
    """Training loss against training time (paper Fig. 7) and against the step (Fig. 6), a line per run.

    The time axis is the running sum of ``time/step``, the clock of the table's ``total ms/step``.
    Returns ``path``.
    """
    fig, (by_time, by_step) = _pyplot().subplots(1, 2, figsize=(11, 4))
    for run, color in zip(runs, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        if run.loss_curve:
            steps, seconds, losses = zip(*run.loss_curve, strict=True)
            smooth = _running_mean(losses, max(1, len(losses) // 50))
            for ax, x in ((by_time, seconds), (by_step, steps)):
                ax.plot(x, losses, color=color, linewidth=0.5, alpha=0.25)
                ax.plot(x, smooth, color=color, linewidth=1.5, label=run.label)
    by_time.set(
        xlabel="training time (s): sum of time/step, the table's clock",
        ylabel="training loss (faint: per step)",
        title="loss vs training time",
    )
    by_step.set(xlabel="step", ylabel="training loss (faint: per step)", title="loss vs step")
    return _save_figure(fig, (by_time, by_step), path, title)


def speedup_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pair the autograd and BPPSA rows of every grid point ``(T, B)``: backward latencies and speedup."""
    points: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        point = points.setdefault((row.get("T"), row.get("B")), {"T": row.get("T"), "B": row.get("B")})
        point[f"{row['method']}_backward_s"] = float(row["backward_s"])
    paired = [p for p in points.values() if "autograd_backward_s" in p and "bppsa_backward_s" in p]
    for point in paired:
        point["speedup"] = point["autograd_backward_s"] / point["bppsa_backward_s"]
    return sorted(paired, key=lambda p: (p["B"] is None, p["B"] or 0, p["T"] is None, p["T"] or 0))


def format_bench_table(name: str, points: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of :func:`speedup_rows`' points (backward ms of both methods, speedup)."""
    lines = [
        f"# bench {name}",
        "",
        "| T | B | autograd backward ms | bppsa backward ms | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {p['T']} | {p['B']} | {1e3 * p['autograd_backward_s']:.3f} | {1e3 * p['bppsa_backward_s']:.3f} "
        f"| {p['speedup']:.2f}x |"
        for p in points
    ]
    return "\n".join(lines)


def plot_bench_grid(points: Sequence[Mapping[str, Any]], x: str, line: str, path: Path, title: str) -> Path:
    """Latency (both methods) and speedup against ``x`` (``"T"`` or ``"1/B"``); a line per ``line`` value."""
    key = "B" if x == "1/B" else x
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for point in points:
        groups.setdefault(point[line], []).append(point)
    fig, (latency, speed) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for value, group in sorted(groups.items()):
        group = sorted(group, key=lambda p: 1 / p[key] if x == "1/B" else p[key])
        xs = [1 / p[key] if x == "1/B" else p[key] for p in group]
        latency.plot(
            xs, [p["autograd_backward_s"] * 1e3 for p in group], "--o", label=f"autograd {line}={value}"
        )
        latency.plot(xs, [p["bppsa_backward_s"] * 1e3 for p in group], "-o", label=f"bppsa {line}={value}")
        speed.plot(xs, [p["speedup"] for p in group], "-o", label=f"{line}={value}")
    latency.set(xscale="log", yscale="log", xlabel=x, ylabel="backward latency (ms)")
    speed.set(xscale="log", xlabel=x, ylabel="backward speedup (autograd / bppsa)")
    speed.axhline(1.0, color="grey", linewidth=0.8)
    return _save_figure(fig, (latency, speed), path, title, legend_size=7)
