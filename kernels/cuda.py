"""CUDA kernels of the scan (``kernels/scan.cu``), compiled at run time with CuPy and launched on torch's stream.

Entry points, with the signatures of the ``bppsa`` torch.library ops (:mod:`lightning_bppsa.ops`
registers them for ``"cuda"``):

- ``scan_dense(jacobians_t, grad, algorithm, chunk_size) -> (B, n + 1, d)``
- ``scan_factored(weight, scales, diagonal, grad, algorithm, chunk_size) -> (B, n + 1, d)``
- ``available() -> (bool, reason)``; ``fits(d, element_bytes) -> (bool, reason)`` (a state too wide for
  the kernels' shared memory runs the torch implementation: :mod:`lightning_bppsa.ops` decides)

The math is :mod:`lightning_bppsa.scan`'s: ``g_n`` = the last-state gradient, ``g_t = g_{t+1} J_t + δ_t``
(row gradients; ``δ`` only for a per-step ``grad`` of shape ``(B, n + 1, d)``). ``algorithm`` picks the kernel:

- ``"linear"``: ``bppsa_sweep_*``, one block per batch row runs the ``n`` steps in order.
- ``"chunked"`` and ``"blelloch"``: ``bppsa_chunked_*``, ONE launch of ``B * ceil(n / chunk_size)`` blocks:
  chunk aggregates, a decoupled look-back carry chain between ticket-ordered blocks, and a sweep of
  every chunk (see the header of ``scan.cu``). Its shared memory holds two ``(d + 1) x d`` matrices, so
  it runs for ``d`` up to 77 (float32) / 54 (float64); wider states, or a single chunk, use the sweep.

Float16 / bfloat16 inputs run in float32 (as the torch implementation does); other inputs are made
contiguous (a copy only when they are not). CuPy is imported inside the functions only, the module is
compiled once per process and device (NVRTC; CuPy keeps the binary in ``$CUPY_CACHE_DIR``), and a launch
uses raw data pointers on ``torch.cuda.current_stream()``: no copies, no synchronisation.

:func:`launch_config` and :func:`kernel_args` are the one place that computes a launch (kernel name,
grid, block, shared memory, buffers, argument words); the host emulation in
:mod:`lightning_bppsa.kernels.emulated` uses them too, so the CPU tests check the CUDA launches.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning_bppsa.kernels._build import kernel_path
from torch import Tensor

__all__ = [
    "KernelUsage",
    "Launch",
    "available",
    "fits",
    "kernel_args",
    "launch_config",
    "ptxas_usage",
    "run",
    "scan_dense",
    "scan_factored",
]

SHARED_BYTES = 48 * 1024  # dynamic shared memory per block without an opt-in attribute
MATRIX_BLOCK = 2  # kMatrixBlock in scan.cu: a thread computes 2 x 2 outputs of a chunk-product step
MAX_THREADS = 256  # __launch_bounds__ in scan.cu
KERNELS = tuple(
    f"bppsa_{schedule}_{chain}_{suffix}"
    for schedule in ("sweep", "chunked")
    for chain in ("dense", "factored")
    for suffix in ("f32", "f64")
)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: what :func:`launch_config` decided."""

    kernel: str  # entry point in scan.cu
    grid: int  # blocks (1-D)
    block: int  # threads per block (a multiple of 32)
    shared_bytes: int  # dynamic shared memory per block
    tile_rows: int  # operand rows streamed through shared memory at once
    chunk: int  # steps per chunk (n for the sweep)
    work_elements: int  # scratch elements of the compute dtype (chunk aggregates and carries)
    sync_words: int  # zeroed uint32 words: ticket counter and chunk flags


