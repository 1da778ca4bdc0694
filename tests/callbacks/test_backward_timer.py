"""BackwardTimer: forward / backward / Jacobian / step times of every training step."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning_bppsa.callbacks import BackwardTimer
from lightning_bppsa.callbacks.backward_timer import jacobian_seconds
from torch import nn


def test_times_every_step_and_the_parts_fit_in_the_step(fit) -> None:
    trainer = fit([BackwardTimer()])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("time/")}
    assert set(metrics) == {"time/forward", "time/backward", "time/jacobian", "time/step"}
    assert metrics["time/forward"] > 0 and metrics["time/backward"] > 0
    assert metrics["time/forward"] + metrics["time/backward"] <= metrics["time/step"]


def test_jacobian_seconds_sums_scanned_modules_only() -> None:
    model = pl.LightningModule()
    model.a, model.b, model.c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    model.a.last_stats = {"path": "scan", "jacobian_seconds": 0.25}
    model.b.last_stats = {"path": "scan", "jacobian_seconds": 0.5}
    model.c.last_stats = {"path": "autograd", "jacobian_seconds": 9.0}
    assert jacobian_seconds(model) == pytest.approx(0.75)
