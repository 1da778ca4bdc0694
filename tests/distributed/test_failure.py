"""A peer that dies or stalls makes the distributed scan fail with a clear error, after the group's timeout."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_bppsa import distributed

TIMEOUT_S = 2.0


def _peers_fail(rank: int, world: int) -> None:
    """Rank 0 scans with rank 1 (which dies) and then with rank 2 (which stalls), each in a subgroup."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    with_dead, with_stalled = dist.new_group([0, 1], timeout=timeout), dist.new_group([0, 2], timeout=timeout)
    if rank == 1:
        os._exit(0)  # abrupt: no clean shutdown of the process group
    if rank == 2:
        time.sleep(2 * TIMEOUT_S + 1)  # stalls past both scans' timeouts, then leaves
        return
    # the stalled peer: gloo's error names the timeout it waited, the subgroup's (not its default 30 min)
    waited = f"Timed out waiting {TIMEOUT_S * 1000:.0f}ms"
    for group, peer, cause in ((with_dead, 1, ""), (with_stalled, 2, f".*{waited}")):
        with pytest.raises(
            distributed.DistributedScanError, match=f"receiving from rank {peer} failed in round 0{cause}"
        ):
            distributed.distributed_backprop_scan(torch.eye(3).expand(1, 4, 3, 3), None, group=group)


@pytest.mark.slow
def test_dead_or_stalled_peer_is_reported_within_timeout(run_distributed) -> None:
    run_distributed(_peers_fail, 3, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("op", ["isend", "irecv"])
def test_a_peer_gone_before_the_op_is_posted_is_reported(monkeypatch, op: str) -> None:
    """gloo raises from ``isend``/``irecv`` themselves when the peer's connection is already closed."""

    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    rank = 1 if op == "isend" else 0  # rank 1 of 2 only sends in round 0, rank 0 only receives
    monkeypatch.setattr(distributed.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(distributed.dist, op, closed)
    peer, verb = (0, "sending to") if op == "isend" else (1, "receiving from")
    summary = torch.zeros(1, 4, 3) if rank == 1 else None
    with pytest.raises(distributed.DistributedScanError, match=f"{verb} rank {peer} failed in round 0"):
        distributed._exclusive_scan(summary, torch.zeros(1, 5, 3), group=None)
