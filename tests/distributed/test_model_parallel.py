"""``BPPSAModelParallelStrategy`` (``"bppsa_model_parallel"``) trains to the same weights as single-process autograd."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_bppsa  # noqa: F401  (registers the strategy)
from lightning_bppsa.model_parallel import ModelParallelRNN

T, B, STEPS = 11, 3, 3


class _Bitstream(pl.LightningModule):
    """Elman RNN + linear head, loss on the last hidden state (the paper's RNN benchmark, Eq. 8-9)."""

    def __init__(self, nonlinearity: str) -> None:
        super().__init__()
        self.rnn = nn.RNN(2, 5, nonlinearity=nonlinearity, batch_first=True)
        self.head = nn.Linear(5, 4)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, h_n = self.rnn(x)
        return nn.functional.cross_entropy(self.head(h_n[0]), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _train_and_compare(rank: int, world: int) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(B * STEPS, T, 2, dtype=torch.float64), torch.randint(0, 4, (B * STEPS,)))
    for nonlinearity in ("tanh", "relu"):
        model = _Bitstream(nonlinearity).double()
        reference = copy.deepcopy(model)
        optimizer = reference.configure_optimizers()
        for x, y in DataLoader(data, batch_size=B):
            optimizer.zero_grad()
            reference.loss(x, y).backward()
            optimizer.step()
        trainer = pl.Trainer(
            strategy="bppsa_model_parallel",
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,  # the reference reads the batches in order
        )
        trainer.fit(model, DataLoader(data, batch_size=B))
        assert isinstance(model.rnn, ModelParallelRNN)
        assert model.state_dict().keys() == reference.state_dict().keys()
        for name, value in model.state_dict().items():
            expected = reference.state_dict()[name]
            assert not torch.equal(value, _Bitstream(nonlinearity).double().state_dict()[name])
            error = (value - expected).abs().max().item()
            assert error < 1e-9, (
                f"rank {rank}, {nonlinearity}, {name}: differs from single-process by {error:.2e}"
            )
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks ended with different parameters"


@pytest.mark.slow
def test_model_parallel_training_matches_single_process(run_distributed) -> None:
    run_distributed(_train_and_compare, 3)
