"""Fit the calibrated CUDA model (:mod:`lightning_bppsa.cuda_step_model`) to the committed H100 measurements.

    python benchmarks/fit_cuda_model.py           # the fitted constants, each row's error, the path each shape gets
    python benchmarks/fit_cuda_model.py --write   # the same, and the constants written into cuda_step_model.py
    python benchmarks/fit_cuda_model.py --data results/cuda-calib.csv   # another grid (e.g. a new GPU run's)
    python benchmarks/fit_cuda_model.py --fused-data results/cuda-calib-h200-20dff7a.csv --write  # fused: an H200's
    python benchmarks/fit_cuda_model.py --fused-data results/cuda-calib-h200-20dff7a.csv \
        --layout-data results/cluster-layouts-h200-f9d52e5.md --step-data results/cuda-step-h200-213b46c.md
        # the cluster kernels' constant on a layout sweep, checked on a whole-step table's cluster layers

No GPU needed. Data: ``results/calib-h100-2026-11-26-eeeac3a.csv`` (the calibration grid of ``benchmarks/gpu.py``
on an H100, package commit eeeac3a; its ``#`` lines say where it comes from): kernel launches alone, whole
steps of cuDNN, whole steps of the scan (forced ``linear`` / ``chunked``, and ``auto`` where its plan ran the
scan: the ``plan`` column says which kernel and chunk ran). Kernels are fitted on the launches; the torch
step on cuDNN's rows; the scan step on the rows that ran the scan with the CUDA forward kernel, with the
kernel time of the launch that ran taken from the measurements (:func:`measured_kernel`), so that
kernel-model error does not leak into the step constants; the fused backward kernel's constants on its
launches alone (``fused_kernel`` rows, from the RNN grid: ``G = 1``), where the data has them (the H100 file
does not: ``--fused-data`` names a file that does, e.g. ``results/cuda-calib-h200-20dff7a.csv``, an H200's, the
same GH100 chip). Least squares on log(predicted / measured). Where the fused kernel ran at a shape's ``d``,
the path picked compares cuDNN with the faster the model predicts of the factored scan and the fused kernel.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
from pathlib import Path

import numpy as np
from lightning_bppsa.kernels import recurrent_cuda

from lightning_bppsa import cuda_step_model as model
from lightning_bppsa.cells import CELLS

RESULTS = Path(__file__).parent / "results"
DATA = RESULTS / "calib-h100-2026-11-26-eeeac3a.csv"
#: the layer plan's margin the acceptance test allows: the picked path within 10% of the faster measured one
TOLERANCE = 1.1
#: where the fit starts (read off the data by hand: a warp step ~0.1 us, a matrix step ~1.5 us + 0.07 us per
#: pass and operand row, cuDNN ~0.7-2 us a step, the scan's host ~1.1 ms, its forward ~0.2 us a step): the fit
#: has flat directions and, through max(), local minima; a fixed start makes it reproducible
START_KERNELS = model.KernelConstants(
    launch=4e-5, warp_step=9e-8, warp_operand=3e-9, sweep_element=1.5e-9, chunk_fixed=5e-5, matrix_step=1.4e-6,
    matrix_pass=7e-8, carry=1.2e-6, carry_element=1e-9, throughput=8e-10, throughput_slot=4.5e-13,
)  # fmt: skip
START_STEPS = model.StepConstants(
    torch_host=9e-4, torch_gpu=3e-4, torch_step=6.5e-7, torch_wide=4e-11, torch_row=5e-8, torch_batch=2e-9,
    torch_mac=2.4e-13, scan_host=1.1e-3, scan_gpu=1e-4, forward_step=2e-7, generic_step=2e-7, generic_unit=5e-9,
    elementwise=3.5e-11,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Launch:
    """One measured launch of the scan kernel alone (RNN: ``m = d``)."""

    algorithm: str  # "linear" or "chunked"
    d: int
    batch: int
    n: int
    chunk: int  # n for the sweep
    seconds: float


@dataclasses.dataclass(frozen=True)
class ScanStep:
    """One measured whole training step that ran the scan's CUDA kernels."""

    d: int
    batch: int
    n: int
    algorithm: str  # what ran: "linear" or "chunked"
    chunk: int
    seconds: float
    torch_forward: bool  # the CUDA forward kernel refused the shape: torch's forward ran (not the model's)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The measurements the model is fitted on and tested against."""

    launches: list[Launch]
    cudnn: dict[tuple[int, int, int], float]  # (d, B, T) -> seconds of cuDNN's step
    scans: list[ScanStep]
    fused: list[Launch] = dataclasses.field(default_factory=list)  # the fused backward kernel alone (RNN)
    #: (d, B, T) -> seconds of the fastest measured step whose linear plan ran the fused backward kernel
    fused_steps: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV whose comment lines start with ``#``."""
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def scan_plan(plan: str, n: int) -> tuple[str, int] | None:
    """``(algorithm, chunk)`` of a ``last_stats["plan"]`` that ran the CUDA scan (``"scan linear [cuda]"``,
    ``"scan chunked(c=64) [cuda]"``, maybe followed by ``", torch forward: ..."``); ``None`` for any other,
    also where the fused backward kernel ran instead of the factored scan (``", fused backward kernel"``: its
    time is not the scan kernels', whose constants these rows fit)."""
    found = re.match(r"scan (linear|chunked)(?:\(c=(\d+)\))? \[cuda\]", plan)
    if found is None or "fused backward kernel" in plan:
        return None
    return found.group(1), int(found.group(2) or n)


