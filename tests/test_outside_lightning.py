"""Outside re-run (#19): Trainer(strategy="bppsa") against strategy="auto" on a tiny recurrent model, over
optimization mode, accumulation, clipping, precision, and checkpoints crossing the two strategies."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bppsa import BPPSAStrategy

TOLERANCE = {"64-true": 1e-10, "32-true": 1e-5, "bf16-mixed": 2e-2}


class TinyRecurrent(pl.LightningModule):
    """GRU -> LSTM (or RNN) -> linear head, loss on every step; SGD so weights move visibly in 3 steps.

    ``lstm=False`` swaps the LSTM for an RNN: torch's own LSTM fails under CPU bf16 autocast (oneDNN "could
    not create a primitive descriptor for the LSTM forward propagation primitive", torch 2.13), strategy
    "auto" included, so there is nothing to compare against.
    """

    def __init__(self, manual: bool = False, clip: float | None = None, lstm: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.gru = nn.GRU(3, 5, batch_first=True)
        self.lstm = (nn.LSTM if lstm else nn.RNN)(5, 4, num_layers=2, bidirectional=True)
        self.head = nn.Linear(8, 2)
        self.automatic_optimization = not manual
        self.clip = clip

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, _ = self.gru(x)
        out, _ = self.lstm(out.transpose(0, 1))
        loss = nn.functional.mse_loss(self.head(out.transpose(0, 1)), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.5)


def _loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 7, 3, generator=g), torch.randn(24, 7, 2, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=3, shuffle=False)


def _trainer(strategy, precision, steps, accumulate=1, clip=None):
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, precision=precision, max_steps=steps,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )


def _fit(strategy, precision, manual=False, accumulate=1, clip=None, steps=3):
    model = TinyRecurrent(manual=manual, clip=clip if manual else None, lstm=precision != "bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(strategy, precision, steps, accumulate, None if manual else clip).fit(model, _loader())
    return model


def _assert_same_weights(ours, ref, tol):
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    moved, initial = 0, TinyRecurrent(lstm=isinstance(ref.lstm, nn.LSTM)).state_dict()
    for name, value in ref_sd.items():
        torch.testing.assert_close(ours_sd[name], value, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
        moved += not torch.equal(value, initial[name].to(value.dtype))
    assert moved == len(ref_sd), "some weights did not move: the comparison would be vacuous"


MATRIX = [
    (manual, accumulate, clip)
    for manual in (False, True)
    for accumulate in ((1,) if manual else (1, 2))  # Lightning refuses accumulation with manual optimization
    for clip in (None, 0.05)
]


@pytest.mark.slow
@pytest.mark.parametrize("precision", sorted(TOLERANCE))
@pytest.mark.parametrize(("manual", "accumulate", "clip"), MATRIX)
def test_bppsa_weights_equal_auto(precision, manual, accumulate, clip):
    ours = _fit(BPPSAStrategy(algorithm="linear"), precision, manual, accumulate, clip)
    assert type(ours.gru).__module__.startswith("lightning_bppsa"), type(ours.gru)
    assert type(ours.lstm).__module__.startswith("lightning_bppsa"), type(ours.lstm)
    assert ours.gru.last_stats["path"] == ours.lstm.last_stats["path"] == "scan", ours.lstm.last_stats
    ref = _fit("auto", precision, manual, accumulate, clip)
    _assert_same_weights(ours, ref, TOLERANCE[precision])


def _resume(tmp_path, first, second):
    """3 steps under ``first``, a checkpoint, then on to step 6 under ``second`` (float64)."""
    model = TinyRecurrent()
    trainer = _trainer(first, "64-true", 3)
    path = tmp_path / f"{first}-{second}.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, _loader())
        trainer.save_checkpoint(path)
        keys = list(torch.load(path, weights_only=False)["state_dict"])
        assert keys == list(TinyRecurrent().state_dict()), keys  # torch's keys, no wrapper prefix
        resumed = TinyRecurrent()
        _trainer(second, "64-true", 6).fit(resumed, _loader(), ckpt_path=path)
    return resumed


@pytest.mark.slow
@pytest.mark.parametrize(("first", "second"), [("bppsa", "auto"), ("auto", "bppsa"), ("bppsa", "bppsa")])
def test_checkpoint_crosses_strategies(tmp_path, first, second):
    """Save under one strategy, resume under the other: the same weights as saving and resuming under "auto".

    (The reference resumes too: Lightning restarts the epoch's dataloader on a mid-epoch resume, so a plain
    6-step run sees other batches.)
    """
    _assert_same_weights(_resume(tmp_path, first, second), _resume(tmp_path, "auto", "auto"), 1e-10)
