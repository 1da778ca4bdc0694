"""LeNet-5 on CIFAR-10: the convergence check of the BPPSA paper (Sec. 4, Fig. 6).

Trained with SGD (lr 1e-3, momentum 0.9), batch 256, under both strategies from the same seed: BPPSA
computes the exact back-propagation gradients, so the two training-loss curves overlap. The
convolutional part is an ``nn.Sequential`` chain (conv / ReLU / max-pool) that ``strategy="bppsa"``
converts.

    lightning-bppsa compare --config lenet5_convergence --max-epochs 5
"""

from __future__ import annotations

import torch
from lightning_bppsa.recipes._common import ClassificationTask
from torch import Tensor, nn

__all__ = ["LeNet5"]


class LeNet5(ClassificationTask):
    """LeNet-5 for 3x32x32 inputs: two conv(5x5)-ReLU-maxpool stages, then 400-120-84-10.

    Args:
        lr: SGD learning rate (the paper: 1e-3).
        momentum: SGD momentum (the paper: 0.9).
    """

    def __init__(self, lr: float = 1e-3, momentum: float = 0.9) -> None:
        super().__init__(num_classes=10)
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
        )

    def forward(self, images: Tensor) -> Tensor:
        """``images``: ``(B, 3, 32, 32)`` -> logits ``(B, 10)``."""
        return self.classifier(self.features(images))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
