"""``distributed_launch.spawn_gloo``: torchrun-like children on one gloo group, and a wall limit (on an injected clock)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_bppsa.distributed_launch import spawn_gloo


def _check_environment(rank: int, world: int, offset: float) -> None:
    assert dist.get_backend() == "gloo" and (dist.get_rank(), dist.get_world_size()) == (rank, world)
    env = {key: os.environ[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    value = torch.tensor([rank + offset], dtype=torch.float64)
    dist.all_reduce(value)
    assert value.item() == sum(range(world)) + world * offset


def _sleep_forever(rank: int, world: int) -> None:
    time.sleep(3600)


@pytest.mark.slow
def test_children_share_a_gloo_group_and_look_torchrun_launched(run_distributed) -> None:
    run_distributed(_check_environment, 2, 0.5)


def test_a_stuck_child_is_terminated_at_the_wall_limit() -> None:
    """An injected clock that advances 0.25 s a reading: the limit of 1 s is reached on the fourth reading
    after the start, however long the children take to start or the machine is loaded."""
    readings = itertools.count(0.0, 0.25)
    before = set(multiprocessing.active_children())
    with pytest.raises(TimeoutError, match="_sleep_forever on 2 processes did not finish within wall_limit_s=1"):
        spawn_gloo(_sleep_forever, 2, wall_limit_s=1.0, clock=lambda: next(readings))
    assert next(readings) == 1.25  # start, then join timeout / limit check pairs: (0.25, 0.5), (0.75, 1.0)
    assert set(multiprocessing.active_children()) <= before, "a child outlived the wall limit"


def test_world_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match="world must be an int >= 1; got 0"):
        spawn_gloo(_sleep_forever, 0)