def _threads(work_items: int) -> int:
    return min(MAX_THREADS, 32 * max(1, math.ceil(work_items / 32)))


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
) -> Launch:
    """The launch of one scan of ``batch`` chains of ``n >= 1`` steps of state size ``d``.

    ``m`` is the factored weight's rows (``d`` for a dense chain); ``affine`` is a per-step gradient.
    Raises ``ValueError`` if ``d`` is too wide even for the sweep's shared memory (~2000 float64).
    """
    if n < 1 or batch < 1 or d < 1:
        raise ValueError(f"launch_config needs n, batch, d >= 1; got n={n}, batch={batch}, d={d}")
    suffix = {4: "f32", 8: "f64"}[element_bytes]
    chain = "factored" if factored else "dense"
    operand_rows = m if factored else d
    rows = d + int(affine)  # rows of a chunk aggregate [C; b]
    chunk = max(1, min(chunk_size, n))
    chunks = math.ceil(n / chunk)
    matrices = 2 * rows * d * element_bytes
    vectors = 2 * d * element_bytes
    row_bytes = d * element_bytes
    chunked = algorithm in ("chunked", "blelloch") and chunks > 1 and matrices + vectors + row_bytes <= SHARED_BYTES
    if chunked:
        tile_rows = min(operand_rows, (SHARED_BYTES - matrices - vectors) // row_bytes)
        return Launch(
            kernel=f"bppsa_chunked_{chain}_{suffix}",
            grid=batch * chunks,
            block=_threads(math.ceil(rows / MATRIX_BLOCK) * math.ceil(d / MATRIX_BLOCK)),
            shared_bytes=matrices + vectors + tile_rows * row_bytes,
            tile_rows=tile_rows,
            chunk=chunk,
            work_elements=batch * chunks * (rows * d + d),
            sync_words=1 + batch * chunks,
        )
    if vectors + row_bytes > SHARED_BYTES:
        raise ValueError(f"state size d={d} is too wide for the CUDA scan kernels' shared memory")
    tile_rows = min(operand_rows, (SHARED_BYTES - vectors) // row_bytes)
    return Launch(
        kernel=f"bppsa_sweep_{chain}_{suffix}",
        grid=batch,
        block=_threads(d),
        shared_bytes=vectors + tile_rows * row_bytes,
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
) -> list[int]:
    """The kernel's 14 argument words (pointers as addresses, 0 for none), in ``BPPSA_PARAMS`` order."""
    return [mat, scales, diagonal, grad, out, work, sync, n, batch, d, m, launch.chunk, int(affine), launch.tile_rows]


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
) -> Tensor:
    """Prepare buffers, compute the launch and hand it to ``launcher(launch, args, device)``.

    ``mat`` is ``jacobians_t`` (``scales is None``) or the factored ``weight``. Returns ``(B, n + 1, d)``
    in ``grad``'s dtype. Shared by the CUDA path and the host emulation.
    """
    compute = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    factored = scales is not None

    def prepared(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(compute).contiguous()

    mat, scales, diagonal, grad_c = (prepared(t) for t in (mat, scales, diagonal, grad))
    batch, d = grad.shape[0], grad.shape[-1]
    n = scales.shape[1] if factored else mat.shape[1]
    m = mat.shape[0] if factored else d
    affine = grad.dim() == 3
    out = torch.empty(batch, n + 1, d, dtype=compute, device=grad.device)
    if n == 0 or batch == 0 or d == 0:  # nothing to scan: g_n only
        out[:, n] = grad_c[:, n] if affine else grad_c
        return out.to(grad.dtype)
    launch = launch_config(
        factored=factored,
        element_bytes=out.element_size(),
        n=n,
        batch=batch,
        d=d,
        m=m,
        affine=affine,
        algorithm=algorithm,
        chunk_size=chunk_size,
    )
    work = torch.empty(launch.work_elements, dtype=compute, device=grad.device)
    sync = torch.zeros(launch.sync_words, dtype=torch.int32, device=grad.device)

    def address(t: Tensor | None) -> int:
        return 0 if t is None or t.numel() == 0 else t.data_ptr()

    args = kernel_args(
        launch,
        mat=address(mat),
        scales=address(scales),
        diagonal=address(diagonal),
        grad=address(grad_c),
        out=address(out),
        work=address(work),
        sync=address(sync),
        n=n,
        batch=batch,
        d=d,
        m=m,
        affine=affine,
    )
    launcher(launch, args, grad.device)
    return out.to(grad.dtype)


# --------------------------------------------------------------------------------------------------
# CuPy: availability, the compiled module, the launch.
# --------------------------------------------------------------------------------------------------


_AVAILABLE: dict[str, tuple[bool, str]] = {}  # the answer of the first eager call


def available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy and a CUDA device are usable, else ``(False, why)``.

    The first eager call compiles the kernels (once; CuPy caches the binary on disk). While
    ``torch.compile`` traces (the cost model asks from inside ``backprop_scan``), it only reports what
    an earlier eager call found, so tracing never imports CuPy or compiles.
    """
    if "answer" not in _AVAILABLE:
        if torch.compiler.is_compiling():
            return False, "not checked yet (first asked while torch.compile traces)"
        _AVAILABLE["answer"] = _check_available()
    return _AVAILABLE["answer"]


def _check_available() -> tuple[bool, str]:
    try:
        import cupy  # noqa: F401
    except ImportError as err:
        return False, f"CuPy is not installed ({err}); install cupy-cuda12x or cupy-cuda13x"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:  # a driver / CuPy mismatch shows here, once, instead of in the first scan
        _module(torch.cuda.current_device())
    except Exception as err:  # CuPy raises several unrelated types (CompileException, CUDADriverError, ...)
        return False, f"the CUDA kernels do not compile or load here ({type(err).__name__}: {err})"
    return True, ""


def source() -> str:
    """``scan.cu`` with its header inlined (CuPy's cache key is the source text, so a header edit counts)."""
    header = kernel_path("cuda_host_emulation.h").read_text()
    return kernel_path("scan.cu").read_text().replace('#include "cuda_host_emulation.h"', header)


@functools.cache
def _module(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source(), options=("-std=c++17",))
        module.compile()
    return module


def _launch_cuda(launch: Launch, args: list, device: torch.device) -> None:
    import cupy
    import numpy

    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _module(index).get_function(launch.kernel)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        kernel((launch.grid,), (launch.block,), tuple(numpy.uint64(a) for a in args), shared_mem=launch.shared_bytes)


@dataclass(frozen=True)
class KernelUsage:
    """What ptxas reports for one kernel."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


def ptxas_usage(archs: tuple[str, ...] = ("sm_80", "sm_90"), nvcc: str | None = None) -> dict[str, dict[str, KernelUsage]]:
    """Compile ``scan.cu`` with nvcc for ``archs`` (one front-end pass) and return ptxas's report per arch and kernel.

    ptxas runs with ``-warn-spills -Werror``: a spill fails the compilation (``RuntimeError`` with the
    command and its output). Needs only nvcc, no GPU or driver. Raises ``FileNotFoundError`` without nvcc.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH")
    gencodes = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            nvcc, "-fatbin", "-std=c++17", *gencodes, "-Xptxas", "-v", "-Xptxas", "-warn-spills",
            "-Xptxas", "-Werror", "-o", f"{tmp}/scan.fatbin", str(kernel_path("scan.cu")),
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {result.returncode}:\n{result.stderr[-3000:]}")
    usage: dict[str, dict[str, KernelUsage]] = {arch: {} for arch in archs}
    for entry in re.split(r"Compiling entry function ", result.stderr)[1:]:
        name, arch = re.match(r"'(\w+)' for '(\w+)'", entry).groups()
        stack, stores, loads = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", entry
        ).groups()
        registers = re.search(r"Used (\d+) registers", entry).group(1)
        usage[arch][name] = KernelUsage(int(registers), int(stack), int(stores), int(loads))
    return usage


def fits(d: int, element_bytes: int) -> tuple[bool, str]:
    """Whether a state of size ``d`` fits the kernels' shared memory (the sweep's: the chunked kernel falls
    back to the sweep where its matrices do not fit); ``(False, reason)`` otherwise."""
    try:
        launch_config(
            factored=False, element_bytes=element_bytes, n=1, batch=1, d=d, m=d, affine=True,
            algorithm="linear", chunk_size=1,
        )
    except ValueError as err:
        return False, str(err)
    return True, ""


def scan_dense(jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
    """``bppsa::scan_dense`` on CUDA: ``jacobians_t`` ``(B, n, d, d)``, ``grad`` ``(B, d)`` or ``(B, n + 1, d)``."""
    return run(jacobians_t, None, None, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=_launch_cuda)


def scan_factored(
    weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk_size: int
) -> Tensor:
    """``bppsa::scan_factored`` on CUDA: ``J_t = diag(u_t) + [diag(s^1_t) .. diag(s^k_t)] W`` (see ``FactoredJacobians``)."""
    return run(weight, scales, diagonal, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=_launch_cuda)
