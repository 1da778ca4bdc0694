"""A tiny LightningModule with a conv chain that strategy "bppsa" converts, and a Trainer factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyChain(pl.LightningModule):
    """conv -> ReLU -> max-pool chain (scanned under "bppsa") and a linear head, on 1x6x6 inputs."""

    def __init__(self, samples: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Linear(8, 3)
        generator = torch.Generator().manual_seed(0)
        self.data = TensorDataset(
            torch.randn(samples, 1, 6, 6, generator=generator), torch.randint(3, (samples,))
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.features(x)), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture
def fit(tmp_path: Any) -> Callable[..., pl.Trainer]:
    """``fit(callbacks, model=None, **trainer_kwargs)``: train quietly under "bppsa"; returns the Trainer."""

    def run(
        callbacks: list[pl.Callback], model: pl.LightningModule | None = None, **kwargs: Any
    ) -> pl.Trainer:
        defaults: dict[str, Any] = dict(
            strategy="bppsa", max_steps=4, logger=False, enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=1, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer = pl.Trainer(callbacks=callbacks, **{**defaults, **kwargs})
        trainer.fit(model if model is not None else TinyChain())
        return trainer

    return run


@pytest.fixture
def tiny_chain() -> type[TinyChain]:
    """The :class:`TinyChain` class (test modules cannot import conftest under --import-mode=importlib)."""
    return TinyChain
