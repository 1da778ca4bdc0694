"""The CUDA kernels' instruction-level model (:mod:`lightning_bppsa.kernels.cuda`): the time of one launch
from the instructions its steps issue, as a band (``benchmarks/gpu.py --plan`` reports it beside the
measurements). The plan picks kernels with the model calibrated on H100 measurements instead
(:mod:`lightning_bppsa.cuda_step_model`, through :func:`cuda_choose`). Against the H100's launches of the
kernels of commit eeeac3a (``benchmarks/results/calib-h100-2026-11-26-eeeac3a.csv``, ``cuda-gpu.md``) the
band's middle is 0.86-1.19x the warp sweep (d <= 32, T >= 1000) and ~0.4-0.6x the chunked kernel (optimistic:
its matrix steps and look-back are the older, unmeasured counts).

It was written before any GPU was available. The instruction counts are measured (the SASS of ``scan.cu``, see
:class:`StepInstructions`); the device figures are assumptions (H100 SXM class, :class:`CudaModel`), but one:
the issue rate of a lone warp, read off the warp sweeps' measurements.
Every step runs loops that the compiler does not unroll (the warp sweep: unrolled per ``(d, k)``), one warp's
instructions in order, so a step costs between its issued instructions (every latency hidden: the ``low``
bound) and its issued instructions plus one memory latency per loop iteration (nothing hidden: ``high``); a
prediction is that band, and :func:`cuda_kernel_seconds` its geometric middle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_bppsa.cuda_step_model import fastest_kernel
from lightning_bppsa.kernels import cuda as cuda_kernel

__all__ = ["CUDA_MODEL", "SASS_COUNTS", "CudaModel", "StepInstructions", "cuda_choose", "cuda_kernel_band",
           "cuda_kernel_seconds"]  # fmt: skip


@dataclass(frozen=True)
class StepInstructions:
    """Issued instructions per warp and iteration of the innermost loops of a scan step: counted in the
    SASS of ``scan.cu`` (sm_90, nvcc 13.0, float32; float64 within 3) by
    :func:`lightning_bppsa.kernels.cuda_inspect.sass_loops`, checked by ``tests/kernels/test_cuda_compile.py``."""

    tile_factored: int = 31  # one scaled weight element into the shared tile (2 LDG, FMUL, STS)
    tile_dense: int = 23  # one Jacobian element (LDG, STS)
    tile_aggregate: int = 11  # one element of a published aggregate (LDG.cg from L2, STS)
    fma_vector: int = 24  # two operand rows of a vector step (4 LDS, 2 FFMA: the index bookkeeping dominates)
    fma_matrix: int = 44  # two operand rows of a 2 x 2-outputs-per-thread matrix step (8 LDS, 8 FFMA)
    step_overhead: int = 150  # outside the loops (prefetch, epilogue, indexing): from the SASS, +-50
    # the warp-resident sweep (d <= 32), compiled per (d, k) with every loop over d unrolled: a step issues
    # overhead + row d + column k d (factored) or overhead + row d + element d² (dense) instructions, a fit to
    # :func:`lightning_bppsa.kernels.cuda_inspect.warp_step_counts` of the modules (d, k) in {(8, 1), (16, 2),
    # (20, 1), (20, 3), (32, 1), (8, 3)} (factored, within 2; W in shared memory, (32, 5): 402, 6% above) and
    # d in {8, 16, 20, 32} (dense, within 5): sm_90, nvcc 13.0, float32
    warp_overhead_factored: int = 67  # the ring's wait, copy and commit, u g + delta, the store, the loop
    warp_row_factored: float = 1.9  # per state row: its shuffle and chain FMA, less what the vectors share
    warp_column_factored: float = 1.6  # per element of the lane's column (k d): FMA, share of a scale load
    warp_overhead_dense: int = 62
    warp_row_dense: float = 1.3
    warp_element_dense: float = 0.27  # per operand element (d² a step): the lane's share of the ring's copies


SASS_COUNTS = StepInstructions()
WARP_CHAINS = 4  # kChains in scan.cu: the warp step's independent partial sums


@dataclass(frozen=True)
class CudaModel:
    """Assumed GPU figures (not measured: no GPU was lent when they were written), but ``lone_warp_cpi``."""

    name: str = "H100 SXM (assumed figures)"
    sms: int = 132
    schedulers_per_sm: int = 4  # one warp instruction per scheduler and cycle
    clock_hz: float = 1.75e9
    launch_seconds: float = 6e-6  # the kernel launch (assumed; no memset of the chunked flags since f01aaee)
    barrier_cycles: float = 30  # one __syncthreads of a few warps
    l1_cycles: float = 35  # L1 hit: a step's prefetched operand
    l2_cycles: float = 270  # L2 hit: published chunk aggregates and carries, a flag poll
    smem_cycles: float = 30  # a shared-memory load
    fma_cycles: float = 4  # dependent FFMA to FFMA
    shfl_cycles: float = 25  # a shuffle's result
    #: cycles per instruction a lone warp issues (its dependent instructions stall it): the one MEASURED figure,
    #: the H100's warp sweeps alone at d = 8 / 20 / 32 (calib-h100-2026-11-26-eeeac3a.csv, T = 10000, one warp
    #: per scheduler) took 2.16 / 2.12 / 2.03 cycles per instruction of their SASS
    lone_warp_cpi: float = 2.1
    blocks_per_sm: int = 8  # resident blocks per SM (registers ~50-75 x <= 256 threads)
    shared_limit: int = 232448  # shared memory per block with the opt-in (what kernels.cuda launches with)


CUDA_MODEL = CudaModel()


def _step_cycles(
    *,
    rows: int,
    d: int,
    operand_rows: int,
    threads: int,
    block: int,
    tile_rows: int,
    tile_instructions: int,
    tile_latency: float,
    model: CudaModel,
    counts: StepInstructions,
) -> tuple[float, float, float]:
    """(low, high) cycles of one ``product`` in scan.cu for one warp, and the instructions the whole block
    issues: ``rows x d`` outputs (``block x block`` per thread) times an ``operand_rows x d`` operand
    streamed through shared memory in tiles of ``tile_rows``."""
    groups = math.ceil(rows / block) * math.ceil(d / block)
    passes = math.ceil(groups / threads)
    tiles = math.ceil(operand_rows / tile_rows)
    tile_iterations = passes * tiles * math.ceil(min(tile_rows, operand_rows) * d / threads)
    fma_iterations = passes * math.ceil(operand_rows / 2)
    fma = counts.fma_matrix if block > 1 else counts.fma_vector
    issued = tile_iterations * tile_instructions + fma_iterations * fma + counts.step_overhead
    barriers = (passes * tiles + 1) * model.barrier_cycles
    low = issued + barriers
    high = low + tile_iterations * tile_latency + fma_iterations * model.smem_cycles + model.l1_cycles
    return low, high, issued * threads / 32


def _warp_step_instructions(*, d: int, tiles: int, factored: bool, counts: StepInstructions) -> float:
    """Instructions one warp issues for a step of the warp-resident sweep of ``(d, tiles)`` (float32)."""
    if factored:
        return (
            counts.warp_overhead_factored
            + (counts.warp_row_factored + counts.warp_column_factored * tiles) * d
        )
    return counts.warp_overhead_dense + counts.warp_row_dense * d + counts.warp_element_dense * d * d


def _warp_step_cycles(
    *, d: int, tiles: int, factored: bool, batch: int, model: CudaModel, counts: StepInstructions
) -> tuple[float, float]:
    """(low, high) cycles of one step of the warp-resident sweep (``bppsa_warpsweep_*``, one warp per row).

    A step issues the instructions of :class:`StepInstructions`' ``warp_*`` counts; its dependent chain is a
    shuffle, then ``ceil(d / WARP_CHAINS)`` FMAs on each of the independent partial sums and three adds (the
    column of ``J_t`` is formed during the step before, its operand staged steps ahead by ``cp.async``), and
    a lone warp issues one instruction per ``lone_warp_cpi`` cycles. Low: the larger of the two (warps sharing
    a scheduler take turns). High: both in sequence, plus a shared-memory load (the ring's slot)."""
    per_step = _warp_step_instructions(d=d, tiles=tiles, factored=factored, counts=counts)
    warps_per_scheduler = math.ceil(math.ceil(batch / model.sms) / model.schedulers_per_sm)
    issued = per_step * max(model.lone_warp_cpi, warps_per_scheduler)  # a lone warp, or warps taking turns
    chain = model.shfl_cycles + (math.ceil(d / WARP_CHAINS) + 3) * model.fma_cycles
    return max(issued, chain), issued + chain + model.smem_cycles


def cuda_kernel_band(
    algorithm: str,
    *,
    n: int,
    d: int,
    batch: int,
    width: int | None,
    chunk_size: int,
    affine: bool = False,
    element_bytes: int = 4,
    model: CudaModel = CUDA_MODEL,
    counts: StepInstructions = SASS_COUNTS,
) -> tuple[float, float]:
    """Predicted (low, high) seconds of one CUDA scan launch (``"linear"``: the sweep kernel; ``"chunked"``
    / ``"blelloch"``: the one-launch chunked kernel), from the launch that ``launch_config`` computes.

    - warp sweep (``d <= 32``): ``n`` dependent steps of one warp per row (:func:`_warp_step_cycles`).
    - sweep: ``n`` dependent vector steps per block, ``B`` blocks side by side (in waves).
    - chunked: ``c`` matrix steps (every chunk's aggregate, bounded below by the grid's issue rate: all
      blocks' instructions over all schedulers), then ``p = ceil(n / c)`` dependent carries (each a flag
      poll and one vector step with its operand from L2), then ``c`` vector steps of the chunk's sweep
      (warp steps for ``d <= 32``).
    """
    if n < 1:
        return model.launch_seconds, model.launch_seconds
    factored = width is not None
    launch = cuda_kernel.launch_config(
        factored=factored, element_bytes=element_bytes, n=n, batch=batch, d=d, m=width or d, affine=affine,
        algorithm=algorithm, chunk_size=chunk_size, shared_limit=model.shared_limit,
    )  # fmt: skip
    operand = width or d
    operand_tile = counts.tile_factored if factored else counts.tile_dense
    common = dict(d=d, threads=launch.block, tile_rows=launch.tile_rows, model=model, counts=counts)
    if cuda_kernel.warp_resident(factored=factored, d=d, m=operand):  # the sweeps take the warp step
        vector_low, vector_high = _warp_step_cycles(
            d=d, tiles=operand // d, factored=factored, batch=batch, model=model, counts=counts
        )  # fmt: skip
    else:
        vector_low, vector_high, _ = _step_cycles(
            rows=1, operand_rows=operand, block=1, tile_instructions=operand_tile, tile_latency=model.l1_cycles,
            **common,
        )  # fmt: skip
    if launch.kernel.startswith("bppsa_warpsweep_"):
        return tuple(model.launch_seconds + n * x / model.clock_hz for x in (vector_low, vector_high))
    if launch.kernel.startswith("bppsa_sweep_"):
        waves = math.ceil(batch / (model.sms * model.blocks_per_sm))
        cycles = (waves * n * vector_low, waves * n * vector_high)
    else:
        # where one warp forms the aggregates (cuda_kernel.warp_aggregates), the block product's count stands
        # for it, as in cuda_step_model
        common["threads"] = cuda_kernel.product_threads(d + int(affine), d)
        c, chunks = launch.chunk, math.ceil(n / launch.chunk)
        matrix_low, matrix_high, matrix_issued = _step_cycles(
            rows=d + int(affine), operand_rows=operand, block=cuda_kernel.MATRIX_BLOCK, tile_instructions=operand_tile,
            tile_latency=model.l1_cycles, **common,
        )  # fmt: skip
        hop_low, hop_high, _ = _step_cycles(
            rows=1, operand_rows=d, block=1, tile_instructions=counts.tile_aggregate, tile_latency=model.l2_cycles,
            **common,
        )  # fmt: skip
        issue_bound = batch * n * matrix_issued / (model.sms * model.schedulers_per_sm)
        cycles = (
            max(c * matrix_low, issue_bound) + chunks * (hop_low + model.l2_cycles) + c * vector_low,
            max(c * matrix_high, issue_bound) + chunks * (hop_high + 2 * model.l2_cycles) + c * vector_high,
        )
    return tuple(model.launch_seconds + x / model.clock_hz for x in cycles)


def cuda_kernel_seconds(
    algorithm: str,
    *,
    n: int,
    d: int,
    batch: int,
    width: int | None,
    chunk_size: int,
    affine: bool = False,
    element_bytes: int = 4,
    model: CudaModel = CUDA_MODEL,
) -> float:
    """The geometric middle of :func:`cuda_kernel_band` (same arguments): what the plan compares."""
    low, high = cuda_kernel_band(
        algorithm, n=n, d=d, batch=batch, width=width, chunk_size=chunk_size, affine=affine,
        element_bytes=element_bytes, model=model,
    )  # fmt: skip
    return math.sqrt(low * high)


def cuda_choose(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, element_bytes: int = 4
) -> tuple[str, int]:
    """The CUDA kernels' rule, by the calibrated model (:func:`lightning_bppsa.cuda_step_model.fastest_kernel`):
    ``"linear"`` keeps the sweep; ``"chunked"`` / ``"blelloch"`` get the chunk size predicted fastest, or the
    sweep where no chunked launch fits an H100's shared memory; ``"auto"`` the faster of the two. The plan
    asks the device's own limit first (:func:`lightning_bppsa.kernels.cuda.refusal`, in
    :mod:`lightning_bppsa.plan`) and asks this only where the chunked kernel can launch there. ``element_bytes`` is
    the compute dtype's (4: float32 and half precision, 8: float64): it sizes the shared-memory tiles."""
    if element_bytes not in (4, 8):
        raise ValueError(f"element_bytes must be 4 or 8 (the kernels' compute dtypes); got {element_bytes}")
    return fastest_kernel(algorithm, n=n, d=d, m=width or d, batch=batch, element_bytes=element_bytes)
