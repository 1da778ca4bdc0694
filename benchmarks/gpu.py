"""The CUDA scan kernels on a GPU: BPPSA (lightning_bppsa.nn) vs cuDNN, in one command.

First run on an H100 on 2026-11-26 (``results/cuda-gpu-h100-2026-11-26.md``, ``results/calib-h100-2026-11-26.csv``).

    python benchmarks/gpu.py --all --within 480  # GPU: every stage below, what fits in 8 minutes (see below)
    python benchmarks/gpu.py --device cpu --tiny --all --within 120  # CPU smoke mode of the same command
    python benchmarks/gpu.py --first-contact  # GPU: sanitizers, look-back stress, then the paper's grids (< 10 min)
    python benchmarks/gpu.py            # GPU: the paper's grids, writes benchmarks/results/cuda-gpu.md
    python benchmarks/gpu.py --quick    # GPU: the paper's headline rows only
    python benchmarks/gpu.py --plan     # no GPU needed: the model's predictions -> benchmarks/results/cuda-plan-gpu.md

On an H100 the whole of ``--all`` needed ~10 minutes on 2026-11-26 (tests/gpu ~75 s with a cold kernel
cache, the calibration grid ~5 minutes, the user cells ~2 minutes), more than one call of a lent GPU machine
(at most 10 minutes, 15 minutes of device time a session, a start ~1-2 minutes of it). On an H200 on
2026-11-27 tests/gpu (385 tests) took about a minute, the calibration grid's 72 shapes ~150 s, 19 of the 23 user
cells ~2 minutes; one call of every stage but the paper's grids fitted the device time with a margin (the
``stalls`` stage, added since, has not run on a GPU yet: ten ncu profiles, each bounded by PROFILE_SECONDS and
the deadline; what the deadline leaves no time for is written as skipped):

    python benchmarks/gpu.py --all --stages tests,host,step,fused,forward,stalls,overhead,chain,cells,calib --within 540

``--all`` runs the stages below, each writing its files under ``benchmarks/results/`` as it goes (a killed run
leaves what was finished), each headed by the device, torch, cuDNN, CuPy, the commit (``$BPPSA_COMMIT`` or
``git rev-parse``) and the time (UTC). Every stage checks the time left before each measurement and writes
"skipped: out of time" for what does not fit; timed functions run interleaved (A x N, B x N, ... over 3
rounds, N what the time allows, up to 20) after 3 warm-up calls, each call waited for (host time included).

1. ``cuda-tests.md``: ``pytest tests/gpu -q`` in a subprocess (at most 240 s, under pytest-xdist where installed): its summary line and failures.
2. ``cuda-step.md``: the whole training step (zero grads, forward, loss = sum of the last output step,
   backward) of torch.nn.RNN/GRU/LSTM (cuDNN) against lightning_bppsa.nn's with ``algorithm="auto"`` and
   the same weights, fifteen workloads incl. H = 128 / 256 for each cell (issue 28's targets), an LSTM of
   H = 160 and GRUs of 192 and 384 (on sm_90 those five gated layers' kernels run as clusters of blocks); the
   no-grad forward of both; the step captured in one CUDA graph, cuDNN's and the scan's (issue 29: the GPU's work
   without the host's); each one's gradient error against torch's module in float64; what "auto" chose
   (``last_stats["plan"]``); our "auto" module's step captured (H <= 64) and the decision the capture ran
   (the path the GPU's time alone chose: ``layer_plan.LayerPlan.captured``).
3. ``cuda-calib.csv`` / ``cuda-calib.md``: the calibration grid, RNN tanh input 1, d {8 .. 256} x B {1 .. 256}
   x T {100, 1000, 10000}, in the committed CSV's columns plus ``plan`` and ``note``: step and forward of
   both, the step with the scan forced linear / chunked, the scan kernel alone; the cheapest shapes first,
   forced scans and kernels that took > 50 ms per call in the committed data skipped.
4. ``cuda-gpu.md``: the paper's grids (below), with the time left.

Between 1 and 2: ``cuda-host.md`` (``benchmarks/host_path.py``: where a step's host time goes, torch's module and
ours with the scan forced: step waited for, host time to queue it, back to back, CUDA-graphed, syncs, kernels
and GPU busy per step, the profiler's and cProfile's tables). Between 2 and 3 (each with its own time
budget): ``cuda-fused.md`` (one layer call's backward by the fused backward kernel and by the factored scan
of the linear plan, on the same factors: whether the fused kernel should also replace the warp sweep),
``cuda-forward.md`` (``benchmarks/recurrent_forward_gpu.py``: the forward kernels alone against cuDNN's forward,
device time a call),
``cuda-stalls.md`` (``benchmarks/kernel_stalls.py``: Nsight Compute's profile of every kernel of one training
step, cuDNN's and ours, RNN / GRU / LSTM at H = 20 (linear) and the RNN at T = 10000 (chunked): ns and
instructions per dependent step, and the stall reasons a warp waits in), ``cuda-overhead.md`` (what our module adds where "auto"
keeps torch's layer: torch, torch again and ours, 10 interleaved rounds), ``cuda-chain.md``, VGG-11's
convolution chain, cuDNN autograd vs ``SparseChain``; and ``cells-gpu.md``, user-written cells
(``benchmarks/cells.py``'s, the style corpus included) at H = 32, B = 16, T = 1000: the whole training step
of autograd through the Python loop, ``Recurrence`` (its CUDA compiled loop) and JAX
``jit(value_and_grad(lax.scan))`` of the same cell math on the same GPU, each one's gradient error
against the float64 loop, the cells that do not fit in time written as skipped.

With ``--device cpu --tiny`` every stage runs on tiny shapes on the CPU, timed by the CPU clock (the
kernel-alone rows say "n/a: no CUDA"): a smoke test of the command, tested in tests/bench/test_gpu_command.py.

Grids (hidden 20, loss on the last step, as in the paper): RNN T sweep {10 .. 30000} at B = 16 and
1/B sweep B {2 .. 256} at T = 1000 (bitstream input, 1 feature); GRU S / M / L = (T, input) (259, 38),
(517, 24), (1034, 12) at B 16 / 32 / 64. Per row, same weights, one process: ``loss.backward()`` of
torch.nn.RNN/GRU (cuDNN) and of lightning_bppsa.nn.RNN/GRU (the scan on the CUDA kernels), each timed
alone on a fresh graph (its forward untimed; CUDA events, median); the scan kernel alone (sweep and chunked, the
launch ``launch_config`` computes) next to the model's prediction; peak CUDA memory of one forward +
backward.

The model (``--plan``; :func:`lightning_bppsa.cuda_cost_model.cuda_kernel_band`)
--------------------------------------------------------------------------------
Per launch, for B chains of n steps, state d, operand rows K (factored: K = m = k d; dense: K = d),
R = d (+1 for per-step gradients), chunk c, p = ceil(n / c) chunks: each step (a ``product`` in
scan.cu) costs the instructions its loops issue, counted in the SASS (per warp and iteration: tile
loads, FMA pairs, plus ~150 outside the loops), with every latency hidden (low) or one memory latency
per iteration (high).

- sweep (``bppsa_sweep_*``, 1 launch, B blocks; for d <= 32 ``bppsa_warpsweep_*``, one warp per row, state
  in registers, W loaded once): n dependent vector steps.
- chunked (``bppsa_chunked_*``, 1 launch + 1 memset of 1 + B p flags, B p blocks): c matrix steps
  (bounded below by the grid's issue rate), p dependent carries (a flag poll and one vector step with
  its operand from L2 each), then c vector steps.

The cuDNN baseline cannot be modelled; the plan compares with the paper's measured V100 baseline
(Appendix G, Table 4: (53.33 - 25.86) s per 2000 iterations = 13.7 ms per backward at B = 16,
T = 1000, i.e. ~13.7 us per step, and 404 ms at T = 30000) and says what an H100 cuDNN would have to
exceed for each target to fail. What the plan predicts is written to
``results/cuda-plan-gpu.md`` with the registers per kernel (ptxas, sm_80 / sm_90).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime
import importlib.util
import io
import itertools
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also where loaded by path
from device_runner import (
    NO_CUDA,
    RESULTS,
    ROOT,
    SKIPPED,
    WARMUP,
    Backward,
    Runner,
    cuda_peak_bytes,
    header,
    interleaved,
    markdown_table,
    ms_text,
    ratio_text,
    train_step,
    write,
)
from device_runner import commit as _commit  # noqa: F401 - tests/bench/test_gpu_command.py clears its cache
from host_path import HostWorkload, graphed_seconds, host_stage, python_profile
from kernel_stalls import stalls_stage
from recurrent_forward_gpu import forward_stage

HIDDEN = 20
RNN_LENGTHS = (10, 30, 100, 300, 1000, 3000, 10000, 30000)
RNN_BATCHES = (2, 4, 8, 16, 32, 64, 128, 256)
GRU_SIZES = {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}
GRU_BATCHES = (16, 32, 64)
#: the paper's V100 cuDNN backward per step (Table 4, B = 16): (53.33 - 25.86) s / 2000 iterations / 1000 steps
PAPER_V100_SECONDS_PER_STEP = (53.33 - 25.86) / 2000 / 1000
TARGETS = {"RNN T=1000": 100.0, "RNN T=30000": 300.0, "GRU L": 30.0}


def rows(quick: bool) -> list[tuple[str, int, int, int]]:
    """(cell, B, T, input) of every row of the paper's grids."""
    if quick:
        return [("RNN", 16, 1000, 1), ("RNN", 16, 30000, 1), ("GRU", 64, 1034, 12)]
    grid = [("RNN", 16, t, 1) for t in RNN_LENGTHS]
    grid += [("RNN", b, 1000, 1) for b in RNN_BATCHES if b != 16]
    grid += [("GRU", b, t, i) for (t, i) in GRU_SIZES.values() for b in GRU_BATCHES]
    return grid


# --------------------------------------------------------------------------------------------------
# Where, on what and until when the stages measure
# --------------------------------------------------------------------------------------------------