def load(path: Path = DATA) -> Calibration:
    """The rows of ``path`` that have a time (a row with a note but no ms was skipped or refused)."""
    launches, cudnn, scans, fused, fused_steps = [], {}, [], [], {}
    for r in read_csv(path):
        if not r["ms"]:
            continue
        d, batch, n, seconds = int(r["d"]), int(r["B"]), int(r["T"]), float(r["ms"]) * 1e-3
        if r["what"] == "kernel":
            launches.append(Launch(r["algorithm"], d, batch, n, int(r["chunk"]), seconds))
        elif r["what"] == "fused_kernel":
            fused.append(Launch("fused", d, batch, n, n, seconds))
        elif r["what"] == "step_cudnn":
            cudnn[(d, batch, n)] = seconds
        elif r["what"] in ("step_scan", "step_bppsa"):
            if (ran := scan_plan(r["plan"], n)) is not None:
                scans.append(ScanStep(d, batch, n, *ran, seconds, "torch forward" in r["plan"]))
            elif "fused backward kernel" in r["plan"]:
                fused_steps[(d, batch, n)] = min(seconds, fused_steps.get((d, batch, n), math.inf))
    return Calibration(launches, cudnn, scans, fused, fused_steps)


def predicted_kernel(
    algorithm: str, d: int, batch: int, n: int, chunk: int, constants=model.KERNELS, affine: bool = False
) -> float:
    """The model's seconds of one launch of the calibration grid's shape (RNN: ``m = d``, float32; the
    launches alone had the last state's gradient only: not ``affine``)."""
    return model.kernel_seconds(
        algorithm, n=n, d=d, m=d, batch=batch, chunk=chunk, affine=affine, constants=constants
    )


def measured_kernel(data: Calibration, step: ScanStep, constants=model.KERNELS) -> float:
    """The kernel time inside ``step``: its launch as measured alone where that launch was measured, else the
    model's time corrected by its error at the nearest measured chunk of the same algorithm and shape, else
    the model's time; times the model's ratio of the step's affine launch (a per-step gradient) to that
    launch (the last state's gradient only)."""

    def pred(chunk: int, affine: bool = False) -> float:
        return predicted_kernel(step.algorithm, step.d, step.batch, step.n, chunk, constants, affine)

    same = [
        x
        for x in data.launches
        if (x.algorithm, x.d, x.batch, x.n) == (step.algorithm, step.d, step.batch, step.n)
    ]
    if same:
        near = min(same, key=lambda x: abs(math.log(x.chunk / step.chunk)))
        alone = pred(step.chunk) * near.seconds / pred(near.chunk)
    else:
        alone = pred(step.chunk)
    return alone * pred(step.chunk, affine=True) / pred(step.chunk)


