"""VGG-11's convolutional chain: BPPSA's sparse scan (``SparseChain``) vs autograd (paper Sec. 4.3 / 5.3).

Model: VGG-11's 8 convolutions (3x3, padding 1) with ReLUs and 5 2x2 max-pools (21 layers), float32
(:func:`lightning_bppsa.recipes.vgg11_pruned.vgg11_features`). Weights: dense (random init) or
97%-pruned by class-blind magnitude pruning (one threshold over all conv weights, See et al. 2016):
the pruned weights leave the Jacobians' patterns, as in the paper's retraining experiment.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_bppsa.bench.measure import interleaved_medians, median_seconds, peak_memory_bytes
from lightning_bppsa.jacobians import linearize
from lightning_bppsa.nn import SparseChain
from lightning_bppsa.recipes.vgg11_pruned import vgg11_features
from lightning_bppsa.sparse_scan import sparse_backprop_scan

__all__ = ["WEIGHTS", "bench_rows", "build_case", "measure"]

WEIGHTS = ("dense", "pruned 97%")


def init_weights(model: nn.Module) -> None:
    """Stand-in for trained weights: N(0, 1) in every conv layer (comparable magnitudes across layers)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.normal_()


def prune_class_blind(model: nn.Module, fraction: float) -> None:
    """Zero the ``fraction`` of conv weights with the smallest magnitude, one threshold for all layers."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    magnitudes = torch.cat([w.detach().abs().reshape(-1) for w in weights])
    threshold = magnitudes.kthvalue(int(fraction * magnitudes.numel())).values
    with torch.no_grad():
        for w in weights:
            w[w.abs() <= threshold] = 0


def rescale(model: nn.Module) -> None:
    """He scale ``sqrt(2 / fan_in)`` per layer after pruning, so activations stay O(1) through 8 convs."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_((2.0 / m.weight[0].numel()) ** 0.5)


def build_case(
    weights: str, batch: int, width: int = 1, size: int = 32
) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """Seeded model, input ``x: (batch, 3, size, size)`` and output gradient (the shape of ``model(x)``).

    Args:
        weights: one of :data:`WEIGHTS`.
        width: divisor of every conv's channel count (1 = the real network).
        size: input height and width (a multiple of 32: five 2x2 pools).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}; got {weights!r}")
    torch.manual_seed(0)
    model = vgg11_features(1 / width)
    init_weights(model)
    if weights == "pruned 97%":
        prune_class_blind(model, 0.97)
    rescale(model)
    x = torch.randn(batch, 3, size, size, requires_grad=True)
    with torch.no_grad():
        grad = torch.randn_like(model(x))
    return model, x, grad


def _step(
    model: nn.Module, x: torch.Tensor, grad: torch.Tensor, algorithm: str | None = None
) -> Callable[[], None]:
    """``model(x).backward(grad)`` (forward + backward), run with the chain's ``algorithm`` when given."""

    def step() -> None:
        if algorithm is not None:
            model.algorithm = algorithm
        x.grad = None
        model.zero_grad(set_to_none=True)
        model(x).backward(grad)

    return step


def time_backward(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, min_run_time: float) -> float:
    """Median seconds of ``model(x).backward(grad)`` (forward + backward)."""
    return median_seconds(_step(model, x, grad), min_run_time=min_run_time)


def time_scan(
    model: nn.Sequential, x: torch.Tensor, grad: torch.Tensor, algorithm: str, min_run_time: float
) -> float:
    """Median seconds of the sparse scan alone, on the chain's Jacobians computed once."""
    h, jacs = x.detach(), []
    with torch.no_grad():
        for layer in model:
            h, jac = linearize(layer, h)
            jacs.append(jac)
    g = grad.reshape(grad.shape[0], -1)
    return median_seconds(
        lambda: sparse_backprop_scan(jacs, g, algorithm=algorithm), min_run_time=min_run_time
    )


