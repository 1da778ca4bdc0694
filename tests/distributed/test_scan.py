"""``distributed.distributed_backprop_scan`` equals the single-process scan over the concatenated chain."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_bppsa import distributed
from lightning_bppsa.jacobians import FactoredJacobians
from lightning_bppsa.scan import backprop_scan

B, D = 2, 3


def _chain(n: int, factored: bool, seed: int) -> FactoredJacobians | torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if not factored:
        return 0.6 * torch.randn(B, n, D, D, generator=gen, dtype=torch.float64)
    # GRU-shaped: k = 3 tiles and a diagonal term
    weight = 0.5 * torch.randn(3 * D, D, generator=gen, dtype=torch.float64)
    scales = torch.rand(B, n, 3 * D, generator=gen, dtype=torch.float64)
    diagonal = torch.rand(B, n, D, generator=gen, dtype=torch.float64)
    return FactoredJacobians(weight, scales, diagonal)


def _segment(jac, start: int, stop: int):
    if isinstance(jac, FactoredJacobians):
        return FactoredJacobians(jac.weight, jac.scales[:, start:stop], jac.diagonal[:, start:stop])
    return jac[:, start:stop]


def _check_splits(rank: int, world: int, splits: list[list[int]]) -> None:
    """For each split, factored or dense, per-step or last-state gradients: distributed == reference."""
    for seed, (lengths, factored, per_step) in enumerate(
        itertools.product(splits, (False, True), (False, True))
    ):
        n = sum(lengths)
        jac = _chain(n, factored, seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        direct = torch.randn(B, n + 1, D, generator=gen, dtype=torch.float64)
        if not per_step:
            direct[:, :n] = 0
        reference = backprop_scan(jac, direct, algorithm="linear")
        start = sum(lengths[:rank])
        stop = start + lengths[rank]
        if per_step:  # a boundary state's direct gradient belongs to the rank on its right
            local = direct[:, start : stop + 1].clone()
            if rank < world - 1:
                local[:, -1] = 0
        else:
            local = direct[:, n] if rank == world - 1 else None
        out = distributed.distributed_backprop_scan(_segment(jac, start, stop), local)
        again = distributed.distributed_backprop_scan(_segment(jac, start, stop), local)
        assert torch.equal(out, again), "not bitwise reproducible for a fixed split"
        expected = reference[:, start : stop + 1]
        error = (out - expected).abs().max().item() / expected.abs().max().item()
        assert error < 1e-12, f"rank {rank}, split {lengths}, factored={factored}: rel error {error:.2e}"


def _check_two_ranks(rank: int, world: int) -> None:
    _check_splits(rank, world, [[4, 4], [1, 6]])
    if rank == 0:  # both errors are raised before any message is sent
        with pytest.raises(ValueError, match="only accepted on the last rank"):
            distributed.distributed_backprop_scan(torch.ones(1, 2, 3, 3), torch.ones(1, 3))
        with pytest.raises(ValueError, match="must be zero on every rank but the last"):
            distributed.distributed_backprop_scan(torch.ones(1, 2, 3, 3), torch.ones(1, 3, 3))


@pytest.mark.slow
def test_two_ranks_and_bad_input(run_distributed) -> None:
    run_distributed(_check_two_ranks, 2)


@pytest.mark.slow
def test_three_ranks_odd_splits(run_distributed) -> None:
    run_distributed(_check_splits, 3, [[5, 1, 7], [1, 1, 1]])


@pytest.mark.slow
def test_four_ranks(run_distributed) -> None:
    run_distributed(_check_splits, 4, [[3, 5, 2, 6], [1, 2, 1, 1]])
