"""BackwardTimer: forward / backward / Jacobian / step times of every training step."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
from lightning_bppsa.callbacks import BackwardTimer
from lightning_bppsa.callbacks.backward_timer import jacobian_seconds
from torch import nn


def test_times_every_step_from_its_marks(fit) -> None:
    # an injected clock that reads 0, 1, 2, ...: marks start, before backward, after backward, end
    trainer = fit([BackwardTimer(clock=itertools.count().__next__)])
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("time/")}
    assert metrics == {"time/forward": 1.0, "time/backward": 1.0, "time/jacobian": 0.0, "time/step": 3.0}


def test_logs_only_on_the_steps_the_trainer_logs(fit) -> None:
    class Recorder(pl.loggers.logger.Logger):
        name, version, steps = "recorder", 0, []

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("time/") for k in metrics):
                self.steps.append(step)

        def log_hyperparams(self, *args, **kwargs):
            pass

    logs = []
    timer = BackwardTimer()
    original = timer._watch.mark
    timer._watch.mark = lambda name, device: (logs.append(name), original(name, device))[1]
    recorder = Recorder()
    fit([timer], max_steps=6, log_every_n_steps=3, logger=recorder)
    assert recorder.steps == [2, 5]  # Lightning's steps 3 and 6, counted from 0
    assert logs.count("end") == 2  # nothing measured or logged on the other steps


def test_jacobian_seconds_sums_scanned_modules_only() -> None:
    model = pl.LightningModule()
    model.a, model.b, model.c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    model.a.last_stats = {"path": "scan", "jacobian_seconds": 0.25}
    model.b.last_stats = {"path": "scan", "jacobian_seconds": 0.5}
    model.c.last_stats = {"path": "autograd", "jacobian_seconds": 9.0}
    assert jacobian_seconds(model) == pytest.approx(0.75)
