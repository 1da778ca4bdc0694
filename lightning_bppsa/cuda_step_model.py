"""The calibrated CUDA model of one recurrent layer's training step: torch's own layer (cuDNN) vs the scan.

Fitted on measurements, not derived from instruction counts: the calibration grid of ``benchmarks/gpu.py`` on
one H100 80GB HBM3 (2026-11-26 18:24-18:29 UTC, torch 2.11.0+cu130, cuDNN 9.19, CuPy 14.2), package commit
eeeac3a (the warp sweep per ``(d, k)``, the chunked kernel's look-back with epoch flags, the forward kernels
per ``H``); the data is ``benchmarks/results/calib-h100-2026-11-26-eeeac3a.csv``. (The first H100 run, of
the older kernels at commit 87e86d4, is ``calib-h100-2026-11-26.csv``: history, no longer fitted.) It is
what the layer plan (:mod:`lightning_bppsa.layer_plan`) uses where it cannot measure: before the first
measurement of a shape, for shapes too large to measure twice, and while ``torch.compile`` traces or a CUDA
graph is captured. It also picks the scan kernel and chunk on CUDA (:func:`fastest_kernel`).

Per call, for a cell with ``G`` gate blocks, hidden ``H``, scan state ``d``, factored operand rows ``m``,
batch ``B`` and ``n`` steps (seconds):

- torch (cuDNN's persistent kernels): ``max(host, gpu + n (step + wide G H² + √B row + B batch + B mac G H²))``;
- scan: ``max(host, gpu + forward) + kernel + n B G H elementwise``: the host's Python up to the scan's launch
  (~1.2 ms, more than cuDNN's whole step at small sizes) overlaps the forward kernel (:func:`forward_seconds`:
  ``n`` steps of a constant per kernel family), the scan and the backward's elementwise work come after both
  (measured additive: at T = 100 the d = 64 / 128 steps are ~1.1 ms plus their kernel alone);
- the scan kernels (:func:`kernel_seconds`, for a layer's per-step gradient: ``affine``): the sweep ``n``
  dependent steps (warp-resident for ``d <= 32``: ``n (w0 + w1 m)``, the same for every ``B`` measured; else a
  block per row streaming its operand tile: ``n s d min(m, 128)`` per wave of blocks); the chunked kernel
  every block's ``c`` matrix steps (``matrix_step + matrix_pass x passes x m``: a pass covers ``2 x 2``
  outputs per thread of the ``(d + 1) x d`` aggregate, so d = 32 takes two passes of 256 threads) in waves of
  the blocks an SM holds, or the SMs' throughput over all ``B n`` steps, whichever is longer; ``p`` dependent
  carries (``~ d²`` each); the chunk's sweep. Where its matrices do not fit shared memory the launch is the
  sweep (:func:`runs_chunked`), and so is the model.

A layer whose backward runs the fused kernel (``recurrent_cuda.<cell>_backward``: the linear recursion and its
gate gradients in one launch, in place of the factored scan) costs :func:`fused_seconds` instead of the scan
kernel: a launch plus the form of the forward kernel's steps (:func:`_row_kernel_seconds`) with constants of
its own. Both directions' kernels come in three families: float32 ``H <= 32`` compiled per ``H`` (``W_hh``
in registers, the RNN cells in one warp, the gated cells' forward a lane a gate of a unit: a constant a step, measured
on the RNN only); float32 ``32 < H <= 256`` compiled per cell and ``H``
(``recurrent_cuda.wide_layout``: a unit's share of ``W_hh`` split over its lanes, in registers or partly in
shared memory: a step plus a lane's multiply-adds from each, in waves of the blocks the SMs hold by
registers); float64, generic (``W_hh`` in shared memory; its constants fitted on the float32 shared-memory
kernels they replaced, at eeeac3a and be3c8e9). The fused kernel's constants and the float32 forward's above
a warp are fitted by ``benchmarks/fit_cuda_model.py --fused-data`` on an H200's grid at 20dff7a
(``results/cuda-calib-h200-20dff7a.csv``, the RNN kernels' steps in groups of 4): the 72 ``fused_kernel``
launches (median error 20%, worst 1.61x: a step takes up to ~1.5x longer at B >= 16 than at B = 1, which the
form does not carry) and the 53 scan steps at ``d > 32`` with their backward as measured alone (median 6%,
worst 1.45x), RNN ``H = 256`` (part of ``W_hh`` in shared memory) at T = 1000 and 10000 among them, so the
fused step is priced up to :data:`FUSED_MEASURED_HIDDEN`. With them the model's pick is within 10% of the
faster measured path at 68 of that grid's 72 shapes: 1.21x and 1.32x at two host-bound T = 100 shapes (two
copies of cuDNN's module read up to 15% apart there), 1.18x at d = 64 B = 16 T = 1000 and 1.14x at d = 128
B = 1 T = 1000; at d = 256 T >= 1000 it picks the fused kernel's step, measured 1.5-1.7x faster than cuDNN's
(``tests/test_cuda_step_model.py``; on the grid at a4e83a3, whose kernels were replaced since, 63 of 64; on
the grid at 213b46c, its chunked kernel forming the aggregates in one warp at d <= 32, 70 of 72, the two
others host-bound T = 1000 shapes within 15%). Layers whose ``W_hh`` no block holds run as clusters of
blocks on sm_90 (``recurrent_cuda.launch_layout``): a lane's share as in one block, plus ``cluster_step``
per block of the cluster a step, fitted on the 72 launches of the H200's layout sweep at f9d52e5 that ran
as clusters (``results/cluster-layouts-h200-f9d52e5.md``, ``fit_cuda_model.py --layout-data``: GRU H = 128 /
192 / 256 / 384 and LSTM H = 160 forward and backward, B = 16, every cluster and lanes a unit; median error
1.22x, worst 2.03x, the launches' own layouts within 0.56-1.22x). Whole steps of those layers are underpriced
(GRU H = 256 / 384 and LSTM B = 32 H = 256 at 213b46c: 0.56-0.81x; the ``G`` terms are a form, not a fit), and
cuDNN's more (the form fitted on the RNN grid: 9.4-19.6 ms against 34.5-36.7 measured, where cuDNN's
persistent kernels no longer hold the weights), so the model's scan-over-cuDNN ratio there is below the
measured one: it picks the scan only where it beats that underestimate.

Fitted by least squares on the log of the ratio (``benchmarks/fit_cuda_model.py``, which prints every row's
error): the kernels on 192 launches alone (median error 7%, all within 1.4x but the three of one anomalous
shape, d = 20 B = 1 T = 100), cuDNN's step on 72 shapes (median 11%, worst 1.56x at T = 100, where cuDNN
measured 0.57-1.33 ms), the scan step on its 87 measured steps at d <= 32 (forced linear / chunked and
``auto``'s; median 6%, worst 1.41x; above, the forward kernels since replaced ran) of the RNN grid
d in {8..256} x B in {1..256} x T in {100, 1000, 10000}. At 58 of the 59 shapes where both were measured,
the path it picks costs within 10% of the faster; at d = 20 B = 64 T = 1000 1.13x, within the spread of
repeated measurements there (``tests/test_cuda_step_model.py``). Only RNN cells (``G = 1``) were measured:
the ``G`` terms are a form, not a fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_bppsa.kernels import cuda as cuda_kernel
from lightning_bppsa.kernels import recurrent_cuda

__all__ = ["FUSED_MEASURED_HIDDEN", "KERNELS", "STEPS", "KernelConstants", "StepConstants", "fastest_kernel",
           "forward_seconds", "fused_seconds", "kernel_seconds", "runs_chunked", "step_seconds"]  # fmt: skip

#: the widest hidden size at which a whole step with the fused backward was measured at T >= 1000, where the
#: forward kernel's time shows (a GRU of H = 384, clusters of 8 blocks, in the H200's step table at 213b46c;
#: the RNN grid's widest, 256, at 20dff7a; 128 at a4e83a3): the model does not extrapolate the scan's step
#: beyond it
FUSED_MEASURED_HIDDEN = 384

H100_SMS = 132
H100_SHARED = 232448  # the per-block shared memory opt-in the kernels launch with on an H100
H100_SM_SHARED = 233472  # shared memory per SM (228 KiB) ...
H100_BLOCK_RESERVED = 1024  # ... of which the driver reserves 1 KiB per resident block
H100_SM_THREADS = 2048
H100_SM_BLOCKS = 32
H100_CLUSTER_LIMIT = 8  # the most blocks of a cluster the kernels launch on sm_90 (the portable size)


@dataclass(frozen=True)
class KernelConstants:
    """Seconds per unit of the scan kernels' terms (see the module docstring)."""

    launch: float = 3.87e-05
    warp_step: float = 8.23e-08
    warp_operand: float = 3.83e-09
    sweep_element: float = 1.51e-09
    chunk_fixed: float = 5.51e-05
    matrix_step: float = 7.49e-07
    matrix_pass: float = 7.68e-08
    carry: float = 9.36e-07
    carry_element: float = 7.55e-10
    throughput: float = 5.94e-10
    throughput_slot: float = 4.5e-13


