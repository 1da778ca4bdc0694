"""The Lightning strategies that route supported modules' backward through the scan.

The scan itself lives in the converted modules (their autograd Functions run ``backprop_scan``), so
``loss.backward()`` anywhere — automatic or manual optimization, gradient accumulation, AMP — already
uses it. A strategy converts the model at ``connect``, reports what runs where, and owns ``backward``
so that the hooks around it stay in Lightning's order and gradient checks can run. That behaviour is
written once, in ``_BPPSAMixin``, and combined with two Lightning strategies:

- :class:`BPPSAStrategy` (``"bppsa"``): one device (``SingleDeviceStrategy``).
- :class:`BPPSADDPStrategy` (``"bppsa_ddp"``): data parallel over processes (``DDPStrategy``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bppsa.gradcheck import gradient_difference
from lightning_bppsa.nn import ConversionRecord, convert
from lightning_bppsa.nn.convert import is_converted
from lightning_bppsa.plan import check_algorithm

__all__ = ["BPPSADDPStrategy", "BPPSAStrategy", "format_conversion_table", "module_plan"]

log = logging.getLogger(__name__)

# the report of the model's first conversion, kept on the model itself so that a later connect (validate /
# test / predict after fit, by this strategy or a new Trainer's) reports it instead of "already converted"
_REPORT_ATTR = "_bppsa_conversion_report"
# (algorithm, rows) of the table last logged for the model: the same table is not logged twice (fit, validate)
_LOGGED_ATTR = "_bppsa_logged_table"


def module_plan(module: torch.nn.Module) -> str | None:
    """What a converted module ran in its last backward, e.g. ``"scan linear"`` or ``"autograd (reason)"``.

    Read from ``module.last_stats``: its ``"plan"`` when the module reports one, else its ``"path"`` and
    the algorithm the scan resolved (``"scan_algorithm"``, or the module's ``"algorithm"``); ``None``
    before the module's first call.
    """
    stats = getattr(module, "last_stats", None)
    if not isinstance(stats, dict) or "path" not in stats and "plan" not in stats:
        return None
    if stats.get("plan"):
        return str(stats["plan"])
    if stats["path"] != "scan":
        return str(stats["path"])
    return f"scan {stats.get('scan_algorithm') or stats.get('algorithm') or ''}".strip()


def format_conversion_table(
    records: Sequence[ConversionRecord], algorithm: str | None = None, plans: Mapping[str, str] | None = None
) -> str:
    """The conversion report as a fixed-width table (module, type, backward path, [plan,] reason).

    ``algorithm``, when given, is the scan algorithm the strategy set on every converted module;
    ``plans`` (module path -> :func:`module_plan`), when given, adds what each module ran in its first
    backward (what ``"auto"`` resolved to).
    """
    if not records:
        return "BPPSA: no supported module found; every backward stays on autograd."
    header = ("module", "type", "backward", *(("ran",) if plans is not None else ()), "why")
    rows = [header]
    for r in records:
        plan = (plans.get(r.path) or "-",) if plans is not None else ()
        rows.append((r.path, r.module_type, "scan" if r.scanned else "autograd", *plan, r.reason))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    title = "BPPSA conversion" + ("" if algorithm is None else f" (algorithm {algorithm!r})")
    return title + ":\n" + "\n".join(lines)


def _with_earlier_reasons(
    report: Sequence[ConversionRecord], earlier: Sequence[ConversionRecord]
) -> list[ConversionRecord]:
    """``report`` with each already-converted module's row replaced by the row of its first conversion."""
    first = {record.path: record for record in earlier if record.scanned}
    return [first.get(r.path, r) if r.already_converted else r for r in report]


class _BPPSAMixin:
    """Conversion, report and backward shared by every BPPSA strategy; put it before a Lightning strategy.

    Args: ``algorithm``, ``modules``, ``check_every``, ``check_threshold`` as documented on
    :class:`BPPSAStrategy`; ``kwargs`` go to the Lightning strategy it is combined with.
    """

    strategy_name: str
    strategy_description: str

    def __init__(
        self,
        algorithm: str = "auto",
        modules: Sequence[str] | None = None,
        check_every: int = 0,
        check_threshold: float = 1e-4,
        **kwargs: Any,
    ) -> None:
        check_algorithm(algorithm)
        if not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0; got {check_every!r}")
        super().__init__(**kwargs)
        self.algorithm = algorithm
        self.modules = None if modules is None else list(modules)
        self.check_every = check_every
        self.check_threshold = check_threshold
        self.conversion_report: list[ConversionRecord] = []
        self.last_gradient_difference: float | None = None
        self._backward_calls = 0
        self._warned_backward_override = False
        self._table_pending = False

    def connect(self, model: pl.LightningModule) -> None:
        report: list[ConversionRecord] = []
        if convert(model, modules=self.modules, report=report) is not model:
            raise TypeError("the LightningModule itself cannot be replaced by convert()")
        for module in model.modules():
            if is_converted(module) and hasattr(module, "algorithm"):
                module.algorithm = self.algorithm
        report = _with_earlier_reasons(report, getattr(model, _REPORT_ATTR, ()))
        setattr(model, _REPORT_ATTR, report)
        self.conversion_report = report
        # Training: log the table after the first backward, when it can say what "auto" resolved to.
        trainer = getattr(model, "_trainer", None)
        self._table_pending = trainer is not None and trainer.state.fn == "fit"
        if not self._table_pending:
            self._log_table(model, plans=None)
        super().connect(model)

    def _log_table(self, model: torch.nn.Module, plans: Mapping[str, str] | None) -> None:
        """Log the conversion table unless the same one (algorithm and rows) was logged for ``model``."""
        key = (self.algorithm, [(r.path, r.scanned, r.reason) for r in self.conversion_report])
        if getattr(model, _LOGGED_ATTR, None) == key:
            return
        object.__setattr__(model, _LOGGED_ATTR, key)  # a plain attribute, never a submodule or buffer
        rank_zero_info(format_conversion_table(self.conversion_report, self.algorithm, plans))

    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """``Strategy.backward`` with the same hooks in the same order; the scan runs inside autograd."""
        module = self.lightning_module
        assert module is not None
        self._warn_if_backward_overridden(module)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._backward_calls += 1
        if self.check_every and self._backward_calls % self.check_every == 0:
            self._check_gradients(closure_loss, module)
        closure_loss.backward(*args, **kwargs)
        if self._table_pending:
            self._table_pending = False
            plans = {r.path: module_plan(module.get_submodule(r.path)) for r in self.conversion_report}
            self._log_table(module, {path: plan for path, plan in plans.items() if plan is not None})
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _warn_if_backward_overridden(self, module: pl.LightningModule) -> None:
        if not self._warned_backward_override and is_overridden("backward", module, pl.LightningModule):
            self._warned_backward_override = True
            warnings.warn(
                f"{type(module).__name__}.backward is overridden, but strategy {self.strategy_name!r} calls "
                "loss.backward() itself so that the scan and the gradient checks run; the override is bypassed.",
                stacklevel=2,
            )

    def _check_gradients(self, loss: Tensor, module: pl.LightningModule) -> None:
        # torch.autograd.grad leaves .grad alone and never runs the parameters' AccumulateGrad nodes, so
        # under DDP it does not trigger the reducer's all-reduce: the difference is this rank's own
        difference = gradient_difference(loss, module.parameters())
        self.last_gradient_difference = difference
        trainer = module._trainer
        if trainer is not None and trainer.logger is not None:
            trainer.logger.log_metrics({"bppsa/grad_rel_diff": difference}, step=trainer.global_step)
        if difference > self.check_threshold:
            warnings.warn(
                f"BPPSA gradients differ from autograd's by {difference:.3e} (relative) at backward call "
                f"{self._backward_calls}, above check_threshold={self.check_threshold:g}.",
                stacklevel=2,
            )

    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry = StrategyRegistry) -> None:
        # override=True: re-importing (or reloading) the package must never raise.
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.strategy_description, override=True
        )


