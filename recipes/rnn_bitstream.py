"""RNN bitstream classification (BPPSA paper, Sec. 4.1, Eq. 8-9): the recurrent benchmark workload.

Each sample is a bitstream ``x_1..x_T`` of one class ``c`` in 0..9, with ``x_t ~ Bernoulli(0.05 + 0.1 c)``
(Eq. 8); a single-layer ``nn.RNN`` (hidden 20, tanh) reads it and a linear layer classifies its last
hidden state (Eq. 9), so the loss is on the last step only. Adam, lr 1e-5, 32000 training samples.
The dataset is generated deterministically from ``seed`` and cached. Under ``strategy="bppsa"`` the
``nn.RNN`` is converted and its backward through the T steps runs as a scan.

    lightning-bppsa fit --config rnn_bitstream
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_bppsa.recipes._common import (
    ClassificationTask,
    RecipeConfigError,
    Split,
    TensorDataModule,
)
from torch import Tensor, nn
from tqdm import tqdm

__all__ = ["BitstreamDataModule", "BitstreamRNN", "generate_bitstreams"]

NUM_CLASSES = 10


def generate_bitstreams(
    num_samples: int, seq_len: int, seed: int, chunk: int = 1000
) -> tuple[Tensor, Tensor]:
    """Eq. 8: labels ``c ~ U{0..9}`` and bits ``x[i, t] ~ Bernoulli(0.05 + 0.1 c_i)``.

    Returns ``(bits (num_samples, seq_len) uint8, labels (num_samples,) int64)``; the same arguments
    always give the same tensors.
    """
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(NUM_CLASSES, (num_samples,), generator=generator)
    bits = torch.empty(num_samples, seq_len, dtype=torch.uint8)
    with tqdm(total=num_samples, desc=f"bitstreams T={seq_len}", unit="sample", leave=False) as progress:
        for start in range(0, num_samples, chunk):
            p = 0.05 + 0.1 * labels[start : start + chunk, None].float()
            bits[start : start + chunk] = torch.rand(p.shape[0], seq_len, generator=generator) < p
            progress.update(p.shape[0])
    return bits, labels


class BitstreamDataModule(TensorDataModule):
    """Generated bitstreams (Eq. 8): ``x`` is ``(B, T)`` uint8 bits, ``y`` is ``(B,)`` the class.

    Args:
        seq_len: T, the number of time steps (the paper: 10 .. 30000).
        num_samples: training samples (the paper: 32000).
        val_samples: validation samples (generated with ``seed + 1``).
        **common: ``batch_size`` (default 16), ``seed`` (of the generator), ``cache_dir``, ``num_workers``
            (see :class:`~lightning_bppsa.recipes._common.TensorDataModule`).
    """

    def __init__(
        self,
        seq_len: int = 1000,
        num_samples: int = 32000,
        val_samples: int = 1000,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.seq_len, self.num_samples, self.val_samples = seq_len, num_samples, val_samples

    def check(self) -> None:
        super().check()
        if self.seq_len < 1 or self.num_samples < self.batch_size or self.val_samples < 1:
            raise RecipeConfigError(
                "need seq_len >= 1, num_samples >= batch_size and val_samples >= 1; got "
                f"seq_len={self.seq_len}, num_samples={self.num_samples}, batch_size={self.batch_size}, "
                f"val_samples={self.val_samples}"
            )

    def cache_name(self) -> str:
        return f"bitstream-T{self.seq_len}-n{self.num_samples}-v{self.val_samples}-seed{self.seed}.pt"

    def build(self) -> Split:
        train_x, train_y = generate_bitstreams(self.num_samples, self.seq_len, self.seed)
        val_x, val_y = generate_bitstreams(self.val_samples, self.seq_len, self.seed + 1)
        return {"train_x": train_x, "train_y": train_y, "val_x": val_x, "val_y": val_y}


class BitstreamRNN(ClassificationTask):
    """Eq. 9: ``h_t = tanh(W_ih x_t + W_hh h_{t-1} + b)``, logits ``= W_out h_T + b_out``.

    Args:
        hidden_size: RNN hidden size (the paper: 20).
        lr: Adam learning rate (the paper: 1e-5).
    """

    def __init__(self, hidden_size: int = 20, lr: float = 1e-5) -> None:
        super().__init__(NUM_CLASSES)
        self.save_hyperparameters()
        self.rnn = nn.RNN(1, hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, NUM_CLASSES)

    def forward(self, bits: Tensor) -> Tensor:
        """``bits``: ``(B, T)`` of 0/1 (any dtype) -> logits ``(B, 10)``."""
        _, h_n = self.rnn(bits.to(self.head.weight.dtype).unsqueeze(-1))
        return self.head(h_n[-1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
