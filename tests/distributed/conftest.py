"""The distributed tests spawn ``p`` CPU processes on one gloo group with ``_distributed_launch.spawn``."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightning_bppsa._distributed_launch import spawn


@pytest.fixture
def run_distributed() -> Callable[..., None]:
    return spawn
