"""Trainer(strategy="bppsa", accelerator="gpu") puts the model on the GPU and matches autograd."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_bppsa import BPPSAStrategy

pytestmark = pytest.mark.cuda


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        assert self.device.type == "cuda"
        out, _ = self.rnn(batch[0])
        return nn.functional.cross_entropy(self.head(out[:, -1]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(strategy, precision):
    pl.seed_everything(0, verbose=False)
    model = Tiny()
    data = [(torch.randn(4, 50, 3), torch.randint(0, 2, (4,))) for _ in range(3)]
    pl.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, max_steps=3, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    ).fit(model, data)
    return model


@pytest.mark.parametrize("precision,rtol", [("64-true", 1e-9), ("32-true", 1e-4), ("16-mixed", 5e-2)])
def test_gpu_training_matches_autograd(cuda, precision, rtol):
    ours, ref = fit(BPPSAStrategy(algorithm="chunked"), precision), fit("auto", precision)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert a.device.type == "cuda"
        assert ((a - b).norm() / b.norm()).item() <= rtol


def test_string_strategy_gets_the_gpu(cuda):
    trainer = pl.Trainer(strategy="bppsa", accelerator="gpu", devices=1, logger=False)
    assert trainer.strategy.root_device.type == "cuda"
