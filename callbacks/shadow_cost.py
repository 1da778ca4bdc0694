"""``ShadowCostMonitor``: watch backward time and memory for growth over training ("shadow cost").

"A Shadow Cost of Jacobian Accumulation" reports back-propagation time per batch that grows over
training (1.6x over 30 epochs) although the computation graph never changes, e.g. because memory is
released late. A BPPSA implementation caches plans and Jacobian buffers, exactly where such a cost
could hide; this callback measures it.
"""

from __future__ import annotations

import os
import resource
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_bppsa.callbacks._stopwatch import Stopwatch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

__all__ = ["ShadowCostMonitor", "growth", "linear_trend"]


def growth(values: list[float], window: float = 0.25) -> float:
    """Robust growth of a series: lower quartile of its last ``window`` share over that of its first.

    The lower quartile is the intrinsic cost of a step: other processes competing for the cores only
    ever add time, to some steps, while a shadow cost shifts every step. ``1.0`` means flat; ``1.6`` is
    the paper's shadow cost. Returns ``1.0`` for fewer than 8 values.
    """
    if len(values) < 8:
        return 1.0
    k = max(2, int(len(values) * window))
    first = statistics.quantiles(values[:k], n=4, method="inclusive")[0]
    last = statistics.quantiles(values[-k:], n=4, method="inclusive")[0]
    return last / first if first > 0 else 1.0


def linear_trend(values: list[float]) -> tuple[float, float]:
    """Least-squares line through ``(i, values[i])``: ``(intercept, slope per index)``."""
    n = len(values)
    if n < 2:
        return (values[0] if values else 0.0), 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    slope = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sxx
    return mean_y - slope * mean_x, slope


def _memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated since the last reset on a GPU; else the process's resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the high-water mark, which can only rise
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _signature(batch: Any) -> str:
    """Shapes and dtypes of the batch's tensors: batches with the same signature run the same graph."""
    found: list[tuple] = []
    apply_to_collection(batch, Tensor, lambda t: found.append((tuple(t.shape), t.dtype)))
    return repr(found)


class ShadowCostMonitor(Callback):
    """Per-batch and per-epoch backward time and memory, their trend, and a warning when they grow.

    For every training batch it measures the time inside ``loss.backward()`` and the memory after it
    (peak CUDA memory of the batch on a GPU, resident set size on CPU). Growth is judged only over the
    batches whose inputs have the most common shapes (the same graph): :func:`growth` compares the
    lower quartile of the last quarter of the series with that of the first (after ``warmup`` batches),
    and a least-squares line gives the trend. At every epoch end and at the end of training it logs
    ``shadow/epoch_backward_s``, ``shadow/time_growth``, ``shadow/memory_growth`` and
    ``shadow/time_trend`` (relative change per 1000 batches), and warns once per quantity when a growth
    exceeds ``max_growth``. Per batch it logs ``shadow/backward_s`` and ``shadow/memory_bytes``.

    Args:
        max_growth: warn above this ratio (the paper saw 1.6 over 30 epochs).
        warmup: batches ignored at the start (allocator warm-up, caches being filled).
        min_batches: no verdict before this many batches after warm-up.
        cpu_time: on CPU, time backward in process CPU seconds instead of wall-clock seconds, so that
            other processes sharing the cores do not read as growth.
        clock: on CPU, the clock read before and after each backward instead (tests inject one).

    Example:
        >>> trainer = pl.Trainer(strategy="bppsa", callbacks=[ShadowCostMonitor(max_growth=1.3)])
    """

    def __init__(
        self,
        max_growth: float = 1.3,
        warmup: int = 20,
        min_batches: int = 40,
        cpu_time: bool = False,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.max_growth = max_growth
        self.warmup = warmup
        self.min_batches = min_batches
        self.cpu_time = cpu_time
        self.backward_s: list[float] = []
        self.memory: list[int] = []
        self.signatures: list[str] = []
        self.epoch_backward_s: list[float] = []
        self.warned: dict[str, bool] = {"time": False, "memory": False}
        self._watch = Stopwatch(cpu_time=cpu_time, clock=clock)
        self._epoch_start = 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._current = _signature(batch)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._watch.clear()
        self._seconds = 0.0

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._watch.mark("before", pl_module.device)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch.mark("after", pl_module.device)
        self._seconds += self._watch.seconds("before", "after")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._watch.has("after"):
            return
        memory = _memory_bytes(pl_module.device)
        self.backward_s.append(self._seconds)
        self.memory.append(memory)
        self.signatures.append(self._current)
        pl_module.log("shadow/backward_s", self._seconds, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("shadow/memory_bytes", float(memory), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = len(self.backward_s)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch = self.backward_s[self._epoch_start :]
        if epoch:
            self.epoch_backward_s.append(sum(epoch))
            pl_module.log("shadow/epoch_backward_s", sum(epoch), on_step=False, on_epoch=True, batch_size=1)
        for key, value in self.verdict().items():
            pl_module.log(f"shadow/{key}", value, on_step=False, on_epoch=True, batch_size=1)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.verdict()

    def _same_graph(self, series: list[float]) -> list[float]:
        """The series after warm-up, restricted to the batches with the most common signature."""
        kept = list(zip(self.signatures, series, strict=True))[self.warmup :]
        if not kept:
            return []
        common = Counter(s for s, _ in kept).most_common(1)[0][0]
        return [value for s, value in kept if s == common]

    def verdict(self) -> dict[str, float]:
        """Growth and trend of backward time and memory so far; warns (once each) above ``max_growth``."""
        times = self._same_graph(self.backward_s)
        memory = self._same_graph([float(m) for m in self.memory])
        if len(times) < self.min_batches:
            return {}
        intercept, slope = linear_trend(times)
        result = {
            "time_growth": growth(times),
            "memory_growth": growth(memory),
            "time_trend": 1000 * slope / intercept if intercept > 0 else 0.0,
        }
        for kind in ("time", "memory"):
            ratio = result[f"{kind}_growth"]
            if ratio > self.max_growth and not self.warned[kind]:
                self.warned[kind] = True
                rank_zero_warn(
                    f"ShadowCostMonitor: backward {kind} grew {ratio:.2f}x over {len(times)} batches "
                    f"with an unchanged graph (threshold {self.max_growth:g}x): a shadow cost"
                )
        return result

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(cpu_time=self.cpu_time)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "backward_s": self.backward_s,
            "memory": self.memory,
            "signatures": self.signatures,
            "epoch_backward_s": self.epoch_backward_s,
            "warned": self.warned,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            setattr(self, key, value)
