"""The recurrent forward kernels alone on a GPU, against cuDNN's forward (issue 29's forward target).

    python benchmarks/recurrent_forward_gpu.py                      # GPU: prints a markdown table
    python benchmarks/recurrent_forward_gpu.py --out benchmarks/results/recurrent-forward-gpu.md

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

Nothing here runs without CUDA (exit status 2 with a message).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Callable

import torch
from lightning_bppsa.kernels import cupy_loader, recurrent_cuda

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per function (default 20)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("recurrent_forward_gpu.py needs a CUDA device", file=sys.stderr)
        return 2
    ok, reason = recurrent_cuda.available()
    if not ok:
        print(f"the recurrent CUDA kernels cannot run here: {reason}", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    head = (
        f"# Recurrent forward kernels vs cuDNN\n\n{props.name}, torch {torch.__version__}, cuDNN "
        f"{torch.backends.cudnn.version()}, CuPy {cupy_loader.cupy_version()}, float32, device time per call "
        f"(torch.profiler, {args.calls} calls), ring depth {recurrent_cuda.RING_DEPTH}\n"
    )
    rows = [measure(*workload, args.calls) for workload in WORKLOADS]
    columns = list(rows[0])
    lines = [head, "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        cells = [f"{v:.1f}" if isinstance(v, float) and "us" in k else f"{v:.2e}" if isinstance(v, float) else v
                 for k, v in row.items()]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
