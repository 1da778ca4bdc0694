"""How the benchmarks measure: peak memory, and no allocator tuning at import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_bppsa.bench.measure import median_seconds, peak_memory_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_sees_a_temporary_tensor() -> None:
    nbytes = 64 * 2**20
    peak = peak_memory_bytes(lambda: torch.ones(nbytes // 4).sum())
    assert nbytes * 0.9 < peak < nbytes * 2


def test_median_seconds_is_positive() -> None:
    assert median_seconds(lambda: torch.ones(10).sum(), min_run_time=0.01) > 0


@pytest.mark.slow
def test_importing_the_cli_does_not_tune_the_allocator() -> None:
    code = (
        "import ctypes\n"
        "opened = []\n"
        "original = ctypes.CDLL\n"
        "ctypes.CDLL = lambda name, *a, **k: opened.append(name) or original(name, *a, **k)\n"
        "import lightning_bppsa.cli, lightning_bppsa.cli.bench, lightning_bppsa.bench.rnn\n"
        "assert 'libc.so.6' not in opened, opened\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
