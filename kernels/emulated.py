"""The CUDA scan kernels run on the CPU: ``scan.cu`` compiled with g++ and the host-emulation header.

For tests on machines without a GPU. The same source and the same launches as
:mod:`lightning_bppsa.kernels.cuda` (:func:`~lightning_bppsa.kernels.cuda.launch_config`), with one
OS thread per CUDA thread; ``resident`` bounds the blocks that run at once (as on a GPU that has room
for only that many), which checks that the inter-block waits cannot deadlock; blocks are dispatched
in a random order drawn from ``seed`` (0: index order), and the thread of every release store of a
flag then stalls up to ``jitter_us`` (its block stays at what it announced: the window between a
block's two announcements).
Slow (a barrier costs a few context switches): keep grids tiny. Like the CUDA path, one library per module:
the generic one, and one per ``(d, k)`` of a ``d <= 32`` chain (``cuda.module_options``: ~2-3 s of g++ once,
then cached), so the emulation runs the very specialisation a GPU compiles.

Build through :func:`lightning_bppsa.kernels._build.load_library` into ``$BPPSA_CACHE_DIR``;
A ThreadSanitizer variant (``build_arguments("thread")``) loads only into a process started with
``LD_PRELOAD`` of ``libtsan.so``, where importing torch alone takes ~20 s: the test builds and runs it
in a torch-free process from :func:`build_arguments` and the launch that :mod:`.cuda` computed.
"""

from __future__ import annotations

import ctypes

import torch
from lightning_bppsa.kernels import cuda
from lightning_bppsa.kernels._build import load_library
from torch import Tensor

__all__ = ["LaunchTimeout", "build_arguments", "library", "scan_dense", "scan_factored"]

_COMPILER = ["g++", "-std=c++20", "-pthread", "-x", "c++"]
_TIMEOUT, _ERROR = 1, 2  # BPPSA_EMU_* in cuda_host_emulation.h


class LaunchTimeout(RuntimeError):
    """An emulated launch did not finish in time (a deadlock: it was aborted)."""


def build_arguments(sanitize: str | None = None, warp_shape: tuple[int, int] | None = None) -> dict:
    """The keyword arguments of ``load_library`` for the emulated kernels of one module (``warp_shape``: see
    ``cuda.module_options``; plain data: a process that must not import torch, such as a ThreadSanitizer
    run, can build the same library from them)."""
    shape = f"_d{warp_shape[0]}_k{warp_shape[1]}" if warp_shape else ""
    layout = ["bppsa_warp_layout"] if warp_shape else []
    flags = ["-O1", "-g", f"-fsanitize={sanitize}"] if sanitize else ["-O2"]
    return {
        "name": "bppsa_scan_emulated" + shape + (f"_{sanitize}" if sanitize else ""),
        "sources": [str(cuda.source_path("scan.cu"))],
        "compiler": _COMPILER,
        "flag_sets": [[*flags, *cuda.module_options(warp_shape)]],
        "depends": [str(cuda.source_path("cuda_host_emulation.h"))],
        "symbols": ["bppsa_emu_launch", *layout, *(f"{k}_host" for k in cuda.module_kernels(warp_shape))],
    }


#: ``bppsa_emu_launch(entry, args, grid, block, shared_bytes, resident, timeout_s, seed, jitter_us)``
LAUNCH_ARGTYPES = [
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.c_uint,
    ctypes.c_uint,
    ctypes.c_size_t,
    ctypes.c_uint,
    ctypes.c_double,
    ctypes.c_ulonglong,
    ctypes.c_double,
]


def library(warp_shape: tuple[int, int] | None = None) -> ctypes.CDLL:
    """The emulated kernels of one module (built once, cached): the generic one, or ``warp_shape``'s."""
    lib = load_library(**build_arguments(warp_shape=warp_shape))
    lib.bppsa_emu_launch.restype = ctypes.c_int
    lib.bppsa_emu_launch.argtypes = LAUNCH_ARGTYPES
    if warp_shape:  # bppsa_warp_layout(factored, element_bytes, lean, depth): the layout scan.cu compiled
        lib.bppsa_warp_layout.restype = ctypes.c_longlong
        lib.bppsa_warp_layout.argtypes = [ctypes.c_longlong] * 4
    return lib


def _launcher(resident: int | None, timeout: float, seed: int, jitter_us: float):
    def launch(config: cuda.Launch, args: list, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the emulated kernels take CPU tensors; got {device}")
        lib = library(config.warp_shape)
        if config.work_elements:  # poisoned scratch (all-ones bytes: NaN): reading unpublished data shows
            ctypes.memset(args[5], 0xFF, config.work_elements * (8 if config.kernel.endswith("f64") else 4))
        words = (ctypes.c_uint64 * len(args))(*args)
        entry = ctypes.cast(getattr(lib, f"{config.kernel}_host"), ctypes.c_void_p)
        blocks = config.grid if resident is None else resident
        status = lib.bppsa_emu_launch(
            entry, words, config.grid, config.block, config.shared_bytes, blocks, timeout, seed, jitter_us
        )
        if status == _TIMEOUT:
            raise LaunchTimeout(
                f"{config.kernel} ({config.grid} blocks, {blocks} resident) did not finish in {timeout} s"
            )
        if status == _ERROR:
            raise RuntimeError(
                f"{config.kernel}: an emulated thread failed (a bad warp mask, shared memory exhausted, a "
                "misaligned vector load, copies pending at a block's end, or a kernel invariant)"
            )

    return launch


def scan_dense(
    jacobians_t: Tensor,
    grad: Tensor,
    algorithm: str,
    chunk_size: int,
    *,
    resident: int | None = None,
    timeout: float = 60.0,
    seed: int = 1,
    jitter_us: float = 0.0,
    shared_limit: int = cuda.SHARED_BYTES,
) -> Tensor:
    """:func:`lightning_bppsa.kernels.cuda.scan_dense` on CPU tensors; ``resident`` blocks at once (all if
    ``None``), dispatched in the order drawn from ``seed``, release stores delayed up to ``jitter_us``;
    ``shared_limit``: the per-block shared memory of the GPU being emulated (see ``cuda.launch_config``)."""
    launcher = _launcher(resident, timeout, seed, jitter_us)
    return cuda.run(
        jacobians_t, None, None, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=launcher,
        shared_limit=shared_limit,
    )  # fmt: skip


def scan_factored(
    weight: Tensor,
    scales: Tensor,
    diagonal: Tensor | None,
    grad: Tensor,
    algorithm: str,
    chunk_size: int,
    *,
    resident: int | None = None,
    timeout: float = 60.0,
    seed: int = 1,
    jitter_us: float = 0.0,
    shared_limit: int = cuda.SHARED_BYTES,
) -> Tensor:
    """:func:`lightning_bppsa.kernels.cuda.scan_factored` on CPU tensors (see :func:`scan_dense`)."""
    launcher = _launcher(resident, timeout, seed, jitter_us)
    return cuda.run(
        weight, scales, diagonal, grad, algorithm=algorithm, chunk_size=chunk_size, launcher=launcher,
        shared_limit=shared_limit,
    )  # fmt: skip
