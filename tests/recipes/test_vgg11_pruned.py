"""Pruned VGG-11: class-blind magnitude pruning, masked retraining, pruning a dense checkpoint."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning_bppsa.recipes.cifar10 import CIFAR10DataModule
from lightning_bppsa.recipes.vgg11_pruned import PrunedVGG11, vgg11_features
from torch import nn


def _weights(model: PrunedVGG11) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]


def test_vgg11_has_eight_convolutions_and_three_linear_layers() -> None:
    model = PrunedVGG11()
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 8
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 3
    assert vgg11_features(0.125)(torch.randn(2, 3, 32, 32)).shape == (2, 64, 1, 1)


def test_pruning_is_global_magnitude_and_keeps_the_parameters() -> None:
    model = PrunedVGG11(width=0.125, prune_amount=0.9)
    before = {id(p) for p in model.parameters()}
    magnitudes = torch.cat([w.detach().abs().flatten() for w in _weights(model)])
    model.prune()
    assert {id(p) for p in model.parameters()} == before  # the optimizer keeps training the same tensors
    weights = torch.cat([w.detach().flatten() for w in _weights(model)])
    assert (weights == 0).float().mean().item() == pytest.approx(0.9, abs=1e-3)
    threshold = magnitudes.kthvalue(int(0.9 * magnitudes.numel())).values
    assert (
        weights.abs().min() == 0 and weights[weights != 0].abs().min() >= threshold
    )  # one threshold, all layers
    per_layer = [(w == 0).float().mean().item() for w in _weights(model)]
    assert max(per_layer) - min(per_layer) > 0.05  # class-blind: layers end up with different sparsities


@pytest.mark.slow
def test_retraining_keeps_pruned_weights_at_zero(tmp_path: Path) -> None:
    model = PrunedVGG11(width=0.0625, prune_amount=0.97, dense_epochs=1, lr=0.05)
    data = CIFAR10DataModule(batch_size=8, stand_in_train=32, stand_in_val=8, cache_dir=str(tmp_path))
    trainer = pl.Trainer(
        max_epochs=2, limit_train_batches=3, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, strategy="bppsa",
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert bool(model.pruned)
    for weight, mask in zip(_weights(model), model.masks(), strict=True):
        assert torch.all(weight[mask == 0] == 0)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "dense.ckpt")
    again = PrunedVGG11(width=0.0625, dense_checkpoint=str(tmp_path / "dense.ckpt"))
    assert bool(again.pruned)
    for ours, theirs in zip(again.masks(), model.masks(), strict=True):
        assert torch.equal(ours, theirs)
