"""CIFAR-10 data for the image recipes: the standard python batches, or a generated stand-in.

Real data: ``data_dir`` is the extracted ``cifar-10-batches-py`` folder (``data_batch_1`` ..
``data_batch_5`` and ``test_batch``, pickled dicts with ``b"data"`` (N, 3072) uint8 and ``b"labels"``).
Stand-in (``data_dir: null``): images of the same shape made of a fixed random low-frequency pattern
per class plus noise, so that a network can learn them.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning_bppsa.recipes._common import (
    MissingDataError,
    RecipeConfigError,
    Split,
    TensorDataModule,
    announce_stand_in,
)
from torch import Tensor

__all__ = ["CIFAR10DataModule", "check_cifar10_layout", "generate_cifar10_stand_in", "load_cifar10"]

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
LAYOUT = """expected the extracted CIFAR-10 python batches (cifar-10-python.tar.gz from
https://www.cs.toronto.edu/~kriz/cifar.html):
  {root}/data_batch_1 .. {root}/data_batch_5
  {root}/test_batch"""


def check_cifar10_layout(root: Path) -> None:
    """Raise :class:`MissingDataError`, showing the expected layout, unless ``root`` holds the batches."""
    missing = [name for name in [*TRAIN_FILES, TEST_FILE] if not (root / name).is_file()]
    if missing:
        raise MissingDataError(
            f"CIFAR-10: missing {', '.join(missing)} in {root}\n" + LAYOUT.format(root=root)
        )


def _read_batch(path: Path) -> tuple[Tensor, Tensor]:
    """One python batch file -> images ``(N, 3, 32, 32)`` uint8, labels ``(N,)`` int64; a file that is not
    one raises :class:`RecipeConfigError` naming it and what it should hold."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        batch = pickle.loads(raw, encoding="bytes")
        images = torch.as_tensor(np.asarray(batch[b"data"]))
        labels = torch.as_tensor(np.asarray(batch[b"labels"]))
        problem = "" if images.dtype == torch.uint8 else f"b'data' of dtype {images.dtype}"
        if images.dim() != 2 or images.shape[1] != 3072 or labels.shape != images.shape[:1]:
            problem = f"b'data' of shape {tuple(images.shape)} and b'labels' of shape {tuple(labels.shape)}"
    except Exception as error:  # unpickling arbitrary bytes can fail in any way
        problem = f"{type(error).__name__}: {str(error)[:200]}"
    if problem:
        raise RecipeConfigError(
            f"CIFAR-10: {path} is not a CIFAR-10 python batch ({problem}); each batch is a pickled dict with "
            "b'data': (N, 3072) uint8 and b'labels': N ints\n" + LAYOUT.format(root=path.parent)
        )
    return images.reshape(-1, 3, 32, 32), labels.to(torch.int64)


def load_cifar10(root: str | Path) -> Split:
    """Read the CIFAR-10 python batches in ``root``: images ``(N, 3, 32, 32)`` uint8, labels int64."""
    root = Path(root).expanduser()
    check_cifar10_layout(root)

    def read(names: list[str]) -> tuple[Tensor, Tensor]:
        images, labels = [], []
        for name in names:
            x, y = _read_batch(root / name)
            images.append(x)
            labels.append(y)
        return torch.cat(images), torch.cat(labels)

    train_x, train_y = read(TRAIN_FILES)
    val_x, val_y = read([TEST_FILE])
    return {"train_x": train_x, "train_y": train_y, "val_x": val_x, "val_y": val_y}


def generate_cifar10_stand_in(num_train: int, num_val: int, seed: int) -> Split:
    """CIFAR-10-shaped images: per class a fixed smooth random pattern, plus per-image noise and shift."""
    generator = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.rand(10, 3, 4, 4, generator=generator), size=(32, 32), mode="bilinear")

    def draw(n: int) -> tuple[Tensor, Tensor]:
        labels = torch.randint(10, (n,), generator=generator)
        brightness = 0.5 + torch.rand(n, 1, 1, 1, generator=generator)
        noise = 0.25 * torch.randn(n, 3, 32, 32, generator=generator)
        images = (patterns[labels] * brightness + noise).clamp(0, 1)
        return (images * 255).round().to(torch.uint8), labels

    train_x, train_y = draw(num_train)
    val_x, val_y = draw(num_val)
    return {"train_x": train_x, "train_y": train_y, "val_x": val_x, "val_y": val_y}


class CIFAR10DataModule(TensorDataModule):
    """CIFAR-10 batches ``x (B, 3, 32, 32)`` float (normalised per channel), ``y (B,)``.

    Args:
        data_dir: the ``cifar-10-batches-py`` folder; ``None`` trains on the generated stand-in.
        batch_size: B.
        stand_in_train: stand-in training images.
        stand_in_val: stand-in validation images.
        **common: ``seed`` (of the stand-in generator), ``cache_dir``, ``num_workers``
            (see :class:`~lightning_bppsa.recipes._common.TensorDataModule`).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        batch_size: int = 256,
        stand_in_train: int = 10000,
        stand_in_val: int = 2000,
        **common: Any,
    ) -> None:
        super().__init__(batch_size=batch_size, **common)
        self.data_dir = None if data_dir is None else Path(data_dir).expanduser().resolve()
        self.stand_in_train, self.stand_in_val = stand_in_train, stand_in_val

    def check(self) -> None:
        super().check()
        if self.data_dir is not None:
            check_cifar10_layout(self.data_dir)

    def cache_name(self) -> str:
        if self.data_dir is not None:
            return f"cifar10-{hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:10]}.pt"
        return f"cifar10-stand-in-{self.stand_in_train}-{self.stand_in_val}-seed{self.seed}.pt"

    def build(self) -> Split:
        if self.data_dir is not None:
            return load_cifar10(self.data_dir)
        return generate_cifar10_stand_in(self.stand_in_train, self.stand_in_val, self.seed)

    def setup(self, stage: str) -> None:
        if self.data_dir is None:
            announce_stand_in("CIFAR-10", f"{self.stand_in_train} class-patterned 32x32 images")
        super().setup(stage)

    def on_after_batch_transfer(
        self, batch: tuple[Tensor, Tensor], dataloader_idx: int
    ) -> tuple[Tensor, Tensor]:
        """uint8 images -> float, normalised with the CIFAR-10 channel means and deviations."""
        images, labels = batch
        mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1)
        return (images.float() / 255 - mean) / std, labels
