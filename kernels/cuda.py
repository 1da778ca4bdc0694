"""CUDA kernels of the scan (``kernels/scan.cu``), compiled at run time with CuPy and launched on torch's stream.

Entry points, with the signatures of the ``bppsa`` torch.library ops (:mod:`lightning_bppsa.ops`
registers them for ``"cuda"``):

- ``scan_dense(jacobians_t, grad, algorithm, chunk_size) -> (B, n + 1, d)``
- ``scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size) -> (B, n + 1, d)``
- ``available() -> (bool, reason)``; ``refusal(algorithm, d=, element_bytes=, shared_limit=) -> str | None``:
  why a launch of ``algorithm`` cannot be made on a device (a state too wide for the sweep's shared memory,
  the chunked kernel's matrices beyond it), ``None`` where it can. The plan (:mod:`lightning_bppsa.plan`)
  asks it before anything runs and :func:`launch_config` decides by it: a launch the kernels cannot make as
  planned changes the plan, never the launch (:func:`run` raises where a plan asks for one anyway).

The math is :mod:`lightning_bppsa.scan`'s: ``g_n`` = the last-state gradient, ``g_t = g_{t+1} J_t + δ_t``
(row gradients; ``δ`` only for a per-step ``grad`` of shape ``(B, n + 1, d)``). ``algorithm`` picks the kernel:

- ``"linear"``: ``bppsa_warpsweep_*`` for ``d <= 32`` (``k <= 5`` weight tiles, ``m = k d``): one warp per
  batch row runs the ``n`` steps in order, the state in registers (one value per lane, broadcast by
  ``__shfl_sync``), from a module compiled for that ``(d, k)`` (:func:`module_options`: loops unrolled,
  register indices static); each step's column of ``J_t`` is formed in registers during the step before
  (factored: from ``W`` held in registers where :func:`warp_layout` says it fits, else in shared memory),
  and the operands are staged up to 32 steps ahead in a shared-memory ring filled by ``cp.async``
  (:func:`warp_layout`; the invariant is in ``scan.cu``); otherwise ``bppsa_sweep_*``, one block per batch
  row, every step through shared memory.
- ``"chunked"`` and ``"blelloch"``: ``bppsa_chunked_*``, ONE launch of ``B * ceil(n / chunk_size)`` blocks:
  chunk aggregates, a decoupled look-back carry chain between ticket-ordered blocks, and a sweep of
  every chunk (see the header of ``scan.cu``; for ``d <= 32`` by warp 0 with the warp-resident step, from the
  same specialised module). Its shared memory holds two ``(d + 1) x d`` matrices:
  the launch opts in to the device's whole per-block shared memory (``shared_memory_per_block_optin``,
  227 KiB on an H100: ``d`` up to 169 float32 / 119 float64; 48 KiB without the opt-in: 77 / 54);
  wider states are planned as the sweep (:func:`refusal`), and a single chunk is the sweep. Deterministic: a chunk's carry is recomputed by the
  same instructions that made its predecessor's published inclusive, so the bits do not depend on how
  far the look-back went (nothing to switch under ``torch.use_deterministic_algorithms(True)``).

Float16 / bfloat16 inputs run in float32 (as the torch implementation does); other inputs are made
contiguous (a copy only when they are not). CuPy (>= 14, with NVRTC: the ``cuda12`` / ``cuda13`` extras)
is used through the package's one loader (:mod:`lightning_bppsa.kernels.cupy_loader`): the module is
compiled once per process and device (NVRTC; CuPy keeps the binary in ``$CUPY_CACHE_DIR``) by
:func:`available` or :func:`prepare` (the generic module), and the module of a ``d <= 32`` chain's ``(d, k)``
by its first launch or ``prepare(device, warp_shape)``; never inside a CUDA graph capture (a first call
there raises: run one step before capturing), and a launch passes raw data pointers on
``torch.cuda.current_stream()``: no copies, no synchronisation.

Host cost per launch: the output and (chunked) the scratch from torch's caching allocator, the launch of a
cached :func:`launch_config`, one argument tuple, the kernel. The chunked kernel's look-back flags and
ticket counter are one cached buffer per device and stream that no launch clears (no memset launch, no
allocation): each launch publishes its flags with an epoch of its own and sets its ticket counter back to
0 (:func:`_look_back_flags` states the invariant; a CUDA graph capture gets a buffer of its own).

:func:`launch_config` and :func:`kernel_args` are the one place that computes a launch (kernel name,
grid, block, shared memory, buffers, argument words); the host emulation in
:mod:`lightning_bppsa.kernels.emulated` uses them too, so the CPU tests check the CUDA launches.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning_bppsa.kernels import cupy_loader
from lightning_bppsa.kernels._build import kernel_path
from torch import Tensor

from lightning_bppsa.algorithms import compute_dtype

__all__ = [
    "Launch",
    "available",
    "current_shared_limit",
    "device_shared_limit",
    "refusal",
    "kernel_args",
    "launch_config",
    "prepare",
    "module_kernels",
    "module_options",
    "WarpLayout",
    "warp_layout",
    "warp_resident",
    "warp_shape",
    "source_path",
    "run",
    "scan_dense",
    "scan_factored",
]

SHARED_BYTES = (
    cupy_loader.PORTABLE_SHARED_BYTES
)  # shared memory per block (static + dynamic) without the opt-in
#: static shared memory of each kernel family (ptxas / NVRTC report it: the compile gate and the CuPy
#: loader check these figures); a launch's dynamic part gets the limit minus this
STATIC_SHARED_BYTES = {"sweep": 0, "chunked": 16, "warpsweep": 0}
MATRIX_BLOCK = 2  # kMatrixBlock in scan.cu: a thread computes 2 x 2 outputs of a chunk-product step
MAX_THREADS = 256  # __launch_bounds__ in scan.cu
WARP = 32  # lanes of a warp: the warp-resident sweep's block, and its widest state
MAX_TILES = 5  # kMaxTiles in scan.cu: the warp sweep's factored weight has m = k d rows, k <= 5
MAX_DEPTH = 32  # kMaxDepth in scan.cu: ring slots of the warp sweep at most
WARP_SHARED_BYTES = 47 * 1024  # kWarpSharedBytes in scan.cu: a warp sweep's ring + shared W
REGISTER_WORDS = 160  # kRegisterWords in scan.cu: W in registers where W and two columns take this many words
KERNELS = tuple(
    f"bppsa_{schedule}_{chain}_{suffix}"
    for schedule in ("sweep", "chunked", "warpsweep")
    for chain in ("dense", "factored")
    for suffix in ("f32", "f64")
)


def module_kernels(warp_shape: tuple[int, int] | None) -> tuple[str, ...]:
    """The entry points of the module compiled for ``warp_shape`` (``(d, k)``: the chunked kernels and the warp
    sweeps of that shape) or of the generic module (``None``: the chunked kernels and the block sweeps)."""
    schedules = ("chunked", "warpsweep") if warp_shape else ("sweep", "chunked")
    return tuple(k for k in KERNELS if k.split("_")[1] in schedules)


def module_options(warp_shape: tuple[int, int] | None) -> tuple[str, ...]:
    """The compiler options (NVRTC, nvcc or g++) of the module for ``warp_shape`` (see :func:`module_kernels`)."""
    if warp_shape is None:
        return ()
    d, k = warp_shape
    return (f"-DBPPSA_WARP_D={d}", f"-DBPPSA_WARP_K={k}")


@dataclass(frozen=True)
class Launch:
    """One kernel launch: what :func:`launch_config` decided."""

    kernel: str  # entry point in scan.cu
    grid: int  # blocks (1-D)
    block: int  # threads per block (a multiple of 32)
    shared_bytes: int  # dynamic shared memory per block
    static_bytes: int  # the kernel's static shared memory (STATIC_SHARED_BYTES)
    tile_rows: int  # operand rows streamed through shared memory at once (warp sweep: its ring's depth)
    chunk: int  # steps per chunk (n for the sweep)
    work_elements: int  # scratch elements of the compute dtype (chunk aggregates and carries)
    sync_words: (
        int  # 64-bit words: ticket counter and chunk flags (never cleared per launch: _look_back_flags)
    )
    #: (d, k) of the module specialised for the warp-resident step (warp sweep, or the chunked kernel's chunk
    #: sweeps; k = 1 for a dense chain), ``None``: the generic module (:func:`module_options`)
    warp_shape: tuple[int, int] | None = None


def warp_resident(*, factored: bool, d: int, m: int) -> bool:
    """Whether a chain runs its sweeps with the warp-resident step (``d <= 32`` and, factored, ``m = k d`` with
    ``k <= MAX_TILES``): the ``"linear"`` kernel and the chunked kernel's chunk sweeps, from the module
    specialised for :func:`warp_shape`. Its shared memory (:func:`warp_layout`) fits every device's 48 KiB."""
    return 1 <= d <= WARP and (not factored or (m % d == 0 and 1 <= m // d <= MAX_TILES))


def warp_shape(*, factored: bool, d: int, m: int) -> tuple[int, int] | None:
    """``(d, k)`` of the module a chain's sweeps run from (``k = m / d`` tiles; 1 for a dense chain), ``None``
    where the chain is not :func:`warp_resident` (the generic module)."""
    if not warp_resident(factored=factored, d=d, m=m):
        return None
    return d, m // d if factored else 1


#: kWarpAggregateWidth in scan.cu: the widest k d whose chunk aggregates one warp forms (float32)
WARP_AGGREGATE_WIDTH = 104


def warp_aggregates(warp: tuple[int, int] | None, element_bytes: int) -> bool:
    """Whether the chunked kernel of a chain of warp shape ``warp`` (:func:`warp_shape`; ``None``: the generic
    module) forms its chunk aggregates in one warp, its block (``aggregates_in_warp`` in scan.cu): float32
    chains of ``k d <= WARP_AGGREGATE_WIDTH``. Wider or float64 chains spilled at 255 registers there: the
    block's matrix product forms them."""
    return warp is not None and element_bytes == 4 and warp[0] * warp[1] <= WARP_AGGREGATE_WIDTH


@dataclass(frozen=True)
class WarpLayout:
    """The warp sweep's shared memory (``WarpLayout`` in scan.cu, which this mirrors; a test compares them)."""

    depth: int  # ring slots: a step's operand is staged up to depth - 1 steps ahead of the one formed
    slot: int  # elements of one slot (one step's operand, padded to whole 16-byte vectors)
    weight_in_registers: (
        bool  # factored: W held in registers (else transposed in shared memory after the ring)
    )
    lean: bool  # the chunked kernel's variant: the column formed in its own step, W in shared memory
    shared_bytes: int  # the ring and (if not in registers) W


def _whole_vectors(n: int, vector: int) -> int:
    return -(-n // vector) * vector


def _lane_stride(
    n: int, vector: int
) -> int:  # an odd number of vectors: one vector per lane, no bank conflict
    return (-(-n // vector) | 1) * vector


@functools.lru_cache(maxsize=256)
def warp_layout(*, factored: bool, d: int, k: int, element_bytes: int, lean: bool = False) -> WarpLayout:
    """The shared memory of the warp sweep of ``(d, k)`` (``k`` weight tiles; 1 for a dense chain); ``lean``:
    the chunked kernel's chunk sweeps (fewer registers: ``W`` always in shared memory).

    A slot holds a step's operand (factored: ``k`` tiles of ``s_t``, ``u_t``, ``delta_t``; dense: the rows
    of ``J_t^T``, padded so that each lane reads its own row without bank conflicts, and ``delta_t``). ``W``
    stays in registers (not lean) where it and two register columns take at most ``REGISTER_WORDS`` 32-bit
    words per lane (the compile gate checks that no shape spills). The depth is the largest power of two
    ``<= MAX_DEPTH`` whose ring fits ``WARP_SHARED_BYTES`` with a shared ``W`` and, lean where
    :func:`warp_aggregates`, the chunk aggregate's ``J'`` and rows.
    """
    vector = 16 // element_bytes
    part = _whole_vectors(d, vector)
    operand = k * part + part if factored else d * _lane_stride(d, vector)
    slot = operand + part
    in_registers = factored and not lean and (k + 2) * d * element_bytes // 4 <= REGISTER_WORDS
    weight = WARP * _lane_stride(k * part, vector) if factored and not in_registers else 0
    # the chunked kernel's aggregate after W (warp_aggregates): one step's J' and each lane's row of C
    aggregate = d * part + WARP * _lane_stride(d, vector) if lean and warp_aggregates((d, k), element_bytes) else 0
    depth, budget = MAX_DEPTH, WARP_SHARED_BYTES - (weight + aggregate) * element_bytes
    while depth > 2 and depth * slot * element_bytes > budget:
        depth //= 2
    return WarpLayout(depth, slot, in_registers, lean, (depth * slot + weight + aggregate) * element_bytes)


@functools.lru_cache(maxsize=256)
def refusal(
    algorithm: str, *, d: int, element_bytes: int, shared_limit: int, affine: bool = True
) -> str | None:
    """Why the scan kernels cannot launch ``algorithm`` over states of size ``d`` on a device giving a block
    ``shared_limit`` bytes of shared memory (static + dynamic), one line; ``None`` where they can.

    ``"linear"``: the sweep (one vector step through shared memory; the warp sweep of ``d <= 32`` always
    fits). ``"chunked"`` / ``"blelloch"``: the chunked kernel (two ``(d + affine) x d`` matrices, two
    vectors and one operand row). ``affine``: a per-step gradient (one more matrix row; a plan that does not
    know asks with ``True``, the larger need). The ONE statement of these limits: :func:`launch_config`
    decides by it and the plan asks it (``lightning_bppsa.plan``). Cached.
    """
    if element_bytes not in (4, 8):
        raise ValueError(f"element_bytes must be 4 or 8 (the kernels' compute dtypes); got {element_bytes}")
    vectors, row_bytes = 2 * d * element_bytes, d * element_bytes
    if algorithm in ("chunked", "blelloch"):
        need = STATIC_SHARED_BYTES["chunked"] + 2 * (d + int(affine)) * row_bytes + vectors + row_bytes
        if need > shared_limit:
            return (
                f"the chunked scan kernel of d={d} needs {need} B of shared memory per block, "
                f"the device gives {shared_limit} B"
            )
        return None
    need = STATIC_SHARED_BYTES["sweep"] + vectors + row_bytes
    if need > shared_limit:
        return (
            f"state size d={d} is too wide for the CUDA scan kernels' shared memory: the sweep needs "
            f"{need} B per block, the device gives {shared_limit} B"
        )
    return None


def current_shared_limit() -> int:
    """Shared memory a block may use on torch's current CUDA device (:func:`device_shared_limit`): what a
    plan made without a tensor at hand assumes (``lightning_bppsa.plan.choose``)."""
    return device_shared_limit(torch.cuda.current_device())


def _threads(work_items: int) -> int:
    return min(MAX_THREADS, 32 * max(1, math.ceil(work_items / 32)))


def product_threads(rows: int, d: int) -> int:
    """The chunked kernel's block where the block's shared-memory product forms the chunk aggregates (``rows x d``
    outputs, ``MATRIX_BLOCK``² a thread; where :func:`warp_aggregates`, one warp forms them instead)."""
    return _threads(math.ceil(rows / MATRIX_BLOCK) * math.ceil(d / MATRIX_BLOCK))


@functools.lru_cache(maxsize=256)
def launch_config(
    *,
    factored: bool,
    element_bytes: int,
    n: int,
    batch: int,
    d: int,
    m: int,
    affine: bool,
    algorithm: str,
    chunk_size: int,
    shared_limit: int = SHARED_BYTES,
) -> Launch:
    """The launch of one scan of ``batch`` chains of ``n >= 1`` steps of state size ``d``.

    ``m`` is the factored weight's rows (``d`` for a dense chain); ``affine`` is a per-step gradient;
    ``shared_limit`` is the shared memory a block may use, static + dynamic (48 KiB, or the device's
    opt-in maximum). Cached: a training loop asks with the same shape every step.
    ``"chunked"`` / ``"blelloch"`` launch the sweep where there is one chunk or :func:`refusal` refuses the
    chunked kernel (the plan has then planned the sweep: :func:`run` refuses such a launch).
    Raises ``ValueError`` if ``d`` is too wide even for the sweep's shared memory (~2000 float64 at 48 KiB).
    """
    if n < 1 or batch < 1 or d < 1:
        raise ValueError(f"launch_config needs n, batch, d >= 1; got n={n}, batch={batch}, d={d}")
    if shared_limit < SHARED_BYTES:
        raise ValueError(f"shared_limit={shared_limit} is below the 48 KiB every CUDA device gives a block")
    suffix = {4: "f32", 8: "f64"}[element_bytes]
    chain = "factored" if factored else "dense"
    operand_rows = m if factored else d
    rows = d + int(affine)  # rows of a chunk aggregate [C; b]
    chunk = max(1, min(chunk_size, n))
    chunks = math.ceil(n / chunk)
    matrices = 2 * rows * d * element_bytes
    vectors = 2 * d * element_bytes
    row_bytes = d * element_bytes
    chunked_budget = shared_limit - STATIC_SHARED_BYTES["chunked"]
    chunked = (
        algorithm in ("chunked", "blelloch")
        and chunks > 1
        and refusal("chunked", d=d, element_bytes=element_bytes, shared_limit=shared_limit, affine=affine)
        is None
    )
    warp = warp_shape(factored=factored, d=d, m=m)
    layout = (
        warp_layout(factored=factored, d=d, k=warp[1], element_bytes=element_bytes, lean=chunked)
        if warp
        else None
    )
    warp_bytes = layout.shared_bytes if layout else 0
    if chunked:
        # the aggregates in one warp's registers (warp_aggregates: no matrices in shared memory; the warp layout
        # holds its steps' J'), or the block's product; the chunk's sweep reuses the memory (max, not sum)
        matrices, block = (
            (0, WARP) if warp_aggregates(warp, element_bytes)
            else (matrices, product_threads(rows, d))
        )  # fmt: skip
        tile_rows = min(operand_rows, (chunked_budget - matrices - vectors) // row_bytes)
        return Launch(
            kernel=f"bppsa_chunked_{chain}_{suffix}",
            grid=batch * chunks,
            block=block,
            shared_bytes=max(matrices + vectors + tile_rows * row_bytes, warp_bytes),
            static_bytes=STATIC_SHARED_BYTES["chunked"],
            tile_rows=tile_rows,
            chunk=chunk,
            work_elements=batch * chunks * (rows * d + d),
            sync_words=1 + batch * chunks,
            warp_shape=warp,
        )
    if warp:
        return Launch(
            kernel=f"bppsa_warpsweep_{chain}_{suffix}",
            grid=batch,
            block=WARP,
            shared_bytes=warp_bytes,
            static_bytes=STATIC_SHARED_BYTES["warpsweep"],
            tile_rows=layout.depth,
            chunk=n,
            work_elements=0,
            sync_words=0,
            warp_shape=warp,
        )
    why = refusal("linear", d=d, element_bytes=element_bytes, shared_limit=shared_limit)
    if why:
        raise ValueError(why)
    sweep_budget = shared_limit - STATIC_SHARED_BYTES["sweep"]
    tile_rows = min(operand_rows, (sweep_budget - vectors) // row_bytes)
    return Launch(
        kernel=f"bppsa_sweep_{chain}_{suffix}",
        grid=batch,
        block=_threads(d),
        shared_bytes=vectors + tile_rows * row_bytes,
        static_bytes=STATIC_SHARED_BYTES["sweep"],
        tile_rows=tile_rows,
        chunk=n,
        work_elements=0,
        sync_words=0,
    )


def kernel_args(
    launch: Launch,
    *,
    mat: int,
    scales: int,
    diagonal: int,
    grad: int,
    out: int,
    work: int,
    sync: int,
    n: int,
    batch: int,
    d: int,
    m: int,
    affine: bool,
    epoch: int = 0,
) -> list[int]:
    """The kernel's 15 argument words (pointers as addresses, 0 for none), in ``BPPSA_PARAMS`` order; ``epoch``:
    the chunked kernel's launch number on its ``sync`` buffer (>= 1; unused by the sweeps)."""
    return [
        mat,
        scales,
        diagonal,
        grad,
        out,
        work,
        sync,
        n,
        batch,
        d,
        m,
        launch.chunk,
        int(affine),
        launch.tile_rows,
        epoch,
    ]


Launcher = Callable[[Launch, list, torch.device], None]


def run(
    mat: Tensor,
    scales: Tensor | None,
    diagonal: Tensor | None,
    grad: Tensor,
    *,
    algorithm: str,
    chunk_size: int,
    launcher: Launcher,
    shared_limit: int = SHARED_BYTES,
) -> Tensor:
    """Prepare buffers, compute the launch and hand it to ``launcher(launch, args, device)``.

    ``mat`` is ``jacobians_t`` (``scales is None``) or the factored ``weight``. Returns ``(B, n + 1, d)``
    in ``grad``'s dtype. ``shared_limit``: see :func:`launch_config`. Shared by the CUDA path and the host
    emulation. Per call it allocates the output and, for the chunked kernel only, its scratch (torch's
    caching allocator, on the current stream: no driver call in steady state, capturable in a CUDA graph);
    the chunked kernel's flags are the stream's cached buffer (:func:`_look_back_flags`: no allocation, no
    memset launch); the launch itself is computed once per shape (:func:`launch_config` is cached).
    """
    compute = compute_dtype(grad.dtype)
    factored = scales is not None
    mat, scales, diagonal, grad_c = (_prepared(t, compute) for t in (mat, scales, diagonal, grad))
    batch, d = grad.shape[0], grad.shape[-1]
    n = scales.shape[1] if factored else mat.shape[1]
    m = mat.shape[0] if factored else d
    affine = grad.dim() == 3
    out = torch.empty(batch, n + 1, d, dtype=compute, device=grad.device)
    if n == 0 or batch == 0 or d == 0:  # nothing to scan: g_n only
        out[:, n] = grad_c[:, n] if affine else grad_c
        return out.to(grad.dtype)
    shape = dict(n=n, batch=batch, d=d, m=m, affine=affine)  # the chain's: the launch's and the kernel's
    launch = launch_config(
        factored=factored,
        element_bytes=out.element_size(),
        **shape,
        algorithm=algorithm,
        chunk_size=chunk_size,
        shared_limit=shared_limit,
    )
    # a plan asking for a chunked launch the kernels cannot make: never silently the sweep
    if launch.chunk == n and algorithm in ("chunked", "blelloch") and max(1, chunk_size) < n:
        why = refusal(
            algorithm, d=d, element_bytes=out.element_size(), shared_limit=shared_limit, affine=affine
        )
        raise ValueError(
            f"lightning_bppsa: a {algorithm} scan was planned that the CUDA kernels cannot launch: {why}"
        )
    # the sweeps use neither: no allocation, no fill
    work = (
        torch.empty(launch.work_elements, dtype=compute, device=grad.device) if launch.work_elements else None
    )
    sync, epoch = _look_back_flags(grad.device, launch.sync_words) if launch.sync_words else (None, 0)
    args = kernel_args(
        launch,
        mat=_address(mat),
        scales=_address(scales),
        diagonal=_address(diagonal),
        grad=_address(grad_c),
        out=_address(out),
        work=_address(work),
        sync=_address(sync),
        **shape,
        epoch=epoch,
    )
    try:
        launcher(launch, args, grad.device)
    except BaseException:
        if sync is not None:  # a launch that may have stopped half way: its ticket counter may not be 0
            _FLAGS.pop(_flags_key(grad.device), None)
        raise
    return out if out.dtype == grad.dtype else out.to(grad.dtype)


#: (device, stream handle) -> [the chunked kernel's flag buffer (int64 words), its next epoch]
_FLAGS: dict[tuple[torch.device, int], list] = {}


def _flags_key(device: torch.device) -> tuple[torch.device, int]:
    if device.type != "cuda":
        return device, 0  # the host emulation: launches run one at a time
    index = _device_index(device)
    return torch.device("cuda", index), torch._C._cuda_getCurrentRawStream(index)


def _look_back_flags(device: torch.device, words: int) -> tuple[Tensor, int]:
    """The chunked kernel's ``sync`` buffer (at least ``words`` 64-bit words) and this launch's epoch.

    No clearing per launch (the kernel's flags carry their launch's epoch, its ticket counter is set back
    to 0 by its last ticket: ``scan.cu``). Invariant: launches that may overlap never share a buffer, and
    launches sharing one never share an epoch. Hence one buffer per (device, current stream), kept and grown
    (to twice its size, zeroed once then), allocated on that stream (its old buffer, freed when grown, goes
    back to torch's caching allocator, which hands it only to later work on the same stream), with a
    per-buffer epoch counter (Python ints: no wrap; ``next`` on an ``itertools.count`` is atomic under the
    GIL, so two threads on one stream get two epochs). While a CUDA graph is captured, a buffer of the
    graph's own, zeroed by a captured memset (replayed before every replay) at epoch 1: a graph may be
    replayed on any stream, beside eager launches, so it must not share the stream's buffer.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(words, dtype=torch.int64, device=device), 1
    key = _flags_key(device)
    entry = _FLAGS.get(key)
    if entry is None or entry[0].numel() < words:
        size = max(words, 2 * entry[0].numel()) if entry is not None else words
        entry = _FLAGS[key] = [torch.zeros(size, dtype=torch.int64, device=device), itertools.count(1)]
    return entry[0], next(entry[1])


def _prepared(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype`` and contiguous; ``t`` itself (no call into torch) when it already is."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def _address(t: Tensor | None) -> int:
    """A kernel's pointer argument: the data address, 0 for none."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


# --------------------------------------------------------------------------------------------------
# CuPy (through the package's one loader, :mod:`.cupy_loader`): availability, the kernels, the launch.
# --------------------------------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy and a CUDA device are usable and the kernels load, else ``(False, why)``.

    The first eager call compiles the kernels (:func:`prepare`; CuPy caches the binary on disk). While
    ``torch.compile`` traces (the cost model asks from inside ``backprop_scan``), it only reports what
    an earlier eager call found, so tracing never imports CuPy or compiles.
    """
    return cupy_loader.family_available("the CUDA kernels", prepare)


def source_path(name: str) -> Path:
    """Where ``scan.cu`` / its header are read from: this package, or ``$BPPSA_CUDA_SOURCE_DIR`` (the
    mutation tests point it at a mutated copy)."""
    folder = os.environ.get("BPPSA_CUDA_SOURCE_DIR")
    return Path(folder) / name if folder else kernel_path(name)


def source() -> str:
    """``scan.cu`` with its header inlined (CuPy's cache key is the source text, so a header edit counts)."""
    header = source_path("cuda_host_emulation.h").read_text()
    return source_path("scan.cu").read_text().replace('#include "cuda_host_emulation.h"', header)


def device_shared_limit(device_index: int) -> int:
    """Shared memory a block may use on the device, static + dynamic: its opt-in maximum."""
    return cupy_loader.shared_limit(device_index)


#: (device index, warp shape or None) -> {kernel name: loaded cupy Function}
_KERNELS_ON: dict[tuple[int, tuple[int, int] | None], dict] = {}


def prepare(device_index: int, warp_shape: tuple[int, int] | None = None) -> dict:
    """Compile (NVRTC) and load a module's kernels on a device, once: the generic module, or the one
    specialised for ``warp_shape`` (``(d, k)``, see :func:`module_options`); opt every kernel in to the
    device's whole shared memory and check its static shared memory against ``STATIC_SHARED_BYTES``.

    Returns ``{kernel name: cupy Function}``. Call it (or run one scan of each shape) before capturing a
    CUDA graph: inside a capture a module's first scan raises instead of compiling (loading a module is
    not a capturable operation).
    """
    key = (device_index, warp_shape)
    functions = _KERNELS_ON.get(key)
    if functions is not None:
        return functions
    code, options = source(), module_options(warp_shape)
    functions = {
        name: cupy_loader.load_function(device_index, code, name, options)
        for name in module_kernels(warp_shape)
    }
    limit = device_shared_limit(device_index)
    for name, function in functions.items():
        static = STATIC_SHARED_BYTES[name.split("_")[1]]
        if function.shared_size_bytes > static:
            raise RuntimeError(
                f"{name} has {function.shared_size_bytes} B of static shared memory here, launch_config "
                f"budgets {static} B (STATIC_SHARED_BYTES)"
            )
        cupy_loader.reserve_shared(function, limit - static)  # here, not in a launch a graph may capture
    _KERNELS_ON[key] = functions
    return functions


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _launch_cuda(launch: Launch, args: list, device: torch.device) -> None:
    index = _device_index(device)
    functions = _KERNELS_ON.get((index, launch.warp_shape)) or prepare(index, launch.warp_shape)
    cupy_loader.launch(functions[launch.kernel], index, launch.grid, launch.block, launch.shared_bytes, args)


def _device_limit(t: Tensor) -> int:
    return device_shared_limit(_device_index(t.device))


def scan_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """``bppsa::scan_dense`` on CUDA: ``jacobians_t`` ``(B, n, d, d)``, ``grad`` ``(B, d)`` or ``(B, n + 1, d)``."""
    return run(
        jacobians_t, None, None, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=_launch_cuda,
        shared_limit=_device_limit(grad),
    )  # fmt: skip


def scan_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """``bppsa::scan_factored`` on CUDA: ``J_t = diag(u_t) + [diag(s^1_t) .. diag(s^k_t)] W`` (see ``FactoredJacobians``)."""
    return run(
        weight, scales, diagonal, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=_launch_cuda,
        shared_limit=_device_limit(grad),
    )  # fmt: skip
