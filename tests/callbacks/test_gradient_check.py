"""GradientCheck: BPPSA's gradients against autograd's, every N steps."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_bppsa.callbacks import GradientCheck
from lightning_bppsa.callbacks.gradient_check import DEFAULT_KEY, SECONDS_KEY

import lightning_bppsa.nn as bnn
from lightning_bppsa import backends
from lightning_bppsa.cli.report import read_scalars
from lightning_bppsa.gradcheck import gradient_difference
from lightning_bppsa.nn._reference_backward import reference_backward, reference_backward_enabled


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


def _on_another_thread(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run on a thread of its own and joined, as autograd runs a CUDA tensor's backward on its
    device thread, not on the thread that called ``torch.autograd.grad``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        result: dict[str, Any] = {}

        def target() -> None:
            try:
                result["value"] = function(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller's thread below
                result["error"] = error

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    return call


@pytest.mark.parametrize("corrupt", [False, True])
def test_gradient_difference_reports_a_corrupted_scan_whose_backward_runs_on_another_thread(monkeypatch, corrupt):
    # every backward on a thread other than the one inside reference_backward(), as on a GPU: the reference
    # must still be autograd's (with a thread-local switch the corrupted scan was compared with itself: 0.0)
    if corrupt:  # the layer's backward (eager: backends.backward; dispatched: the op, which calls it)
        scan = backends.backward
        monkeypatch.setattr(backends, "backward", lambda *args: [2 * g for g in scan(*args)])
    monkeypatch.setattr(torch.autograd, "grad", _on_another_thread(torch.autograd.grad))
    torch.manual_seed(0)
    rnn = bnn.RNN(2, 4, algorithm="linear", dtype=torch.float64)
    loss = rnn(torch.randn(5, 3, 2, dtype=torch.float64))[0].pow(2).sum()
    difference = gradient_difference(loss, rnn.parameters())
    assert rnn.last_stats["path"] == "scan"
    if corrupt:  # twice the true gradients: relative error 1
        assert difference == pytest.approx(1.0, rel=1e-9)
    else:
        assert difference < 1e-12


def test_reference_backward_is_seen_by_every_thread_while_any_block_is_open() -> None:
    seen = _on_another_thread(reference_backward_enabled)
    assert not seen()
    with reference_backward():
        with reference_backward():
            assert seen()
        assert seen()  # the outer block is still open
    assert not seen() and not reference_backward_enabled()