class BPPSAStrategy(_BPPSAMixin, SingleDeviceStrategy):
    """Single-device strategy whose supported modules run their backward as a BPPSA scan.

    Args:
        algorithm: scan algorithm for every converted module (see ``backprop_scan``); ``"auto"``
            lets each module pick, falling back to autograd where the scan does not pay.
        modules: qualified module names to convert; ``None`` converts every supported module.
        check_every: every ``check_every`` backward passes, also compute the gradients with autograd
            and log the largest relative difference as ``bppsa/grad_rel_diff`` (0 = off).
        check_threshold: warn when that difference exceeds this value.
        device: the device to train on; by default the first one the Trainer's accelerator picks
            (more than one device: use :class:`BPPSADDPStrategy`, ``strategy="bppsa_ddp"``).

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(strategy="bppsa", accelerator="cpu", max_steps=1, logger=False)
        >>> trainer = pl.Trainer(strategy=BPPSAStrategy(algorithm="chunked", check_every=100), logger=False)
    """

    strategy_name = "bppsa"
    strategy_description = "Back-propagation as a parallel prefix scan"

    def __init__(
        self,
        algorithm: str = "auto",
        modules: Sequence[str] | None = None,
        check_every: int = 0,
        check_threshold: float = 1e-4,
        device: torch.device | str | int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            algorithm=algorithm,
            modules=modules,
            check_every=check_every,
            check_threshold=check_threshold,
            device=device if device is not None else "cpu",
            **kwargs,
        )
        self._explicit_device = device is not None
        # Filled by the accelerator connector when the strategy was made from a string.
        self._parallel_devices: list[torch.device] | None = None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The devices the Trainer's accelerator picked; this strategy trains on the first one."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices is not None and len(devices) > 1 and not self._explicit_device:
            rank_zero_warn(
                f"strategy 'bppsa' trains on one device; it uses {devices[0]} of the {len(devices)} devices "
                "given. For data-parallel training on all of them use strategy='bppsa_ddp'."
            )
        self._parallel_devices = devices

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._explicit_device and self.parallel_devices:
            return torch.device(self.parallel_devices[0])
        return super().root_device


