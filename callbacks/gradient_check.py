"""``GradientCheck``: every N steps, compare BPPSA's gradients with autograd's on the same graph."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_bppsa.callbacks._log import log_now
from torch import Tensor
from typing_extensions import override

from lightning_bppsa.gradcheck import gradient_difference

__all__ = ["DEFAULT_KEY", "SECONDS_KEY", "GradientCheck"]

DEFAULT_KEY = "bppsa/grad_rel_diff"
"""The metric's default name: the one ``BPPSAStrategy(check_every=N)`` logs its own check under."""
SECONDS_KEY = "bppsa/grad_check_s"
"""Seconds each check took, logged with it: a timing of the step can leave the check out."""


class GradientCheck(Callback):
    """Every ``every_n_steps`` optimizer steps, log the largest relative gradient error of BPPSA.

    Just before the step's backward, the parameters' gradients of the loss are computed twice on the
    same graph (``retain_graph=True``): as configured (BPPSA modules use the scan) and inside
    :func:`lightning_bppsa.nn.reference_backward` (plain autograd); ``max |Δg| / max |g_ref|`` over
    parameters is logged as ``key``, and the seconds the check took as :data:`SECONDS_KEY` (it runs inside
    the training step: two extra backward passes). The real backward is untouched. The reference switch is
    process-wide while the check runs (so autograd's GPU threads see it): other threads' backward passes in
    that window take the reference path too.

    Args:
        every_n_steps: check on optimizer steps 0, N, 2N, ... (the first backward of that step).
        threshold: warn when the error exceeds it.
        key: the logged metric's name.
        clock: the clock the check's duration is read from (``time.perf_counter``; injectable for tests).

    Example:
        >>> trainer = pl.Trainer(strategy="bppsa", callbacks=[GradientCheck(every_n_steps=500)])
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        threshold: float = 1e-4,
        key: str = DEFAULT_KEY,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1; got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.threshold = threshold
        self.key = key
        self.clock = clock
        self.worst = 0.0
        self.last: float | None = None
        self._checked_step = -1

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._checked_step:
            return
        self._checked_step = step
        start = self.clock()
        error = gradient_difference(loss, pl_module.parameters())  # a float: synchronised on a GPU too
        seconds = self.clock() - start
        self.last, self.worst = error, max(self.worst, error)
        log_now(trainer, {self.key: error, SECONDS_KEY: seconds})
        if not error <= self.threshold:  # NaN too
            rank_zero_warn(
                f"GradientCheck: BPPSA gradients differ from autograd's by {error:.3e} (relative) at step "
                f"{step}, above threshold={self.threshold:g}"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"worst": self.worst, "last": self.last}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.worst, self.last = state_dict["worst"], state_dict["last"]
