"""A cell's CUDA loop (:mod:`lightning_bppsa.nn.cell_cuda`) run on the CPU through the host emulation.

For tests on machines without a GPU: the generated source, the very text NVRTC compiles on a GPU, built with
g++ and ``cuda_host_emulation.h`` (one OS thread per CUDA thread), launched with the launches
:func:`lightning_bppsa.nn.cell_cuda.launch_config` computes, on CPU tensors. Keep grids tiny: a forward or a
backward is one block of ``32 ceil(H / 32)`` threads per batch row (where ``H < 32``: one per item of the step,
piece coordinate or read column, up to 256).
"""

from __future__ import annotations

import ctypes
import os

import torch
from lightning_bppsa.kernels._build import cache_dir, load_library
from lightning_bppsa.kernels.emulated import LAUNCH_ARGTYPES, LaunchTimeout

__all__ = ["EmulatedBackend"]

_TIMEOUT, _ERROR = 1, 2  # BPPSA_EMU_TIMEOUT / BPPSA_EMU_ERROR in cuda_host_emulation.h
#: the per-block shared memory emulated: an H100's opt-in limit (the kernels' staged weights are checked against it)
H100_SHARED_BYTES = 227 * 1024
_LIBRARIES: dict[str, ctypes.CDLL] = {}  # source digest -> its built library


class EmulatedBackend:
    """The :class:`lightning_bppsa.nn.cell_cuda.Backend` of the host emulation: CPU tensors, g++ builds (cached in
    ``$BPPSA_CACHE_DIR``), every block resident at once, blocks dispatched in a seeded order."""

    platform = "cuda (emulated)"

    def __init__(
        self, *, shared_limit: int = H100_SHARED_BYTES, timeout: float = 60.0, seed: int = 1
    ) -> None:
        self._shared_limit, self._timeout, self._seed = shared_limit, timeout, seed
        # (entry point, grid, block, shared bytes), in order
        self.launches: list[tuple[str, int, int, int]] = []

    def shared_limit(self, device: torch.device) -> int:
        return self._shared_limit

    def load(self, source, device: torch.device) -> ctypes.CDLL:
        if device.type != "cpu":
            raise RuntimeError(f"the emulated CUDA cell loop takes CPU tensors, not {device.type}")
        if source.digest in _LIBRARIES:
            return _LIBRARIES[source.digest]
        folder = cache_dir() / "cells"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"bppsa_cell_cuda_{source.digest}.cu"
        if not path.exists() or path.read_text() != source.text:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source.text)
            tmp.replace(path)
        from lightning_bppsa.nn.cell_cuda import ENTRIES

        library = load_library(
            f"bppsa_cell_cuda_emulated_{source.digest}", [str(path)], ["g++", "-std=c++20", "-pthread", "-x", "c++"],
            flag_sets=[["-O1"]], symbols=["bppsa_emu_launch", *(f"{k}_host" for k in ENTRIES)],
        )  # fmt: skip
        library.bppsa_emu_launch.restype = ctypes.c_int
        library.bppsa_emu_launch.argtypes = LAUNCH_ARGTYPES
        _LIBRARIES[source.digest] = library
        return library

    def launch(self, source, launch, args: list[int], device: torch.device) -> None:
        library = self.load(source, device)  # built once per source
        words = (ctypes.c_uint64 * len(args))(*args)
        entry = ctypes.cast(getattr(library, f"{launch.entry}_host"), ctypes.c_void_p)
        self.launches.append((launch.entry, launch.grid, launch.block, launch.shared_bytes))
        status = library.bppsa_emu_launch(
            entry,
            words,
            launch.grid,
            launch.block,
            launch.shared_bytes,
            launch.grid,
            self._timeout,
            self._seed,
            0.0,
        )
        if status == _TIMEOUT:
            raise LaunchTimeout(f"{launch.kernel} ({launch.grid} blocks) did not finish in {self._timeout} s")
        if status == _ERROR:
            raise RuntimeError(f"{launch.kernel}: an exception escaped an emulated thread")
