"""The cached tensor DataModule every recipe shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_bppsa.recipes.rnn_bitstream import BitstreamDataModule


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[:200]),  # cut short
        lambda path: path.write_bytes(b""),
        lambda path: path.write_bytes(b"\x80\x04garbage" * 10),
        lambda path: torch.save([1, 2, 3], path),  # a readable file that is no cache
    ],
    ids=["truncated", "empty", "garbage", "not-a-split"],
)
def test_a_corrupted_cache_is_named_deleted_and_built_again(tmp_path: Path, damage) -> None:
    def data() -> BitstreamDataModule:
        return BitstreamDataModule(
            seq_len=5, num_samples=16, val_samples=4, batch_size=4, cache_dir=str(tmp_path)
        )

    fresh = data()
    fresh.prepare_data()
    fresh.setup("fit")
    damage(fresh.cache_path)
    again = data()
    again.prepare_data()
    with pytest.warns(UserWarning, match=f"data cache {fresh.cache_path} is corrupted .*building it again"):
        again.setup("fit")
    assert all(torch.equal(again.tensors[key], fresh.tensors[key]) for key in fresh.tensors)
    assert torch.load(fresh.cache_path).keys() == fresh.tensors.keys()  # rewritten whole
