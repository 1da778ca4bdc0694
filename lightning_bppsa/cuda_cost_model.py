"""The CUDA kernels' cost model (:mod:`lightning_bppsa.kernels.cuda`): a latency / throughput model of one
launch, used to pick the sweep or the chunked kernel and its chunk size on CUDA.

No GPU was available to fit it: the figures are assumptions (H100 SXM class), stated in :class:`CudaModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_bppsa.kernels import cuda as cuda_kernel

__all__ = ["CUDA_MODEL", "CudaModel", "cuda_choose", "cuda_kernel_seconds"]



@dataclass(frozen=True)
class CudaModel:
    """Assumed GPU figures behind :func:`cuda_kernel_seconds` (not measured: no GPU was lent)."""

    name: str = "H100 SXM (assumed figures)"
    sms: int = 132
    clock_hz: float = 1.75e9
    launch_seconds: float = 6e-6  # the kernel launch plus the zeroed flag buffer (a memset)
    barrier_cycles: float = 30  # one __syncthreads of a few warps
    l1_cycles: float = 35  # L1 hit: a step's prefetched operand, the shared weight
    l2_cycles: float = 270  # L2 hit: published chunk aggregates and carries
    fma_cycles: float = 4  # dependent FMA latency
    epilogue_cycles: float = 40  # diagonal, addend, stores of a step
    smem_wavefronts_per_cycle: float = 1.0  # per SM: one 32-lane shared-memory access per cycle
    blocks_per_sm: int = 8  # resident blocks per SM (registers ~50-100 x <= 256 threads)
    shared_limit: int = 232448  # shared memory per block with the opt-in (what kernels.cuda launches with)


CUDA_MODEL = CudaModel()


def _cuda_step(rows: int, d: int, operand_rows: int, threads: int, block: int, tile_rows: int,
               operand_cycles: float, model: CudaModel) -> tuple[float, float]:
    """(latency in cycles, shared-memory wavefronts) of one ``product`` in scan.cu: ``rows x d`` times a
    ``operand_rows x d`` operand streamed through shared memory, ``block x block`` outputs per thread."""
    groups = math.ceil(rows / block) * math.ceil(d / block)
    passes = math.ceil(groups / threads)
    tiles = math.ceil(operand_rows / tile_rows)
    load = tiles * (2 * model.barrier_cycles + operand_cycles + math.ceil(tile_rows * d / threads))
    chain = passes * (operand_rows / 2 * model.fma_cycles + model.l1_cycles + model.epilogue_cycles)
    wavefronts = threads // 32 * passes * operand_rows * 2 * block  # per operand row: block X + block tile reads
    return load + chain + model.barrier_cycles, wavefronts


def cuda_kernel_seconds(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, chunk_size: int,
    affine: bool = False, element_bytes: int = 4, model: CudaModel = CUDA_MODEL,
) -> float:
    """Predicted seconds of one CUDA scan launch (``"linear"``: the sweep kernel; ``"chunked"`` /
    ``"blelloch"``: the one-launch chunked kernel), from the launch that ``launch_config`` computes.

    - sweep: ``n`` dependent vector steps per block, ``B`` blocks side by side.
    - chunked: ``c`` matrix steps (every chunk's aggregate; bounded below by the grid's shared-memory
      throughput, all SMs together: 2 x 2 outputs per thread read 4 shared values per 4 FMAs), then ``p = ceil(n / c)`` dependent look-back hops (one vector step
      with its operand from L2 each), then ``c`` vector steps of the chunk's sweep.
    """
    if n < 1:
        return model.launch_seconds
    factored = width is not None
    launch = cuda_kernel.launch_config(
        factored=factored, element_bytes=element_bytes, n=n, batch=batch, d=d, m=width or d, affine=affine,
        algorithm=algorithm, chunk_size=chunk_size, shared_limit=model.shared_limit,
    )
    operand = width or d
    vector, _ = _cuda_step(1, d, operand, launch.block, 1, launch.tile_rows, model.l1_cycles, model)
    if launch.kernel.startswith("bppsa_sweep_"):
        waves = math.ceil(batch / (model.sms * model.blocks_per_sm))
        return model.launch_seconds + waves * n * vector / model.clock_hz
    c, chunks = launch.chunk, math.ceil(n / launch.chunk)
    rows = d + int(affine)
    matrix, wavefronts = _cuda_step(rows, d, operand, launch.block, cuda_kernel.MATRIX_BLOCK, launch.tile_rows, model.l1_cycles, model)
    hop, _ = _cuda_step(1, d, d, launch.block, 1, launch.tile_rows, model.l2_cycles, model)
    throughput = batch * n * wavefronts / (model.sms * model.smem_wavefronts_per_cycle)
    cycles = max(c * matrix, throughput) + chunks * hop + c * vector
    return model.launch_seconds + cycles / model.clock_hz


def cuda_choose(
    algorithm: str, *, n: int, d: int, batch: int, width: int | None, element_bytes: int = 4
) -> tuple[str, int]:
    """The CUDA kernels' rule: ``"linear"`` keeps the sweep; ``"chunked"`` / ``"blelloch"`` get the chunk
    size the model predicts fastest; ``"auto"`` takes whichever of the two the model predicts faster.
    ``element_bytes`` is the compute dtype's (4: float32 and half precision, 8: float64): it sizes the
    shared-memory tiles, so the plan is dtype-aware."""
    if element_bytes not in (4, 8):
        raise ValueError(f"element_bytes must be 4 or 8 (the kernels' compute dtypes); got {element_bytes}")
    if n <= 1:
        return ("linear" if algorithm == "auto" else algorithm), 1
    candidates = sorted({2**k for k in range(1, int(math.log2(n)) + 1) if 2**k < n} | {max(2, math.isqrt(n))})

    def seconds(name: str, c: int) -> float:
        return cuda_kernel_seconds(name, n=n, d=d, batch=batch, width=width, chunk_size=c, element_bytes=element_bytes)

    chunk = min(candidates, key=lambda c: seconds("chunked", c))
    if algorithm != "auto":
        return algorithm, chunk
    return ("chunked", chunk) if seconds("chunked", chunk) < seconds("linear", n) else ("linear", chunk)