@dataclass(frozen=True)
class StepConstants:
    """Seconds per unit of the whole-step terms (see the module docstring)."""

    torch_host: float = 0.000897
    torch_gpu: float = 0.000289
    torch_step: float = 6.5e-07
    torch_wide: float = 3.79e-11
    torch_row: float = 5.07e-08
    torch_batch: float = 2.36e-09
    torch_mac: float = 2.39e-13
    scan_host: float = 0.00118
    scan_gpu: float = 1.69e-05
    forward_step: float = 2.08e-07
    generic_step: float = 2e-07
    generic_unit: float = 5e-09
    elementwise: float = 3.48e-11
    #: the fused backward kernel's launch and step, per kernel family as the forward's
    fused_launch: float = 4.13e-05
    fused_step: float = 1.08e-07
    fused_generic_step: float = 4.08e-07
    fused_generic_unit: float = 5.41e-09
    #: the float32 kernels compiled per H > 32 (W_hh in registers, or partly): a step, per multiply-add of a
    #: lane's share in registers, per multiply-add of it in shared memory; the forward's and the backward's
    forward_register_step: float = 2.88e-07
    forward_register_unit: float = 4.33e-10
    forward_register_shared: float = 6.3e-09
    fused_register_step: float = 8.68e-08
    fused_register_unit: float = 1.44e-09
    fused_register_shared: float = 8.92e-09
    #: what a step of a kernel run as a cluster of blocks adds per block of the cluster, each direction (the
    #: cluster barrier, the peer stores): fitted on the H200's launches of every layout at f9d52e5
    #: (``fit_cuda_model.py --layout-data``)
    cluster_step: float = 1.42e-07


