"""Runs read back from TensorBoard: medians, the step-time clock, gradient checks, the table."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_bppsa.cli import report
from lightning_bppsa.cli.report import (
    CHECK_SECONDS,
    WARM_UP_KEY,
    Conditions,
    RunSummary,
    block_speedups,
    format_comparison,
    loss_plot_data,
    plot_loss_curves,
    speedups,
    summarise_run,
)


def _write_run(
    folder: Path,
    step_seconds: list[float],
    losses: list[float],
    checks: dict[int, float],
    check_seconds: dict[int, float] | None = None,
    warm_up: float | None = None,
) -> str:
    writer = SummaryWriter(str(folder))
    if warm_up is not None:
        writer.add_scalar(WARM_UP_KEY, warm_up, 0)
    for step, (seconds, loss) in enumerate(zip(step_seconds, losses, strict=True)):
        writer.add_scalar("time/step", seconds, step)
        writer.add_scalar("time/backward", seconds / 2, step)
        writer.add_scalar("train/loss", loss, step)
    for step, value in checks.items():
        writer.add_scalar("bppsa/grad_rel_diff", value, step)
    for step, value in (check_seconds or {}).items():
        writer.add_scalar(CHECK_SECONDS, value, step)
    writer.close()
    return str(folder)


def test_summary_uses_the_step_time_clock_and_keeps_the_gradient_checks(tmp_path: Path) -> None:
    seconds = [0.5, 0.1, 0.2, 0.3, 0.4, 0.2]  # the first step is warm-up, left out of the medians
    log_dir = _write_run(tmp_path / "bppsa", seconds, [2.0, 1.9, 1.8, 1.7, 1.6, 1.5], {0: 3e-7, 3: 5e-7})
    summary = summarise_run("bppsa", log_dir, {"val/acc": 0.5})
    assert summary.seconds["step"] == pytest.approx(0.2) and summary.seconds["backward"] == pytest.approx(0.1)
    assert [s for _, s, _ in summary.loss_curve] == pytest.approx([0.5, 0.6, 0.8, 1.1, 1.5, 1.7])
    assert [step for step, _, _ in summary.loss_curve] == list(range(6))
    assert summary.grad_rel_diff == [(0, pytest.approx(3e-7)), (3, pytest.approx(5e-7))]
    assert summary.final["train/loss"] == pytest.approx(1.75) and summary.final["val/acc"] == 0.5


def test_table_reports_speedups_and_the_agreement_of_the_runs() -> None:
    curve = [(0, 0.1, 2.0), (1, 0.2, 1.5)]
    autograd = RunSummary("autograd", "", {"backward": 0.03, "step": 0.05}, curve, {"train/loss": 1.5})
    bppsa = RunSummary(
        "bppsa", "", {"backward": 0.01, "step": 0.02}, [(0, 0.1, 2.0), (1, 0.15, 1.5 + 2e-6)],
        {"train/loss": 1.5}, [(0, 1e-7), (5, 4e-7)],
    )  # fmt: skip
    assert speedups(autograd, bppsa) == pytest.approx({"backward": 3.0, "step": 2.5})
    table = format_comparison(autograd, bppsa)
    assert "| backward ms/step | 30.00 | 10.00 | 3.00x |" in table
    assert "| total ms/step | 50.00 | 20.00 | 2.50x |" in table
    assert "| max train-loss gap at the same step |  | 2.00e-06 |  |" in table
    assert "| first step with a train-loss gap > 0.0001 |  | none |  |" in table
    assert (
        "| max gradient rel. diff vs autograd (2 checks, 0.00 s: left out of the medians and the clock) |  | 4.00e-07 |  |"
        in table
    )


def test_gradient_checks_are_left_out_of_the_medians_and_the_clock(tmp_path: Path) -> None:
    seconds = [0.5, 0.1, 0.9, 0.1, 0.1, 0.3]  # step 2 holds a check of 0.8 s
    log_dir = _write_run(tmp_path / "b", seconds, [2.0] * 6, {2: 1e-7}, {2: 0.8})
    summary = summarise_run("bppsa", log_dir, {})
    assert summary.seconds["step"] == pytest.approx(0.1)  # median of steps 1, 3, 4, 5
    assert sorted(summary.per_step["step"]) == [1, 3, 4, 5] and summary.check_seconds == pytest.approx(0.8)
    assert [s for _, s, _ in summary.loss_curve] == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.9, 1.2])


def test_the_warm_up_is_its_own_row_outside_the_medians_and_the_clock(tmp_path: Path) -> None:
    seconds, losses = [0.1, 0.2, 0.1, 0.3, 0.1, 0.2], [2.0, 1.9, 1.8, 1.7, 1.6, 1.5]
    autograd = summarise_run("autograd", _write_run(tmp_path / "a", seconds, losses, {}, warm_up=0.5), {})
    bppsa = summarise_run("bppsa", _write_run(tmp_path / "b", seconds, losses, {}, warm_up=8.0), {})
    assert (autograd.warm_up_seconds, bppsa.warm_up_seconds) == (0.5, 8.0)
    assert bppsa.seconds["step"] == pytest.approx(0.2) and sorted(bppsa.per_step["step"]) == [1, 2, 3, 4, 5]
    assert [s for _, s, _ in bppsa.loss_curve] == pytest.approx([0.1, 0.3, 0.4, 0.7, 0.8, 1.0])
    table = format_comparison(autograd, bppsa)
    assert "before step 0, outside the medians and the clock) | 0.5 | 8 |  |" in table
    to_loss = next(row for row in table.splitlines() if row.startswith("| seconds to smoothed train/loss"))
    assert to_loss.endswith(" | 1.00x |")  # the same curves on the same clock: 8 s against 0.5 s left out


def _run(label: str, step_ms: list[float], losses: list[float]) -> RunSummary:
    clock = [sum(step_ms[: i + 1]) / 1e3 for i in range(len(step_ms))]
    return RunSummary(
        label, "", {"step": sorted(step_ms)[len(step_ms) // 2] / 1e3},
        [(i, t, loss) for i, (t, loss) in enumerate(zip(clock, losses, strict=True))],
        per_step={"step": {i: ms / 1e3 for i, ms in enumerate(step_ms)}},
    )  # fmt: skip


def test_per_block_speedups_show_how_a_load_change_moved_the_ratio() -> None:
    # the machine got twice as slow for the second block, for both runs alike (they took turns)
    autograd = _run("autograd", [40, 40, 80, 80], [2, 2, 2, 2])
    bppsa = _run("bppsa", [10, 10, 20, 25], [2, 2, 2, 2])
    assert block_speedups(autograd, bppsa, "step", 2) == pytest.approx([4.0, 80 / 22.5])
    table = format_comparison(autograd, bppsa, Conditions(1, (1.0, 0.5, 0.25), (2.0, 1.0, 0.5), 2))
    assert "| total speedup per block of 2 steps: median (range of 2) |  |  | 3.78x (3.56-4.00x) |" in table
    assert "| torch threads | 1 | 1 |  |" in table
    assert "| load average (1, 5, 15 min) at start; at end | 1.00 0.50 0.25; 2.00 1.00 0.50 |  |  |" in table


def test_time_to_a_common_loss_and_the_smoothing_window() -> None:
    losses = [2.0 - 0.01 * i for i in range(100)]  # the same curve: BPPSA 4x faster per step
    autograd, bppsa = _run("autograd", [40] * 100, losses), _run("bppsa", [10] * 100, losses)
    data = loss_plot_data([autograd, bppsa])
    assert data.window == 2 and data.smooth[0] == data.smooth[1]
    top, floor = data.smooth[0][0], data.smooth[0][-1]
    assert data.target == pytest.approx(top - 0.8 * (top - floor))
    (step_a, time_a), (step_b, time_b) = data.reached
    assert step_a == step_b and time_a / time_b == pytest.approx(4.0)
    assert (
        f"| seconds to smoothed train/loss <= {data.target:.3f} | {time_a:.3g} | {time_b:.3g} | 4.00x |"
        in (format_comparison(autograd, bppsa))
    )


def test_loss_plot_draws_identical_runs_both_visible_on_a_log_time_axis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = []
    save = report._save_figure
    monkeypatch.setattr(
        report, "_save_figure", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k)
    )
    losses = [2.0 - 0.01 * i for i in range(100)]
    runs = [_run("autograd", [40] * 100, losses), _run("bppsa", [10] * 100, losses)]
    path = plot_loss_curves(runs, tmp_path / "loss.png", "title")
    assert path.read_bytes().startswith(b"\x89PNG")
    by_time, by_step = figures[0].axes
    assert by_time.get_xscale() == "log" and "mean of 2 steps" in by_step.get_ylabel()
    under, over = (line for line in by_step.get_lines() if "mean of 2 steps" in str(line.get_label()))
    assert under.get_label().startswith("autograd") and over.get_label().startswith("bppsa")
    assert under.get_linewidth() > 2 * over.get_linewidth() and over.get_linestyle() == "--"
    assert under.get_markevery() != over.get_markevery()  # markers offset: both runs show
