"""Fit the calibrated CUDA model (:mod:`lightning_bppsa.cuda_step_model`) to the committed H100 measurements.

    python benchmarks/fit_cuda_model.py   # prints the fitted constants and each step row's error (no GPU needed)

Data: ``results/calib-h100-2026-11-26.csv`` (kernel launches alone, whole steps of cuDNN and of BPPSA "auto")
and ``results/calib-h100-2026-11-26-plans.csv`` (which path and scan plan each BPPSA row ran). Kernels are fitted
on the launches; the torch step on cuDNN's rows; the scan step on the rows that ran the scan, with the kernel
time of the plan that ran taken from the measured launches (nearest chunk), so that kernel-model error does not
leak into the step constants. Least squares on log(predicted / measured).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from pathlib import Path

import numpy as np

from lightning_bppsa import cuda_step_model as model

RESULTS = Path(__file__).parent / "results"


def read_csv(path: Path) -> list[dict[str, str]]:
    """Rows of a CSV whose comment lines start with ``#``."""
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def load() -> tuple[list[tuple], dict, dict]:
    """(kernel launches (algorithm, d, B, T, chunk, s), steps {(what, d, B, T): s}, plans {(d, B, T): (path, plan)})."""
    launches, steps = [], {}
    for r in read_csv(RESULTS / "calib-h100-2026-11-26.csv"):
        key = int(r["d"]), int(r["B"]), int(r["T"])
        seconds = float(r["ms"]) * 1e-3
        if r["what"] == "kernel":
            launches.append((r["algorithm"], *key, int(r["chunk"]), seconds))
        else:
            steps[(r["what"], *key)] = seconds
    plans = {(int(r["d"]), int(r["B"]), int(r["T"])): (r["path"], r["plan"])
             for r in read_csv(RESULTS / "calib-h100-2026-11-26-plans.csv")}  # fmt: skip
    return launches, steps, plans


def measured_kernel(launches: list[tuple], key: tuple[int, int, int], plan: str) -> float | None:
    """The measured launch nearest to ``plan`` (``"linear [cuda]"`` / ``"chunked(c=N) [cuda]"``) at ``key``
    (``None``: not measured, too slow to time)."""
    found = [x for x in launches if tuple(x[1:4]) == key]
    if plan.startswith("linear"):
        return next((x[5] for x in found if x[0] == "linear"), None)
    chunk = int(re.search(r"c=(\d+)", plan).group(1))
    return min((x for x in found if x[0] == "chunked"), key=lambda x: abs(math.log(x[4] / chunk)))[5]


def _fit(fields: list[str], residuals, base):
    from scipy.optimize import least_squares  # the fit only: loading the data needs no SciPy

    x0 = np.array([getattr(base, f) for f in fields])
    result = least_squares(lambda x: residuals(dataclasses.replace(base, **dict(zip(fields, x, strict=True)))), x0,
                           bounds=(0, np.inf), x_scale=x0)  # fmt: skip
    return dataclasses.replace(base, **dict(zip(fields, result.x, strict=True)))


def main() -> None:
    launches, steps, plans = load()
    kfields = [f.name for f in dataclasses.fields(model.KernelConstants)]

    def kernel_res(k):
        return [math.log(model.kernel_seconds(a, n=t, d=d, m=d, batch=b, chunk=c, constants=k) / s)
                for a, d, b, t, c, s in launches]  # fmt: skip

    kernels = _fit(kfields, kernel_res, model.KERNELS)
    torch_fields = [f.name for f in dataclasses.fields(model.StepConstants) if f.name.startswith("torch")]
    scan_fields = [f.name for f in dataclasses.fields(model.StepConstants) if not f.name.startswith("torch")]
    keys = sorted({k[1:] for k in steps})

    def torch_res(s):
        return [math.log(model.step_seconds("torch", gates=1, hidden=d, d=d, m=d, batch=b, n=t, constants=s)
                         / steps[("step_cudnn", d, b, t)]) for d, b, t in keys]  # fmt: skip

    scan_kernel = {k: measured_kernel(launches, k, plans[k][1]) for k in keys if plans[k][0] == "scan"}
    scan_rows = [k for k, seconds in scan_kernel.items() if seconds is not None]

    def scan_res(s):
        out = []
        for d, b, t in scan_rows:
            with_kernel = dataclasses.replace(s, scan_gpu=s.scan_gpu + scan_kernel[(d, b, t)])
            quiet = dataclasses.replace(model.KERNELS, **{f: 0.0 for f in kfields})  # the measured kernel only
            pred = model.step_seconds("scan", gates=1, hidden=d, d=d, m=d, batch=b, n=t, constants=with_kernel,
                                      kernels=quiet)  # fmt: skip
            out.append(math.log(pred / steps[("step_bppsa", d, b, t)]))
        return out

    stepc = _fit(torch_fields, torch_res, model.STEPS)
    stepc = _fit(scan_fields, scan_res, stepc)
    for name, fitted in (("KernelConstants", kernels), ("StepConstants", stepc)):
        print(name)
        for f in dataclasses.fields(fitted):
            print(f"    {f.name}: float = {getattr(fitted, f.name):.3g}")
    for label, res in (("kernels", kernel_res(kernels)), ("torch steps", torch_res(stepc)), ("scan steps", scan_res(stepc))):
        err = np.exp(np.abs(res))
        print(f"{label}: median error x{np.median(err):.2f}, worst x{err.max():.2f} over {len(res)} rows")


if __name__ == "__main__":
    main()
