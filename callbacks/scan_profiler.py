"""``ScanProfiler``: per-step FLOPs and sparsity of the BPPSA scans (paper Fig. 10) to the logger."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_bppsa.callbacks._log import log_now
from typing_extensions import override

from lightning_bppsa.sparse_scan import ScanStepFlops

__all__ = ["ScanProfiler", "summarise_flop_report"]


def summarise_flop_report(rows: Sequence[ScanStepFlops]) -> dict[str, float]:
    """Scalars of one :func:`~lightning_bppsa.sparse_scan.scan_flop_report`.

    ``bppsa_steps`` / ``bp_steps``: sequential steps of the scan and of plain BP; ``*_critical_flops``:
    FLOPs on each critical path; ``*_total_flops``: all FLOPs; ``step_ratio`` = ``bp_steps / bppsa_steps``
    and ``flop_ratio`` = BPPSA's total over BP's total; ``max_density`` of the scan's matrices.
    """
    out: dict[str, float] = {}
    for method in ("bppsa", "bp"):
        mine = [row for row in rows if row.method == method]
        out[f"{method}_steps"] = max((row.step for row in mine), default=0)
        out[f"{method}_critical_flops"] = sum(row.flops for row in mine if row.critical)
        out[f"{method}_total_flops"] = sum(row.flops for row in mine)
    scan = [row for row in rows if row.method == "bppsa"]
    out["max_density"] = max((row.density for row in scan), default=0.0)
    out["step_ratio"] = out["bp_steps"] / out["bppsa_steps"] if out["bppsa_steps"] else 0.0
    out["flop_ratio"] = out["bppsa_total_flops"] / out["bp_total_flops"] if out["bp_total_flops"] else 0.0
    return out


class ScanProfiler(Callback):
    """Every ``every_n_steps`` steps, report the FLOPs and sparsity of every scanned chain's backward.

    Reads ``module.flop_report()`` (a list of :class:`~lightning_bppsa.sparse_scan.ScanStepFlops`, as
    :class:`lightning_bppsa.nn.SparseChain` gives for its last forward) of every submodule that has one.
    Logs the scalars of :func:`summarise_flop_report` as ``scan/<module>/<name>``; with a
    TensorBoardLogger also a Fig. 10 style figure (critical-path FLOPs and matrix density per sequential
    step, BPPSA against BP) under ``scan/<module>``. Recurrent BPPSA modules have no such report yet.

    Args:
        every_n_steps: report after the backward of optimizer steps 0, N, 2N, ...
        figures: also draw the per-step figure (needs matplotlib and a TensorBoardLogger).
    """

    def __init__(self, every_n_steps: int = 500, figures: bool = True) -> None:
        self.every_n_steps = every_n_steps
        self.figures = figures
        self.last_reports: dict[str, list[ScanStepFlops]] = {}
        self._warned = False

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        reports = {}
        for name, module in pl_module.named_modules():
            if callable(getattr(module, "flop_report", None)):
                try:
                    reports[name] = module.flop_report()
                except RuntimeError:  # no scanned forward yet (e.g. the chain ran on autograd)
                    continue
        if not reports and not self._warned:
            self._warned = True
            rank_zero_warn(
                "ScanProfiler: no module with a scan FLOP report (no converted chain ran the scan)"
            )
        self.last_reports = reports
        for name, rows in reports.items():
            log_now(
                trainer, {f"scan/{name}/{key}": float(v) for key, v in summarise_flop_report(rows).items()}
            )
            if self.figures and isinstance(trainer.logger, TensorBoardLogger):
                figure = _step_figure(rows, name)
                if figure is not None:
                    trainer.logger.experiment.add_figure(
                        f"scan/{name}", figure, global_step=trainer.global_step
                    )


def _step_figure(rows: Sequence[ScanStepFlops], name: str) -> Any:
    """Critical-path FLOPs and density per sequential step, BPPSA vs BP (``None`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (flops, density) = plt.subplots(1, 2, figsize=(10, 3.5))
    for method, style in (("bppsa", "-o"), ("bp", "--s")):
        critical = sorted(
            (row.step, row.flops, row.density) for row in rows if row.method == method and row.critical
        )
        if critical:
            steps, values, dens = zip(*critical, strict=True)
            flops.plot(steps, values, style, label=method)
            density.plot(steps, dens, style, label=method)
    flops.set(
        xlabel="sequential step", ylabel="critical-path FLOPs", yscale="log", title=f"{name}: FLOPs per step"
    )
    density.set(xlabel="sequential step", ylabel="density (1 - sparsity)", title="matrix density per step")
    flops.legend()
    density.legend()
    fig.tight_layout()
    return fig
