"""The CUDA scan kernels on a GPU: BPPSA (lightning_bppsa.nn) vs cuDNN autograd, the paper's grids.

Ready for a GPU machine; nothing here was run on one (no GPU was lent to this project's sessions).

    python benchmarks/gpu.py --first-contact  # GPU: sanitizers, look-back stress, then every grid (< 10 min)
    python benchmarks/gpu.py            # GPU: every grid, CUDA events, writes benchmarks/results/cuda-gpu.md
    python benchmarks/gpu.py --quick    # GPU: the headline rows only
    python benchmarks/gpu.py --plan     # no GPU needed: the model's predictions -> benchmarks/results/cuda-plan-gpu.md

Grids (hidden 20, loss on the last step, as in the paper): RNN T sweep {10 .. 30000} at B = 16 and
1/B sweep B {2 .. 256} at T = 1000 (bitstream input, 1 feature); GRU S / M / L = (T, input) (259, 38),
(517, 24), (1034, 12) at B 16 / 32 / 64. Per row, same weights, one process: ``loss.backward()`` of
torch.nn.RNN/GRU (cuDNN) and of lightning_bppsa.nn.RNN/GRU (the scan on the CUDA kernels), each timed
alone on a graph recorded once (CUDA events, median); the scan kernel alone (sweep and chunked, the
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
import datetime
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
HIDDEN = 20
RNN_LENGTHS = (10, 30, 100, 300, 1000, 3000, 10000, 30000)
RNN_BATCHES = (2, 4, 8, 16, 32, 64, 128, 256)
GRU_SIZES = {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}
GRU_BATCHES = (16, 32, 64)
#: the paper's V100 cuDNN backward per step (Table 4, B = 16): (53.33 - 25.86) s / 2000 iterations / 1000 steps
PAPER_V100_SECONDS_PER_STEP = (53.33 - 25.86) / 2000 / 1000
TARGETS = {"RNN T=1000": 100.0, "RNN T=30000": 300.0, "GRU L": 30.0}


def rows(quick: bool) -> list[tuple[str, int, int, int]]:
    """(cell, B, T, input) of every benchmark row."""
    if quick:
        return [("RNN", 16, 1000, 1), ("RNN", 16, 30000, 1), ("GRU", 64, 1034, 12)]
    grid = [("RNN", 16, t, 1) for t in RNN_LENGTHS]
    grid += [("RNN", b, 1000, 1) for b in RNN_BATCHES if b != 16]
    grid += [("GRU", b, t, i) for (t, i) in GRU_SIZES.values() for b in GRU_BATCHES]
    return grid


# --------------------------------------------------------------------------------------------------
# Measurement (GPU only)
# --------------------------------------------------------------------------------------------------


def event_seconds(fn, repeats: int) -> float:
    """Median of ``repeats`` runs of ``fn`` between CUDA events, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _backward_of(module: nn.Module, x: torch.Tensor):
    output, _ = module(x)
    loss = output[:, -1].pow(2).sum()
    return lambda: loss.backward(retain_graph=True)