def step(path: str, d: int, batch: int, n: int, **kwargs) -> float:
    """The model's seconds of a training step of the grid's RNN shape on ``path``."""
    return model.step_seconds(path, gates=1, hidden=d, d=d, m=d, batch=batch, n=n, **kwargs)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the model picks at one measured shape, and what that costs against the faster measured path."""

    d: int
    batch: int
    n: int
    picked: str  # "torch" or "scan"
    cudnn: float  # measured seconds
    scan: float  # the best measured scan step (any algorithm and chunk, or the fused backward kernel)
    predicted_torch: float
    predicted_scan: float

    @property
    def cost(self) -> float:
        """The picked path's measured seconds over the faster measured path's (1: the right pick)."""
        got = self.cudnn if self.picked == "torch" else self.scan
        return got / min(self.cudnn, self.scan)


def decisions(
    data: Calibration,
    kernels: model.KernelConstants = model.KERNELS,
    steps: model.StepConstants = model.STEPS,
) -> list[Decision]:
    """The model's pick at every shape where cuDNN's step and at least one scan step were measured. Where the
    fused backward kernel ran at the shape's ``d`` (a ``fused_kernel`` launch was measured), the model's scan is
    the faster it predicts of the factored scan and the fused kernel, as the layer plan's is."""
    out = []
    fused_widths = {x.d for x in data.fused}
    for key in sorted(data.cudnn):
        scans = [s.seconds for s in data.scans if (s.d, s.batch, s.n) == key]
        scans += [data.fused_steps[key]] if key in data.fused_steps else []
        if not scans:
            continue
        torch_, scan = (step(path, *key, constants=steps, kernels=kernels) for path in ("torch", "scan"))
        if key[0] in fused_widths:
            scan = min(scan, step("scan", *key, fused=True, constants=steps, kernels=kernels))
        picked = "scan" if scan < torch_ else "torch"
        out.append(Decision(*key, picked, data.cudnn[key], min(scans), torch_, scan))
    return out


def _fit(fields: list[str], residuals, base):
    """``base`` with ``fields`` refitted: least squares over their logs (positive constants, every one on the
    scale of its start; bounds at 0 would move SciPy's start to 1e-10, above most of these constants)."""
    from scipy.optimize import least_squares  # the fit only: loading the data needs no SciPy

    x0 = np.array([getattr(base, f) for f in fields])

    def constants(y):
        return dataclasses.replace(base, **{f: float(v) for f, v in zip(fields, x0 * np.exp(y), strict=True)})

    return constants(least_squares(lambda y: residuals(constants(y)), np.zeros(len(fields))).x)


def fit(data: Calibration, fused: Calibration | None = None) -> tuple[model.KernelConstants, model.StepConstants]:
    """The constants that fit ``data``, from :data:`START_KERNELS` and :data:`START_STEPS`; the fused kernel's on
    ``fused``'s launches (default: ``data``'s), and the forward kernel's above one warp in float32 on ``fused``'s
    steps (none without ``fused``: ``data``'s ran the kernels before them)."""
    kfields = [f.name for f in dataclasses.fields(model.KernelConstants)]
    kernels = _fit(kfields, lambda k: kernel_residuals(data, k), START_KERNELS)
    names = [f.name for f in dataclasses.fields(model.StepConstants)]
    torch_fields = [f for f in names if f.startswith("torch")]
    # the generic forward's constants are kept: fitted at eeeac3a, where float32 d > 32 ran it (now float64's)
    scan_fields = [f for f in names if not f.startswith(("torch", "fused", "generic")) and f not in REGISTER_FORWARD_FIELDS]
    steps = _fit(torch_fields, lambda s: torch_residuals(data, s), START_STEPS)
    steps = _fit(scan_fields, lambda s: scan_residuals(data, s, kernels), steps)
    if fused is None:
        return kernels, fit_fused(data, steps)
    steps = fit_fused(fused, steps)
    return kernels, fit_register_forward(fused, steps, kernels)


