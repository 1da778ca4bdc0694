"""The recurrent forward kernels alone on a GPU, against cuDNN's forward (issue 29's forward target).

    python benchmarks/recurrent_forward_gpu.py --results /tmp/r   # GPU: writes cuda-forward.md there
    python benchmarks/gpu.py --all                                # its "forward" stage: the same table

(``benchmarks/results/recurrent-forward-gpu.md``: its first run, at b2ef8cf, written by the standalone form of
then.) Every workload's row is written as it is measured, the rest "skipped: out of time" past the deadline.

Per workload (cell, B, T, input I, H; float32, no grad), the device time per call read from ``torch.profiler``
(kernels only: no host time), after warm-up calls that compile the per-H module:

- ``per-H``: the kernel lightning_bppsa launches for H <= 32 (``bppsa_<cell>_forward_f32_h<H>``: W_hh in
  registers, gi staged through the shared-memory ring);
- ``shared``: the shared-memory kernel of the same cell (``bppsa_<cell>_forward_f32``) on the same inputs,
  the family the per-H kernels replaced at H <= 32 (W_hh in shared memory, gi one step ahead);
- ``cuDNN rec``: cuDNN's recurrent kernels (names holding ``RNN_``, e.g. ``RNN_blockPersist_fp_RNN``) of
  ``torch.nn.RNN/GRU/LSTM``; ``cuDNN all``: every kernel of its forward (its input GEMM included);
- ``ours all``: our input GEMM (``x W_ihᵀ + b``, one ``addmm``) plus the per-H kernel;
- ``max abs diff``, ``shared max abs diff``: the largest difference between the per-H / shared kernel's ``out``
  and cuDNN's (a sanity check; cuDNN's GEMMs may run in TF32).

Without CUDA every row says so ("n/a: no CUDA").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from lightning_bppsa.kernels import cupy_loader, recurrent_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also where loaded by path
from device_runner import NO_CUDA, RESULTS, SKIPPED, Runner, header, markdown_table, write

#: (cell, B, T, I, H): the issue's rows first (RNN B16 T1000 H20, GRU B64 T1034 I12 H20), then B, T, H around them
WORKLOADS = (
    ("rnn_tanh", 16, 1000, 1, 20),
    ("gru", 64, 1034, 12, 20),
    ("rnn_tanh", 1, 1000, 1, 20),
    ("rnn_tanh", 16, 10000, 1, 20),
    ("rnn_tanh", 256, 1000, 1, 20),
    ("rnn_tanh", 16, 1000, 1, 8),
    ("rnn_tanh", 16, 1000, 1, 32),
    ("gru", 16, 1034, 12, 20),
    ("gru", 16, 1000, 32, 32),
    ("lstm", 16, 1000, 1, 20),
    ("lstm", 16, 1000, 32, 32),
)
MODULES = {"rnn_tanh": torch.nn.RNN, "gru": torch.nn.GRU, "lstm": torch.nn.LSTM}
DEVICE = "cuda"


def device_times(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """Microseconds of device time per call of ``fn``, by kernel name (``torch.profiler``, CUDA activity)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device = getattr(event, "self_device_time_total", None)
        totals[event.key] += device if device is not None else event.self_cuda_time_total
    return {name: us / calls for name, us in totals.items() if us > 0}


def shared_memory_forward(cell: str, gi, w_hh, b_hh, h0, c0) -> tuple[torch.Tensor, ...]:
    """The layer's forward on the shared-memory kernel of its cell, whatever H (the same launch words)."""
    index = gi.device.index if gi.device.index is not None else torch.cuda.current_device()

    def launcher(launch: recurrent_cuda.Launch, device: torch.device) -> None:
        nbytes = recurrent_cuda._shared_bytes(cell, launch.args[-1], 4, fixed=False)
        kernel = f"bppsa_{cell}_forward_f32"
        recurrent_cuda._launch_cuda(
            dataclasses.replace(launch, kernel=kernel, shared_bytes=nbytes, options=()), device
        )

    return recurrent_cuda.forward(
        cell, gi, w_hh, b_hh, h0, c0, launcher=launcher, device_type=gi.device.type,
        shared_limit=cupy_loader.shared_limit(index),
    )  # fmt: skip


