"""The trial step that leaves no trace, and the warm-up step ``compare`` runs before its clock."""

from __future__ import annotations

import random
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_bppsa.callbacks import BackwardTimer
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_bppsa.bench.trial import NotMeasurable, WarmUp, trial_step
from lightning_bppsa.cli.report import RunSummary, format_comparison, read_scalars, summarise_run

BUILD_SECONDS = 100.0  # what the first forward "costs": the kernels it builds


class FakeClock:
    """A clock that moves only when told to (the model's forward moves it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Net(pl.LightningModule):
    """An RNN with everything a trial step could disturb: dropout (RNG), batch norm (buffers), a metric."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 8, batch_first=True)
        self.norm = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 2)
        self.acc = MulticlassAccuracy(2)
        self.clock = clock
        self.forwards = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.clock is not None:  # the first forward of the process builds its kernels
            self.clock.now += BUILD_SECONDS if self.forwards == 0 else 1.0
        self.forwards += 1
        x, y = batch
        out, _ = self.rnn(x)
        logits = self.head(self.drop(self.norm(out[:, -1])))
        self.acc(logits, y)
        loss = F.cross_entropy(logits, y)
        self.log("train/loss", loss, on_step=True)
        self.log("train/acc", self.acc, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 5, 3), torch.tensor([0, 1, 1, 0])


def test_a_trial_step_leaves_gradients_buffers_metrics_and_generators_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    net, batch = Net(), _batch()
    net.head.weight.grad = torch.ones_like(net.head.weight)  # a gradient already there is kept, not added to
    logged: list[str] = []
    monkeypatch.setattr(pl.LightningModule, "log", lambda self, name, *a, **k: logged.append(name))
    before = {
        "buffers": [b.clone() for b in net.buffers()],
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state()[1].copy(),
    }
    trial_step(net, lambda: {"loss": net.training_step(batch, 0)})  # a dict output, as Lightning allows
    assert net.forwards == 1 and logged == [] and "log" not in vars(net)  # nothing logged, log is back
    assert (
        torch.equal(net.head.weight.grad, torch.ones_like(net.head.weight))
        and net.rnn.weight_hh_l0.grad is None
    )
    assert all(torch.equal(b, saved) for b, saved in zip(net.buffers(), before["buffers"], strict=True))
    assert net.norm.num_batches_tracked == 0 and net.acc.update_count == 0
    assert torch.equal(torch.get_rng_state(), before["torch"]) and random.getstate() == before["python"]
    assert np.array_equal(np.random.get_state()[1], before["numpy"])
    net.training_step(batch, 0)
    assert logged == ["train/loss", "train/acc"]


def test_a_trial_step_names_a_metric_it_could_not_roll_back_and_refuses_manual_optimization() -> None:
    net, batch = Net(), _batch()
    net.acc(torch.randn(4, 2), batch[1])  # updated before the trial: its state cannot be rolled back
    with pytest.warns(UserWarning, match="metric 'acc' held 1 update"):
        trial_step(net, lambda: net.training_step(batch, 0))
    net.automatic_optimization = False
    with pytest.raises(NotMeasurable, match="manual optimization"):
        trial_step(net, lambda: net.training_step(batch, 0))
    assert net.forwards == 1


def _fit(tmp_path: Path, name: str, warm_up: bool) -> tuple[Net, str]:
    """Six BPPSA steps of :class:`Net`; the step times from a clock that only the forward moves."""
    pl.seed_everything(0, verbose=False)
    clock = FakeClock()
    net = Net(clock)
    x, y = torch.randn(12, 5, 3), torch.randint(0, 2, (12,))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    callbacks = [WarmUp(clock=clock)] if warm_up else []
    trainer = pl.Trainer(
        strategy="bppsa", accelerator="cpu", max_steps=6, log_every_n_steps=1,
        logger=TensorBoardLogger(str(tmp_path), name=name, version=0),
        callbacks=[*callbacks, BackwardTimer(clock=clock)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(net, data)
    return net, trainer.logger.log_dir


def test_the_warm_up_is_timed_on_its_own_and_training_goes_on_as_without_it(tmp_path: Path) -> None:
    cold, cold_dir = _fit(tmp_path, "cold", warm_up=False)
    warm, warm_dir = _fit(tmp_path, "warm", warm_up=True)
    assert warm.forwards == cold.forwards + 1
    # the same trajectory: losses, weights, batch-norm statistics, the epoch's accuracy (two epochs of 3 steps)
    cold_scalars, warm_scalars = read_scalars(cold_dir), read_scalars(warm_dir)
    for tag in ("train/loss", "train/acc_epoch"):
        assert [v for _, _, v in warm_scalars[tag]] == [v for _, _, v in cold_scalars[tag]], tag
    for (key, a), (_, b) in zip(cold.state_dict().items(), warm.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    # the build sits in the first step without the warm-up; with it, in a row of its own
    cold_run, warm_run = summarise_run("autograd", cold_dir, {}), summarise_run("bppsa", warm_dir, {})
    assert cold_run.loss_curve[0][1] == BUILD_SECONDS and cold_run.warm_up_seconds is None
    assert warm_run.warm_up_seconds == BUILD_SECONDS
    assert [seconds for _, seconds, _ in warm_run.loss_curve] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert warm_run.seconds["step"] == 1.0 and sorted(warm_run.per_step["step"]) == [1, 2, 3, 4, 5]
    assert "| one-time warm-up s (kernel builds: a forward + backward before step 0, outside the medians and " \
        "the clock) | - | 100 |  |" in format_comparison(cold_run, warm_run)  # fmt: skip


def test_no_warm_up_row_when_neither_run_had_one() -> None:
    runs = RunSummary("autograd", "", {"step": 0.01}), RunSummary("bppsa", "", {"step": 0.01})
    assert "warm-up" not in format_comparison(*runs)