def measure(
    model: nn.Sequential,
    chain: SparseChain,
    x: torch.Tensor,
    grad: torch.Tensor,
    min_run_time: float,
    algorithms: Sequence[str] = ("linear", "auto"),
    scan_alone: bool = True,
    rounds: int = 1,
) -> dict[str, Any]:
    """Medians of forward + backward (ms) and peak memory (MiB): autograd and ``chain`` per algorithm.

    Keys: ``autograd_ms``, ``autograd_mib``, ``chain_<algorithm>_ms`` (and ``scan_<algorithm>_ms``, the
    scan alone on given Jacobians, when ``scan_alone``), ``chain_<last algorithm>_mib``; the step times
    are medians over ``rounds`` rounds timing all of them in turn, ``step_speedups`` (autograd / chain with
    the last algorithm) one per round.
    """
    steps = {"autograd": _step(model, x, grad)}
    steps.update({f"chain_{algorithm}": _step(chain, x, grad, algorithm) for algorithm in algorithms})
    times = interleaved_medians(steps, rounds, min_run_time)
    row: dict[str, Any] = {f"{name}_ms": statistics.median(values) * 1e3 for name, values in times.items()}
    last = f"chain_{algorithms[-1]}"
    row["step_speedups"] = [a / b for a, b in zip(times["autograd"], times[last], strict=True)]
    row["autograd_mib"] = peak_memory_bytes(lambda: model(x).backward(grad)) / 2**20
    if scan_alone:
        for algorithm in algorithms:
            row[f"scan_{algorithm}_ms"] = time_scan(model, x, grad, algorithm, min_run_time) * 1e3
    row[f"chain_{chain.algorithm}_mib"] = peak_memory_bytes(lambda: chain(x).backward(grad)) / 2**20
    return row


def bench_rows(
    *,
    quick: bool = False,
    weights: str = "pruned 97%",
    batches: Sequence[int] | None = None,
    width: int | None = None,
    size: int | None = None,
    algorithm: str = "auto",
    min_run_time: float | None = None,
    rounds: int | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows for ``lightning-bppsa bench vgg`` (contract: :data:`lightning_bppsa.cli.bench.BENCHMARKS`).

    Per batch size, two rows: ``method`` ``"autograd"`` (``nn.Sequential``) and ``"bppsa"``
    (``SparseChain`` with ``algorithm``), each with ``T`` (layers in the chain), ``B``, ``backward_s``
    (forward + backward minus forward, medians), ``forward_s``, ``step_s`` and ``peak_bytes``.

    Args:
        quick: batches (1, 2) of a VGG-11 with 1/16 of the channels, short timings.
        weights: ``"dense"`` or ``"pruned 97%"`` (the paper's Sec. 5.3 setting).
        batches: batch sizes (default 1, 4, 16).
        width: divisor of every conv's channel count (default 1, quick 16).
        size: input height and width (a multiple of 32: five 2x2 pools).
        algorithm: the chain's scan algorithm.
        min_run_time: seconds per timing (default 0.5, quick 0.01).
        rounds: rounds timing autograd and BPPSA in turn (default 3, quick 2); the BPPSA row's
            ``speedup_min`` / ``speedup_max`` give the range of the step speedup over them.
    """
    batches = batches or ((1, 2) if quick else (1, 4, 16))
    width = width or (16 if quick else 1)
    size = size or 32
    min_run_time = min_run_time if min_run_time is not None else (0.01 if quick else 0.5)
    rounds = rounds or (2 if quick else 3)
    for batch in batches:
        model, x, grad = build_case(weights, batch, width, size)
        chain = SparseChain.from_sequential(model, algorithm=algorithm)
        r = measure(
            model, chain, x, grad, min_run_time, algorithms=(algorithm,), scan_alone=False, rounds=rounds
        )
        point = {"T": len(model), "B": batch, "weights": weights, "width": width, "size": size}
        for method, module, step_ms, mib in (
            ("autograd", model, r["autograd_ms"], r["autograd_mib"]),
            ("bppsa", chain, r[f"chain_{algorithm}_ms"], r[f"chain_{algorithm}_mib"]),
        ):
            # as in the RNN grid: the chain's forward (with gradients) includes the Jacobian generation
            forward = median_seconds(lambda m=module, x=x: m(x), min_run_time=min_run_time)
            yield {
                "method": method, **point, "algorithm": algorithm if method == "bppsa" else "",
                "backward_s": max(step_ms / 1e3 - forward, 1e-9), "forward_s": forward,
                "step_s": step_ms / 1e3, "peak_bytes": int(mib * 2**20),
                **({"path": chain.last_stats["path"], "speedup_min": min(r["step_speedups"]),
                    "speedup_max": max(r["step_speedups"])} if method == "bppsa" else {"path": "autograd"}),
            }  # fmt: skip