def measure(cell: str, batch: int, steps: int, inputs: int, hidden: int, calls: int) -> dict[str, object]:
    """One workload's row (see the module docstring)."""
    torch.manual_seed(0)
    module = MODULES[cell](inputs, hidden, batch_first=True).to(DEVICE)
    x = torch.randn(batch, steps, inputs, device=DEVICE)
    h0 = torch.randn(1, batch, hidden, device=DEVICE) * 0.5
    c0 = torch.randn(1, batch, hidden, device=DEVICE) * 0.5 if cell == "lstm" else None
    w_ih, w_hh, b_ih, b_hh = (p.detach() for p in module.parameters())
    fold = cell != "gru"  # b_hh folded into gi but for GRU (b_hn sits inside r (.))
    bias = b_ih + b_hh if fold else b_ih
    kernel_b_hh = None if fold else b_hh
    gi = torch.addmm(bias, x.reshape(-1, inputs), w_ih.t()).view(batch, steps, -1)

    def ours() -> tuple[torch.Tensor, ...]:
        if cell == "lstm":
            return recurrent_cuda.lstm_forward(gi, w_hh, h0[0], c0[0])
        if cell == "gru":
            return recurrent_cuda.gru_forward(gi, w_hh, kernel_b_hh, h0[0])
        return recurrent_cuda.rnn_forward(gi, w_hh, kernel_b_hh, h0[0], relu=False)

    def ours_all() -> None:
        torch.addmm(bias, x.reshape(-1, inputs), w_ih.t())
        ours()

    def cudnn() -> torch.Tensor:
        with torch.no_grad():
            return module(x, (h0, c0) if cell == "lstm" else h0)[0]

    assert ours() is not None, f"the per-H kernel declined {cell} H={hidden}"
    per_h = device_times(ours, calls)
    c0_row = None if c0 is None else c0[0]
    shared = device_times(lambda: shared_memory_forward(cell, gi, w_hh, kernel_b_hh, h0[0], c0_row), calls)
    reference = device_times(cudnn, calls)
    everything = device_times(ours_all, calls)
    name = f"bppsa_{cell}_forward_f32_h{hidden}"
    return {
        "workload": f"{cell} B{batch} T{steps} I{inputs} H{hidden}",
        "per-H us": per_h.get(name, float("nan")),
        "shared us": shared.get(f"bppsa_{cell}_forward_f32", float("nan")),
        "cuDNN rec us": sum(us for k, us in reference.items() if "RNN_" in k),
        "cuDNN all us": sum(reference.values()),
        "ours all us": sum(everything.values()),
        "max abs diff": (ours()[0] - cudnn()).abs().max().item(),
        "shared max abs diff": (
            shared_memory_forward(cell, gi, w_hh, kernel_b_hh, h0[0], c0_row)[0] - cudnn()
        )
        .abs()
        .max()
        .item(),
    }


#: profiled calls per function
CALLS = 20
COLUMNS = ("workload", "per-H us", "shared us", "cuDNN rec us", "cuDNN all us", "ours all us", "max abs diff",
           "shared max abs diff")  # fmt: skip


def row_text(row: dict[str, object]) -> list[str]:
    """:func:`measure`'s row as table cells: microseconds to 0.1, differences in 3 digits."""
    return [f"{v:.1f}" if isinstance(v, float) and "us" in k else f"{v:.2e}" if isinstance(v, float) else str(v)
            for k, v in row.items()]  # fmt: skip


def forward_stage(runner: Runner, calls: int = CALLS) -> list[list[str]]:
    """:func:`measure` of every workload of :data:`WORKLOADS` while time is left, ``cuda-forward.md`` rewritten
    after each."""
    ok, reason = recurrent_cuda.available() if runner.device == "cuda" else (False, NO_CUDA)
    done: list[list[str]] = []
    for workload in WORKLOADS:
        label = f"{workload[0]} B{workload[1]} T{workload[2]} I{workload[3]} H{workload[4]}"
        absent = (
            NO_CUDA if runner.device != "cuda"
            else f"n/a: the kernels cannot run here ({reason})" if not ok
            else SKIPPED if runner.left() <= 0
            else None
        )  # fmt: skip
        done.append([label, absent, *["-"] * (len(COLUMNS) - 2)] if absent else row_text(measure(*workload, calls)))
        print("forward " + " | ".join(done[-1]), flush=True)
        write(runner, "cuda-forward.md", header(runner, "Recurrent forward kernels vs cuDNN") + (
            f"float32, no gradient, device time per call (torch.profiler, {calls} calls), ring depth "
            f"{recurrent_cuda.RING_DEPTH}; the columns: `benchmarks/recurrent_forward_gpu.py`'s docstring.\n\n"
            + markdown_table(COLUMNS, done)
        ))  # fmt: skip
    return done


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=CALLS, help="profiled calls per function (default %(default)s)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where cuda-forward.md goes")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = Runner(device, None, time.monotonic() + 600, results=args.results,
                    command="python benchmarks/recurrent_forward_gpu.py")  # fmt: skip
    forward_stage(runner, args.calls)


if __name__ == "__main__":
    main()
