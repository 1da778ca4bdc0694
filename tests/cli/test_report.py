"""Runs read back from TensorBoard: medians, the step-time clock, gradient checks, the table."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_bppsa.cli.report import (
    RunSummary,
    format_comparison,
    plot_loss_curves,
    speedups,
    summarise_run,
)


def _write_run(folder: Path, step_seconds: list[float], losses: list[float], checks: dict[int, float]) -> str:
    writer = SummaryWriter(str(folder))
    for step, (seconds, loss) in enumerate(zip(step_seconds, losses, strict=True)):
        writer.add_scalar("time/step", seconds, step)
        writer.add_scalar("time/backward", seconds / 2, step)
        writer.add_scalar("train/loss", loss, step)
    for step, value in checks.items():
        writer.add_scalar("bppsa/grad_rel_diff", value, step)
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
    assert "| max gradient rel. diff vs autograd (2 checks) |  | 4.00e-07 |  |" in table


def test_loss_plot_is_written(tmp_path: Path) -> None:
    runs = [RunSummary("autograd", "", loss_curve=[(0, 0.1, 2.0), (1, 0.3, 1.0)])]
    path = plot_loss_curves(runs, tmp_path / "loss.png", "title")
    assert path.read_bytes().startswith(b"\x89PNG")
