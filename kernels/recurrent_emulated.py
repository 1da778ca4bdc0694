"""The recurrent forward kernels (``recurrent.cu``) run on the CPU through the host-emulation headers.

For tests on machines without a GPU: the same source compiled with g++ (``cuda_host_emulation.h`` and
``recurrent_emulation.h``), the same launches as :mod:`lightning_bppsa.kernels.recurrent_cuda`
(:func:`~lightning_bppsa.kernels.recurrent_cuda.prepare`), one OS thread per CUDA thread. The functions
take CPU tensors and have the signatures of the CUDA ones plus ``shared_limit`` (the per-block shared
memory of the GPU being emulated, default an A100's opt-in 163 KiB), ``cluster_limit`` (the largest
thread-block cluster it runs: 1, an A100's, by default; 8 for an sm_90 device), ``resident`` (blocks, or
clusters, running at once, all if ``None``) and ``timeout`` (seconds before a hung launch is aborted).
"""

from __future__ import annotations

import ctypes

import torch
from lightning_bppsa.kernels import recurrent_cuda
from lightning_bppsa.kernels._build import kernel_path, load_library
from lightning_bppsa.kernels.emulated import LAUNCH_ARGTYPES, LaunchTimeout
from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES, Launch
from torch import Tensor

__all__ = ["build_arguments", "gru_backward", "gru_forward", "library", "lstm_backward", "lstm_forward", "rnn_backward",
           "rnn_forward"]

_TIMEOUT, _ERROR = 1, 2  # BPPSA_EMU_TIMEOUT / BPPSA_EMU_ERROR in cuda_host_emulation.h


def build_arguments(sanitize: str | None = None, options: tuple[str, ...] = ()) -> dict:
    """The keyword arguments of ``load_library`` for the emulated recurrent kernels of the module with the -D
    ``options`` (a :class:`~lightning_bppsa.kernels.recurrent_cuda.Launch`'s; ``()``: the shared-memory
    kernels) and ``sanitize`` (e.g. "address")."""
    defines = dict(option[2:].split("=", 1) for option in options)
    suffix = "".join(f"_{name.removeprefix('BPPSA_REC_').lower()}{value}" for name, value in defines.items())
    hidden, wide_cell = defines.get("BPPSA_REC_HIDDEN"), defines.get("BPPSA_REC_CELL")
    if wide_cell:  # one cell's forward or backward compiled for an H > 32 (recurrent_cuda.wide_options)
        direction = "forward" if defines.get("BPPSA_REC_FORWARD") else "backward"
        cluster = f"_c{defines['BPPSA_REC_CLUSTER']}" if "BPPSA_REC_CLUSTER" in defines else ""
        kernels = [f"bppsa_{wide_cell}_{direction}_f32_h{hidden}{cluster}"]
    elif hidden:
        kernels = [f"bppsa_{cell}_{direction}_f32_h{hidden}" for cell in recurrent_cuda.CELLS
                   for direction in ("forward", "backward")]  # fmt: skip
    else:
        kernels = list(recurrent_cuda.KERNELS)
    return {
        "name": "bppsa_recurrent_emulated" + suffix + (f"_{sanitize}" if sanitize else ""),
        "sources": [str(kernel_path("recurrent.cu"))],
        "compiler": ["g++", "-std=c++20", "-pthread", "-x", "c++", *options],
        "flag_sets": [["-O1", "-g", f"-fsanitize={sanitize}"] if sanitize else ["-O2"]],
        "depends": [str(kernel_path("cuda_host_emulation.h")), str(kernel_path("recurrent_emulation.h"))],
        "symbols": ["bppsa_emu_launch_clusters", *(f"{k}_host" for k in kernels)],
    }


_LIBRARIES: dict[tuple[str, ...], ctypes.CDLL] = {}