#: the calibration grid's whole steps (cuDNN, its copy, ours) run this many times the shapes' rounds: host-bound
#: steps at T = 100 drift between rounds; the budget is the same, the interleaving finer
STEP_ROUNDS = 3


def calib_step_rounds(runner: Runner) -> int:
    """The interleaved rounds of the calibration grid's whole steps."""
    return STEP_ROUNDS * runner.shapes.rounds


#: a forced-scan or kernel-alone measurement whose one call took longer than this on the H100 is skipped
SLOW_MS = 50.0
COMMITTED_CALIB = RESULTS / "calib-h100-2026-11-26.csv"
#: the committed calibration CSV's columns, then what this command adds: what "auto" chose, why a row has no ms
CALIB_COLUMNS = ("what", "cell", "d", "B", "T", "algorithm", "chunk", "ms", "plan", "note")
#: each stage's share of ``--all``'s time: a stage may use its share of the time left when it starts, among
#: the stages still to run (what one leaves unused goes to those after it); a whole run needs ~10 minutes
#: of an H100 (two calls of <= 5 minutes: see the module docstring)
STAGE_SHARES = {
    "tests": 0.15, "host": 0.1, "step": 0.15, "fused": 0.05, "forward": 0.05, "stalls": 0.1, "overhead": 0.05,
    "chain": 0.05, "cells": 0.2, "calib": 0.3, "paper": 0.05,
}  # fmt: skip
#: every stage of ``--all`` in its order (``paper``: the paper's grids)
STAGES = tuple(STAGE_SHARES)
#: the share of ``--within`` kept back for starting up, writing the files and a measurement that overruns
MARGIN = 0.05
#: tests/gpu took 83 s with a cold kernel cache on an H200 once (353 tests), > 150 s at a4e83a3 (~400 tests) in
#: one process, and > 240 s at 20dff7a under 14 xdist workers of 16 torch threads each (374 of 398 passed, none
#: failed, when stopped: float64 CPU references crawling on oversubscribed cores)
TESTS_SECONDS = 240.0
#: pytest-xdist's workers where it is installed (the lent GPU machines have it, and 16 cores), one CPU thread each
#: (:data:`ONE_THREAD`): all cores but two. The tests' time goes to float64 CPU references and per-shape
#: kernels; their NVRTC compiles take 0.1-5 s each (sm_90, this repository's CPU)
TEST_WORKERS = ("-n", str(max(1, min(14, (os.cpu_count() or 1) - 2)))) if importlib.util.find_spec("xdist") else ()
#: the CPU threads each test process may use (OpenMP's, MKL's, torch's intra-op pool reads OMP_NUM_THREADS)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TESTS_COMMAND = (
    sys.executable,
    "-m",
    "pytest",
    "tests/gpu",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:benchmark",  # pytest-benchmark's warning under xdist, once per test, buried the output's tail
    *TEST_WORKERS,
)  # -q: pyproject's addopts (-qq hides the count)

Workload = tuple[str, int, int, int, int]  # (cell, B, T, input, H)


@dataclass(frozen=True)
class Shapes:
    """The workloads of every stage of ``--all``."""

    step: tuple[Workload, ...]
    calib_d: tuple[int, ...]
    calib_batch: tuple[int, ...]
    calib_length: tuple[int, ...]
    kernel_chunks: tuple[int, ...]  # the chunked kernel-alone rows: those chunk sizes below T
    paper: tuple[tuple[str, int, int, int], ...]  # (cell, B, T, input)
    paper_hidden: int
    max_steps: int  # timed calls of each function per round, at most
    chain: tuple[tuple[str, int, int], ...] = ()  # VGG-11's conv chain: (weights, B, channel divisor)
    overhead: tuple[Workload, ...] = ()  # where "auto" keeps torch's layer: what our module adds to it
    cells: tuple[int, int, int] = (32, 16, 1000)  # the user-cells stage: (H, B, T) of every cell
    cell_names: tuple[str, ...] = ()  # ... and which cells (benchmarks/cells.py's names; all where empty)
    host: tuple[
        HostWorkload, ...
    ] = ()  # the host-path stage: (cell, B, T, input, H, algorithm forced on ours)
    fused: tuple[tuple[str, int, int, int], ...] = ()  # the fused-backward stage: (cell, B, T, H)
    rounds: int = 3


GPU_SHAPES = Shapes(
    step=(
        ("RNN", 16, 1000, 1, 20), ("RNN", 1, 1000, 1, 20), ("RNN", 16, 10000, 1, 20), ("RNN", 256, 1000, 1, 20),
        ("GRU", 16, 1034, 12, 20), ("GRU", 64, 1034, 12, 20), ("LSTM", 16, 1034, 12, 20),
        ("RNN", 16, 1000, 32, 128), ("GRU", 16, 1000, 32, 128), ("LSTM", 16, 1000, 32, 128),
        ("GRU", 16, 1000, 32, 256), ("LSTM", 32, 1000, 64, 256),
        ("GRU", 16, 1000, 32, 192), ("LSTM", 16, 1000, 32, 160),  # clusters of 2 blocks on sm_90 (of 4 above)
        ("GRU", 16, 1000, 32, 384),  # 8 blocks, beyond one block's 256 threads
    ),
    calib_d=(8, 20, 32, 64, 128, 256),
    calib_batch=(1, 16, 64, 256),
    calib_length=(100, 1000, 10000),
    kernel_chunks=(16, 64, 256),
    paper=tuple(rows(quick=False)),
    paper_hidden=HIDDEN,
    max_steps=20,
    chain=(("dense", 1, 1), ("dense", 16, 1), ("pruned 97%", 1, 1), ("pruned 97%", 16, 1)),
    overhead=(
        ("RNN", 16, 100, 1, 32), ("RNN", 64, 100, 1, 32), ("RNN", 16, 100, 1, 64), ("RNN", 64, 100, 1, 8),
        ("GRU", 16, 1034, 12, 20), ("LSTM", 16, 1034, 12, 20), ("RNN", 16, 1000, 32, 128),
    ),
    host=(
        ("RNN", 16, 1000, 1, 20, "linear"), ("RNN", 16, 1000, 1, 20, "chunked"), ("GRU", 16, 1034, 12, 20, "linear"),
        ("LSTM", 16, 1034, 12, 20, "linear"),
    ),
    fused=(
        ("RNN", 16, 1000, 20), ("RNN", 256, 1000, 20), ("GRU", 16, 1034, 20), ("GRU", 64, 1034, 20),
        ("LSTM", 16, 1034, 20), ("RNN", 16, 1000, 64), ("GRU", 16, 1000, 64), ("LSTM", 16, 1000, 64),
    ),
)  # fmt: skip
#: the smoke mode (``--device cpu --tiny``): every stage, on shapes a CPU runs in seconds
TINY_SHAPES = Shapes(
    step=(("RNN", 2, 6, 1, 3), ("GRU", 2, 5, 2, 3), ("LSTM", 2, 5, 2, 3)),
    calib_d=(2, 3),
    calib_batch=(1, 2),
    calib_length=(4, 9),
    kernel_chunks=(2, 4),
    paper=(("RNN", 2, 6, 1), ("GRU", 2, 5, 3)),
    paper_hidden=4,
    max_steps=2,
    chain=(("dense", 1, 16), ("pruned 97%", 2, 16)),
    overhead=(("RNN", 2, 6, 1, 3),),
    cells=(3, 2, 5),
    cell_names=("gated",),
    host=(("RNN", 2, 6, 1, 3, "linear"),),
    fused=(("RNN", 2, 5, 3), ("GRU", 2, 5, 3), ("LSTM", 2, 5, 3)),  # each cell: RNN is torch.nn.RNN (mode RNN_TANH)
)


# --------------------------------------------------------------------------------------------------
# What is measured: modules, steps, kernels
# --------------------------------------------------------------------------------------------------


def _bppsa(ref: nn.RNNBase, algorithm: str) -> nn.Module:
    """lightning_bppsa.nn's module of ``ref``'s class and sizes (batch first), with ``ref``'s weights."""
    from lightning_bppsa import nn as bnn

    module = getattr(bnn, type(ref).__name__)(
        ref.input_size, ref.hidden_size, batch_first=True, algorithm=algorithm
    )
    module.load_state_dict(ref.state_dict())
    return module.to(ref.weight_hh_l0.device)


def _copy_of(ref: nn.RNNBase) -> nn.RNNBase:
    """A second copy of torch's module, its weights in one flat buffer as the original's (a deep copy's are
    not: cuDNN would compact them on every call, ~150-300 us a step on an H200 host)."""
    again = copy.deepcopy(ref)
    again.flatten_parameters()
    return again


def _pair(cell: str, inputs: int, hidden: int, batch: int, length: int, device: str):
    """(torch's module, lightning_bppsa's with ``algorithm="auto"`` and the same weights, a batch-first input);
    with one input feature the input is the bitstream task of Sec. 4.1."""
    torch.manual_seed(0)
    ref = getattr(nn, cell)(inputs, hidden, batch_first=True).to(device)
    x = torch.randn(batch, length, inputs, device=device)
    return ref, _bppsa(ref, "auto"), (x > 0.5).float() if inputs == 1 else x


