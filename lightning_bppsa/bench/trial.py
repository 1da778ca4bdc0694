"""A training step that leaves no trace, and the warm-up step ``lightning-bppsa compare`` runs before its clock.

The first forward and backward of a run build what every later step reuses: the CUDA kernels (NVRTC, ~8 s
on an H100), the compiled C cell kernels, a user cell's trace and measured plan. Timed, that one-time cost
sits in the first step and in every clock that sums the steps (on the H100 it made BPPSA's "seconds to the
same loss" 0.24x autograd's while its steps ran at ~1x). :class:`WarmUp` runs one :func:`trial_step` on the
first training batch before that step's timers start, so the build is measured on its own.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_bppsa.callbacks._log import log_now

__all__ = ["WARM_UP_KEY", "NotMeasurable", "WarmUp", "rng_kept", "synchronize", "trial_step"]

WARM_UP_KEY = "time/warm_up"
"""The scalar :class:`WarmUp` logs: seconds of the warm-up step (once, at step 0)."""


class NotMeasurable(Exception):
    """Why a model's training step cannot run outside training (e.g. manual optimization)."""


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; nothing to wait for elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def rng_kept(device: torch.device) -> Iterator[None]:
    """Every generator training draws from (torch's on the CPU and on ``device``, Python's, NumPy's) is
    restored on exit to its state on entry."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = (
        [torch.cuda.current_device() if device.index is None else device.index]
        if device.type == "cuda"
        else []
    )
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``LightningModule.log`` / ``log_dict`` during a trial step."""


def trial_step(module: pl.LightningModule, training_step: Callable[[], Any]) -> None:
    """Run ``training_step()`` (``module``'s training step on a batch) and its loss's backward, leaving
    training as it was.

    Afterwards the parameters' gradients, the buffers (batch-norm statistics, ...) and every generator
    (:func:`rng_kept`) are as before; torchmetrics metrics that held no update are reset (one that held
    updates already keeps the trial's, with a warning naming it); ``log`` / ``log_dict`` log nothing; no
    optimizer steps. The loss is backpropagated by ``loss.backward()``: strategy and callback hooks of the
    backward do not run.

    Raises:
        NotMeasurable: under manual optimization (its training step steps the optimizers itself).
    """
    if not module.automatic_optimization:
        raise NotMeasurable("manual optimization: its training_step steps the optimizers itself")
    params = list(module.parameters())
    grads = [None if p.grad is None else p.grad.clone() for p in params]  # backward accumulates in place
    buffers = [(buffer, buffer.clone()) for buffer in module.buffers()]
    metrics = [(name, m, m.update_count) for name, m in module.named_modules() if isinstance(m, Metric)]
    module.log = module.log_dict = _no_log  # instance attributes: the methods are back once deleted
    try:
        with rng_kept(next((p.device for p in params), torch.device("cpu"))):
            output = training_step()
            loss = output["loss"] if isinstance(output, Mapping) else output
            if loss is not None:  # None: Lightning skips the step, so there is nothing to build
                loss.backward()
    finally:
        del module.log, module.log_dict
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for name, metric, count in metrics:
            if count == 0:
                metric.reset()
            elif metric.update_count != count:
                warnings.warn(
                    f"metric {name!r} held {count} update(s) before the trial step and now includes its batch too",
                    stacklevel=2,
                )


class WarmUp(Callback):
    """Before the first training step: one :func:`trial_step` on that step's batch, timed on its own.

    Kernels are built and caches filled there instead of inside the first step, and training goes on
    exactly as without it. The seconds (``clock``; the device synchronised) are logged once as
    :data:`WARM_UP_KEY` and kept as :attr:`seconds`. Put it before every callback that times the step (its
    ``on_train_batch_start`` must run first). Under manual optimization it warns and does nothing.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds: float | None = None
        self._tried = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._tried:
            return
        self._tried = True
        start = self.clock()
        try:
            # through the strategy, as the real step is: its precision context (autocast) included
            trial_step(pl_module, lambda: trainer.strategy.training_step(batch, batch_idx))
        except NotMeasurable as why:
            rank_zero_warn(f"no warm-up step ({why}): the first step's time includes any kernel builds")
            return
        synchronize(pl_module.device)
        self.seconds = self.clock() - start
        log_now(trainer, {WARM_UP_KEY: self.seconds})
