"""GradientCheck: BPPSA's gradients against autograd's, every N steps."""

from __future__ import annotations

import itertools

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_bppsa.callbacks import GradientCheck
from lightning_bppsa.callbacks.gradient_check import DEFAULT_KEY, SECONDS_KEY

from lightning_bppsa.cli.report import read_scalars


def test_logs_a_small_error_on_the_checked_steps(fit) -> None:
    check = GradientCheck(every_n_steps=2)
    trainer = fit([check], max_steps=5)
    assert trainer.strategy.conversion_report and any(r.scanned for r in trainer.strategy.conversion_report)
    assert check.last is not None and check.worst < 1e-5
    assert DEFAULT_KEY in trainer.callback_metrics
    assert check.state_dict() == {"worst": check.worst, "last": check.last}


def test_each_check_logs_the_seconds_it_took(fit, tmp_path) -> None:
    check = GradientCheck(every_n_steps=2, clock=itertools.count(step=0.25).__next__)
    fit([check], max_steps=4, logger=TensorBoardLogger(tmp_path, "s"))
    logged = read_scalars(str(tmp_path / "s" / "version_0"))[SECONDS_KEY]
    assert [(step, value) for _, step, value in logged] == [(0, 0.25), (2, 0.25)]


def test_warns_above_the_threshold(fit) -> None:
    with pytest.warns(UserWarning, match="GradientCheck: BPPSA gradients differ"):
        fit([GradientCheck(every_n_steps=1, threshold=-1.0)], max_steps=1)


def test_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        GradientCheck(every_n_steps=0)


def test_every_check_reaches_the_logger_whatever_log_every_n_steps(fit, tmp_path) -> None:
    fit(
        [GradientCheck(every_n_steps=3)],
        max_steps=7,
        log_every_n_steps=50,
        logger=TensorBoardLogger(tmp_path, "g"),
    )
    logged = read_scalars(str(tmp_path / "g" / "version_0"))[DEFAULT_KEY]
    assert [step for _, step, _ in logged] == [0, 3, 6]
