"""Light gated recurrent unit (LiGRU, Ravanelli et al. 2018) on the bitstream task, as a user-written cell.

The data are the bitstreams of :mod:`~lightning_bppsa.recipes.rnn_bitstream` (BPPSA Eq. 8). The network is
a LiGRU written by hand, the way a researcher writes a new cell: the input projection of every step is
one GEMM before the loop (with a row-wise LayerNorm in place of the paper's batch norm, which would mix
batch rows), and the cell keeps only the recurrence,

    z_t = σ(a^z_t + U_z h_{t-1}),   h̃_t = ReLU(a^h_t + U_h h_{t-1}),   h_t = z_t ⊙ h_{t-1} + (1 - z_t) ⊙ h̃_t,

looped by :class:`lightning_bppsa.nn.Recurrence`, whose backward is the dense scan whatever the strategy;
a linear layer classifies ``h_T``. ``scan=False`` loops the same cell under plain autograd: the baseline.

    lightning-bppsa fit --config ligru_bitstream
"""

from __future__ import annotations

import torch
from lightning_bppsa.recipes._common import ClassificationTask
from lightning_bppsa.recipes.rnn_bitstream import NUM_CLASSES, BitstreamDataModule
from torch import Tensor, nn

from lightning_bppsa.nn import Recurrence

__all__ = ["BitstreamDataModule", "BitstreamLiGRU", "LiGRUCell"]


class LiGRUCell(nn.Module):
    """The LiGRU recurrence: ``(a_t (B, 2H), h (B, H)) -> h'``; ``a_t`` is the step's input projection."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.state_size = hidden_size
        self.recurrent = nn.Linear(hidden_size, 2 * hidden_size, bias=False)
        nn.init.orthogonal_(self.recurrent.weight)

    def forward(self, a_t: Tensor, h: Tensor) -> Tensor:
        a_z, a_h = a_t.chunk(2, -1)
        u_z, u_h = self.recurrent(h).chunk(2, -1)
        z = torch.sigmoid(a_z + u_z)
        return z * h + (1 - z) * torch.relu(a_h + u_h)


class BitstreamLiGRU(ClassificationTask):
    """LiGRU over the bits, logits from the last state.

    Args:
        hidden_size: the state size H.
        lr: Adam learning rate.
        scan: loop the cell with :class:`~lightning_bppsa.nn.Recurrence` (scan backward); ``False``:
            a plain Python loop under autograd (the baseline).
        algorithm: the scan algorithm of ``Recurrence`` (``"auto"``, ``"linear"``, ``"blelloch"``, ``"chunked"``).
    """

    def __init__(self, hidden_size: int = 20, lr: float = 1e-3, scan: bool = True, algorithm: str = "auto") -> None:
        super().__init__(NUM_CLASSES)
        self.save_hyperparameters()
        self.project = nn.Linear(1, 2 * hidden_size)
        self.norm = nn.LayerNorm(2 * hidden_size)
        self.rnn = Recurrence(LiGRUCell(hidden_size), batch_first=True, algorithm=algorithm)
        self.head = nn.Linear(hidden_size, NUM_CLASSES)

    def forward(self, bits: Tensor) -> Tensor:
        """``bits``: ``(B, T)`` of 0/1 (any dtype) -> logits ``(B, 10)``."""
        a = self.norm(self.project(bits.to(self.head.weight.dtype).unsqueeze(-1)))  # (B, T, 2H), one GEMM
        if self.hparams.scan:
            _, h = self.rnn(a)
        else:
            cell = self.rnn.cell
            h = a.new_zeros(a.shape[0], cell.state_size)
            for a_t in a.unbind(1):
                h = cell(a_t, h)
        return self.head(h)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
