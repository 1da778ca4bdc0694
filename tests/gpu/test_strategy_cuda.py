"""Trainer(strategy="bppsa") on the backend's accelerator ("gpu"; "cpu" where the kernels are emulated)
puts the model on its device and matches autograd."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bppsa import BPPSAStrategy

pytestmark = pytest.mark.cuda


class Tiny(pl.LightningModule):
    def __init__(self, device_type: str):
        super().__init__()
        self.rnn = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 2)
        self.device_type = device_type

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert self.device.type == self.device_type
        out, _ = self.rnn(x)
        return nn.functional.cross_entropy(self.head(out[:, -1]), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches(steps: int = 3, batch: int = 4) -> DataLoader:
    """``steps`` batches of ``(x (batch, 50, 3), y (batch,))``: ONE DataLoader (a list of batches would be
    read by ``Trainer.fit`` as a list of dataloaders)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(steps * batch, 50, 3, generator=g), torch.randint(0, 2, (steps * batch,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def fit(strategy, precision, backend):
    pl.seed_everything(0, verbose=False)
    model = Tiny(backend.device.type)
    pl.Trainer(
        strategy=strategy, accelerator=backend.accelerator, devices=1, max_steps=3, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(model, batches())
    return model


@pytest.mark.parametrize("precision,rtol", [("64-true", 1e-9), ("32-true", 1e-4), ("mixed", 5e-2)])
def test_training_matches_autograd(backend, precision, rtol):
    precision = backend.mixed_precision if precision == "mixed" else precision
    ours, ref = fit(BPPSAStrategy(algorithm="chunked"), precision, backend), fit("auto", precision, backend)
    assert ours.rnn.last_stats["path"] == "scan"
    # the device the steps ran on is checked inside training_step: after fit Lightning moves the model to the CPU
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert ((a - b).norm() / b.norm()).item() <= rtol


def test_string_strategy_gets_the_device(backend):
    trainer = pl.Trainer(strategy="bppsa", accelerator=backend.accelerator, devices=1, logger=False)
    assert trainer.strategy.root_device.type == backend.device.type