class BPPSADDPStrategy(_BPPSAMixin, DDPStrategy):
    """Data-parallel BPPSA: Lightning's DDP over ``devices x num_nodes`` processes, backward through the scan.

    Every process converts its replica of the model exactly as :class:`BPPSAStrategy` does (same
    conversion report, logged once by global rank 0), runs the scan on its share of the batch, and DDP
    averages the parameter gradients over the processes. The converted modules' autograd Functions
    return their parameter gradients from ``backward`` like any torch op, so they reach ``.grad``
    through the parameters' ``AccumulateGrad`` nodes, where DDP's reducer hooks bucket and all-reduce
    them: the update is the one of single-process training on the combined batch (with a mean loss
    and equal per-process batches). ``"auto"``'s cost model sees the per-process batch size.

    Backend: NCCL on GPUs, gloo on CPU (``process_group_backend=`` overrides). Processes are launched
    as for ``strategy="ddp"``: Lightning re-runs the script once per local device, or they are started
    externally (``torchrun``, SLURM: ``LOCAL_RANK`` etc. set). Lightning's ``DistributedSampler``
    gives each process its own slice of every epoch.

    Args:
        algorithm, modules, check_every, check_threshold: as for :class:`BPPSAStrategy`; the gradient
            check compares this process's local gradients (before the all-reduce).
        kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``process_group_backend``,
            ``timeout``, ``start_method``, ``find_unused_parameters``, ...) and on to
            ``DistributedDataParallel``.

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(strategy="bppsa_ddp", accelerator="cpu", devices=2, logger=False)
        >>> trainer = pl.Trainer(strategy=BPPSADDPStrategy(algorithm="chunked"), devices=2, num_nodes=1)  # doctest: +SKIP
    """

    strategy_name = "bppsa_ddp"
    strategy_description = "Data-parallel (DDP) training with back-propagation as a parallel prefix scan"


# the names exist as soon as the classes do (see lightning_bppsa._registration)
BPPSAStrategy.register_strategies()
BPPSADDPStrategy.register_strategies()