#: the fused backward kernel's constants, each family's fitted where a launch of that family was measured
FUSED_FIELDS = ("fused_launch", "fused_step", "fused_register_step", "fused_register_unit", "fused_register_shared")
#: the forward kernel's above one warp in float32 (``W_hh`` in registers, or partly)
REGISTER_FORWARD_FIELDS = ("forward_register_step", "forward_register_unit", "forward_register_shared")


def _wide(x) -> bool:
    """Whether a launch or step of the RNN grid ran the float32 kernels of ``H > 32`` (:func:`recurrent_cuda.wide_layout`)."""
    return x.d > recurrent_cuda.FIXED_HIDDEN


def fit_fused(data: Calibration, steps: model.StepConstants) -> model.StepConstants:
    """``steps`` with the fused kernel's constants fitted on ``data.fused``, starting from ``steps``' values; a
    family without a measured launch (float32 ``H <= 32``: per ``H``; above: ``W_hh`` in registers or partly,
    ``recurrent_cuda.wide_layout``) keeps ``steps``' constants. ``data`` must be a grid measured at ff2c2be or
    later (before, the kernels above a warp read all of ``W_hh`` from shared memory: the generic constants,
    fitted on ``results/cuda-calib-h200-be3c8e9.csv`` and now describing float64's kernels, are not refitted)."""
    wide = [x for x in data.fused if _wide(x)]
    fields = (["fused_launch"] if data.fused else []) + (["fused_step"] if len(data.fused) > len(wide) else []) + (
        list(FUSED_FIELDS[2:]) if wide else []
    )
    return _fit(fields, lambda s: fused_residuals(data, s), steps) if fields else steps


def fit_register_forward(
    data: Calibration, steps: model.StepConstants, kernels: model.KernelConstants
) -> model.StepConstants:
    """``steps`` with the forward kernel's constants above one warp in float32 fitted on ``data``'s scan steps at
    ``d > 32`` (the factored scan's, its kernel as measured, :func:`measured_kernel`; the fused kernel's, its
    launch as measured), the other constants as given; unchanged where ``data`` has no such step."""
    residuals = register_forward_residuals(data, steps, kernels)
    if not residuals:
        return steps
    return _fit(list(REGISTER_FORWARD_FIELDS), lambda s: register_forward_residuals(data, s, kernels), steps)


def register_forward_residuals(
    data: Calibration, s: model.StepConstants, kernels: model.KernelConstants
) -> list[float]:
    """log(predicted / measured) of each scan step of ``data`` at ``d > 32`` whose backward was measured alone
    (:func:`fit_register_forward`)."""
    out = _scan_residuals(data, [x for x in _fitted_scans(data) if _wide(x)], s, kernels)
    launches = {(x.d, x.batch, x.n): x.seconds for x in data.fused}
    quiet = _without_kernels(kernels)
    for key, seconds in sorted(data.fused_steps.items()):
        if key[0] > recurrent_cuda.FIXED_HIDDEN and key in launches:  # the step without its backward kernel
            pred = step("scan", *key, algorithm="linear", constants=s, kernels=quiet) + launches[key]
            out.append(math.log(pred / seconds))
    return out


def fused_residuals(data: Calibration, s: model.StepConstants) -> list[float]:
    """log(predicted / measured) of each fused kernel launch (the RNN grid: one gate block, float32)."""
    return [
        math.log(model.fused_seconds(gates=1, hidden=x.d, n=x.n, batch=x.batch, constants=s) / x.seconds)
        for x in data.fused
    ]


def kernel_residuals(data: Calibration, k: model.KernelConstants) -> list[float]:
    return [
        math.log(predicted_kernel(x.algorithm, x.d, x.batch, x.n, x.chunk, k) / x.seconds)
        for x in data.launches
    ]


