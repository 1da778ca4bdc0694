"""Pruned VGG-11 on CIFAR-10 (BPPSA paper, Sec. 4.3): BPPSA on a sparse convolutional chain.

Stages: train the dense network; prune 97 % of the conv and linear weights by magnitude, class-blind
(one global threshold over all layers, ``torch.nn.utils.prune.global_unstructured`` with
``L1Unstructured``); retrain with the pruned weights held at zero. Under ``strategy="bppsa"`` the
``features`` chain (conv / ReLU / max-pool) runs its backward as a scan over sparse Jacobians.

Two ways to run the stages:

- one fit: ``dense_epochs`` epochs dense, then prune and retrain until ``trainer.max_epochs``;
- two fits (the paper's way, dense stage on autograd): train with ``--model.prune_amount=0
  --trainer.strategy=auto``, then retrain from that checkpoint with ``--model.dense_checkpoint=PATH``
  (the weights are loaded and pruned before the Trainer starts).

    lightning-bppsa fit --config vgg11_pruned --data.data_dir=path/to/cifar-10-batches-py
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_bppsa.recipes._common import ClassificationTask, RecipeConfigError
from torch import Tensor, nn
from torch.nn.utils import prune

__all__ = ["PrunedVGG11", "VGG11_CHANNELS", "vgg11_features"]

VGG11_CHANNELS: tuple[int | str, ...] = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
"""VGG configuration "A" (11 weight layers: these 8 convolutions and 3 linear layers); "M" = 2x2 max-pool."""


def vgg11_features(width: float = 1.0) -> nn.Sequential:
    """VGG-11's convolutional chain (3x3 conv + ReLU, 2x2 max-pool): ``(B, 3, 32, 32) -> (B, C, 1, 1)``.

    ``width`` scales every channel count (1.0 = the real network).
    """
    layers: list[nn.Module] = []
    channels = 3
    for item in VGG11_CHANNELS:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            out = max(1, round(int(item) * width))
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
            channels = out
    return nn.Sequential(*layers)


class PrunedVGG11(ClassificationTask):
    """VGG-11 for CIFAR-10 with class-blind magnitude pruning and masked retraining.

    Args:
        lr: SGD learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        width: channel multiplier (1.0 = VGG-11; smaller for quick runs).
        prune_amount: share of all conv and linear weights set to zero (the paper: 0.97); 0 = no pruning.
        dense_epochs: epochs trained dense before pruning within this fit (ignored with ``dense_checkpoint``).
        dense_checkpoint: a checkpoint of the dense stage to load and prune before training.
    """

    def __init__(
        self,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        width: float = 1.0,
        prune_amount: float = 0.97,
        dense_epochs: int = 10,
        dense_checkpoint: str | None = None,
    ) -> None:
        super().__init__(num_classes=10)
        self.save_hyperparameters()
        self.features = vgg11_features(width)
        channels = self.features[-3].out_channels
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels, 512),
            nn.ReLU(),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Linear(512, 10),
        )
        self._prunable = [m for m in self.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
        for index, module in enumerate(self._prunable):
            self.register_buffer(f"mask_{index}", torch.ones_like(module.weight))
        self.register_buffer("pruned", torch.tensor(False))
        if dense_checkpoint is not None:
            state = torch.load(dense_checkpoint, map_location="cpu", weights_only=True)["state_dict"]
            self.load_state_dict(state)
            self.prune()

    def masks(self) -> list[Tensor]:
        """The 0/1 mask of every conv and linear weight, in module order."""
        return [getattr(self, f"mask_{index}") for index in range(len(self._prunable))]

    @torch.no_grad()
    def prune(self) -> None:
        """Zero the ``prune_amount`` smallest-magnitude weights over all conv and linear layers at once."""
        if self.hparams.prune_amount == 0 or self.pruned:
            return
        targets = [(module, "weight") for module in self._prunable]
        prune.global_unstructured(
            targets, pruning_method=prune.L1Unstructured, amount=self.hparams.prune_amount
        )
        for module, mask in zip(self._prunable, self.masks(), strict=True):
            mask.copy_(module.weight_mask)
            prune.remove(module, "weight")  # keeps the same Parameter object, now holding the zeros
        self.pruned.fill_(True)
        kept = sum(int(mask.sum()) for mask in self.masks()) / sum(mask.numel() for mask in self.masks())
        rank_zero_info(f"vgg11_pruned: pruned {1 - kept:.1%} of the conv and linear weights (class-blind)")

    def setup(self, stage: str) -> None:
        if not 0 <= self.hparams.prune_amount < 1:
            raise RecipeConfigError(
                f"vgg11_pruned: prune_amount must be in [0, 1); got {self.hparams.prune_amount}"
            )

    def on_train_epoch_start(self) -> None:
        if self.hparams.dense_checkpoint is None and self.current_epoch >= self.hparams.dense_epochs:
            self.prune()

    def on_train_batch_end(
        self, outputs: Tensor | dict, batch: tuple[Tensor, Tensor], batch_idx: int
    ) -> None:
        """Keep pruned weights at zero after every optimizer step (retraining never revives them)."""
        if self.pruned:
            with torch.no_grad():
                for module, mask in zip(self._prunable, self.masks(), strict=True):
                    module.weight.mul_(mask)

    def forward(self, images: Tensor) -> Tensor:
        """``images``: ``(B, 3, 32, 32)`` -> logits ``(B, 10)``."""
        return self.classifier(self.features(images))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
