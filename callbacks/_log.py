"""Log a callback's occasional measurement right away, not subject to ``log_every_n_steps``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

__all__ = ["log_now"]


def log_now(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger at the current global step and expose them in ``callback_metrics``.

    ``LightningModule.log`` only writes on steps that are multiples of ``log_every_n_steps``, which would
    silently drop a check that runs every N steps for an N that is not aligned with it.
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    trainer.callback_metrics.update({key: torch.tensor(value) for key, value in metrics.items()})
