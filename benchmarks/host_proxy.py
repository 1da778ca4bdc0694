"""The host's share of a recurrent layer's CUDA training step, measured on a machine without a GPU.

Issue 29: at T ~ 1000 a GPU step of ours is bound by the host (H200, RNN B=16 T=1000 H=20: 1.09 ms eager,
0.35 ms CUDA-graphed; ``cuda-step-h200-54c70a0.md``), and GPUs are lent to few sessions. This runs the CUDA path
itself (:func:`lightning_bppsa.testing.cuda_path_on_cpu` with ``run_kernels=False``: the CUDA backend, the plan
as on CUDA, every launch prepared as on a GPU, then dropped) on tiny CPU tensors (B=1, T=3), so what is timed is
the Python, the plan, the launch preparation and the torch ops of one step (zero the gradients, forward, loss =
sum of the last output step, backward), not the kernels. Per cell and algorithm, one thread:

- us/step: the median of interleaved rounds (the CPU clock);
- Python calls/step: ``cProfile``'s count over the profiled steps;
- aten ops (launching)/step: the ops that reach the dispatcher's Python key, and those of them that queue a
  kernel on a GPU (:class:`~lightning_bppsa.testing.OpCounter`; the layers' own ops then called directly, as
  eagerly on a GPU);
- torch us/step: torch's own module's step at the same shape on the CPU (a different path: its CPU kernels,
  not cuDNN's; the order of size of torch's own share).

Rows "auto, replayed": an ``"auto"`` module deciding for the scan, whose steps replay from CUDA graphs on a GPU
(:mod:`lightning_bppsa.nn._replay`), here over :func:`lightning_bppsa.testing.graphs_on_cpu` with
``run_graphs=False`` (a replay does nothing, as the dropped launches): what is timed is the host's share of a
replayed step (the input's copy, the graphs' bookkeeping, torch's autograd around one ``Function`` each way).

The GPU host's Python was ~2.5-3x slower than this machine's (cProfile of the same step: 1.75 ms there at
be3c8e9 vs 0.63 ms here), so a microsecond saved here is worth ~2-3 on that host; only a GPU run says what the
step gains.

    OMP_NUM_THREADS=1 flock -x /tmp/bppsa-bench.lock python benchmarks/host_proxy.py
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
from pathlib import Path
from unittest import mock

import torch
from device_runner import RESULTS, Runner, header, markdown_table, train_step, uncommitted
from host_path import scan_decided

from lightning_bppsa import nn as bnn
from lightning_bppsa.bench.measure import load_average, machine_description
from lightning_bppsa.nn import _scan_layer
from lightning_bppsa.testing import OpCounter, cuda_path_on_cpu, graphs_on_cpu

COLUMNS = ("cell", "algorithm", "plan", "us/step", "Python calls/step", "aten ops (launching)/step", "torch us/step")
REPLAYED = "auto, replayed"
#: (cell, algorithm forced on ours; REPLAYED: "auto" deciding for the scan, its step replayed from graphs)
WORKLOADS = (("RNN", "linear"), ("RNN", "chunked"), ("GRU", "linear"), ("GRU", "chunked"), ("LSTM", "linear"),
             ("RNN", REPLAYED), ("GRU", REPLAYED), ("LSTM", REPLAYED))  # fmt: skip
BATCH, STEPS, INPUTS, HIDDEN = 1, 3, 1, 20


def _medians(runner: Runner, steps: dict[str, object], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each step, ``rounds`` interleaved rounds of ``calls`` calls each."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name] += runner.call_seconds(step, calls)
    return {name: statistics.median(t) for name, t in times.items()}


def _python_calls(step, steps: int) -> float:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    return pstats.Stats(profiler).total_calls / steps


def _aten_ops(step) -> str:
    """``"total (launching)"`` aten ops of one step (:class:`~lightning_bppsa.testing.OpCounter`), the layers'
    ops called directly as eagerly on a GPU (under the counting mode they would go through the dispatcher)."""
    with mock.patch.object(_scan_layer, "_dispatched", lambda tensors: False), OpCounter() as counter:
        step()
    return f"{sum(counter.ops.values())} ({counter.launching()})"


def measure(runner: Runner, rounds: int, calls: int) -> list[list[str]]:
    """One row per workload: our module's CUDA path (kernels dropped) and torch's CPU module, interleaved."""
    rows = []
    for cell, algorithm in WORKLOADS:
        torch.manual_seed(0)
        ref = getattr(torch.nn, cell)(INPUTS, HIDDEN, batch_first=True)
        replayed = algorithm == REPLAYED
        ours = getattr(bnn, cell)(INPUTS, HIDDEN, batch_first=True, algorithm="auto" if replayed else algorithm)
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(BATCH, STEPS, INPUTS)
        with cuda_path_on_cpu(run_kernels=False), contextlib.ExitStack() as stack:
            if replayed:  # the scan decided (the model made sure), its graphs' replays dropped as the launches are
                stack.enter_context(scan_decided())
                stack.enter_context(graphs_on_cpu(run_graphs=False))
            steps = {"ours": train_step(ours, x), "torch": train_step(ref, x)}
            for step in steps.values():
                for _ in range(5):
                    step()  # plans made (a linear scan's first backward measures its two kernels)
            seconds = _medians(runner, steps, rounds, calls)
            plan = ours.last_stats["plan"]
            rows.append([
                cell, algorithm, plan, f"{seconds['ours'] * 1e6:.0f}", f"{_python_calls(steps['ours'], 50):.0f}",
                "- (an op-counting mode turns replay off)" if replayed else _aten_ops(steps["ours"]),
                f"{seconds['torch'] * 1e6:.0f}",
            ])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = f"python benchmarks/host_proxy.py --rounds {args.rounds} --calls {args.calls}"
    runner = Runner("cpu", None, float("inf"), results=args.results, command=command)
    load_before, changed = load_average(), uncommitted()
    rows = measure(runner, args.rounds, args.calls)
    text = header(runner, "The host's share of a CUDA training step, on the CPU (kernels not run)") + (
        f"Machine: {machine_description()}; torch threads {torch.get_num_threads()}. Load average (1, 5, 15 min) "
        f"{tuple(round(v, 2) for v in load_before)} before, {tuple(round(v, 2) for v in load_average())} after. "
        f"Files differing from the commit under lightning_bppsa/ and kernels/: {changed}.\n\n"
        f"Ours: `lightning_bppsa.nn.<cell>(algorithm=...)` on the CUDA path with its launches dropped; torch: "
        f"`torch.nn.<cell>` on the CPU. B={BATCH} T={STEPS} input {INPUTS} H={HIDDEN}, float32; step = zero the "
        f"gradients, forward, loss = sum of the last output step, backward. Medians of {args.rounds} interleaved "
        f"rounds of {args.calls} steps. See the script's docstring.\n\n" + markdown_table(COLUMNS, rows)
    )
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "host-proxy-cpu.md").write_text(text)


if __name__ == "__main__":
    main()
