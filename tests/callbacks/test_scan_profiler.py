"""ScanProfiler: the sparse scan's per-step FLOP / sparsity report, logged."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from lightning_bppsa.callbacks import ScanProfiler
from lightning_bppsa.callbacks.scan_profiler import summarise_flop_report


def test_reports_the_converted_chain(fit, tmp_path: Path) -> None:
    profiler = ScanProfiler(every_n_steps=2)
    trainer = fit([profiler], max_steps=3, logger=TensorBoardLogger(tmp_path, name="p"))
    assert list(profiler.last_reports) == ["features"]
    summary = summarise_flop_report(profiler.last_reports["features"])
    assert summary["bp_steps"] == 4 and 0 < summary["bppsa_steps"]
    assert summary["bppsa_critical_flops"] > 0 and 0 < summary["max_density"] <= 1
    assert trainer.callback_metrics["scan/features/bp_steps"] == 4
    assert list((tmp_path / "p" / "version_0").glob("events.out.tfevents.*"))


def test_says_so_when_nothing_is_scanned(fit) -> None:
    with pytest.warns(UserWarning, match="no module with a scan FLOP report"):
        fit([ScanProfiler(every_n_steps=1)], max_steps=1, strategy="auto")