def _peak_bytes(module: nn.Module, x: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    module.zero_grad(set_to_none=True)
    output, _ = module(x)
    output[:, -1].pow(2).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _kernel_seconds(cell: str, batch: int, length: int, repeats: int) -> dict[str, float]:
    """The scan kernels alone on factors of this row's shape (contracting, like a trained RNN)."""
    from lightning_bppsa.kernels import cuda as kernels

    from lightning_bppsa import cuda_cost_model

    tiles = 3 if cell == "GRU" else 1
    weight = torch.randn(tiles * HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5
    scales = torch.rand(batch, length, tiles * HIDDEN, device="cuda")
    diagonal = torch.rand(batch, length, HIDDEN, device="cuda") if cell == "GRU" else None
    grad = torch.randn(batch, HIDDEN, device="cuda")
    width = tiles * HIDDEN
    _, chunk = cuda_cost_model.cuda_choose("chunked", n=length, d=HIDDEN, batch=batch, width=width)
    result = {"chunk": chunk}
    for name, c in (("linear", length), ("chunked", chunk)):

        def launch(name: str = name, c: int = c) -> None:
            kernels.scan_factored(weight, scales, diagonal, grad, name, c)

        result[name] = event_seconds(launch, repeats)
        result[f"model_{name}"] = cuda_cost_model.cuda_kernel_seconds(
            name, n=length, d=HIDDEN, batch=batch, width=width, chunk_size=c
        )
    return result


def measure(cell: str, batch: int, length: int, inputs: int) -> dict:
    from lightning_bppsa import nn as bnn

    torch.manual_seed(0)
    ours = getattr(bnn, cell)(inputs, HIDDEN, batch_first=True, algorithm="auto").cuda()
    ref = getattr(nn, cell)(inputs, HIDDEN, batch_first=True).cuda()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(batch, length, inputs, device="cuda")
    x = (x > 0.5).float() if inputs == 1 else x  # the bitstream task of Sec. 4.1 for the RNN rows
    repeats = 3 if length >= 10000 else 10
    r = {
        "bwd_cudnn": event_seconds(_backward_of(ref, x), repeats),
        "bwd_bppsa": event_seconds(_backward_of(ours, x), repeats),
        "mem_cudnn": _peak_bytes(ref, x),
        "mem_bppsa": _peak_bytes(ours, x),
        "path": f"{ours.last_stats.get('path', '')} {ours.last_stats.get('scan_algorithm', '')}".strip(),
    }
    r.update(_kernel_seconds(cell, batch, length, repeats))
    return r


def measured_table(quick: bool, deadline: float = math.inf) -> str:
    """The measured rows; rows not started by ``deadline`` (``time.monotonic()``) are listed as not measured."""
    lines = [
        "| cell | B | T | input | BPPSA path | backward cuDNN ms | backward BPPSA ms | speedup "
        "| sweep kernel ms (model) | chunked kernel ms (model) | chunk | peak MiB cuDNN | peak MiB BPPSA |",
        "|" + " --- |" * 13,
    ]
    for cell, batch, length, inputs in rows(quick):
        if time.monotonic() > deadline:
            lines.append(f"| {cell} | {batch} | {length} | {inputs} | not measured (time limit) |" + " |" * 8)
            continue
        r = measure(cell, batch, length, inputs)
        ms, mib = 1e3, 2.0**-20
        lines.append(
            f"| {cell} | {batch} | {length} | {inputs} | {r['path']} | {r['bwd_cudnn'] * ms:.3f} "
            f"| {r['bwd_bppsa'] * ms:.3f} | {r['bwd_cudnn'] / r['bwd_bppsa']:.1f}x "
            f"| {r['linear'] * ms:.3f} ({r['model_linear'] * ms:.3f}) "
            f"| {r['chunked'] * ms:.3f} ({r['model_chunked'] * ms:.3f}) | {r['chunk']} "
            f"| {r['mem_cudnn'] * mib:.1f} | {r['mem_bppsa'] * mib:.1f} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


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
        "chunks' sweeps) use the warp-resident step instead (state in registers, W loaded once): 149",
        "instructions per RNN step at d = 20 (factored, float32), 289 for the GRU.",
        "",
        "## Registers per kernel (ptxas, `-warn-spills -Werror`: 0 spill bytes, 0 stack)",
        "",
    ]
    if shutil.which("nvcc"):
        usage = cuda_inspect.ptxas_usage(("sm_80", "sm_90"))
        out += ["| kernel | sm_80 | sm_90 |", "| --- | --- | --- |"]
        out += [f"| {k} | {usage['sm_80'][k].registers} | {usage['sm_90'][k].registers} |" for k in kernels.KERNELS]
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
    for label, k, batch, n in [("RNN", 1, 16, 1000), ("RNN", 1, 16, 30000), ("GRU L", 3, 64, 1034), ("GRU L", 3, 16, 1034)]:
        width = k * HIDDEN
        best, chunk = cuda_cost_model.cuda_choose("auto", n=n, d=HIDDEN, batch=batch, width=width)
        for kernel, algorithm, c in (("sweep", "linear", n), ("chunked", "chunked", chunk)):
            flops, nbytes, path = _work(kernel, batch, n, HIDDEN, k, c)
            band = cuda_cost_model.cuda_kernel_band(algorithm, n=n, d=HIDDEN, batch=batch, width=width, chunk_size=c)
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
    mismatches = sum(not torch.equal(kernels.scan_dense(jt, grad, "chunked", 2), sweep) for _ in range(repeats))
    sweep_float32 = kernels.scan_dense(jt.float(), grad.float(), "linear", 1)
    mismatches += sum(
        not torch.equal(kernels.scan_dense(jt.float(), grad.float(), "chunked", 3), sweep_float32) for _ in range(repeats)
    )
    grid = 64 * 10000
    detail = f"{mismatches} of {2 * repeats} launches differ from the sweep (grid {grid} blocks, 1 + 10000 chunks/row)"
    return mismatches == 0, detail


def first_contact() -> int:
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
        write_measurements(quick=False, deadline=start + 570)  # the whole command in < 10 minutes
    else:
        print("grids not measured: fix the failures above first", flush=True)
    print(f"first contact: {time.monotonic() - start:.0f} s", flush=True)
    return 0 if all(ok for _, ok, _ in report) else 1


def write_measurements(quick: bool, deadline: float = math.inf) -> None:
    device = torch.cuda.get_device_name()
    table = measured_table(quick, deadline)
    header = (
        f"# CUDA kernels vs cuDNN autograd ({device})\n\nMeasured by `python benchmarks/gpu.py"
        f"{' --quick' if quick else ''}` on {datetime.date.today()}, torch {torch.__version__}, "
        f"cuDNN {torch.backends.cudnn.version()}. Backward = `loss.backward()` alone (CUDA events, median).\n\n"
    )
    (RESULTS / "cuda-gpu.md").write_text(header + table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="headline rows only")
    parser.add_argument(
        "--first-contact", action="store_true", help="sanitizers + look-back stress, then every grid (GPU, < 10 min)"
    )
    parser.add_argument("--plan", action="store_true", help="write the model's predictions (no GPU needed)")
    args = parser.parse_args()
    if args.plan:
        text = plan()
        (RESULTS / "cuda-plan-gpu.md").write_text(text)
        print(text)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py: no CUDA device here; run it on a GPU machine (or --plan for the model)")
    from lightning_bppsa.kernels import cuda as kernels

    ok, reason = kernels.available()
    if not ok:
        sys.exit(f"benchmarks/gpu.py: the CUDA kernels cannot run: {reason}")
    if args.first_contact:
        sys.exit(first_contact())
    write_measurements(args.quick)


if __name__ == "__main__":
    main()
