"""A peer that dies or stalls makes the distributed scan fail with a clear error within the timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from lightning_bppsa import distributed

TIMEOUT_S = 3.0


def _peer_fails(rank: int, world: int, mode: str) -> None:
    if rank == 1:
        if mode == "dies":
            os._exit(0)  # abrupt: no clean shutdown of the process group
        time.sleep(TIMEOUT_S + 3)  # stalls past the group's timeout, then leaves
        return
    start = time.monotonic()
    with pytest.raises(distributed.DistributedScanError, match="receiving from rank 1 failed in round 0"):
        distributed.backprop_scan(torch.eye(3).expand(1, 4, 3, 3), None)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 3, f"took {elapsed:.1f} s to notice, timeout is {TIMEOUT_S} s"


@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_peer_failure_is_reported_within_timeout(run_distributed, mode: str) -> None:
    run_distributed(_peer_fails, 2, mode, timeout_s=TIMEOUT_S)