def no_grad_forward(module: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """The module's forward without gradients (inference)."""

    def forward() -> None:
        with torch.no_grad():
            module(x)

    return forward


def _grads(module: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameters' gradients (float64) after one training step."""
    train_step(module, x)()
    return {name: p.grad.detach().double() for name, p in module.named_parameters()}


def grad_relerr(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest ``|g - g64| / |g64|`` (norms) over the parameters."""
    errors = []
    for name, exact in reference.items():
        diff, size = (
            torch.linalg.vector_norm(grads[name] - exact).item(),
            torch.linalg.vector_norm(exact).item(),
        )
        errors.append(diff / size if size > 0 else (0.0 if diff == 0 else math.inf))
    return max(errors)


def plan_columns(plan: str, length: int) -> tuple[str, str]:
    """(algorithm, chunk) of a ``last_stats["plan"]``: ``"scan chunked(c=64) [cuda]"`` -> ("chunked", "64"),
    ``"scan linear [cuda]"`` -> ("linear", T) as the committed CSV writes it; ("", "") for any other path."""
    if not plan.startswith("scan "):
        return "", ""
    chunked = re.search(r"\bchunked\(c=(\d+)\)", plan)
    if chunked:
        return "chunked", chunked.group(1)
    found = re.search(r"\b(linear|blelloch)\b", plan)
    return (found.group(1), str(length) if found.group(1) == "linear" else "") if found else ("", "")


def _factors(cell: str, hidden: int, batch: int, length: int, device: str):
    """Factored Jacobians of one layer's shape, contracting like a trained RNN's: (weight, scales, diagonal, grad)."""
    tiles = 3 if cell == "GRU" else 1
    weight = torch.randn(tiles * hidden, hidden, device=device) / hidden**0.5
    scales = torch.rand(batch, length, tiles * hidden, device=device)
    diagonal = torch.rand(batch, length, hidden, device=device) if cell == "GRU" else None
    return weight, scales, diagonal, torch.randn(batch, hidden, device=device)


def _kernel_call(factors: tuple, algorithm: str, chunk: int) -> Callable[[], object]:
    """One launch of the scan kernel alone (``kernels.cuda.scan_factored``) on ``factors``."""
    from lightning_bppsa.kernels import cuda as kernels

    return lambda: kernels.scan_factored(*factors, algorithm, chunk)


def _fused_refusal(hidden: int) -> str | None:
    """Why the fused RNN backward kernel (float32) cannot launch at ``hidden`` on this device (``None``: it can)."""
    from lightning_bppsa.kernels import cuda as kernels
    from lightning_bppsa.kernels import recurrent_cuda

    if not torch.cuda.is_available():
        return NO_CUDA
    limit = kernels.device_shared_limit(torch.cuda.current_device())
    return recurrent_cuda.backward_refusal("rnn_tanh", hidden, torch.float32, limit)


def _fused_call(batch: int, length: int, hidden: int, device: str) -> Callable[[], object] | str:
    """One launch of the fused RNN backward kernel alone (``recurrent_cuda.rnn_backward``) on contracting random
    states, or why it cannot launch on this device."""
    from lightning_bppsa.kernels import recurrent_cuda

    if (refused := _fused_refusal(hidden)) is not None:
        return f"refused: {refused}"
    out = torch.rand(batch, length, hidden, device=device) * 2 - 1
    weight = torch.randn(hidden, hidden, device=device) / hidden**0.5
    grad = torch.randn(batch, length, hidden, device=device)
    return lambda: recurrent_cuda.rnn_backward(out, weight, grad, False)


# --------------------------------------------------------------------------------------------------
# Stage 1: tests/gpu
# --------------------------------------------------------------------------------------------------


def _refusal(algorithm: str, d: int, chunk: int, length: int) -> str | None:
    """Why the CUDA kernels cannot launch a kernel-alone row (the launcher raises rather than run another
    schedule); ``None`` where they can."""
    from lightning_bppsa.kernels import cuda as kernels

    if algorithm == "linear" or chunk >= length:
        return None
    return kernels.refusal(
        algorithm, d=d, element_bytes=4, shared_limit=kernels.current_shared_limit(), affine=False
    )


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def logged_tests_summary(path: Path, slowest: int = 15) -> str:
    """What the tests' log (``tests/gpu/conftest.py``'s ``BPPSA_TEST_LOG``: phase, outcome, seconds, test a line)
    says in markdown: the outcomes so far and the slowest tests; ``""`` where nothing was logged."""
    if not path.exists():
        return ""
    reports = {}
    for line in path.read_text().splitlines():
        when, outcome, seconds, nodeid = line.split("\t", 3)
        reports[(nodeid, when)] = (outcome, float(seconds))  # a test logged twice (xdist): one entry
    counts = Counter(outcome for outcome, _ in reports.values())
    tally = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    ranked = sorted(((seconds, nodeid, when) for (nodeid, when), (_, seconds) in reports.items()), reverse=True)
    lines = [f"- {seconds:.1f} s `{nodeid}` ({when})" for seconds, nodeid, when in ranked[:slowest]]
    return f"\n## Logged as they finished\n\n{tally} (test phases)\n\nSlowest:\n\n" + "\n".join(lines) + "\n"


def tests_stage(runner: Runner, command: Sequence[str] = TESTS_COMMAND, limit: float = TESTS_SECONDS) -> str:
    """``pytest tests/gpu -q`` in a subprocess, stopped after ``limit`` seconds or at the deadline; writes
    ``cuda-tests.md`` (summary line, failures, the output's tail, and from the tests' own log the outcomes and
    the slowest tests, also of a stopped run) and returns the summary line."""
    timeout, output = min(limit, runner.left()), ""
    runner.results.mkdir(parents=True, exist_ok=True)
    log = runner.results / "cuda-tests-log.txt"
    log.unlink(missing_ok=True)
    if timeout <= 0:
        summary = SKIPPED
    else:
        try:
            # pytest cuts its FAILED lines at the terminal's width; the log: tests/gpu/conftest.py; one CPU
            # thread a worker: 14 xdist workers of 16 threads each made the tests' float64 CPU references
            # crawl (an H200 at 20dff7a: a T=1000 H=100 test 184 s, most scan tests ~28 s each)
            wide = {**os.environ, "COLUMNS": "240", "BPPSA_TEST_LOG": str(log), **ONE_THREAD}
            done = subprocess.run(
                list(command), capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=wide
            )
        except subprocess.TimeoutExpired as stopped:
            output = _text(stopped.stdout) + _text(stopped.stderr)
            summary = f"stopped: did not finish in {timeout:.1f} s"
        else:
            output = done.stdout + done.stderr
            last = next((line for line in reversed(done.stdout.splitlines()) if line.strip()), "no output")
            summary = f"exit {done.returncode}: {last.strip(' =')}"
    failures = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    text = header(runner, "tests/gpu") + f"`{shlex.join(command)}`\n\n**{summary}**\n"
    if failures:
        text += "\n## Failures\n\n" + "\n".join(f"- `{line}`" for line in failures) + "\n"
    text += logged_tests_summary(log)
    if output and not summary.startswith("exit 0"):
        text += "\n## Output (last 3000 characters)\n\n```\n" + output[-3000:] + "\n```\n"
    write(runner, "cuda-tests.md", text)
    print(f"tests/gpu: {summary}", flush=True)
    return summary


# --------------------------------------------------------------------------------------------------
# Stage 2: the whole-step table
# --------------------------------------------------------------------------------------------------

STEP_COLUMNS = (
    "cell", "B", "T", "in", "H", "cuDNN step ms", "BPPSA step ms", "step speedup", "cuDNN fwd ms", "BPPSA fwd ms",
    "cuDNN graphed ms", "scan graphed ms", "graphed speedup", "cuDNN grad relerr", "BPPSA grad relerr", "BPPSA plan",
    "auto graphed ms", "auto's decision in a capture",
)  # fmt: skip
#: the widest layer whose scan is captured in the graphed columns (wider: a forced scan's step takes tens of ms)
GRAPHED_MAX_HIDDEN = 64


def step_row(runner: Runner, workload: Workload, budget: float) -> list[str]:
    """One row of the whole-step table (cells in :data:`STEP_COLUMNS` order), measured within ``budget`` seconds."""
    cell, batch, length, inputs, hidden = workload
    ref, ours, x = _pair(cell, inputs, hidden, batch, length, runner.device)
    step = interleaved(runner, {"cudnn": train_step(ref, x), "bppsa": train_step(ours, x)}, 0.7 * budget)
    if isinstance(step["bppsa"], str):
        return [*map(str, workload), *[step["bppsa"]] * (len(STEP_COLUMNS) - len(workload))]
    plan = ours.last_stats.get("plan", "")
    forward = interleaved(
        runner, {"cudnn": no_grad_forward(ref, x), "bppsa": no_grad_forward(ours, x)}, 0.2 * budget
    )
    graphed = _graphed(runner, ref, x, plan, hidden)
    captured = _auto_captured(runner, ours, x, hidden)
    if runner.left() > 0:
        reference = _grads(copy.deepcopy(ref).double(), x.double())  # float64 cuDNN (float64 torch on a CPU)
        errors = [f"{grad_relerr(_grads(module, x), reference):.1e}" for module in (ref, ours)]
    else:
        errors = [SKIPPED] * 2
    return [
        *map(str, workload), ms_text(step["cudnn"]), ms_text(step["bppsa"]), ratio_text(step["cudnn"], step["bppsa"]),
        ms_text(forward["cudnn"]), ms_text(forward["bppsa"]), ms_text(graphed["cudnn"]), ms_text(graphed["scan"]),
        ratio_text(graphed["cudnn"], graphed["scan"]), *errors, plan, ms_text(captured[0]), captured[1],
    ]  # fmt: skip


def _auto_captured(runner: Runner, ours: nn.RNNBase, x: torch.Tensor, hidden: int) -> tuple[float | str, str]:
    """Seconds per replay of our ``"auto"`` module's whole step captured in one CUDA graph (its shape measured by
    the row's eager steps: a capture runs the path the GPU's time alone chose), and the decision it ran."""
    if runner.device != "cuda":
        return NO_CUDA, "-"
    if runner.left() <= 0:
        return SKIPPED, "-"
    if hidden > GRAPHED_MAX_HIDDEN:
        return f"not captured: H > {GRAPHED_MAX_HIDDEN}", "-"
    seconds = graphed_seconds(ours, x)
    return seconds, ours.last_stats.get("decision", "")


def _graphed(runner: Runner, ref: nn.RNNBase, x: torch.Tensor, plan: str, hidden: int) -> dict[str, float | str]:
    """Seconds per replay of the whole step captured in one CUDA graph (the host's Python gone: the GPU's work)
    of cuDNN's module and of ours with the scan named (the plan's algorithm where "auto" ran the scan, else
    linear: "auto" decides on eager steps; linear where its backward is the fused kernel), or why not measured."""
    if runner.device != "cuda":
        return dict.fromkeys(("cudnn", "scan"), NO_CUDA)
    if runner.left() <= 0:
        return dict.fromkeys(("cudnn", "scan"), SKIPPED)
    if hidden > GRAPHED_MAX_HIDDEN:
        why = f"not captured: H > {GRAPHED_MAX_HIDDEN} (a forced scan's step takes tens of ms)"
        return {"cudnn": graphed_seconds(ref, x), "scan": why}
    # a chunked plan whose first backward measured the fused kernel faster runs that kernel: linear's
    chunked = plan.startswith("scan chunked") and "fused backward kernel" not in plan
    return {"cudnn": graphed_seconds(ref, x), "scan": graphed_seconds(_bppsa(ref, "chunked" if chunked else "linear"), x)}


def step_stage(runner: Runner) -> list[list[str]]:
    """The whole-step table: every workload of ``shapes.step``, the file ``cuda-step.md`` rewritten after each row."""
    workloads = runner.shapes.step
    done: list[list[str]] = []
    for index, workload in enumerate(workloads):
        done.append(step_row(runner, workload, max(runner.left(), 0) / (len(workloads) - index)))
        print("step " + " | ".join(done[-1]), flush=True)
        write(runner, "cuda-step.md", _step_table(runner, done, len(workloads)))
    if not workloads:
        write(runner, "cuda-step.md", _step_table(runner, done, 0))
    return done


def _step_table(runner: Runner, done: list[list[str]], total: int) -> str:
    rounds, steps = runner.shapes.rounds, runner.shapes.max_steps
    return header(runner, 'Whole training step: torch (cuDNN) vs lightning_bppsa (algorithm="auto")') + (
        "torch.nn.RNN/GRU/LSTM vs lightning_bppsa.nn.RNN/GRU/LSTM (\"auto\"), same weights (load_state_dict), float32. "
        "Step = zero the gradients, forward, loss = sum of the last output step, backward. "
        f"Median of {rounds} interleaved rounds of up to {steps} steps each after {WARMUP} warm-up steps, {runner.timer}; "
        "fwd = no-grad forward. Grad relerr = max over parameters of |g - g64| / |g64| against torch's module "
        "in float64 (cuDNN on a GPU). BPPSA plan = `last_stats[\"plan\"]` after a step; speedup = cuDNN / BPPSA. "
        "Graphed: the whole step captured in one CUDA graph, per replay (the host's time gone), cuDNN's module and "
        "ours with the scan named (the plan's algorithm where auto ran the scan, else linear; not where "
        f"H > {GRAPHED_MAX_HIDDEN}).\n\n"
        f"Rows done: {len(done)} of {total} (a skipped row says why).\n\n"
        + markdown_table(STEP_COLUMNS, done)
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Stage 2a: what our module adds where "auto" keeps torch's layer
# --------------------------------------------------------------------------------------------------

FUSED_COLUMNS = (
    "cell", "B", "T", "H", "fused backward ms", "factored scan backward ms", "fused speedup", "factored scan plan",
    "max rel diff",
)  # fmt: skip


def _fused_backend(device: str):
    """The CUDA kernels' backend on a GPU; elsewhere the same backend over their host emulation (CPU tensors:
    the smoke mode runs the stage's code, its times are the emulator's)."""
    from lightning_bppsa.kernels import recurrent_emulated
    from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES

    from lightning_bppsa import backends

    if device == "cuda":
        return backends.CUDA
    return backends.CudaBackend(recurrent_emulated, device, lambda _: SM80_OPTIN_SHARED_BYTES, lambda: (True, ""))


def fused_row(runner: Runner, workload: tuple[str, int, int, int], budget: float) -> list[str]:
    """One row of :data:`FUSED_COLUMNS`: the backward of one layer call (``backends.backward``: kernels, gate
    gradients, Eq. 2's GEMMs, an output gradient on every step) by the fused kernel and by the factored scan
    of the linear plan (the warp sweep for RNN / GRU with H <= 32, else the block sweep), on the same
    forward kernel's factors."""
    from lightning_bppsa import backends
    from lightning_bppsa.cells import cell_of

    kind, batch, length, hidden = workload
    backend, device = _fused_backend(runner.device), runner.device
    torch.manual_seed(0)
    layer = getattr(nn, kind)(12, hidden, batch_first=True).to(device)
    cell, weights = cell_of(layer.mode), [p.detach() for p in layer.parameters()]  # torch's mode: RNN_TANH, GRU, ...
    x = torch.randn(batch, length, 12, device=device)
    h0 = torch.randn(batch, hidden, device=device) / 2
    c0 = torch.randn(batch, hidden, device=device) / 2 if cell.has_cell_state else None
    results = backend.forward(cell, x, h0, c0, weights)
    out, factors = results[0], results[2 if cell.has_cell_state else 1 :]
    grad_out = torch.randn_like(out)
    scan = backends.scan_plan(cell, "linear", batch=batch, n=length, hidden=hidden, device=device,
                              dtype=torch.float32)  # fmt: skip

    def backward(second: object) -> Callable[[], list[torch.Tensor]]:
        call = backends.LayerCall(backend, second, scan)
        return lambda: backends.backward(cell, "linear", call, x, h0, c0, weights, out, factors, grad_out, None, None)

    calls = {"fused": backward(backend.fused), "scan": backward(backends.TORCH)}
    diff = max(
        float((a - b).norm() / b.norm().clamp_min(1e-30))
        for a, b in zip(calls["fused"](), calls["scan"](), strict=True)
    )
    times = interleaved(runner, calls, budget)
    return [kind, str(batch), str(length), str(hidden), ms_text(times["fused"]), ms_text(times["scan"]),
            ratio_text(times["scan"], times["fused"]), scan.text, f"{diff:.1e}"]  # fmt: skip


def fused_stage(runner: Runner) -> list[list[str]]:
    """:func:`fused_row` of every workload of ``shapes.fused``, ``cuda-fused.md`` rewritten after each: whether
    the fused backward kernel should also replace the warp sweep (today it runs only where the factored scan
    would not be warp-resident: an LSTM, or H > 32)."""
    workloads = runner.shapes.fused
    done: list[list[str]] = []
    for index, workload in enumerate(workloads):
        done.append(fused_row(runner, workload, 0.9 * max(runner.left(), 0) / (len(workloads) - index)))
        print("fused " + " | ".join(done[-1]), flush=True)
        write(runner, "cuda-fused.md", header(runner, "The fused backward kernel vs the factored scan") + (
            "Backward of one layer call (`backends.backward`: the kernels, the gate gradients, the GEMMs of Eq. 2; an "
            "output gradient on every step, input 12, float32) on the same forward kernel's factors, by the fused "
            "kernel (`recurrent_cuda.<cell>_backward`) and by the factored scan of the linear plan; median of "
            f"{runner.shapes.rounds} interleaved rounds after {WARMUP} warm-up calls, {runner.timer}. Max rel diff: "
            "the largest norm-wise difference of the two's gradients.\n\n" + markdown_table(FUSED_COLUMNS, done)
        ))  # fmt: skip
    return done


OVERHEAD_COLUMNS = (
    "cell", "B", "T", "in", "H", "torch step ms", "torch again ms", "BPPSA step ms", "BPPSA - torch us",
    "torch again - torch us", "BPPSA plan",
)  # fmt: skip
#: interleaved rounds per workload: the differences sought (~10 us) are below one round's spread
OVERHEAD_ROUNDS = 10


def overhead_row(runner: Runner, workload: Workload, budget: float) -> list[str]:
    """One row of :data:`OVERHEAD_COLUMNS`: torch's module, a second copy of it (how far two runs of the same
    code differ here) and ours (``"auto"``), interleaved, within ``budget`` seconds."""
    cell, batch, length, inputs, hidden = workload
    ref, ours, x = _pair(cell, inputs, hidden, batch, length, runner.device)
    rounds = runner.with_rounds(OVERHEAD_ROUNDS)
    calls = {
        "torch": train_step(ref, x),
        "again": train_step(_copy_of(ref), x),
        "bppsa": train_step(ours, x),
    }
    times = interleaved(rounds, calls, budget)
    if any(isinstance(t, str) for t in times.values()):
        return [*map(str, workload), *[times["bppsa"]] * (len(OVERHEAD_COLUMNS) - len(workload))]
    return [
        *map(str, workload), *(ms_text(times[name]) for name in calls),
        f"{(times['bppsa'] - times['torch']) * 1e6:.0f}", f"{(times['again'] - times['torch']) * 1e6:.0f}",
        ours.last_stats.get("plan", ""),
    ]  # fmt: skip


def overhead_stage(runner: Runner) -> list[list[str]]:
    """:func:`overhead_row` of every workload of ``shapes.overhead``, ``cuda-overhead.md`` rewritten after each."""
    workloads = runner.shapes.overhead
    done: list[list[str]] = []
    profiles = ""
    for index, workload in enumerate(workloads):
        done.append(overhead_row(runner, workload, 0.9 * max(runner.left(), 0) / (len(workloads) - index)))
        print("overhead " + " | ".join(done[-1]), flush=True)
        if index == 0 and runner.left() > 0:
            profiles = _overhead_profiles(runner, workload)
        write(runner, "cuda-overhead.md", header(runner, 'What lightning_bppsa adds where "auto" keeps torch\'s layer') + (
            "Whole training step (as in `cuda-step.md`) of torch's module, of a second copy of it (the spread of two "
            f"runs of the same code) and of lightning_bppsa's (\"auto\"), median of {OVERHEAD_ROUNDS} interleaved "
            f"rounds after {WARMUP} warm-up steps, {runner.timer}. Where the plan is torch's layer (autograd), "
            "BPPSA - torch is what our module adds per step.\n\n"
            f"Rows done: {len(done)} of {len(workloads)}.\n\n" + markdown_table(OVERHEAD_COLUMNS, done) + profiles
        ))  # fmt: skip
    return done


def _overhead_profiles(runner: Runner, workload: Workload) -> str:
    """cProfile of the first workload's steps, torch's module and ours: where ours spends what it adds."""
    cell, batch, length, inputs, hidden = workload
    ref, ours, x = _pair(cell, inputs, hidden, batch, length, runner.device)
    text = ""
    for name, module in (("torch's module", ref), ('lightning_bppsa\'s ("auto")', ours)):
        step = train_step(module, x)
        for _ in range(WARMUP):
            step()
        text += f"\n## cProfile of {name}, {cell} B={batch} T={length}\n\n```\n{python_profile(step, runner.device)}```\n"
    return text


# --------------------------------------------------------------------------------------------------
# Stage 2b: layer chains (SparseChain, VGG-11's convolutions)
# --------------------------------------------------------------------------------------------------

CHAIN_COLUMNS = (
    "weights", "B", "cuDNN fwd+bwd ms", "cuDNN again ms", "SparseChain fwd+bwd ms", "speedup", "SparseChain path",
)  # fmt: skip


def chain_stage(runner: Runner) -> list[list[str]]:
    """cuDNN autograd vs ``convert``'s SparseChain (``algorithm="auto"``) on VGG-11's conv chain (32x32 input,
    paper Sec. 5.3), forward + backward of a fixed output gradient; ``cuda-chain.md`` rewritten after each row."""
    from lightning_bppsa.bench.vgg import _step as chain_step
    from lightning_bppsa.bench.vgg import build_case
    from lightning_bppsa.nn import SparseChain

    done: list[list[str]] = []
    for index, (weights, batch, divisor) in enumerate(runner.shapes.chain):
        model, x, grad = build_case(weights, batch, width=divisor)
        ref = model.to(runner.device)
        ours = SparseChain.from_sequential(copy.deepcopy(ref))
        x, grad = x.detach().to(runner.device).requires_grad_(), grad.to(runner.device)
        budget = max(runner.left(), 0) / (len(runner.shapes.chain) - index)
        calls = {"cudnn": chain_step(ref, x, grad), "again": chain_step(copy.deepcopy(ref), x, grad),
                 "bppsa": chain_step(ours, x, grad)}  # fmt: skip
        times = interleaved(runner, calls, 0.9 * budget)
        stats = ours.last_stats
        why = stats.get("reason") or stats.get("decision")  # auto's measured decision where the scan ran
        path = stats.get("path", "") + (f" ({why})" if why else "")
        done.append([weights, str(batch), ms_text(times["cudnn"]), ms_text(times["again"]), ms_text(times["bppsa"]),
                     ratio_text(times["cudnn"], times["bppsa"]), path])  # fmt: skip
        print("chain " + " | ".join(done[-1]), flush=True)
        write(runner, "cuda-chain.md", header(runner, "Layer chains: cuDNN autograd vs SparseChain (auto)") + (
            "VGG-11's 8 convolutions + ReLUs + 5 max-pools (`lightning_bppsa.bench.vgg.build_case`), float32, "
            f"median of {runner.shapes.rounds} interleaved rounds after {WARMUP} warm-up calls, {runner.timer}; "
            "cuDNN again: a second copy of the same torch model (how far two runs of the same code differ).\n\n"
            + markdown_table(CHAIN_COLUMNS, done)
        ))  # fmt: skip
    return done


# --------------------------------------------------------------------------------------------------
# Stage 2c: user-written cells (benchmarks/cells.py)
# --------------------------------------------------------------------------------------------------


def cells_stage(runner: Runner) -> list[list[str]]:
    """``benchmarks/cells.py``'s table on the runner's device, whole step only, the cells in ``shapes.cells``'s
    size (the headline cells first): ``cells-gpu.md`` rewritten per row (like every file of this command, also in
    the smoke mode: ``cells-cpu.md`` is ``benchmarks/cells.py``'s own CPU table)."""
    import cells  # a sibling module (the path is set above); imported here since it loads JAX and the corpus

    hidden, batch, length = runner.shapes.cells
    names = runner.shapes.cell_names or (*cells.QUICK, *(n for n in cells.CELLS if n not in cells.QUICK))
    shapes = cells.CellRows(cells.rows_of(names, hidden, batch, length), quantities=("step",), rounds=3)
    return cells.device_table(dataclasses.replace(runner, shapes=shapes), name="cells-gpu.md")


# --------------------------------------------------------------------------------------------------
# Stage 3: the calibration grid
# --------------------------------------------------------------------------------------------------


class CommittedTimes:
    """Milliseconds of one call of each measurement of a committed calibration CSV (the H100's)."""

    def __init__(self, rows: Iterable[dict[str, str]]):
        self._ms: dict[tuple, float] = {}
        for row in rows:
            if row["ms"]:
                key = self._key(row["what"], int(row["d"]), int(row["B"]), row["algorithm"], row["chunk"])
                self._ms[key + (int(row["T"]),)] = float(row["ms"])

    @classmethod
    def load(cls, path: Path) -> CommittedTimes:
        """The rows of ``path`` (columns ``what,cell,d,B,T,algorithm,chunk,ms``)."""
        if not path.is_file():
            raise FileNotFoundError(f"the committed calibration data is missing: {path}")
        with path.open(newline="") as f:
            return cls(csv.DictReader(f))

    @staticmethod
    def _key(what: str, d: int, batch: int, algorithm: str, chunk: str | int) -> tuple:
        return what, d, batch, algorithm, "" if algorithm == "linear" else str(chunk)  # linear's chunk is T

    def ms(
        self, what: str, d: int, batch: int, length: int, algorithm: str = "", chunk: str | int = ""
    ) -> float | None:
        """The committed time, or the one at the longest shorter T scaled by length (every path is linear in
        T at these sizes); ``None`` where neither was measured."""
        key = self._key(what, d, batch, algorithm, chunk)
        shorter = [t for (*k, t) in self._ms if tuple(k) == key and t <= length]
        return self._ms[key + (max(shorter),)] * length / max(shorter) if shorter else None

    def total(self, whats: Iterable[str], d: int, batch: int, length: int) -> float | None:
        """The sum of several measurements' committed times (ms), ``None`` if one is missing."""
        times = [self.ms(what, d, batch, length) for what in whats]
        return None if None in times else sum(times)


def _slow(ms: float, what: str = "one call") -> str:
    """Why a measurement is skipped: the committed H100 data (scaled by T where that T is missing)."""
    return f"skipped: {what} took ~{ms:.0f} ms on the H100 (committed data; over {SLOW_MS:.0f} ms)"


def calib_shape(
    runner: Runner, committed: CommittedTimes, d: int, batch: int, length: int, budget: float
) -> list[dict[str, str]]:
    """Every calibration row of one RNN shape (tanh, input 1) in :data:`CALIB_COLUMNS`, within ``budget`` seconds:
    whole step and no-grad forward of cuDNN and of BPPSA "auto", the whole step with the scan forced linear
    and chunked (the chunk the plan chose), the scan kernel alone (linear, chunked c in ``kernel_chunks``) and
    the fused backward kernel alone (``fused_kernel``: the model's :func:`fused_seconds` is not yet fitted)."""
    out: list[dict[str, str]] = []

    def add(
        what: str,
        value: float | str,
        algorithm: str = "",
        chunk: str | int = "",
        plan: str = "",
        note: str = "",
    ) -> None:
        ms = "" if isinstance(value, str) else f"{value * 1e3:.4f}"
        note = value if isinstance(value, str) else note
        values = (what, "RNN", str(d), str(batch), str(length), algorithm, str(chunk), ms, plan, note)
        out.append(dict(zip(CALIB_COLUMNS, values, strict=True)))

    def estimate(*whats: str) -> float | None:
        ms = committed.total(whats, d, batch, length)
        return None if ms is None else ms / 1e3

    share = budget / 6
    ref, ours, x = _pair("RNN", 1, d, batch, length, runner.device)
    # cuDNN again: a second copy of torch's module in the same rounds, how far one host-bound step of the same
    # code drifts (at T = 100 the H200's cuDNN steps read 0.74-1.27 ms across shapes of the same work, and two
    # copies' medians of 3 rounds 0.85-1.13x apart at 20dff7a): three times the rounds
    finer = runner.with_rounds(calib_step_rounds(runner))
    step = interleaved(finer, {"cudnn": train_step(ref, x), "again": train_step(_copy_of(ref), x),
                               "bppsa": train_step(ours, x)}, share,
                       estimate("step_cudnn", "step_cudnn", "step_bppsa"))  # fmt: skip
    add("step_cudnn", step["cudnn"])
    add("step_cudnn_again", step["again"])
    add(
        "step_bppsa",
        step["bppsa"],
        plan="" if isinstance(step["bppsa"], str) else ours.last_stats.get("plan", ""),
    )
    forward = interleaved(runner, {"cudnn": no_grad_forward(ref, x), "bppsa": no_grad_forward(ours, x)}, share,
                          estimate("fwd_cudnn", "fwd_bppsa"))  # fmt: skip
    add("fwd_cudnn", forward["cudnn"])
    add("fwd_bppsa", forward["bppsa"])
    chunks = [c for c in runner.shapes.kernel_chunks if c < length]
    for algorithm in ("linear", "chunked"):
        # its scan is at least the kernel alone: the committed kernel time (the fastest chunk) bounds it below
        kernel_ms = [
            committed.ms("kernel", d, batch, length, algorithm, c)
            for c in ([length] if algorithm == "linear" else chunks)
        ]
        known = [ms for ms in kernel_ms if ms is not None]
        # a linear plan may run the fused backward kernel instead (ms where the factored scan took 50-1000 ms:
        # measured once on the first call), so the factored kernel's time neither skips nor prices its step
        fused = algorithm == "linear" and _fused_refusal(d) is None
        if known and min(known) > SLOW_MS and not fused:
            add("step_scan", _slow(min(known), "its kernel alone"), algorithm)
            continue
        module = _bppsa(ref, algorithm)
        seconds = interleaved(
            runner, {"scan": train_step(module, x)}, share, min(known) / 1e3 if known and not fused else None
        )["scan"]
        plan = "" if isinstance(seconds, str) else module.last_stats.get("plan", "")
        ran, chunk = plan_columns(plan, length)
        asked = f'asked algorithm="{algorithm}"' if plan and ran != algorithm else ""
        add("step_scan", seconds, ran or algorithm, chunk, plan, asked)
    factors = None
    launches = [("linear", length)] + [("chunked", c) for c in chunks]
    for algorithm, chunk in launches:
        ms = committed.ms("kernel", d, batch, length, algorithm, chunk)
        if runner.device != "cuda":
            add("kernel", NO_CUDA, algorithm, chunk)
        elif ms is not None and ms > SLOW_MS:
            add("kernel", _slow(ms), algorithm, chunk)
        elif runner.left() <= 0:
            add("kernel", SKIPPED, algorithm, chunk)
        elif refused := _refusal(algorithm, d, chunk, length):
            add("kernel", f"refused: {refused}", algorithm, chunk)
        else:
            if factors is None:  # allocated only where a kernel runs (the largest shapes' are GiBs)
                factors = _factors("RNN", d, batch, length, runner.device)
            call = {"kernel": _kernel_call(factors, algorithm, chunk)}
            seconds = interleaved(runner, call, share / len(launches), None if ms is None else ms / 1e3)
            add("kernel", seconds["kernel"], algorithm, chunk)
    factors = None  # released before the fused kernel's own tensors
    if runner.device != "cuda":
        add("fused_kernel", NO_CUDA, "fused", length)
    elif runner.left() <= 0:
        add("fused_kernel", SKIPPED, "fused", length)
    else:
        fused = _fused_call(batch, length, d, runner.device)
        seconds = fused if isinstance(fused, str) else interleaved(runner, {"fused": fused}, share, None)["fused"]
        add("fused_kernel", seconds, "fused", length)
    return out


def calib_stage(runner: Runner, committed: CommittedTimes) -> list[dict[str, str]]:
    """The calibration grid, cheapest shapes first (by their committed times); ``cuda-calib.csv`` and
    ``cuda-calib.md`` rewritten after each shape."""
    s = runner.shapes
    shapes = sorted(
        itertools.product(s.calib_d, s.calib_batch, s.calib_length),
        key=lambda shape: (
            committed.total(("step_cudnn", "step_bppsa"), *shape) or math.inf,
            math.prod(shape),
        ),
    )
    done: list[dict[str, str]] = []
    for index, (d, batch, length) in enumerate(shapes):
        rows_ = calib_shape(
            runner, committed, d, batch, length, max(runner.left(), 0) / (len(shapes) - index)
        )
        done += rows_
        step = {row["what"]: row for row in rows_}
        print(f"calib d={d} B={batch} T={length}: step ms cuDNN {_row_ms(step['step_cudnn'])}, "
              f"BPPSA {_row_ms(step['step_bppsa'])}", flush=True)  # fmt: skip
        write_calibration(runner, done, index + 1, len(shapes))
    if not shapes:
        write_calibration(runner, done, 0, 0)
    return done


def write_calibration(runner: Runner, rows_: list[dict[str, str]], shapes_done: int, shapes: int) -> None:
    """``cuda-calib.csv`` (:data:`CALIB_COLUMNS`) and its summary ``cuda-calib.md``."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CALIB_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows_)
    write(runner, "cuda-calib.csv", buffer.getvalue())
    by_shape: dict[tuple[int, int, int], dict[str, dict[str, str]]] = {}
    for row in rows_:
        key = (int(row["d"]), int(row["B"]), int(row["T"]))
        by_shape.setdefault(key, {}).setdefault(
            row["what"] + (row["algorithm"] if row["what"] == "step_scan" else ""), row
        )
    lines, ratios, drifts = [], [], []
    for (d, batch, length), found in sorted(by_shape.items()):
        cudnn, ours = (_row_seconds(found["step_cudnn"]), _row_seconds(found["step_bppsa"]))
        again = _row_seconds(found["step_cudnn_again"]) if "step_cudnn_again" in found else "-"
        ratio, drift = ratio_text(cudnn, ours), ratio_text(cudnn, again)
        if ratio != "-":
            ratios.append((cudnn / ours, d, batch, length))
        if drift != "-":
            drifts.append(cudnn / again)
        forced = [_row_ms(found.get(f"step_scan{a}")) for a in ("linear", "chunked")]
        lines.append(f"| {d} | {batch} | {length} | {ms_text(cudnn)} | {ms_text(again)} ({drift}) | {ms_text(ours)} "
                     f"| {ratio} | {found['step_bppsa']['plan']} | {' | '.join(forced)} "
                     f"| {_row_ms(found.get('fused_kernel'))} |")  # fmt: skip
    below = [r for r in ratios if r[0] < 0.9]
    worst = min(ratios, default=None)
    summary = f"{len(below)} of {len(ratios)} measured shapes below 0.9x cuDNN" + (
        f" (worst {worst[0]:.2f}x at d={worst[1]} B={worst[2]} T={worst[3]})" if worst else ""
    ) + (
        f"; cuDNN's second copy below 0.9x of the first on {sum(r < 0.9 for r in drifts)} of {len(drifts)}"
        f" (range {min(drifts):.2f}x-{max(drifts):.2f}x)." if drifts else "."
    )  # fmt: skip
    text = header(runner, 'Calibration grid: torch (cuDNN) vs lightning_bppsa (algorithm="auto"), RNN tanh, input 1') + (
        "Every measurement is in `cuda-calib.csv` (columns of the committed `calib-h100-2026-11-26.csv`, plus `plan`: "
        "`last_stats[\"plan\"]` after a step, and `note`: why a row has no ms). Whole training step, loss = sum of the "
        f"last output step; median of {calib_step_rounds(runner)} interleaved rounds (cuDNN, again, BPPSA; the "
        f"forced scans and the forward {runner.shapes.rounds}) after {WARMUP} warm-up steps, "
        f"{runner.timer}. Ratio = cuDNN / BPPSA; cuDNN again = a second copy of torch's module in the same rounds (its "
        "ratio cuDNN / again: how far the same code drifts); forced = `algorithm=\"linear\"` / `\"chunked\"` (the chunk the plan chose). "
        f"Forced scans and kernels whose one call took > {SLOW_MS:.0f} ms on the H100 are skipped. Fused kernel = the "
        "fused backward kernel alone (`recurrent_cuda.rnn_backward`, what a linear plan runs where the warp sweep "
        "does not).\n\n"
        f"Shapes done: {shapes_done} of {shapes} (a skipped measurement says why). **{summary}**\n\n"
        "| d | B | T | cuDNN step ms | cuDNN again ms (ratio) | BPPSA step ms | ratio | BPPSA plan | forced linear step ms "
        "| forced chunked step ms | fused kernel ms |\n"
        "|" + " --- |" * 11 + "\n" + "".join(line + "\n" for line in lines)
    )  # fmt: skip
    write(runner, "cuda-calib.md", text)


def _row_seconds(row: dict[str, str]) -> float | str:
    """A CSV row's time in seconds, or its note."""
    return float(row["ms"]) / 1e3 if row["ms"] else row["note"]


def _row_ms(row: dict[str, str] | None) -> str:
    if row is None:
        return "-"
    return f"{ms_text(_row_seconds(row))}" + (f" ({row['plan']})" if row["plan"] else "")


# --------------------------------------------------------------------------------------------------
# Stage 4: the paper's grids
# --------------------------------------------------------------------------------------------------


def _backward_of(module: nn.Module, x: torch.Tensor) -> Backward:
    """``loss.backward()`` alone (loss as in the paper: the last step squared), on a fresh graph each call, its
    forward untimed (:class:`~device_runner.Backward`), as a training step runs it. (Up to 213b46c one graph was
    reused with ``retain_graph``, where our layer then recomputed its forward in every backward but the first:
    those tables count a forward kernel in ours.)"""

    def forward() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        output, _ = module(x)
        return output[:, -1].pow(2).sum()

    return Backward(forward, lambda loss: loss.backward())


def _peak_bytes(runner: Runner, module: nn.Module, x: torch.Tensor) -> int | None:
    """Peak CUDA memory of one forward + backward (``None`` off CUDA)."""
    if runner.device != "cuda":
        return None

    def step() -> None:
        module.zero_grad(set_to_none=True)
        output, _ = module(x)
        output[:, -1].pow(2).sum().backward()

    return cuda_peak_bytes(step)[0]


def _kernel_seconds(runner: Runner, cell: str, batch: int, length: int, budget: float) -> dict:
    """The scan kernels alone on factors of this row's shape (sweep and the chunked launch ``cuda_choose``
    picks), with the CUDA cost model's prediction of each."""
    from lightning_bppsa import cuda_cost_model

    hidden = runner.shapes.paper_hidden
    width = (3 if cell == "GRU" else 1) * hidden
    _, chunk = cuda_cost_model.cuda_choose("chunked", n=length, d=hidden, batch=batch, width=width)
    launches = {"linear": length, "chunked": chunk}
    result: dict = {f"model_{name}": cuda_cost_model.cuda_kernel_seconds(name, n=length, d=hidden, batch=batch,
                    width=width, chunk_size=c) for name, c in launches.items()}  # fmt: skip
    if runner.device != "cuda":
        return {**result, "chunk": chunk, "linear": NO_CUDA, "chunked": NO_CUDA}
    factors = _factors(cell, hidden, batch, length, runner.device)
    calls = {name: _kernel_call(factors, name, c) for name, c in launches.items()}
    return {**result, "chunk": chunk, **interleaved(runner, calls, budget)}


def measure(runner: Runner, cell: str, batch: int, length: int, inputs: int, budget: float) -> dict:
    """One row of the paper's grids: backward alone of cuDNN and of BPPSA, peak memory, the kernels alone."""
    ref, ours, x = _pair(cell, inputs, runner.shapes.paper_hidden, batch, length, runner.device)
    r = interleaved(
        runner, {"bwd_cudnn": _backward_of(ref, x), "bwd_bppsa": _backward_of(ours, x)}, budget / 2
    )
    r["path"] = f"{ours.last_stats.get('path', '')} {ours.last_stats.get('scan_algorithm', '')}".strip()
    r["mem_cudnn"], r["mem_bppsa"] = (_peak_bytes(runner, m, x) for m in (ref, ours))
    r.update(_kernel_seconds(runner, cell, batch, length, budget / 2))
    return r


def measured_table(runner: Runner) -> str:
    """The paper's grids (``shapes.paper``); rows that do not fit before the deadline say so."""
    lines = [
        "| cell | B | T | input | BPPSA path | backward cuDNN ms | backward BPPSA ms | speedup "
        "| sweep kernel ms (model) | chunked kernel ms (model) | chunk | peak MiB cuDNN | peak MiB BPPSA |",
        "|" + " --- |" * 13,
    ]
    grid = runner.shapes.paper
    for index, (cell, batch, length, inputs) in enumerate(grid):
        if runner.left() <= 0:
            lines.append(f"| {cell} | {batch} | {length} | {inputs} | {SKIPPED} |" + " |" * 8)
            continue
        r = measure(runner, cell, batch, length, inputs, runner.left() / (len(grid) - index))
        mib = [f"{r[k] * 2.0**-20:.1f}" if r[k] is not None else "n/a" for k in ("mem_cudnn", "mem_bppsa")]
        lines.append(
            f"| {cell} | {batch} | {length} | {inputs} | {r['path']} | {ms_text(r['bwd_cudnn'])} "
            f"| {ms_text(r['bwd_bppsa'])} | {ratio_text(r['bwd_cudnn'], r['bwd_bppsa'])} "
            f"| {ms_text(r['linear'])} ({ms_text(r['model_linear'])}) "
            f"| {ms_text(r['chunked'])} ({ms_text(r['model_chunked'])}) | {r['chunk']} | {mib[0]} | {mib[1]} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def write_measurements(runner: Runner) -> None:
    """The paper's grids into ``cuda-gpu.md``."""
    table = measured_table(runner)
    text = header(runner, "CUDA kernels vs cuDNN autograd: the paper's grids") + (
        f"Backward = `loss.backward()` alone on a fresh graph (its forward untimed), median of {runner.shapes.rounds} interleaved "
        f"rounds after {WARMUP} warm-up calls, {runner.timer}; hidden {runner.shapes.paper_hidden}.\n\n"
    )
    write(runner, "cuda-gpu.md", text + table + "\n")


# --------------------------------------------------------------------------------------------------
# One command: every stage within a time budget
# --------------------------------------------------------------------------------------------------


def run_all(
    runner: Runner,
    tests_command: Sequence[str] = TESTS_COMMAND,
    committed: Path = COMMITTED_CALIB,
    stages: Collection[str] = STAGES,
) -> None:
    """The ``stages`` (default: all, :data:`STAGES`) in their order before ``runner.deadline``: tests/gpu, the
    whole-step table, the overhead table, the layer chains, the user cells, the calibration grid, the paper's
    grids. Each may use its share (:data:`STAGE_SHARES`) of the time left when it starts, among the chosen
    stages still to run, so that what one leaves unused goes to the next; what does not fit is written as
    skipped; the tests may use up to :data:`TESTS_SECONDS` whatever their share (a share of 74 s of a
    520 s run stopped ``tests/gpu`` on an H200 on 2026-11-27). Each stage writes its files as it goes, so a
    killed run leaves what was finished."""
    times = CommittedTimes.load(committed)
    chosen = [stage for stage in STAGES if stage in stages]
    run = {
        "tests": lambda r: tests_stage(r, tests_command, limit=TESTS_SECONDS),
        "host": host_stage,
        "step": step_stage,
        "fused": fused_stage,
        "forward": forward_stage,
        "stalls": stalls_stage,
        "overhead": overhead_stage,
        "chain": chain_stage,
        "cells": cells_stage,
        "calib": lambda r: calib_stage(r, times),
        "paper": write_measurements,
    }
    for index, stage in enumerate(chosen):
        share = STAGE_SHARES[stage] / sum(STAGE_SHARES[later] for later in chosen[index:])
        budget = share * max(runner.left(), 0)
        if stage == "tests":  # pytest is stopped, not shortened, at its limit: it gets what it needs first
            budget = max(budget, min(TESTS_SECONDS, runner.left()))
        run[stage](runner.until(budget))


# --------------------------------------------------------------------------------------------------
# The plan: the model's predictions (no GPU needed)
# --------------------------------------------------------------------------------------------------


def _work(kernel: str, batch: int, n: int, d: int, k: int, chunk: int) -> tuple[float, float, str]:
    """(FLOPs, global-memory bytes, critical path) of one float32 launch, last-state gradient (R = d);
    the chunk scratch (aggregates, carries) is counted though it mostly stays in L2."""
    width, rows_ = k * d, d
    operands = batch * n * width * 4 + width * d * 4  # scales + the shared weight
    outputs = batch * (n + 1) * d * 4
    if kernel == "sweep":
        return 2 * batch * n * d * width, operands + outputs, f"{n} vector steps"
    p = math.ceil(n / chunk)
    flops = 2 * batch * n * rows_ * d * width + 2 * batch * n * d * width + 2 * batch * p * min(p, 32) * d * d
    scratch = 2 * batch * p * (rows_ + 1) * d * 4  # aggregates + carries, written and read (L2)
    return flops, operands + outputs + scratch, f"{chunk} matrix + {p} look-back + {chunk} vector steps"


def _warp_step(d: int, k: int) -> float:
    """Instructions a factored warp-sweep step issues (d, k tiles): the SASS counts the model uses."""
    from lightning_bppsa import cuda_cost_model

    counts = cuda_cost_model.SASS_COUNTS
    return counts.warp_overhead_factored + counts.warp_row_factored * d + counts.warp_column_factored * k * d


def plan() -> str:
    from lightning_bppsa.kernels import cuda as kernels
    from lightning_bppsa.kernels import cuda_inspect

    from lightning_bppsa import cuda_cost_model

    model = cuda_cost_model.CUDA_MODEL
    out = [
        "# CUDA kernels: the model's plan (not measurements)",
        "",
        f"Written by `python benchmarks/gpu.py --plan` on {datetime.date.today()}. No GPU was available: every time",
        "below is a prediction of `lightning_bppsa.cuda_cost_model.cuda_kernel_band`: the instructions each step",
        "issues, counted in the kernels' SASS (table below), one warp in order, between every latency hidden (low)",
        "and one memory latency per loop iteration (high), under assumed device figures "
        f"({model.name}: {model.sms} SMs x {model.schedulers_per_sm} schedulers at {model.clock_hz / 1e9:.2f} GHz,",
        f"launch + memset {model.launch_seconds * 1e6:.0f} us, barrier {model.barrier_cycles:.0f} cycles, "
        f"L1 {model.l1_cycles:.0f}, L2 {model.l2_cycles:.0f}, shared {model.smem_cycles:.0f}). The band is the",
        "uncertainty the model knows of; the device figures and the ~150 instructions outside the loops are",
        "assumptions on top (a previous model, from shared-memory wavefronts, predicted 41 us for the",
        "RNN B=16 T=1000 row; an outside instruction-level review estimated 105-140 us).",
        "Run `python benchmarks/gpu.py --first-contact` on a GPU to measure (writes `cuda-gpu.md`).",
        "",
        "## Instructions per loop iteration (SASS, sm_90; what the model counts)",
        "",
        "| loop | instructions per warp and iteration |",
        "| --- | --- |",
        *(f"| {name} | {count} |" for name, count in vars(cuda_cost_model.SASS_COUNTS).items()),
        "",
        "The block sweep's inner loop issues 24 instructions for 2 FMAs and a float32 tile element 31: a",
        "d = 20 vector step is ~800 issued instructions. For d <= 32 the sweeps (the linear schedule and the",
        "chunks' sweeps) use the warp-resident step instead (state in registers, W loaded once): "
        f"~{_warp_step(HIDDEN, 1):.0f}",
        f"instructions per RNN step at d = {HIDDEN} (factored, float32), ~{_warp_step(HIDDEN, 3):.0f} for the GRU.",
        "",
        "## Registers per kernel (ptxas, `-warn-spills -Werror`: 0 spill bytes, 0 stack)",
        "",
    ]
    if shutil.which("nvcc"):
        # the warp sweeps are compiled per (d, k): shown for the paper's RNN (d = 20, k = 1)
        usage = cuda_inspect.ptxas_usage(("sm_80", "sm_90"))
        warp = cuda_inspect.ptxas_usage(("sm_80", "sm_90"), warp_shape=(HIDDEN, 1))
        out += ["| kernel | sm_80 | sm_90 |", "| --- | --- | --- |"]
        for k in kernels.KERNELS:
            found, label = (usage, k) if k in usage["sm_80"] else (warp, f"{k} (d = {HIDDEN}, k = 1)")
            out.append(f"| {label} | {found['sm_80'][k].registers} | {found['sm_90'][k].registers} |")
    else:
        out.append("(nvcc not found: no register report)")
    out += [
        "",
        "## Work and predicted time per launch (float32, last-state gradient, d = 20)",
        "",
        "| chain | B | T | kernel | chunk | FLOPs | global-memory bytes | critical path | launches | predicted us (low-high) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    predictions = {}
    for label, k, batch, n in [
        ("RNN", 1, 16, 1000),
        ("RNN", 1, 16, 30000),
        ("GRU L", 3, 64, 1034),
        ("GRU L", 3, 16, 1034),
    ]:
        width = k * HIDDEN
        best, chunk = cuda_cost_model.cuda_choose("auto", n=n, d=HIDDEN, batch=batch, width=width)
        for kernel, algorithm, c in (("sweep", "linear", n), ("chunked", "chunked", chunk)):
            flops, nbytes, path = _work(kernel, batch, n, HIDDEN, k, c)
            band = cuda_cost_model.cuda_kernel_band(
                algorithm, n=n, d=HIDDEN, batch=batch, width=width, chunk_size=c
            )
            seconds = math.sqrt(band[0] * band[1])
            launches = "1" if kernel == "sweep" else "1 + memset"
            out.append(
                f"| {label} | {batch} | {n} | {kernel} | {c if kernel == 'chunked' else '-'} | {flops:.3g} | {nbytes:.3g} "
                f"| {path} | {launches} | {seconds * 1e6:.0f} ({band[0] * 1e6:.0f}-{band[1] * 1e6:.0f}) |"
            )
            if algorithm == best:
                predictions[(label, batch, n)] = (kernel, seconds)
    out += [
        "",
        "## Predicted backward speedups against cuDNN",
        "",
        "Kernel time only. The cuDNN baseline is the paper's V100 measurement, "
        f"{PAPER_V100_SECONDS_PER_STEP * 1e6:.1f} us per step",
        "(Appendix G, Table 4, B = 16: epoch time minus forward-only time, so it also holds the optimizer",
        "step). An H100's cuDNN is faster by an unknown factor: the last column is the per-step cuDNN backward",
        "time on the H100 below which the target is missed, for the kernel alone. The GRU rows reuse that",
        "per-step figure: the paper's GRU table (Table 6) gives epoch times, and turning them into",
        "per-iteration times needs the IRMAS training-set size, which the paper does not state.",
        "",
        "Not modelled, and likely decisive at T ~ 1000: BPPSA's backward is more than the scan kernel. The",
        "module also prepares the Jacobian factors (element-wise passes over (B, T, 3H)) and computes the",
        "parameter gradients (two GEMMs over all steps), a few tens of torch ops at ~5-10 us of launch",
        "each, i.e. ~0.1-0.3 ms whatever T. At T = 1000 that is one to three times the predicted kernel time, so",
        "the 100x end-to-end backward target at T = 1000 is predicted to be met only if those ops shrink",
        "(fusion, or a CUDA graph of the whole backward); at T = 30000 and for GRU L they are a small share.",
        "",
        "| case | kernel (auto) | predicted kernel us | V100 cuDNN backward ms | ratio | target | missed if H100 cuDNN < us/step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (label, batch, n), (kernel, seconds) in predictions.items():
        target_name = "GRU L" if label == "GRU L" else f"RNN T={n}"
        target = TARGETS[target_name]
        baseline = PAPER_V100_SECONDS_PER_STEP * n
        out.append(
            f"| {label} B={batch} T={n} | {kernel} | {seconds * 1e6:.0f} | {baseline * 1e3:.1f} "
            f"| {baseline / seconds:.0f}x | {target:.0f}x | {target * seconds / n * 1e6:.2f} |"
        )
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------------
# First contact with a GPU: sanitizers, look-back stress, then the grids (one command, < 10 minutes)
# --------------------------------------------------------------------------------------------------

#: the CUDA cases of the test suite run under compute-sanitizer (small grids: the tools are slow)
SANITIZED_TESTS = ["tests/gpu/test_cuda_kernels.py", "-k", "sweep or chunked or stream or empty"]
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")


def _sanitizer() -> str | None:
    """compute-sanitizer: on PATH, in $CUDA_HOME/bin, or from the nvidia-cuda-sanitizer-api wheel."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    places = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"]
    places += [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]
    for place in places:
        for candidate in sorted(place.rglob("compute-sanitizer")) if place.is_dir() else []:
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def run_sanitizers(timeout: float) -> list[tuple[str, bool, str]]:
    """(tool, passed, detail) for memcheck, racecheck, synccheck over the test suite's CUDA cases."""
    tool_path = _sanitizer()
    if tool_path is None:
        missing = "compute-sanitizer not found: put the CUDA toolkit's bin/ on PATH, or pip install nvidia-cuda-sanitizer-api"
        return [(tool, False, missing) for tool in SANITIZER_TOOLS]
    results = []
    for tool in SANITIZER_TOOLS:
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "99", sys.executable, "-m", "pytest", "-x", "-q",
               "-p", "no:cacheprovider", *SANITIZED_TESTS]  # fmt: skip
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            results.append((tool, False, f"did not finish in {timeout:.0f} s"))
            continue
        summary = [line for line in done.stdout.splitlines() if "ERROR SUMMARY" in line or "passed" in line]
        detail = f"exit {done.returncode} in {time.monotonic() - start:.0f} s; " + " | ".join(summary[-2:])
        if done.returncode != 0:
            detail += "\n" + (done.stdout + done.stderr)[-3000:]
        results.append((tool, done.returncode == 0, detail))
    return results


def _test_cases():
    """tests/kernels/test_cuda_emulated.py as a module: the exact inputs and the float64 loop it tests with."""
    path = ROOT / "tests" / "kernels" / "test_cuda_emulated.py"
    spec = importlib.util.spec_from_file_location("_cuda_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def look_back_stress(repeats: int = 20) -> tuple[bool, str]:
    """The chunked kernel on a grid far above residency (64 rows x 10000 chunks of 2 steps), exact inputs
    (signed permutations, integer gradients: any order of products gives the same bits), compared bit
    for bit with the sweep in float64 on every repeat, and float32 against the float64 loop."""
    from lightning_bppsa.kernels import cuda as kernels

    cases = _test_cases()
    jt, grad = cases.exact_dense(64, 20000, 4, torch.Generator().manual_seed(0))
    jt, grad = jt.cuda(), grad.cuda()
    sweep = kernels.scan_dense(jt, grad, "linear", 1)
    mismatches = sum(
        not torch.equal(kernels.scan_dense(jt, grad, "chunked", 2), sweep) for _ in range(repeats)
    )
    sweep_float32 = kernels.scan_dense(jt.float(), grad.float(), "linear", 1)
    mismatches += sum(
        not torch.equal(kernels.scan_dense(jt.float(), grad.float(), "chunked", 3), sweep_float32)
        for _ in range(repeats)
    )
    grid = 64 * 10000
    detail = f"{mismatches} of {2 * repeats} launches differ from the sweep (grid {grid} blocks, 1 + 10000 chunks/row)"
    return mismatches == 0, detail


def first_contact(runner: Runner) -> int:
    """Sanitizers, then the look-back stress, then the paper's grids; returns the exit status."""
    start = time.monotonic()
    report = []
    for tool, passed, detail in run_sanitizers(timeout=100):
        report.append((f"compute-sanitizer {tool}", passed, detail))
        print(f"[{'ok' if passed else 'FAIL'}] compute-sanitizer {tool}: {detail}", flush=True)
    passed, detail = look_back_stress()
    report.append(("look-back stress", passed, detail))
    print(f"[{'ok' if passed else 'FAIL'}] look-back stress: {detail}", flush=True)
    if all(ok for _, ok, _ in report):
        write_measurements(runner)
    else:
        print("grids not measured: fix the failures above first", flush=True)
    print(f"first contact: {time.monotonic() - start:.0f} s", flush=True)
    return 0 if all(ok for _, ok, _ in report) else 1


def main() -> None:
    started = time.monotonic()  # the budget counts the kernels' compilation below
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the paper's grids: headline rows only")
    parser.add_argument(
        "--first-contact",
        action="store_true",
        help="sanitizers + look-back stress, then every grid (GPU, < 10 min)",
    )
    parser.add_argument("--plan", action="store_true", help="write the model's predictions (no GPU needed)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="tests/gpu, the whole-step table, the calibration grid, the paper's grids",
    )
    parser.add_argument(
        "--within", type=float, metavar="SECONDS",
        help="the whole run's time budget (default 480 with --all, 570 with --first-contact, else none)",
    )  # fmt: skip
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the smoke mode (CPU clock, no CUDA kernels)",
    )
    parser.add_argument(
        "--stages", default=",".join(STAGES), metavar="LIST",
        help="with --all: the stages to run, comma-separated (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--cells", metavar="LIST",
        help="with --all: the user-cells stage measures only these cells (benchmarks/cells.py's names, comma-separated)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: the smoke mode)")
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="where the files go (default: %(default)s)"
    )
    args = parser.parse_args()
    if args.plan:
        text = plan()
        (RESULTS / "cuda-plan-gpu.md").write_text(text)
        print(text)
        return
    defaults = {"all": 480.0, "first_contact": 570.0}
    within = args.within or next((v for k, v in defaults.items() if getattr(args, k)), math.inf)
    if args.within is not None and args.within <= 0:
        parser.error(f"--within must be > 0 seconds; got {args.within}")
    stages = [stage for stage in args.stages.split(",") if stage]
    if set(stages) - set(STAGES):
        parser.error(
            f"--stages: unknown {sorted(set(stages) - set(STAGES))}; the stages are {','.join(STAGES)}"
        )
    if args.first_contact and args.device != "cuda":
        parser.error("--first-contact runs the CUDA sanitizers: it needs --device cuda")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit(
                "benchmarks/gpu.py: no CUDA device here; run it on a GPU machine (or --device cpu --tiny, or --plan)"
            )
        from lightning_bppsa.kernels import cuda as kernels

        ok, reason = kernels.available()
        if not ok:
            sys.exit(f"benchmarks/gpu.py: the CUDA kernels cannot run: {reason}")
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    if args.quick:
        shapes = dataclasses.replace(shapes, paper=tuple(rows(quick=True)))
    if args.cells:
        shapes = dataclasses.replace(shapes, cell_names=tuple(name for name in args.cells.split(",") if name))
    runner = Runner(
        args.device, shapes, deadline=started + within * (1 - MARGIN),
        results=args.results,
        command=shlex.join(["python", "benchmarks/gpu.py", *sys.argv[1:]]),
    )  # fmt: skip
    if args.first_contact:
        sys.exit(first_contact(runner))
    if args.all:
        run_all(runner, stages=stages)
    else:
        write_measurements(runner)


if __name__ == "__main__":
    main()
