"""CIFAR-10 data: the real python-batches loader (on a tiny fake copy) and the generated stand-in."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_bppsa.recipes._common import MissingDataError, RecipeConfigError
from lightning_bppsa.recipes.cifar10 import CIFAR10DataModule, generate_cifar10_stand_in, load_cifar10


def _write_batches(root: Path, per_batch: int = 4) -> None:
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [1, 2, 3, 9][:per_batch],
        }
        (root / name).write_bytes(pickle.dumps(batch))


def test_real_loader_reads_the_python_batches(tmp_path: Path) -> None:
    _write_batches(tmp_path)
    data = load_cifar10(tmp_path)
    assert data["train_x"].shape == (20, 3, 32, 32) and data["train_x"].dtype == torch.uint8
    assert data["val_x"].shape == (4, 3, 32, 32)
    assert data["train_y"].tolist()[:4] == [1, 2, 3, 9]
    raw = pickle.loads((tmp_path / "data_batch_1").read_bytes())[b"data"][0]
    assert data["train_x"][0, 1, 0, 0].item() == raw[1024]  # channel-major rows, as the format stores them


def test_datamodule_switches_to_the_real_data_and_normalises(tmp_path: Path) -> None:
    _write_batches(tmp_path)
    module = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4, cache_dir=str(tmp_path / "cache"))
    module.prepare_data()
    module.setup("fit")
    images, labels = module.on_after_batch_transfer(next(iter(module.val_dataloader())), 0)
    assert images.dtype == torch.float32 and images.shape == (4, 3, 32, 32)
    assert -3 < images.min() < 0 < images.max() < 3
    assert labels.tolist() == [1, 2, 3, 9]


def test_missing_batches_print_the_expected_layout(tmp_path: Path) -> None:
    (tmp_path / "data_batch_1").write_bytes(b"")
    with pytest.raises(MissingDataError, match="data_batch_2") as error:
        CIFAR10DataModule(data_dir=str(tmp_path), batch_size=4).prepare_data()
    assert "test_batch" in str(error.value) and "cifar-10-python.tar.gz" in str(error.value)


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        (b"\x00\x01 not a pickle at all", "UnpicklingError"),
        (pickle.dumps([1, 2, 3]), "TypeError"),
        (
            pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}),
            "b'data' of shape (2, 100)",
        ),
    ],
)
def test_a_garbage_batch_file_is_named_with_what_it_should_hold(
    tmp_path: Path, garbage: bytes, problem: str
) -> None:
    _write_batches(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(garbage)
    with pytest.raises(RecipeConfigError, match="data_batch_3 is not a CIFAR-10 python batch") as error:
        load_cifar10(tmp_path)
    assert problem in str(error.value) and "pickled dict with b'data': (N, 3072) uint8" in str(error.value)


def test_stand_in_has_cifar_shapes_and_is_learnable_by_its_class_pattern() -> None:
    data = generate_cifar10_stand_in(200, 50, seed=0)
    assert data["train_x"].shape == (200, 3, 32, 32) and data["val_x"].shape == (50, 3, 32, 32)
    x, y = data["train_x"].float(), data["train_y"]
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    nearest = torch.cdist(x.flatten(1), means.flatten(1)).argmin(1)
    assert (nearest == y).float().mean() > 0.5
