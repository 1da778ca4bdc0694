"""Model-parallel backward of a long Elman RNN: distributed BPPSA scan vs the sequential pipeline (CPU, gloo).

Run: ``flock /tmp/bppsa-bench.lock /work/venv/bin/python benchmarks/distributed.py``
Writes ``benchmarks/results/distributed-cpu.md``.

A chain of ``T`` steps (hidden ``H``, batch ``B``) with factored Jacobians ``J_t = diag(f'_t) W_hh`` is
split over ``p`` processes (one intra-op thread each). Two backward passes over the same segments:

- BPPSA: :func:`lightning_bppsa.distributed.distributed_backprop_scan` (local reduce, ``⌈log2 p⌉`` message rounds,
  local down-sweep): ``2T/p + ⌈log2 p⌉`` sequential steps for ``p > 1`` (``T`` for ``p = 1``).
- Pipeline (naive model parallelism): rank ``r`` waits for ``g`` at its right boundary from rank
  ``r + 1``, back-propagates its segment step by step, sends ``g`` at its left boundary to ``r - 1``:
  ``T`` sequential steps, all but one rank idle at any time.

Times are medians of repeated runs, each started after a barrier and taken as the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import machine_description
from torch import Tensor

from lightning_bppsa import distributed
from lightning_bppsa.distributed_launch import spawn_gloo
from lightning_bppsa.jacobians import FactoredJacobians
from lightning_bppsa.scan import backprop_scan

T, H, B = 30000, 20, 8
DTYPE = torch.float32
REPEATS = 5
WORLDS = (1, 2, 4)
RESULTS = Path(__file__).parent / "results" / "distributed-cpu.md"


def _segment(rank: int, world: int) -> tuple[FactoredJacobians, Tensor]:
    """This rank's factored Jacobians (same global chain for every p) and the last-state gradient."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(H, H, generator=gen, dtype=DTYPE) / math.sqrt(H)
    base, extra = divmod(T, world)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    slopes = torch.rand(B, T, H, generator=gen, dtype=DTYPE)[:, start:stop].contiguous()
    return FactoredJacobians(weight, slopes), torch.randn(B, H, generator=gen, dtype=DTYPE)


