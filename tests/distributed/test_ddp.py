"""``BPPSADDPStrategy`` (``"bppsa_ddp"``) on 2 gloo processes equals single-process training on the combined batch.

Each rank reads ``B`` samples a step through a ``DistributedSampler`` without shuffling (rank ``r`` gets
samples ``r, r + 2, ...``; Lightning's own replacement sampler would shuffle the training set), so the
two ranks' step-``k`` batches together are exactly samples ``2Bk .. 2B(k + 1) - 1``, the single-process
step-``k`` batch of ``2B``. With a mean loss, DDP's average of the two ranks' gradients is the gradient
of the combined batch.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_bppsa  # noqa: F401  (registers "bppsa_ddp")
from lightning_bppsa import BPPSADDPStrategy
from lightning_bppsa.testing import assert_derived_close

T, B, STEPS, CLASSES = 9, 3, 3, 4  # B: per-rank batch


class _Classifier(pl.LightningModule):
    """Recurrent layer + linear head, mean cross-entropy on the last step or on every step."""

    def __init__(self, cell: type[nn.Module], every_step: bool, manual: bool) -> None:
        super().__init__()
        self.rnn = cell(2, 5, batch_first=True)
        self.head = nn.Linear(5, CLASSES)
        self.every_step = every_step
        self.automatic_optimization = not manual

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        if self.every_step:
            return nn.functional.cross_entropy(self.head(out).flatten(0, 1), y.repeat_interleave(x.shape[1]))
        return nn.functional.cross_entropy(self.head(out[:, -1]), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(*batch)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _single_process(model: _Classifier, data: TensorDataset, batch: int) -> None:
    optimizer = model.configure_optimizers()
    for x, y in DataLoader(data, batch_size=batch):
        optimizer.zero_grad()
        model.loss(x, y).backward()
        optimizer.step()


def _train_and_compare(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    samples = world * B * STEPS
    data = TensorDataset(
        torch.randn(samples, T, 2, generator=gen, dtype=torch.float64),
        torch.randint(0, CLASSES, (samples,), generator=gen),
    )
    cases = (  # (cell, every_step, manual optimization, strategy)
        (nn.GRU, False, False, BPPSADDPStrategy(algorithm="chunked", check_every=1)),
        (nn.LSTM, True, True, BPPSADDPStrategy(algorithm="blelloch")),
        (nn.RNN, False, False, "bppsa_ddp"),  # the registered name, "auto" algorithm
    )
    for cell, every_step, manual, strategy in cases:
        torch.manual_seed(rank)  # different initial weights per rank: DDP must broadcast rank 0's
        model = _Classifier(cell, every_step, manual).double()
        initial = copy.deepcopy(model)
        for value in initial.state_dict().values():
            dist.broadcast(value, src=0)  # rank 0's initial weights
        reference = copy.deepcopy(initial)
        _single_process(reference, data, world * B)

        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            precision="64-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,  # keep the unshuffled split below
        )
        split = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        trainer.fit(model, DataLoader(data, batch_size=B, sampler=split))

        used = trainer.strategy
        case = f"rank {rank}, {cell.__name__}, every_step={every_step}, manual={manual}"
        assert isinstance(used, BPPSADDPStrategy), case
        assert [(r.path, r.scanned) for r in used.conversion_report] == [("rnn", True)], case
        assert type(model.rnn).__module__.startswith("lightning_bppsa.nn"), case
        if used.check_every:
            assert used.last_gradient_difference is not None and used.last_gradient_difference < 1e-9, case
        for name, value in model.state_dict().items():
            assert not torch.equal(value, initial.state_dict()[name]), f"{case}: {name} did not train"
            assert_derived_close(value, reference.state_dict()[name], name=f"{case}: {name}")
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"{case}: ranks ended with different weights"


@pytest.mark.slow
def test_two_processes_match_single_process_on_the_combined_batch(run_distributed) -> None:
    run_distributed(_train_and_compare, 2, timeout_s=60.0, wall_limit_s=300.0)
