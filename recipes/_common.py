"""What every recipe shares: a classification LightningModule and a cached tensor DataModule.

A recipe subclasses both: the module gets the network (``forward``) and the optimizer, the DataModule
says how to build its tensors (from the real dataset, or a generated stand-in) and how to name the cache.
"""

from __future__ import annotations

import os
import pickle
from abc import abstractmethod
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_bppsa.recipes._errors import MissingDataError, RecipeConfigError
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

__all__ = [
    "DEFAULT_CACHE_DIR",
    "ClassificationTask",
    "MissingDataError",
    "RecipeConfigError",
    "Split",
    "TensorDataModule",
    "announce_stand_in",
]

DEFAULT_CACHE_DIR = "~/.cache/lightning-bppsa"

Split = dict[str, Tensor]
"""Cached tensors: ``train_x``, ``train_y``, ``val_x``, ``val_y`` (labels int64, class indices)."""
SPLIT_KEYS = ("train_x", "train_y", "val_x", "val_y")


def _is_split(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(key), Tensor) for key in SPLIT_KEYS)


def announce_stand_in(recipe: str, what: str) -> None:
    """Log the one line saying a recipe trains on generated data instead of the real dataset."""
    rank_zero_info(f"{recipe}: no data_dir given, training on a generated stand-in ({what}).")


class ClassificationTask(pl.LightningModule):
    """Cross-entropy classification with accuracy (torchmetrics), logged as ``train/*`` and ``val/*``.

    Subclasses define ``forward(x) -> logits (B, num_classes)`` and ``configure_optimizers``.
    """

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

    def _loss(self, batch: tuple[Tensor, Tensor], accuracy: MulticlassAccuracy) -> Tensor:
        x, y = batch
        logits = self(x)
        accuracy(logits, y)
        return F.cross_entropy(logits, y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch, self.train_acc)
        self.log("train/loss", loss, on_step=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch, self.val_acc)
        self.log("val/loss", loss, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_epoch=True, prog_bar=True)


class TensorDataModule(pl.LightningDataModule):
    """Train / validation tensors built once by :meth:`build` and cached to ``cache_dir/cache_name()``.

    A recipe's DataModule takes its own arguments and passes the rest (``**common``) here; LightningCLI
    (jsonargparse) follows ``super().__init__(**common)`` and offers these as ``--data.<name>`` too.

    Args:
        batch_size: B, for training and validation.
        seed: seed of what the recipe generates or draws (stand-in data, validation split).
        cache_dir: where the built tensors are cached (``~`` is expanded).
        num_workers: DataLoader workers.
    """

    def __init__(
        self, batch_size: int = 16, seed: int = 0, cache_dir: str = DEFAULT_CACHE_DIR, num_workers: int = 0
    ) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed
        self.cache_dir = Path(cache_dir).expanduser()
        self.num_workers = num_workers
        self.tensors: Split | None = None

    @abstractmethod
    def cache_name(self) -> str:
        """File name of the cache: must change whenever the built tensors would."""

    def check(self) -> None:
        """Raise :class:`RecipeConfigError` when the configuration cannot work (called before any work).

        Checks run here rather than in ``__init__`` so that the error reaches the user as it is
        (jsonargparse wraps exceptions raised while it builds the object).
        """
        if self.batch_size < 1:
            raise RecipeConfigError(f"batch_size must be >= 1; got {self.batch_size}")

    @abstractmethod
    def build(self) -> Split:
        """Build the tensors (load and preprocess the real dataset, or generate the stand-in)."""

    @property
    def cache_path(self) -> Path:
        """Where the built tensors live."""
        return self.cache_dir / self.cache_name()

    def prepare_data(self) -> None:
        self.check()
        if not self.cache_path.exists():
            self._build_and_cache()

    def _build_and_cache(self) -> Split:
        tensors = self.build()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        partial = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(tensors, partial)
        os.replace(partial, self.cache_path)  # atomic: a half-written cache is never read
        rank_zero_info(f"cached {self.cache_path}")
        return tensors

    def _load_cache(self) -> Split:
        """The cached tensors; a cache that cannot be read (cut short, overwritten, not a cache) is
        reported with its path, deleted and built again."""
        try:
            tensors = torch.load(self.cache_path)
        except (RuntimeError, EOFError, KeyError, ValueError, pickle.UnpicklingError) as error:
            first_sentence = str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else ""
            problem = f"torch.load raised {type(error).__name__}: {first_sentence}"
        else:
            if _is_split(tensors):
                return tensors
            problem = f"it holds a {type(tensors).__name__}, not a dict of tensors {', '.join(SPLIT_KEYS)}"
        rank_zero_warn(
            f"data cache {self.cache_path} is corrupted ({problem}); deleting it and building it again"
        )
        self.cache_path.unlink(missing_ok=True)
        return self._build_and_cache()

    def setup(self, stage: str) -> None:
        self.check()
        if self.tensors is None:
            self.tensors = self._load_cache()

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        assert self.tensors is not None, "call prepare_data() and setup() first"
        dataset = TensorDataset(self.tensors[f"{split}_x"], self.tensors[f"{split}_y"])
        # the shuffle draws from its own generator, not torch's global one: two runs that take turns in one
        # process (`lightning-bppsa compare`) then see the same batches in the same order
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(
            dataset,
            self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            drop_last=shuffle,
            generator=generator,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)