def _timed(fn, repeats: int = REPEATS) -> float:
    """Median over repeats of the slowest rank's wall time of ``fn()`` (one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def _pipeline(jac: FactoredJacobians, grad_last: Tensor, rank: int, world: int) -> Tensor:
    g = grad_last.clone() if rank == world - 1 else torch.empty(B, H, dtype=DTYPE)
    if rank < world - 1:
        dist.recv(g, src=rank + 1)
    out = backprop_scan(jac, g, algorithm="linear")
    if rank > 0:
        dist.send(out[:, 0].contiguous(), dst=rank - 1)
    return out


def _ping_pong(rank: int, shape: tuple[int, ...], repeats: int = 200) -> float:
    """One-way time of a message of ``shape`` between ranks 0 and 1 (half the median round trip)."""
    message = torch.zeros(shape, dtype=DTYPE)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, dst=1)
            dist.recv(message, src=1)
        elif rank == 1:
            dist.recv(message, src=0)
            dist.send(message, dst=0)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2


def _measure(rank: int, world: int, out_path: str) -> None:
    torch.set_num_threads(1)
    jac, grad_last = _segment(rank, world)
    last = grad_last if rank == world - 1 else None
    row = {
        "p": world,
        "bppsa_s": _timed(lambda: distributed.distributed_backprop_scan(jac, last)),
        "pipeline_s": _timed(lambda: _pipeline(jac, grad_last, rank, world)),
    }
    if world == 1:  # per-step costs of the local phases, for the model
        direct = torch.zeros(B, T + 1, H, dtype=DTYPE)
        direct[:, -1] = grad_last
        row["reduce_s"] = _timed(lambda: distributed.segment_summary(jac, direct))
        row["sweep_s"] = _timed(lambda: backprop_scan(jac, direct, algorithm="linear"))
    else:
        row["msg_summary_s"] = _ping_pong(rank, (B, H + 1, H))
        row["msg_vector_s"] = _ping_pong(rank, (B, H))
    if rank == 0:
        Path(out_path).write_text(json.dumps(row))


def _bytes(shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.finfo(DTYPE).bits // 8


def _bppsa_steps(p: int) -> int:
    """Sequential steps on the critical path: reduce, message rounds, down-sweep (the local scan at p = 1)."""
    return T if p == 1 else 2 * math.ceil(T / p) + distributed.scan_rounds(p)


def _report(rows: list[dict], load: tuple[float, float]) -> str:
    one = rows[0]
    t_reduce, t_sweep = one["reduce_s"] / T, one["sweep_s"] / T
    two = next(r for r in rows if r["p"] == 2)  # p = 4 time-slices 2 cores: its latencies are inflated
    t_msg, t_vec = two["msg_summary_s"], two["msg_vector_s"]
    summary_bytes, vector_bytes = _bytes((B, H + 1, H)), _bytes((B, H))
    lines = [
        "# Model-parallel backward of a long RNN: distributed BPPSA vs the sequential pipeline (CPU, gloo)",
        "",
        f"Machine: {machine_description()}. Each rank: one process, `torch.set_num_threads(1)`, gloo over "
        "loopback. **The machine has 2 cores shared with other engineers' jobs: p = 2 already shares them "
        "with other work and p = 4 oversubscribes them (4 processes on 2 cores)**, so p = 4 measures "
        "time-slicing, not parallel speed-up.",
        f"1-minute load average before / after the run: {load[0]:.2f} / {load[1]:.2f} (2 cores): other "
        "jobs were running, so every time below carries contention noise (runs minutes apart moved the "
        "p = 2 rows by up to 2x).",
        "Command: `flock /tmp/bppsa-bench.lock /work/venv/bin/python benchmarks/distributed.py`.",
        "",
        f"Workload: Elman RNN chain, T = {T}, hidden H = {H}, batch B = {B}, {DTYPE}, loss on the last "
        "state; factored Jacobians `J_t = diag(f'_t) W_hh`; segments of T/p steps per rank. Times: "
        f"median of {REPEATS} runs (after a warm-up) of the slowest rank, barrier before each.",
        "",
        "| p | BPPSA steps (2⌈T/p⌉ + ⌈log2 p⌉; T at p = 1) | pipeline steps (T) | BPPSA time | "
        "pipeline time | BPPSA messages / bytes per step | pipeline messages / bytes per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["p"]
        rounds = distributed.scan_rounds(p)
        messages = sum(p - (1 << k) for k in range(rounds))
        lines.append(
            f"| {p} | {_bppsa_steps(p)} | {T} | {r['bppsa_s'] * 1e3:.0f} ms | "
            f"{r['pipeline_s'] * 1e3:.0f} ms | {messages} / {messages * summary_bytes} B | "
            f"{p - 1} / {(p - 1) * vector_bytes} B |"
        )

    def bppsa_model(p: int) -> float:
        if p == 1:
            return T * t_sweep
        return math.ceil(T / p) * (t_reduce + t_sweep) + distributed.scan_rounds(p) * t_msg

    def pipeline_model(p: int) -> float:
        return T * t_sweep + (p - 1) * t_vec

    lines += [
        "",
        "Message sizes: BPPSA sends one `(B, H + 1, H)` summary per rank and round "
        f"({summary_bytes} B); the pipeline one `(B, H)` gradient per boundary ({vector_bytes} B). "
        "BPPSA messages per step = Σ_k (p - 2^k) over its ⌈log2 p⌉ rounds (Kogge-Stone).",
        "",
        "## Measured per-step and per-message costs (the model's inputs)",
        "",
        f"- local reduce (summary, matrix-matrix per step): {t_reduce * 1e6:.2f} µs/step",
        f"- local down-sweep = sequential BP step (linear scan, matrix-vector): {t_sweep * 1e6:.2f} µs/step",
        f"- one summary message (gloo, loopback, ping-pong/2, measured at p = 2): {t_msg * 1e6:.1f} µs; "
        f"one gradient vector message: {t_vec * 1e6:.1f} µs",
        "",
        "## What the model predicts (one core per rank, same per-step and per-message costs)",
        "",
        "`BPPSA(p) = ⌈T/p⌉ (t_reduce + t_sweep) + ⌈log2 p⌉ t_msg` (p > 1), "
        "`pipeline(p) = T t_sweep + (p - 1) t_vec` (the scan's 2-matrix compose per round is "
        "negligible next to a message).",
        "",
        "| p | BPPSA predicted | pipeline predicted | predicted speed-up |",
        "|---|---|---|---|",
    ]
    for p in (1, 2, 4, 64, 1024):
        b, s = bppsa_model(p), pipeline_model(p)
        lines.append(f"| {p} | {b * 1e3:.2f} ms | {s * 1e3:.1f} ms | {s / b:.1f}x |")
    lines += [
        "",
        f"Reading: for every step it owns a BPPSA rank does {(t_reduce + t_sweep) / t_sweep:.1f}x the work "
        "of one sequential step (the reduce is a matrix-matrix step, the sweep a matrix-vector one), so it "
        f"needs more than ~{(t_reduce + t_sweep) / t_sweep:.0f} ranks to beat the pipeline; the gain grows "
        "as T/p shrinks until the ⌈log2 p⌉ message rounds dominate, while the pipeline's p - 1 hand-offs "
        "add to its T sequential steps. The model assumes one free core per rank and a per-message cost that "
        "does not grow with p (an assumption: here p = 4's ping-pong was ~2x slower, from oversubscription; "
        "NCCL over NVLink is ~10x cheaper per message, "
        "TCP across nodes similar or dearer). Memory per rank is the segment's factors and states, "
        "O(B T H / p), plus one (B, H + 1, H) summary per round.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown file to write (default {RESULTS})")
    args = parser.parse_args()  # --help only prints: it no longer runs the benchmark over the committed table
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for world in WORLDS:
            out = str(Path(tmp) / f"p{world}.json")
            spawn_gloo(_measure, world, out, timeout_s=300.0, wall_limit_s=3600.0)
            rows.append(json.loads(Path(out).read_text()))
            print(rows[-1], file=sys.stderr, flush=True)
    args.out.write_text(_report(rows, (load_before, os.getloadavg()[0])))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
