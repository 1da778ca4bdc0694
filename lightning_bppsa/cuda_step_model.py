"""The calibrated CUDA model of one recurrent layer's training step: torch's own layer (cuDNN) vs the scan.

Fitted on measurements (an H100, 2026-11-26, torch 2.11 + cuDNN 9.19, package commit 87e86d4; the data is
``benchmarks/results/calib-h100-2026-11-26.csv``, its provenance beside it), not derived from instruction
counts. It is what the layer plan (:mod:`lightning_bppsa.layer_plan`) uses where it cannot measure: before
the first measurement of a shape, for shapes too large to measure twice, and while ``torch.compile`` traces
or a CUDA graph is captured. It also picks the scan kernel and chunk on CUDA (:func:`fastest_kernel`).

Per call, for a cell with ``G`` gate blocks, hidden ``H``, scan state ``d``, factored operand rows ``m``,
batch ``B`` and ``n`` steps (seconds):

- torch (cuDNN's persistent kernels): ``max(host, gpu + n (step + wide G H² + √B row + B mac G H²))`` (the
  measured cost per step grows as √B below B = 256);
- scan: ``max(host, gpu + forward + kernel + n B G H elementwise)``: the host's Python per call (~1.6 ms a
  step today, more than cuDNN's whole step at small sizes) against the GPU's work, whichever is longer;
- the scan kernels (:func:`kernel_seconds`): the sweep ``n`` dependent steps (warp-resident for ``d <= 32``:
  ``n (w0 + w1 m + w2 B m)``; else a block per row streaming its operand tile: ``n s d min(m, 128)`` per
  wave of blocks); the chunked kernel ``c`` matrix steps (``~ d m`` and ``d² m``: the tile is re-read), ``p``
  dependent carries and a throughput term ``B n d m (q1 + q2 d)``; where its matrices do not fit shared memory
  the launch is the sweep (:func:`runs_chunked`), and so is the model.

Fitted by least squares on the log of the ratio (``benchmarks/fit_cuda_model.py``): kernels over 256 measured
launches (median error ~17%, worst ~3x at d >= 64, where the scan never wins), the steps over the 72 rows of
the RNN grid d in {8..256} x B in {1..256} x T in {100, 1000, 10000}.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_bppsa.kernels import cuda as cuda_kernel

__all__ = ["KERNELS", "STEPS", "KernelConstants", "StepConstants", "fastest_kernel", "kernel_seconds",
           "runs_chunked", "step_seconds"]  # fmt: skip

H100_SMS = 132
H100_SHARED = 232448  # the per-block shared memory opt-in the kernels launch with on an H100


@dataclass(frozen=True)
class KernelConstants:
    """Seconds per unit of the scan kernels' terms (see the module docstring)."""

    launch: float = 7.15e-05
    warp_step: float = 2.17e-07
    warp_operand: float = 5.27e-09
    warp_row_operand: float = 2.33e-11
    sweep_element: float = 1.61e-09
    chunk_fixed: float = 7.85e-05
    matrix_step: float = 1.16e-06
    matrix_element: float = 3.03e-09
    matrix_cube: float = 2.7e-12
    carry: float = 1.38e-06
    carry_element: float = 1.75e-11
    throughput: float = 2.62e-12
    throughput_wide: float = 4.75e-13


@dataclass(frozen=True)
class StepConstants:
    """Seconds per unit of the whole-step terms (see the module docstring)."""

    torch_host: float = 0.000932
    torch_gpu: float = 0.000158
    torch_step: float = 5.63e-07
    torch_wide: float = 4.23e-11
    torch_row: float = 8.24e-08
    torch_mac: float = 2.38e-13
    scan_host: float = 0.00162
    scan_gpu: float = 0.000423
    forward_step: float = 3.57e-07
    forward_wide: float = 3.18e-11
    forward_row: float = 1.63e-11
    forward_mac: float = 3.79e-12
    elementwise: float = 1.3e-11


KERNELS = KernelConstants()
STEPS = StepConstants()


def runs_chunked(*, n: int, d: int, m: int, chunk: int, element_bytes: int = 4, shared_limit: int = H100_SHARED) -> bool:
    """Whether a chunked launch of this shape runs the chunked kernel (else its matrices do not fit shared
    memory, or there is one chunk, and the launch is the sweep)."""
    launch = cuda_kernel.launch_config(
        factored=True, element_bytes=element_bytes, n=max(n, 1), batch=1, d=d, m=m, affine=True,
        algorithm="chunked", chunk_size=chunk, shared_limit=shared_limit,
    )  # fmt: skip
    return launch.kernel.startswith("bppsa_chunked")


