"""GradientCheck: BPPSA's gradients against autograd's, every N steps."""

from __future__ import annotations

import pytest
from lightning_bppsa.callbacks import GradientCheck


def test_logs_a_small_error_on_the_checked_steps(fit) -> None:
    check = GradientCheck(every_n_steps=2)
    trainer = fit([check], max_steps=5)
    assert trainer.strategy.conversion_report and any(r.scanned for r in trainer.strategy.conversion_report)
    assert check.last is not None and check.worst < 1e-5
    assert "grad_check/max_rel_err" in trainer.callback_metrics
    assert check.state_dict() == {"worst": check.worst, "last": check.last}


def test_warns_above_the_threshold(fit) -> None:
    with pytest.warns(UserWarning, match="GradientCheck: BPPSA gradients differ"):
        fit([GradientCheck(every_n_steps=1, threshold=-1.0)], max_steps=1)


def test_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        GradientCheck(every_n_steps=0)
