"""Inference (no gradients) on CPU: torch's fused RNN / GRU / LSTM forward vs the converted module's forward kernel.

Under ``torch.no_grad()`` a converted recurrent module runs its compiled forward kernel alone
(``last_stats["path"] == "forward kernel"``). Same weights, both arms interleaved in one process (A B A B,
rounds of ``torch.utils.benchmark`` medians), hidden 20, float32, batch first.

    OMP_NUM_THREADS=1 flock /tmp/bppsa-bench.lock python benchmarks/inference.py

Writes ``benchmarks/results/inference-cpu.md`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
from pathlib import Path

import torch
from torch import nn

from lightning_bppsa.bench.measure import interleaved_medians, load_average, machine_description, set_threads
from lightning_bppsa.nn import convert

RESULTS = Path(__file__).parent / "results" / "inference-cpu.md"
HIDDEN = 20
#: (label, torch class, input size, layers, bidirectional)
ROWS = [
    ("RNN", nn.RNN, 1, 1, False),
    ("GRU", nn.GRU, 12, 1, False),
    ("LSTM", nn.LSTM, 12, 1, False),
    ("GRU 2 layers bidirectional", nn.GRU, 12, 2, True),
]


def measure(batch: int, length: int, rounds: int, min_run_time: float) -> list[dict[str, object]]:
    """One result per row of :data:`ROWS`: the median over rounds of each arm's median seconds."""
    results = []
    for label, cls, inputs, layers, bidirectional in ROWS:
        torch.manual_seed(0)
        ref = cls(inputs, HIDDEN, num_layers=layers, bidirectional=bidirectional, batch_first=True).eval()
        ours = convert(copy.deepcopy(ref))
        x = torch.randn(batch, length, inputs)
        with torch.no_grad():
            arms = {"torch": lambda ref=ref, x=x: ref(x), "ours": lambda ours=ours, x=x: ours(x)}
            times = interleaved_medians(arms, rounds, min_run_time)
            difference = (ref(x)[0] - ours(x)[0]).abs().max().item()
        assert ours.last_stats["path"] == "forward kernel", ours.last_stats
        torch_s, ours_s = statistics.median(times["torch"]), statistics.median(times["ours"])
        results.append({"row": label, "torch_ms": torch_s * 1e3, "ours_ms": ours_s * 1e3, "diff": difference})
    return results


def render(results: list[dict[str, object]], batch: int, length: int, rounds: int, loads: list) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Inference on CPU: torch's fused forward vs the forward kernel\n",
        f"Machine: {machine_description()}. Measured {when} with `benchmarks/inference.py`; load average "
        f"(1, 5, 15 min) {' / '.join(f'{v:.2f}' for v in loads[0])} before, "
        f"{' / '.join(f'{v:.2f}' for v in loads[1])} after.\n",
        f"B={batch}, T={length}, hidden {HIDDEN}, float32, batch first, under `torch.no_grad()`; medians of "
        f"{rounds} interleaved rounds of `torch.utils.benchmark` medians. Max abs diff: outputs, ours vs torch.\n",
        "| layer | torch ms | ours ms | speedup | max abs diff |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['row']} | {r['torch_ms']:.2f} | {r['ours_ms']:.2f} | {r['torch_ms'] / r['ours_ms']:.1f}x "
            f"| {r['diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    set_threads(args.threads)
    before = load_average()
    results = measure(args.batch, args.length, args.rounds, args.min_run_time)
    table = render(results, args.batch, args.length, args.rounds, [before, load_average()])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