KERNELS = KernelConstants()
STEPS = StepConstants()


def _chunked_launch(
    *,
    n: int,
    d: int,
    m: int,
    chunk: int,
    batch: int,
    element_bytes: int,
    shared_limit: int = H100_SHARED,
    affine: bool = True,
) -> cuda_kernel.Launch:
    return cuda_kernel.launch_config(
        factored=True, element_bytes=element_bytes, n=max(n, 1), batch=batch, d=d, m=m, affine=affine,
        algorithm="chunked", chunk_size=chunk, shared_limit=shared_limit,
    )  # fmt: skip


def runs_chunked(
    *, n: int, d: int, m: int, chunk: int, element_bytes: int = 4, shared_limit: int = H100_SHARED
) -> bool:
    """Whether a chunked launch of this shape runs the chunked kernel (else its matrices do not fit shared
    memory, or there is one chunk, and the launch is the sweep)."""
    launch = _chunked_launch(
        n=n, d=d, m=m, chunk=chunk, batch=1, element_bytes=element_bytes, shared_limit=shared_limit
    )
    return launch.kernel.startswith("bppsa_chunked")


def _sweep_seconds(k: KernelConstants, *, n: int, d: int, m: int, batch: int, element_bytes: int) -> float:
    if d <= cuda_kernel.WARP:
        return n * (k.warp_step + k.warp_operand * m)
    resident = max(1, H100_SHARED // (element_bytes * d * m + 1))
    waves = math.ceil(batch / (H100_SMS * resident))
    return n * k.sweep_element * d * min(m, 128) * waves


def _waves(grid: int, block: int, shared_bytes: int) -> int:
    """Rounds of ``grid`` blocks on an H100's SMs (threads, blocks and shared memory per SM bound the blocks
    resident at once; registers are not counted)."""
    per_sm = min(
        H100_SM_BLOCKS, H100_SM_THREADS // block, H100_SM_SHARED // (shared_bytes + H100_BLOCK_RESERVED)
    )
    return math.ceil(grid / (H100_SMS * max(1, per_sm)))


def kernel_seconds(
    algorithm: str,
    *,
    n: int,
    d: int,
    m: int,
    batch: int,
    chunk: int,
    element_bytes: int = 4,
    affine: bool = True,
    constants: KernelConstants = KERNELS,
) -> float:
    """Predicted seconds of one scan launch (``"linear"``: the sweep; ``"chunked"`` / ``"blelloch"``: the
    chunked kernel with chunk ``chunk``, or the sweep where that launch is the sweep). ``affine``: a per-step
    gradient, as a layer's backward passes (the chunk aggregates get a row: ``d + 1`` of them)."""
    k = constants
    sweep = _sweep_seconds(k, n=n, d=d, m=m, batch=batch, element_bytes=element_bytes)
    launch = _chunked_launch(
        n=n, d=d, m=m, chunk=chunk, batch=batch, element_bytes=element_bytes, affine=affine
    )
    if algorithm == "linear" or not launch.kernel.startswith("bppsa_chunked"):
        return k.launch + sweep
    # a matrix step: each thread computes MATRIX_BLOCK² outputs over the m operand rows, in passes over the
    # (d + affine) x d outputs (d = 32: one pass, two with the affine row). Where one warp forms the aggregates
    # instead (cuda_kernel.warp_aggregates: float32, d <= 32) the block product's price stands for it: on the
    # H200 at 213b46c the warp was 2-3x faster at c = 256, slower at c = 16 (not refitted: the picks on that
    # grid stay within 10% of the faster measured path at 70 of 72 shapes)
    block = cuda_kernel.MATRIX_BLOCK
    threads = cuda_kernel.product_threads(d + int(affine), d)
    cells = math.ceil((d + int(affine)) / block) * math.ceil(d / block)
    passes = math.ceil(cells / threads)
    matrix = k.matrix_step + k.matrix_pass * passes * m
    # every block's c matrix steps, in waves of resident blocks, or the SMs' throughput over all B n steps
    # (every lane of every pass issues, idle ones included)
    waves = _waves(launch.grid, threads, launch.shared_bytes + launch.static_bytes)
    issued = passes * threads * block * block * m
    aggregates = max(waves * chunk * matrix, batch * n * (k.throughput + k.throughput_slot * issued))
    return (
        k.chunk_fixed + aggregates + math.ceil(n / chunk) * (k.carry + k.carry_element * d * d)
        + _sweep_seconds(k, n=chunk, d=d, m=m, batch=1, element_bytes=element_bytes)
    )  # fmt: skip


def _chunks(n: int) -> list[int]:
    """Chunk sizes worth trying: powers of two below ``n`` and ``~sqrt(n)`` (the balance of both phases)."""
    return sorted(
        {2**k for k in range(1, int(math.log2(max(n, 2))) + 1) if 2**k < n} | {max(2, math.isqrt(n))}
    )


def fastest_kernel(
    algorithm: str,
    *,
    n: int,
    d: int,
    m: int,
    batch: int,
    element_bytes: int = 4,
    constants: KernelConstants = KERNELS,
) -> tuple[str, int]:
    """``(algorithm, chunk)`` the CUDA kernels run: ``"linear"`` as asked; ``"chunked"`` / ``"blelloch"`` with
    the chunk predicted fastest, or ``"linear"`` where no chunked launch fits (said, not silent: the plan then
    reports the sweep); ``"auto"`` the faster of the two."""
    if n <= 1 or algorithm == "linear":
        return "linear", 1
    fitting = [c for c in _chunks(n) if runs_chunked(n=n, d=d, m=m, chunk=c, element_bytes=element_bytes)]
    if not fitting:
        return "linear", 1
    common = dict(n=n, d=d, m=m, batch=batch, element_bytes=element_bytes, constants=constants)
    chunk = min(fitting, key=lambda c: kernel_seconds("chunked", chunk=c, **common))
    if algorithm != "auto":
        return algorithm, chunk
    chunked = kernel_seconds("chunked", chunk=chunk, **common)
    linear = kernel_seconds("linear", chunk=1, **common)
    return ("chunked", chunk) if chunked < linear else ("linear", 1)


#: the cell kind of a gate count (the float32 kernels above one warp are laid out per cell)
_CELL_OF_GATES = {1: "rnn_tanh", 3: "gru", 4: "lstm"}


def _row_kernel_seconds(
    direction: str,
    *,
    gates: int,
    hidden: int,
    n: int,
    batch: int,
    element_bytes: int,
    per_h: float,
    generic: tuple[float, float],
    register: tuple[float, float, float],
    cluster_step: float,
    layout: recurrent_cuda.WideLayout | None = None,
) -> float:
    """``n`` dependent steps of the ``direction`` kernel with one block per batch row: float32 with ``H <= 32``
    compiled per ``H`` (``W_hh`` in registers: the RNN's measured the same a step for every ``H`` of the grid,
    ``per_h``, which prices the gated cells' too); float32 above that compiled per ``H`` with a unit's share of
    ``W_hh`` split over its lanes, in registers or partly in shared memory (``recurrent_cuda.wide_layout``:
    ``register`` = a step, a lane's multiply-add from registers, from shared memory: times the block's threads
    over 256), in waves of the blocks the SMs hold by registers, a row's units over a cluster of ``Q`` blocks
    where one block cannot hold ``W_hh`` (``recurrent_cuda.launch_layout`` on an H100: a lane's share as in
    one block, each step ``Q cluster_step`` more; ``layout``: this one, not the launch's); else generic
    (``W_hh`` in shared memory, a step growing with ``G H``: float64)."""
    if element_bytes == 4 and hidden <= recurrent_cuda.FIXED_HIDDEN:
        return n * per_h
    cell = _CELL_OF_GATES.get(gates)
    if layout is None and element_bytes == 4 and cell:
        layout = _wide_layout(cell, hidden, direction, batch)
    if layout is None:
        return n * (generic[0] + generic[1] * gates * hidden)
    rows = gates if direction == "forward" else 1  # a forward lane holds a pack of each gate's row
    on_chip, in_shared = 4 * rows * layout.register_packs, 4 * rows * (layout.lane_packs - layout.register_packs)
    held = recurrent_cuda.wide_blocks_per_sm(cell, hidden, direction, layout.cluster)
    waves = math.ceil(batch * layout.cluster / (H100_SMS * held))
    # a step's shared-memory reads are the whole block's (bandwidth, fitted on blocks of ~256 threads); a
    # cluster's barrier and peer stores grow with its blocks
    in_shared *= recurrent_cuda.wide_threads(math.ceil(hidden / layout.cluster), layout.split) / 256
    barrier = cluster_step * layout.cluster if layout.cluster > 1 else 0.0
    return n * waves * (register[0] + barrier + register[1] * on_chip + register[2] * in_shared)


def _wide_layout(cell: str, hidden: int, direction: str, batch: int) -> recurrent_cuda.WideLayout | None:
    """The layout of the float32 ``direction`` kernel of ``hidden`` > 32 for ``batch`` rows on an H100: one
    block, or a cluster of blocks where one cannot hold ``W_hh``; ``None`` where neither runs."""
    spread = batch <= recurrent_cuda.SPREAD_BATCH
    clustered = recurrent_cuda.launch_layout(cell, hidden, direction, H100_SHARED, H100_CLUSTER_LIMIT, spread)
    return clustered or recurrent_cuda.wide_layout(cell, hidden, direction)


def forward_seconds(
    *, gates: int, hidden: int, n: int, batch: int, element_bytes: int = 4, constants: StepConstants = STEPS,
    layout: recurrent_cuda.WideLayout | None = None,
) -> float:  # fmt: skip
    """Predicted seconds of the scan's forward kernel over ``n`` steps of ``batch`` rows
    (:mod:`lightning_bppsa.kernels.recurrent_cuda`, :func:`_row_kernel_seconds`; ``layout``: of ``W_hh``,
    where not the launch's)."""
    s = constants
    return _row_kernel_seconds(
        "forward", gates=gates, hidden=hidden, n=n, batch=batch, element_bytes=element_bytes, per_h=s.forward_step,
        generic=(s.generic_step, s.generic_unit),
        register=(s.forward_register_step, s.forward_register_unit, s.forward_register_shared),
        cluster_step=s.cluster_step, layout=layout,
    )  # fmt: skip


def fused_seconds(
    *, gates: int, hidden: int, n: int, batch: int, element_bytes: int = 4, constants: StepConstants = STEPS,
    layout: recurrent_cuda.WideLayout | None = None,
) -> float:  # fmt: skip
    """Predicted seconds of the fused backward kernel over ``n`` steps of ``batch`` rows: the form of the
    forward kernel's (:func:`_row_kernel_seconds`) with its own constants (``fused_*``, and a launch
    ``fused_launch``: fitted on an H200's launches by ``benchmarks/fit_cuda_model.py --fused-data``, see the
    module docstring)."""
    s = constants
    return s.fused_launch + _row_kernel_seconds(
        "backward", gates=gates, hidden=hidden, n=n, batch=batch, element_bytes=element_bytes, per_h=s.fused_step,
        generic=(s.fused_generic_step, s.fused_generic_unit),
        register=(s.fused_register_step, s.fused_register_unit, s.fused_register_shared),
        cluster_step=s.cluster_step, layout=layout,
    )  # fmt: skip


def step_seconds(
    path: str,
    *,
    gates: int,
    hidden: int,
    d: int,
    m: int,
    batch: int,
    n: int,
    algorithm: str = "auto",
    element_bytes: int = 4,
    fused: bool = False,
    constants: StepConstants = STEPS,
    kernels: KernelConstants = KERNELS,
) -> float:
    """Predicted seconds of one layer's training step (forward + backward) on the ``path`` ``"torch"``
    (cuDNN) or ``"scan"`` (its kernels, ``algorithm`` resolved by :func:`fastest_kernel`; ``fused``: the
    backward is the fused kernel, :func:`fused_seconds`, infinite above :data:`FUSED_MEASURED_HIDDEN`)."""
    s = constants
    macs = gates * hidden * hidden
    if path == "torch":
        per_step = (s.torch_step + s.torch_wide * macs + math.sqrt(batch) * s.torch_row + batch * s.torch_batch
                    + batch * s.torch_mac * macs)  # fmt: skip
        return max(s.torch_host, s.torch_gpu + n * per_step)
    if path != "scan":
        raise ValueError(f"path must be 'torch' or 'scan'; got {path!r}")
    if fused:
        if hidden > FUSED_MEASURED_HIDDEN:  # never measured there: not priced, so cuDNN's step is the pick
            return math.inf
        kernel = fused_seconds(gates=gates, hidden=hidden, n=n, batch=batch, element_bytes=element_bytes, constants=s)
    else:
        name, chunk = fastest_kernel(
            algorithm, n=n, d=d, m=m, batch=batch, element_bytes=element_bytes, constants=kernels
        )
        kernel = kernel_seconds(name, n=n, d=d, m=m, batch=batch, chunk=chunk, element_bytes=element_bytes,
                                constants=kernels)  # fmt: skip
    forward = forward_seconds(gates=gates, hidden=hidden, n=n, batch=batch, element_bytes=element_bytes, constants=s)
    # the host's Python up to the scan's launch overlaps the forward; the scan and what follows it do not
    return max(s.scan_host, s.scan_gpu + forward) + kernel + s.elementwise * batch * n * gates * hidden
