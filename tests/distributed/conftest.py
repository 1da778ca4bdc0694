"""The distributed tests spawn ``p`` CPU processes on one gloo group with ``distributed_launch.spawn_gloo``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightning_bppsa.distributed_launch import spawn_gloo


@pytest.fixture
def run_distributed() -> Callable[..., None]:
    return spawn_gloo