def _sweep_seconds(k: KernelConstants, *, n: int, d: int, m: int, batch: int, element_bytes: int) -> float:
    if d <= cuda_kernel.WARP:
        return n * (k.warp_step + k.warp_operand * m + k.warp_row_operand * batch * m)
    resident = max(1, H100_SHARED // (element_bytes * d * m + 1))
    waves = math.ceil(batch / (H100_SMS * resident))
    return n * k.sweep_element * d * min(m, 128) * waves


def kernel_seconds(
    algorithm: str, *, n: int, d: int, m: int, batch: int, chunk: int, element_bytes: int = 4,
    constants: KernelConstants = KERNELS,
) -> float:
    """Predicted seconds of one scan launch (``"linear"``: the sweep; ``"chunked"`` / ``"blelloch"``: the
    chunked kernel with chunk ``chunk``, or the sweep where that launch is the sweep)."""
    k = constants
    sweep = _sweep_seconds(k, n=n, d=d, m=m, batch=batch, element_bytes=element_bytes)
    if algorithm == "linear" or not runs_chunked(n=n, d=d, m=m, chunk=chunk, element_bytes=element_bytes):
        return k.launch + sweep
    carries = math.ceil(n / chunk)
    matrix = k.matrix_step + k.matrix_element * d * m + k.matrix_cube * d * d * m
    return (
        k.chunk_fixed + chunk * matrix + carries * (k.carry + k.carry_element * d)
        + batch * n * d * m * (k.throughput + k.throughput_wide * d)
        + _sweep_seconds(k, n=chunk, d=d, m=m, batch=1, element_bytes=element_bytes)
    )  # fmt: skip


def _chunks(n: int) -> list[int]:
    """Chunk sizes worth trying: powers of two below ``n`` and ``~sqrt(n)`` (the balance of both phases)."""
    return sorted({2**k for k in range(1, int(math.log2(max(n, 2))) + 1) if 2**k < n} | {max(2, math.isqrt(n))})


def fastest_kernel(algorithm: str, *, n: int, d: int, m: int, batch: int, element_bytes: int = 4) -> tuple[str, int]:
    """``(algorithm, chunk)`` the CUDA kernels run: ``"linear"`` as asked; ``"chunked"`` / ``"blelloch"`` with
    the chunk predicted fastest, or ``"linear"`` where no chunked launch fits (said, not silent: the plan then
    reports the sweep); ``"auto"`` the faster of the two."""
    if n <= 1 or algorithm == "linear":
        return "linear", 1
    fitting = [c for c in _chunks(n) if runs_chunked(n=n, d=d, m=m, chunk=c, element_bytes=element_bytes)]
    if not fitting:
        return "linear", 1
    chunk = min(fitting, key=lambda c: kernel_seconds("chunked", n=n, d=d, m=m, batch=batch, chunk=c,
                                                      element_bytes=element_bytes))  # fmt: skip
    if algorithm != "auto":
        return algorithm, chunk
    chunked = kernel_seconds("chunked", n=n, d=d, m=m, batch=batch, chunk=chunk, element_bytes=element_bytes)
    linear = kernel_seconds("linear", n=n, d=d, m=m, batch=batch, chunk=1, element_bytes=element_bytes)
    return ("chunked", chunk) if chunked < linear else ("linear", 1)


def step_seconds(
    path: str, *, gates: int, hidden: int, d: int, m: int, batch: int, n: int, algorithm: str = "auto",
    element_bytes: int = 4, constants: StepConstants = STEPS, kernels: KernelConstants = KERNELS,
) -> float:
    """Predicted seconds of one layer's training step (forward + backward) on the ``path`` ``"torch"``
    (cuDNN) or ``"scan"`` (its kernels, ``algorithm`` resolved by :func:`fastest_kernel`)."""
    s = constants
    macs = gates * hidden * hidden
    if path == "torch":
        gpu = s.torch_gpu + n * (s.torch_step + s.torch_wide * macs + math.sqrt(batch) * s.torch_row + batch * s.torch_mac * macs)
        return max(s.torch_host, gpu)
    if path != "scan":
        raise ValueError(f"path must be 'torch' or 'scan'; got {path!r}")
    name, chunk = fastest_kernel(algorithm, n=n, d=d, m=m, batch=batch, element_bytes=element_bytes)
    kernel = kernel_seconds(name, n=n, d=d, m=m, batch=batch, chunk=chunk, element_bytes=element_bytes,
                            constants=kernels)  # fmt: skip
    forward = n * (s.forward_step + s.forward_wide * macs + batch * (s.forward_row + s.forward_mac * macs))
    return max(s.scan_host, s.scan_gpu + forward + kernel + s.elementwise * batch * n * gates * hidden)
