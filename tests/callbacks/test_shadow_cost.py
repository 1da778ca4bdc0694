"""ShadowCostMonitor: growth detection, and no shadow cost in 2000 BPPSA steps."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from lightning_bppsa.callbacks import ShadowCostMonitor
from lightning_bppsa.callbacks.shadow_cost import growth, linear_trend


def test_growth_and_trend_of_synthetic_series() -> None:
    flat = [1.0 + 0.1 * ((i * 7919) % 13 - 6) / 6 for i in range(400)]  # noisy, no trend
    rising = [1.0 + i / 400 for i in range(400)]  # 1.0 -> 2.0
    assert growth(flat) == pytest.approx(1.0, abs=0.05)
    assert growth(rising) == pytest.approx((1 + 324.75 / 400) / (1 + 24.75 / 400))  # lower quartiles
    assert linear_trend(rising) == pytest.approx((1.0, 1 / 400))
    assert growth([1.0, 5.0]) == 1.0  # too short for a verdict


@pytest.fixture
def one_thread():  # noqa: ANN201
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads competing with other processes
    make whole stretches of steps 50x slower (a spinning barrier waits for a descheduled thread), in wall
    and CPU time alike, which is noise and not the growth this test is about."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_warns_when_backward_time_grows(fit, tiny_chain, one_thread) -> None:
    class LeakyChain(tiny_chain):
        """Backward gets slower with every batch, like a graph that drags more and more along."""

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = super().training_step(batch, batch_idx)
            loss.register_hook(lambda grad: _busy_wait(1e-4 * (batch_idx + 1)) or grad)
            return loss

    monitor = ShadowCostMonitor(warmup=10, min_batches=40)
    with pytest.warns(UserWarning, match="backward time grew"):
        fit([monitor], model=LeakyChain(samples=8 * 120), max_steps=120)
    assert monitor.verdict()["time_growth"] > 1.3
    assert monitor.state_dict()["backward_s"] == monitor.backward_s and len(monitor.backward_s) == 120


@pytest.mark.slow
def test_no_shadow_cost_over_2000_bppsa_steps(fit, tiny_chain, one_thread) -> None:
    monitor = ShadowCostMonitor(cpu_time=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|isinstance.treespec).*")
        trainer = fit([monitor], model=tiny_chain(samples=8 * 2000), max_steps=2000)
    assert any(record.scanned for record in trainer.strategy.conversion_report)
    verdict = monitor.verdict()
    assert len(monitor.backward_s) == 2000
    assert verdict["time_growth"] < monitor.max_growth and verdict["memory_growth"] < monitor.max_growth
    assert not any(monitor.warned.values())