def torch_residuals(data: Calibration, s: model.StepConstants) -> list[float]:
    return [
        math.log(step("torch", *key, constants=s) / seconds) for key, seconds in sorted(data.cudnn.items())
    ]


def _fitted_scans(data: Calibration) -> list[ScanStep]:
    return [s for s in data.scans if not s.torch_forward]


def _without_kernels(kernels: model.KernelConstants) -> model.KernelConstants:
    """``kernels`` priced at nothing: a step's prediction without its scan kernel (added as measured)."""
    return dataclasses.replace(kernels, **{f.name: 0.0 for f in dataclasses.fields(kernels)})


def _host_scans(data: Calibration) -> list[ScanStep]:
    """The scan steps the host's, the forward's per-``H`` and the elementwise constants are fitted on: ``d <= 32``
    (above, the forward kernels changed since the H100's grid: :func:`fit_register_forward`)."""
    return [s for s in _fitted_scans(data) if not _wide(s)]


def scan_residuals(data: Calibration, s: model.StepConstants, kernels: model.KernelConstants) -> list[float]:
    """log(predicted / measured) of each scan step of :func:`_host_scans`, the kernel inside it as measured
    (:func:`measured_kernel`)."""
    return _scan_residuals(data, _host_scans(data), s, kernels)


def _scan_residuals(
    data: Calibration, scans: list[ScanStep], s: model.StepConstants, kernels: model.KernelConstants
) -> list[float]:
    quiet = _without_kernels(kernels)
    return [
        math.log((step("scan", x.d, x.batch, x.n, algorithm=x.algorithm, constants=s, kernels=quiet)
                  + measured_kernel(data, x, kernels)) / x.seconds)
        for x in scans
    ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class LayerStep:
    """One row of a whole-step table of ``benchmarks/gpu.py`` (``cuda-step*.md``): a layer of any cell."""

    cell: str  # a name of lightning_bppsa.cells.CELLS ("rnn_tanh" for the table's "RNN")
    batch: int
    n: int
    hidden: int
    cudnn: float  # measured seconds of each path's step
    bppsa: float
    plan: str  # what "auto" ran (``last_stats["plan"]``)

    def predicted(self, path: str, constants: model.StepConstants = model.STEPS) -> float:
        """The model's seconds of this step on ``path``: ``"torch"``, or ``"scan"`` with the fused backward."""
        cell = CELLS[self.cell]
        return model.step_seconds(
            path, gates=cell.gates, hidden=self.hidden, d=cell.state_factor * self.hidden,
            m=cell.jacobian_width(self.hidden), batch=self.batch, n=self.n, fused=path == "scan", constants=constants,
        )  # fmt: skip


def load_steps(path: Path) -> list[LayerStep]:
    """The rows of a whole-step table (markdown; the cells, B, T, ..., cuDNN and BPPSA step ms, and the plan last)."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("RNN", "GRU", "LSTM"):
            name = "rnn_tanh" if cells[0] == "RNN" else cells[0].lower()
            batch, n, hidden = int(cells[1]), int(cells[2]), int(cells[4])
            rows.append(LayerStep(name, batch, n, hidden, float(cells[5]) * 1e-3, float(cells[6]) * 1e-3, cells[-1]))
    return rows


def cluster_steps(rows: list[LayerStep]) -> list[LayerStep]:
    """The rows whose scan ran its kernels as clusters of blocks on an H100 / H200 (float32, the fused
    backward: ``W_hh`` beyond one block), where the launch's layout is still the smallest cluster's (at
    213b46c every cluster was; since, a small batch's 2-block GRU / LSTM spreads over 4 blocks:
    ``recurrent_cuda.launch_layout``)."""
    out = []
    for x in rows:
        layouts = [model._wide_layout(x.cell, x.hidden, d, x.batch) for d in ("forward", "backward")]
        unspread = [model._wide_layout(x.cell, x.hidden, d, recurrent_cuda.SPREAD_BATCH + 1) for d in ("forward", "backward")]
        clustered = any(y is not None and y.cluster > 1 for y in layouts)
        if "fused backward kernel" in x.plan and layouts == unspread and clustered:
            out.append(x)
    return out


@dataclasses.dataclass(frozen=True)
class LayoutLaunch:
    """One launch of ``benchmarks/cluster_layouts.py``'s table: a layer's forward or fused backward kernel alone,
    its ``W_hh`` laid out as ``layout``."""

    cell: str
    hidden: int
    batch: int
    n: int
    direction: str
    layout: recurrent_cuda.WideLayout
    seconds: float

    def predicted(self, constants: model.StepConstants = model.STEPS) -> float:
        price = model.forward_seconds if self.direction == "forward" else model.fused_seconds
        return price(gates=CELLS[self.cell].gates, hidden=self.hidden, n=self.n, batch=self.batch,
                     constants=constants, layout=self.layout)  # fmt: skip


def load_layouts(path: Path) -> list[LayoutLaunch]:
    """The timed launches of a layout table (``cluster-layouts*.md``: ``T=<n>`` in its text, a row per layout
    ``Q=<blocks> x <lanes> lanes``, its ms)."""
    text = path.read_text()
    n = int(re.search(r"T=(\d+)", text).group(1))
    launches = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found = re.search(r"Q=(\d+) x (\d+) lanes", cells[4]) if len(cells) > 8 else None
        if found is None or not re.fullmatch(r"[\d.]+", cells[8]):
            continue
        cell, hidden, batch, direction = cells[0], int(cells[1]), int(cells[2]), cells[3]
        q, split = int(found.group(1)), int(found.group(2))
        layout = recurrent_cuda.wide_layout(cell, hidden, direction, q, splits=(split,))
        launches.append(LayoutLaunch(cell, hidden, batch, n, direction, layout, float(cells[8]) * 1e-3))
    return launches


def cluster_residuals(launches: list[LayoutLaunch], s: model.StepConstants) -> list[float]:
    """log(predicted / measured) of each launch of ``launches`` run as a cluster of blocks."""
    return [math.log(x.predicted(s) / x.seconds) for x in launches if x.layout.cluster > 1]


def fit_cluster(launches: list[LayoutLaunch], steps: model.StepConstants) -> model.StepConstants:
    """``steps`` with :attr:`~lightning_bppsa.cuda_step_model.StepConstants.cluster_step` fitted on the launches
    of a layout table run as clusters (both directions: one constant serves both)."""
    return _fit(["cluster_step"], lambda s: cluster_residuals(launches, s), steps)


def write(constants: list) -> None:
    """Write the fitted constants into ``cuda_step_model.py`` (each field's default, 3 significant digits)."""
    path = Path(model.__file__)
    text = path.read_text()
    for fitted in constants:
        for f in dataclasses.fields(fitted):
            text, count = re.subn(
                rf"(?m)^(    {f.name}: float = )\S+$", rf"\g<1>{getattr(fitted, f.name):.3g}", text
            )
            if count != 1:
                raise ValueError(f"{path.name}: {count} defaults of {f.name} (one expected)")
    path.write_text(text)


def _errors(label: str, residuals: list[float]) -> None:
    err = np.exp(np.abs(residuals))
    print(
        f"{label}: median error x{np.median(err):.2f}, worst x{err.max():.2f} over {len(residuals)} rows "
        f"(sum of squared log errors / 2: {np.square(residuals).sum() / 2:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the constants into cuda_step_model.py")
    parser.add_argument("--data", type=Path, default=DATA, help=f"the calibration CSV (default {DATA.name})")
    parser.add_argument(
        "--fused-data", type=Path, metavar="CSV", help="fit the fused kernel's constants on this CSV's launches"
    )
    parser.add_argument(
        "--layout-data", type=Path, metavar="MD",
        help="fit the cluster kernels' step on this layout table (e.g. results/cluster-layouts-h200-f9d52e5.md)",
    )  # fmt: skip
    parser.add_argument(
        "--step-data", type=Path, metavar="MD",
        help="print the model's whole steps of this step table's cluster layers (e.g. results/cuda-step-h200-213b46c.md)",
    )  # fmt: skip
    args = parser.parse_args()
    data = load(args.data)
    given = load(args.fused_data) if args.fused_data else None
    kernels, steps = fit(data, given)
    layouts = load_layouts(args.layout_data) if args.layout_data else []
    if layouts:
        steps = fit_cluster(layouts, steps)
    fused = given or data
    for name, fitted in (("KernelConstants", kernels), ("StepConstants", steps)):
        print(name)
        for f in dataclasses.fields(fitted):
            print(f"    {f.name}: float = {getattr(fitted, f.name):.3g}")
    _errors("kernels", kernel_residuals(data, kernels))
    _errors("torch steps", torch_residuals(data, steps))
    _errors("scan steps", scan_residuals(data, steps, kernels))
    if fused.fused:
        _errors("fused kernel launches", fused_residuals(fused, steps))
    if args.fused_data:
        _errors("scan steps above a warp (forward kernel)", register_forward_residuals(fused, steps, kernels))
    if layouts:
        _errors("cluster kernels' launches", cluster_residuals(layouts, steps))
        for x in layouts:
            print(f"  {x.cell:5s} H={x.hidden:<4d} B={x.batch:<4d} {x.direction:9s} Q={x.layout.cluster} x "
                  f"{x.layout.split:<2d} {x.seconds * 1e3:7.3f}  x{x.predicted(steps) / x.seconds:.2f}")  # fmt: skip
    for x in cluster_steps(load_steps(args.step_data)) if args.step_data else []:
        print(f"  step {x.cell:5s} B={x.batch:<4d} T={x.n:<6d} H={x.hidden:<4d} measured {x.bppsa * 1e3:7.3f} ms "
              f"(cuDNN {x.cudnn * 1e3:.3f}), predicted {x.predicted('scan', steps) * 1e3:7.3f} "
              f"(cuDNN {x.predicted('torch', steps) * 1e3:.3f})")  # fmt: skip
    print("\nkernel launches, worst 12 (measured ms, predicted / measured)")
    res = kernel_residuals(data, kernels)
    for r, x in sorted(zip(res, data.launches, strict=True), key=lambda p: -abs(p[0]))[:12]:
        print(
            f"  {x.algorithm:8s} c={x.chunk:<5d} d={x.d:<4d} B={x.batch:<4d} T={x.n:<6d} {x.seconds * 1e3:9.3f}  x{math.exp(r):.2f}"
        )
    print("\nscan steps (measured ms, predicted / measured with the kernel as measured)")
    for r, x in zip(scan_residuals(data, steps, kernels), _host_scans(data), strict=True):
        print(
            f"  d={x.d:<4d} B={x.batch:<4d} T={x.n:<6d} {x.algorithm:8s} c={x.chunk:<5d} {x.seconds * 1e3:8.3f}  x{math.exp(r):.2f}"
        )
    print("\ntorch steps (measured ms, predicted / measured)")
    for r, (key, seconds) in zip(torch_residuals(data, steps), sorted(data.cudnn.items()), strict=True):
        print(f"  d={key[0]:<4d} B={key[1]:<4d} T={key[2]:<6d} {seconds * 1e3:8.3f}  x{math.exp(r):.2f}")
    print("\npath picked (measured ms: cuDNN, best scan; predicted ms; cost = picked / faster measured)")
    for x in decisions(data, kernels, steps):
        mark = "  MISS" if x.cost > TOLERANCE else ""
        print(
            f"  d={x.d:<4d} B={x.batch:<4d} T={x.n:<6d} cuDNN {x.cudnn * 1e3:7.3f} scan {x.scan * 1e3:7.3f}  "
            f"predicted {x.predicted_torch * 1e3:7.3f} {x.predicted_scan * 1e3:7.3f}  {x.picked:5s} x{x.cost:.2f}{mark}"
        )
    if args.write:
        write([kernels, steps])
        print(f"\nwritten into {Path(model.__file__).name}")


if __name__ == "__main__":
    main()
