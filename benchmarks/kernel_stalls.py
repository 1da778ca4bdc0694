"""What a recurrent layer's kernels wait on, per dependent step: the ``stalls`` stage of ``benchmarks/gpu.py``.

Issue 29: on an H200 the LSTM's fused backward kernel took ~570 ns a dependent step and the GRU / LSTM forward
kernels ~440-470 ns on an H100 (the RNN's ~160-200 ns), where their SASS issues ~300-400 cycles of work a
step: what bounds them is to be measured, not modelled. Nsight Compute (``ncu``) profiles every kernel of one
training step (zero the gradients, forward, loss = sum of the last output step, backward, float32) of
torch's module (cuDNN) and of lightning_bppsa's with the workload's scan forced, per workload in a process of its
own (:func:`driver`: warm-up steps outside the profiled range, ``torch.cuda.profiler.start`` / ``stop``
around one step). Per kernel that took at least :data:`SHOWN_SHARE` of its step's GPU time: its duration, ns and warp
instructions a step (of T; instructions per warp), the warp's cycles per issued instruction and the stall
reasons that make them up (cycles per issued instruction each, the largest first: ``long_scoreboard`` is a
wait on global or local memory, ``barrier`` on a block or warp barrier, ``short_scoreboard`` on shared memory
or a special function, ``wait`` a fixed-latency dependency, ``math_pipe_throttle`` a busy pipe).

    python benchmarks/kernel_stalls.py                            # GPU and ncu: benchmarks/results/cuda-stalls.md
    python benchmarks/kernel_stalls.py --run bppsa LSTM 16 1034 12 20 linear   # what ncu runs: one profiled step

Without CUDA or ``ncu`` the file says so; a profile ncu refuses (no access to the GPU's performance counters:
``ERR_NVGPUCTRPERM``) is written as ncu's error.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also where loaded by path
from device_runner import NO_CUDA, RESULTS, SKIPPED, Runner, header, markdown_table, train_step, write
from torch import nn

#: (cell, B, T, input, H, the algorithm forced on ours): the workloads whose per-step costs issue 29 asks about,
#: most wanted first (the deadline may stop the stage): the gated cells' forward (a unit's gates in neighbouring
#: lanes since 67317ae, never profiled) and fused backward; at T = 10000 the chunked scan "auto" runs there
#: (never profiled: cuDNN's profile there ran past its time first); the RNN's linear plan (profiled at
#: a4e83a3); at H = 128 the kernels holding W_hh in registers across a block of four warps
STALL_WORKLOADS = (
    ("GRU", 16, 1034, 12, 20, "linear"), ("LSTM", 16, 1034, 12, 20, "linear"), ("RNN", 16, 10000, 1, 20, "chunked"),
    ("RNN", 16, 1000, 1, 20, "linear"), ("RNN", 16, 1000, 1, 128, "linear"),
)  # fmt: skip
MODULES = ("bppsa", "cudnn")  # ours first: cuDNN's long profiles may use up a workload's time
#: the stall reasons ncu counts (smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio: cycles a warp
#: spends in that state per instruction it issues)
STALL_REASONS = (
    "barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle", "long_scoreboard",
    "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction", "not_selected", "selected",
    "short_scoreboard", "sleeping", "tex_throttle", "wait",
)  # fmt: skip
DURATION = "gpu__time_duration.sum"
INSTRUCTIONS = "smsp__inst_executed.sum"
CYCLES_PER_ISSUE = "smsp__average_warp_latency_per_inst_issued.ratio"
#: what every profile asks for; :data:`METRICS` adds the stall reasons (a retry without them where ncu refuses one)
BASE_METRICS = (DURATION, INSTRUCTIONS)
METRICS = (
    *BASE_METRICS,
    CYCLES_PER_ISSUE,
    *(f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in STALL_REASONS),
)
#: a kernel is in the table where it took at least this share of its step's profiled GPU time
SHOWN_SHARE = 0.05
#: stall reasons shown per kernel, the largest first
TOP_STALLS = 4
#: seconds one profiled process may take (ncu replays each kernel once per metric pass)
PROFILE_SECONDS = 120.0
STALL_COLUMNS = (
    "module", "workload", "kernel", "grid x block", "us", "share of step", "ns / step", "warp inst / step",
    "cycles / issue", "largest stalls (cycles / issue)",
)  # fmt: skip

#: runs a command within a timeout: (command, timeout) -> (exit status, stdout + stderr)
Run = Callable[[Sequence[str], float], tuple[int, str]]


@dataclass(frozen=True)
class KernelProfile:
    """One profiled kernel launch: its name, launch shape and metrics (by ncu's name, as numbers)."""

    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    metrics: dict[str, float]

    @property
    def warps(self) -> int:
        """Warps of the launch (blocks x warps a block)."""
        return math.prod(self.grid) * -(-math.prod(self.block) // 32)


def driver(module: str, workload: tuple[str, int, int, int, int, str]) -> str:
    """One profiled training step of ``module`` (``"cudnn"``: torch's; ``"bppsa"``: lightning_bppsa's with the
    workload's algorithm) on ``workload``, after warm-up steps outside the profiled range; returns its plan."""
    from lightning_bppsa import nn as bnn

    cell, batch, length, inputs, hidden, algorithm = workload
    torch.manual_seed(0)
    layer = (
        getattr(nn, cell)(inputs, hidden, batch_first=True)
        if module == "cudnn"
        else getattr(bnn, cell)(inputs, hidden, batch_first=True, algorithm=algorithm)
    ).cuda()
    step = train_step(layer, torch.randn(batch, length, inputs, device="cuda"))
    for _ in range(3):  # kernels built, plans measured: not profiled
        step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # ncu --profile-from-start off: only what follows is profiled
    step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return getattr(layer, "last_stats", {}).get("plan", "torch's layer")


def ncu_command(ncu: str, module: str, workload: Sequence[int | str], metrics: Sequence[str]) -> list[str]:
    """The ncu command that profiles every kernel of :func:`driver`'s step, its metrics as CSV on stdout."""
    return [
        ncu, "--csv", "--profile-from-start", "off", "--metrics", ",".join(metrics),
        sys.executable, str(Path(__file__).resolve()), "--run", module, *map(str, workload),
    ]  # fmt: skip


def parse(text: str) -> list[KernelProfile]:
    """The kernels of ncu's ``--csv`` output (its details page: a row per kernel and metric, after whatever
    the program printed), in launch order; values with thousands separators read as numbers."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels: dict[str, tuple[str, str, str, dict[str, float]]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not (row.get("ID") or "").isdigit() or not row.get("Metric Name"):
            continue  # a line ncu or the program printed between the rows
        entry = kernels.setdefault(row["ID"], (row["Kernel Name"], row["Grid Size"], row["Block Size"], {}))
        try:
            entry[3][row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            continue  # "n/a" where a metric does not apply
    return [
        KernelProfile(name, _dims(grid), _dims(block), metrics)
        for name, grid, block, metrics in (kernels[k] for k in sorted(kernels, key=int))
    ]


def _dims(text: str) -> tuple[int, ...]:
    """``"(16, 1, 1)"`` -> ``(16, 1, 1)``."""
    return tuple(int(part) for part in text.strip("() ").split(",") if part.strip())


def _stalls(metrics: dict[str, float]) -> str:
    """The largest stall reasons, ``reason value`` each."""
    found = [
        (metrics[f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"], reason)
        for reason in STALL_REASONS
        if f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" in metrics
    ]
    largest = sorted(found, reverse=True)[:TOP_STALLS]
    return ", ".join(f"{reason} {value:.1f}" for value, reason in largest) or "-"


def rows_of(module: str, workload: Sequence[int | str], kernels: Sequence[KernelProfile]) -> list[list[str]]:
    """The table rows of one profiled step: the kernels that took at least :data:`SHOWN_SHARE` of its GPU time."""
    steps = int(workload[2])
    total = sum(k.metrics.get(DURATION, 0.0) for k in kernels)
    rows = []
    for kernel in kernels:
        ns = kernel.metrics.get(DURATION)
        if ns is None or total <= 0 or ns < SHOWN_SHARE * total:
            continue
        inst = kernel.metrics.get(INSTRUCTIONS)
        cycles = kernel.metrics.get(CYCLES_PER_ISSUE)
        rows.append([
            module, " ".join(map(str, workload)), f"`{kernel.name[:80]}`",
            f"{'x'.join(map(str, kernel.grid))} x {'x'.join(map(str, kernel.block))}", f"{ns / 1e3:.1f}",
            f"{ns / total:.0%}", f"{ns / steps:.0f}", "-" if inst is None else f"{inst / kernel.warps / steps:.0f}",
            "-" if cycles is None else f"{cycles:.1f}", _stalls(kernel.metrics),
        ])  # fmt: skip
    return rows


def _run(command: Sequence[str], timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"stopped: did not finish in {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


def _failure(status: int, output: str) -> str:
    """Why a profile gave no kernels: ncu's error lines, else the output's last line."""
    errors = [line.strip() for line in output.splitlines() if "ERROR" in line or "ERR_" in line]
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
    return f"exit {status}: " + ("; ".join(errors[:3]) if errors else last)[:300]


def profile(
    ncu: str, module: str, workload: Sequence[int | str], timeout: float, run: Run = _run
) -> tuple[list[KernelProfile], str]:
    """The kernels of one profiled step and ``""``, or none and why; without the stall metrics where ncu refuses
    one of them (the retry's kernels, and that it retried)."""
    status, output = run(ncu_command(ncu, module, workload, METRICS), timeout)
    kernels = parse(output)
    if kernels:
        return kernels, ""
    why = _failure(status, output)
    status, output = run(ncu_command(ncu, module, workload, BASE_METRICS), timeout)
    kernels = parse(output)
    if kernels:
        return kernels, f"without the stall metrics ({why})"
    return [], f"{why}; without the stall metrics: {_failure(status, output)}"


def stalls_stage(runner: Runner, ncu: str | None = None, run: Run = _run) -> list[list[str]]:
    """Every workload of :data:`STALL_WORKLOADS` and module of :data:`MODULES` profiled before the deadline;
    ``cuda-stalls.md`` rewritten after each."""
    ncu = ncu if ncu is not None else shutil.which("ncu")
    done: list[list[str]] = []
    notes: list[str] = []
    for workload in STALL_WORKLOADS:
        for module in MODULES:
            label = [module, " ".join(map(str, workload))]
            absent = (
                NO_CUDA if runner.device != "cuda"
                else "n/a: ncu not found" if ncu is None
                else SKIPPED if runner.left() <= 0
                else None
            )  # fmt: skip
            if absent is not None:
                done.append([*label, absent, *["-"] * (len(STALL_COLUMNS) - 3)])
                continue
            kernels, why = profile(ncu, module, workload, min(PROFILE_SECONDS, runner.left()), run)
            rows = rows_of(module, workload, kernels)
            done += rows or [[*label, why or "no kernel", *["-"] * (len(STALL_COLUMNS) - 3)]]
            if why and rows:
                notes.append(f"- {module} {label[1]}: {why}")
            print(f"stalls {module} {label[1]}: {len(kernels)} kernels {why}", flush=True)
        write(runner, "cuda-stalls.md", header(runner, "What the recurrent kernels wait on (Nsight Compute)") + (
            "One training step per module and workload (cell B T input H, and the algorithm forced on "
            "lightning_bppsa's), float32, profiled by `ncu` after 3 warm-up steps (`benchmarks/kernel_stalls.py`); "
            f"kernels that took >= {SHOWN_SHARE:.0%} of the step's GPU time. ns / step and warp inst / step: per "
            "dependent step of T (instructions per warp of the launch); cycles / issue: a warp's cycles per "
            "issued instruction, the stalls its parts (ncu's `smsp__average_warps_issue_stalled_*`).\n\n"
            + markdown_table(STALL_COLUMNS, done)
            + ("\n" + "\n".join(notes) + "\n" if notes else "")
        ))  # fmt: skip
    return done


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=7, metavar=("MODULE", "CELL", "B", "T", "IN", "H", "ALGORITHM"),
                        help="one profiled step (what ncu runs)")  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.run:
        module, cell, *sizes, algorithm = args.run
        print(driver(module, (cell, *map(int, sizes), algorithm)), file=sys.stderr)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = Runner(device, None, time.monotonic() + 600, results=args.results,
                    command="python benchmarks/kernel_stalls.py")  # fmt: skip
    stalls_stage(runner)


if __name__ == "__main__":
    main()
