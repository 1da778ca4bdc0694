"""``BPPSAStrategy``: the Lightning glue that routes supported modules' backward through the scan."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from typing_extensions import override

from lightning_bppsa.nn import ConversionRecord, convert
from lightning_bppsa.scan import ALGORITHMS

__all__ = ["BPPSAStrategy"]

log = logging.getLogger(__name__)


class BPPSAStrategy(SingleDeviceStrategy):
    """Single-device strategy whose supported modules run their backward as a BPPSA scan.

    Args:
        algorithm: scan algorithm for every converted module (see ``backprop_scan``).
        modules: qualified module names to convert; ``None`` converts every supported module.
        device: the device to train on; by default the one the Trainer's accelerator picks.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(strategy="bppsa", accelerator="cpu", max_steps=1, logger=False)
    """

    strategy_name = "bppsa"

    def __init__(
        self,
        algorithm: str = "auto",
        modules: Sequence[str] | None = None,
        device: torch.device | str | int | None = None,
        **kwargs,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self.algorithm = algorithm
        self.modules = None if modules is None else list(modules)
        self._explicit_device = device is not None
        # Filled by the accelerator connector when the strategy was made from a string.
        self.parallel_devices: list[torch.device] | None = None
        self.conversion_report: list[ConversionRecord] = []

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._explicit_device and self.parallel_devices:
            return torch.device(self.parallel_devices[0])
        return super().root_device

    @override
    def connect(self, model) -> None:
        report: list[ConversionRecord] = []
        converted = convert(model, modules=self.modules, report=report)
        if converted is not model:
            raise TypeError("the LightningModule itself cannot be replaced by convert()")
        self.conversion_report = report
        super().connect(model)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry = StrategyRegistry) -> None:
        # override=True: re-importing (or reloading) the package must never raise.
        strategy_registry.register(
            cls.strategy_name, cls, description="Back-propagation as a parallel prefix scan", override=True
        )