def library(options: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The emulated kernels of the module with the -D ``options`` (built once, cached in ``$BPPSA_CACHE_DIR``)."""
    lib = _LIBRARIES.get(options)
    if lib is None:
        lib = load_library(**build_arguments(options=options))
        lib.bppsa_emu_launch_clusters.restype = ctypes.c_int
        lib.bppsa_emu_launch_clusters.argtypes = [*LAUNCH_ARGTYPES, ctypes.c_uint]  # and the blocks a cluster
        _LIBRARIES[options] = lib
    return lib


def _launcher(resident: int | None, timeout: float):
    def launch(config: Launch, device: torch.device) -> None:
        lib = library(config.options)
        words = (ctypes.c_uint64 * len(config.args))(*config.args)
        entry = ctypes.cast(getattr(lib, f"{config.kernel}_host"), ctypes.c_void_p)
        blocks = config.grid // config.cluster if resident is None else resident  # clusters resident
        # clusters in a seeded order, no release jitter: only a cluster's blocks communicate (its barrier)
        status = lib.bppsa_emu_launch_clusters(
            entry, words, config.grid, config.block, config.shared_bytes, blocks, timeout, 1, 0.0, config.cluster
        )
        if status == _TIMEOUT:
            raise LaunchTimeout(
                f"{config.kernel} ({config.grid} blocks, {blocks} resident) did not finish in {timeout} s"
            )
        if status == _ERROR:
            raise RuntimeError(f"{config.kernel}: an exception escaped an emulated thread")

    return launch


def _forward(cell, gi, w_hh, b_hh, h0, c0, shared_limit, resident, timeout, cluster_limit):
    return recurrent_cuda.forward(
        cell, gi, w_hh, b_hh, h0, c0, launcher=_launcher(resident, timeout), device_type="cpu",
        shared_limit=shared_limit, cluster_limit=cluster_limit,
    )  # fmt: skip


def rnn_forward(
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    relu: bool,
    *,
    shared_limit: int = SM80_OPTIN_SHARED_BYTES,
    resident: int | None = None,
    timeout: float = 60.0,
    cluster_limit: int = 1,
) -> tuple[Tensor] | None:
    """:func:`lightning_bppsa.kernels.recurrent_cuda.rnn_forward` on CPU tensors."""
    return _forward(
        "rnn_relu" if relu else "rnn_tanh", gi, w_hh, b_hh, h0, None, shared_limit, resident, timeout, cluster_limit
    )


def gru_forward(
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    *,
    shared_limit: int = SM80_OPTIN_SHARED_BYTES,
    resident: int | None = None,
    timeout: float = 60.0,
    cluster_limit: int = 1,
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """:func:`lightning_bppsa.kernels.recurrent_cuda.gru_forward` on CPU tensors."""
    return _forward("gru", gi, w_hh, b_hh, h0, None, shared_limit, resident, timeout, cluster_limit)


def lstm_forward(
    gi: Tensor,
    w_hh: Tensor,
    h0: Tensor,
    c0: Tensor,
    *,
    shared_limit: int = SM80_OPTIN_SHARED_BYTES,
    resident: int | None = None,
    timeout: float = 60.0,
    cluster_limit: int = 1,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """:func:`lightning_bppsa.kernels.recurrent_cuda.lstm_forward` on CPU tensors."""
    return _forward("lstm", gi, w_hh, None, h0, c0, shared_limit, resident, timeout, cluster_limit)



def _backward(
    cell, factors, w_hh, grad_out, grad_h, grad_cn, sums, shared_limit, resident, timeout, cluster_limit
):
    return recurrent_cuda.backward(
        cell, factors, w_hh, grad_out, grad_h, grad_cn, launcher=_launcher(resident, timeout), device_type="cpu",
        shared_limit=shared_limit, sums=sums, cluster_limit=cluster_limit,
    )  # fmt: skip


def rnn_backward(
    out: Tensor, w_hh: Tensor, grad_out: Tensor | None, relu: bool, sums: object = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None, *, shared_limit: int = SM80_OPTIN_SHARED_BYTES,
    resident: int | None = None, timeout: float = 60.0, cluster_limit: int = 1,
) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """:func:`lightning_bppsa.kernels.recurrent_cuda.rnn_backward` on CPU tensors."""
    cell = "rnn_relu" if relu else "rnn_tanh"
    return _backward(
        cell, (out,), w_hh, grad_out, grad_h, None, sums, shared_limit, resident, timeout, cluster_limit
    )


def gru_backward(
    scales: Tensor, z: Tensor, dn: Tensor, w_hh: Tensor, grad_out: Tensor | None, sums: object = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None, *, shared_limit: int = SM80_OPTIN_SHARED_BYTES,
    resident: int | None = None, timeout: float = 60.0, cluster_limit: int = 1,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """:func:`lightning_bppsa.kernels.recurrent_cuda.gru_backward` on CPU tensors."""
    return _backward(
        "gru", (scales, z, dn), w_hh, grad_out, grad_h, None, sums, shared_limit, resident, timeout, cluster_limit
    )


def lstm_backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_cn: Tensor | None,
    sums: object = None, keep_gate_grads: bool = True, grad_h: Tensor | None = None, *,
    shared_limit: int = SM80_OPTIN_SHARED_BYTES, resident: int | None = None, timeout: float = 60.0,
    cluster_limit: int = 1,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """:func:`lightning_bppsa.kernels.recurrent_cuda.lstm_backward` on CPU tensors."""
    return _backward(
        "lstm", (gates, cells, c0), w_hh, grad_out, grad_h, grad_cn, sums, shared_limit, resident, timeout,
        cluster_limit,
    )
