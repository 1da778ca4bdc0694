"""A factored cell's compiled loop on CUDA: the CPU loop's generated step (:mod:`~lightning_bppsa.nn.cell_kernel`)
run by CUDA kernels (``kernels/cell_loop_cuda.h``).

The step's pointwise part is generated from the traced graph by :mod:`~lightning_bppsa.nn.cell_kernel`'s own
generator (values and forward-mode partials, per coordinate ``j``: the same statements as the CPU loop's) for
this module's :data:`TARGET`: device functions, one thread per coordinate instead of the loop over ``j``,
``kernels/cell_cuda_prologue.h`` instead of ``activations.h``, ``kernels/cell_loop_cuda.h`` instead of
``cell_loop.h``. Three kernels, launched on torch's current stream:

- the forward loop (one block per batch row): the states and, with partials, the Jacobians' factors and the
  partials by the input part's values, in one pass (the input projection is one torch GEMM before it, as on
  the CPU); below a warp's width (``H < 32``: :data:`SPREAD_BELOW`) the forward and the backward share their
  products with the weights over a block of up to :data:`MAX_THREADS` threads (a state of widths (31, 33) is
  64 blocks of width 1: one thread per coordinate left one thread doing a step's 64 x 64 multiply-adds);
- the backward (one block per batch row): the reverse linear sweep of the factored Jacobians fused with the
  products the parameter VJP needs; the weights' GEMMs then run in torch (:meth:`CellKernel.vjp`);
- the products alone, after a scan that ran elsewhere (``"blelloch"`` / ``"chunked"``).

:class:`CudaCellKernel` is a :class:`~lightning_bppsa.nn.cell_kernel.CellKernel` whose compiled library is
these launches (:class:`_Launches` takes the C functions' arguments): its forward, scan, products and VJP are
the CPU kernel's own code. The kernels are built by a :class:`Backend`: NVRTC through the package's CuPy
loader :mod:`lightning_bppsa.kernels.cupy_loader` (:class:`CupyBackend`, the default), or the host emulation
(:mod:`lightning_bppsa.kernels.cell_cuda_emulated`: the same source text through g++, the same launches, on
CPU tensors). The pieces' weights are staged in shared memory where they fit the device's, else read from
global memory. Where the source cannot be made (an op the generator does not compile), ``H > 256`` (one
thread per coordinate), the device has no room for the state buffers, or the kernels do not build or load
(no CuPy, no NVRTC), construction raises :class:`~lightning_bppsa.nn.cell_kernel.Unsupported` or
:class:`RuntimeError` and :class:`~lightning_bppsa.nn.Recurrence` keeps the torch path with the reason.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_bppsa.kernels._build import kernel_path
from lightning_bppsa.nn import cell_kernel
from lightning_bppsa.nn.cell_kernel import CellKernel, Unsupported
from lightning_bppsa.nn.cell_structure import CellStructure

__all__ = [
    "Backend",
    "CellSource",
    "CudaCellKernel",
    "CupyBackend",
    "Launch",
    "KERNELS",
    "TARGET",
    "generate",
    "launch_config",
    "weight_products",
]

KERNELS = ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward", "bppsa_cell_cuda_cotangent")
MAX_THREADS = 256  # CELL_MAX_THREADS in cell_loop_cuda.h: one thread per coordinate of a state tensor
#: below this width the forward and the backward spread the products with the weights over the whole block
#: (CELL_SPREAD in cell_loop_cuda.h): a warp of one coordinate per thread would leave most lanes idle
SPREAD_BELOW = 32
#: the cotangent kernel's grid-stride launch: threads per block and at most this many blocks
COTANGENT_BLOCK, COTANGENT_GRID = 256, 4096
_HEADERS = ("cuda_host_emulation.h", "cell_cuda_prologue.h", "cell_loop_cuda.h")


@dataclass(frozen=True)
class CellSource:
    """A cell's generated CUDA source (headers inlined: CuPy's cache key is the text) and what launches need."""

    text: str
    digest: str  # of the text: names the built module
    n_inputs: int  # NI: input-part values, each a (pointer, row stride) pair of kernel parameters
    width: int  # H
    n_states: int  # M
    pieces: int  # NK
    read_columns: int  # CHI - CLO: the state columns the pieces' weights read (the staged rows)
    element_bytes: int

    @property
    def spread(self) -> bool:
        """The kernels spread the products with the weights over the block (``CELL_SPREAD``)."""
        return self.width < SPREAD_BELOW


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as :func:`launch_config` computed it."""

    kernel: str
    grid: int
    block: int
    shared_bytes: int  # dynamic shared memory per block
    staged: bool = False  # the pieces' weights staged in shared memory (forward, backward)


def generate(structure: CellStructure, dtype: torch.dtype) -> tuple[CellSource, list, cell_kernel._Layout]:
    """The CUDA source of ``structure``'s loop in ``dtype``, the input-part values it reads, in order, and the
    partials it keeps (the C generator's :class:`~lightning_bppsa.nn.cell_kernel._Input` list and ``_Layout``);
    :class:`Unsupported` where the generator does not compile the graph."""
    text, inputs, layout = cell_kernel._generated(structure, dtype, TARGET)
    for header in _HEADERS:
        # inlined once each: their include guards would only warn in the main file
        text = text.replace(
            f'#include "{header}"', kernel_path(header).read_text().replace("#pragma once", "")
        )
    read = [q for piece in structure.pieces for q, _ in piece.reads]
    h = structure.width
    source = CellSource(
        text=text, digest=hashlib.sha256(text.encode()).hexdigest()[:16], n_inputs=len(inputs), width=h,
        n_states=structure.n_states, pieces=len(structure.pieces),
        read_columns=(max(read) - min(read) + 1) * h if read else 0, element_bytes=dtype.itemsize,
    )  # fmt: skip
    return source, inputs, layout


def _epilogue(structure: CellStructure, n_inputs: int) -> list[str]:
    """After the step: the kernels' parameter macros (the input values as (pointer, row stride) pairs), then the
    kernels."""
    pointers = ", ".join(f"in{k}" for k in range(n_inputs))
    strides = ", ".join(f"st{k}" for k in range(n_inputs))
    params = "".join(f", const REAL* __restrict__ in{k}, int64_t st{k}" for k in range(n_inputs))
    host = "".join(
        f", (const REAL*)a[base + {2 * k}], (int64_t)a[base + {2 * k + 1}]" for k in range(n_inputs)
    )
    return [
        f"#define CELL_INPUT_PARAMS {params}",
        f"#define CELL_INPUT_POINTERS {pointers}",
        f"#define CELL_INPUT_STRIDES {strides}",
        f"#define CELL_INPUT_HOST_ARGS(base) {host}",
        f"#define CELL_SPREAD {int(structure.width < SPREAD_BELOW)}",
        '#include "cell_loop_cuda.h"',
    ]


#: the CUDA kernels: the step as device functions, one thread per coordinate j (kernels/cell_loop_cuda.h)
TARGET = cell_kernel.Target(
    generator="lightning_bppsa/nn/cell_cuda.py",
    prologue=('#include "cuda_host_emulation.h"', '#include "cell_cuda_prologue.h"'),
    qualifier="__device__ __forceinline__",
    loop="{{ const int64_t j = threadIdx.x;",
    epilogue=_epilogue,
)


def launch_config(source: CellSource, kernel: str, batch: int, steps: int, shared_limit: int) -> Launch:
    """The launch of ``kernel`` over ``batch`` rows of ``steps`` steps on a device whose blocks may use
    ``shared_limit`` bytes of shared memory: the ONE place that computes it (the GPU and the host emulation
    both launch what it says). The forward and the backward stage the pieces' weights in shared memory where
    they fit, else read them from global memory (``Launch.staged``)."""
    h, m, k, size = source.width, source.n_states, source.pieces, source.element_bytes
    weights = source.read_columns * k * h * size
    block = 32 * math.ceil(h / 32)
    if kernel in ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward"):
        forward = kernel == "bppsa_cell_cuda_forward"
        # forward: two state buffers and the pieces; backward: two buffers of the pieces' products (spread: and
        # the read columns' sums)
        buffers = (2 * m * h + k * h if forward else 2 * k * h + source.read_columns * source.spread) * size
        if source.spread:  # a thread per piece coordinate (forward) or read column (backward), up to the cap
            spread = k * h if forward else source.read_columns
            block = min(MAX_THREADS, max(block, 32 * math.ceil(spread / 32)))
        staged = buffers + weights <= shared_limit
        return Launch(kernel, batch, block, buffers + weights * staged, staged)
    if kernel == "bppsa_cell_cuda_cotangent":
        work = batch * steps * h
        block = min(COTANGENT_BLOCK, 32 * max(1, math.ceil(work / 32)))
        return Launch(kernel, max(1, min(COTANGENT_GRID, math.ceil(work / block))), block, 0)
    raise ValueError(f"no such kernel {kernel!r}; one of {KERNELS}")


def weight_products(source: CellSource, launch: Launch) -> int:
    """The multiply-adds with the pieces' weights that the busiest thread of ``launch`` (forward or backward) does
    in one step: the pieces from the read state columns (forward), the read columns' sums over the pieces'
    products (backward). The serial part of a step that the layout decides (cell_loop_cuda.h)."""
    h, pieces, columns = source.width, source.pieces * source.width, source.read_columns
    if launch.kernel not in ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward"):
        raise ValueError(f"{launch.kernel} does no products with the weights")
    forward = launch.kernel == "bppsa_cell_cuda_forward"
    if source.spread:  # the block shares the piece coordinates (forward) or the read columns (backward)
        return math.ceil((pieces if forward else columns) / launch.block) * (columns if forward else pieces)
    # thread j: its coordinate of every piece (forward), of every read state (backward)
    return source.pieces * columns if forward else (columns // h) * pieces


class Backend(Protocol):
    """What builds and launches a cell's kernels: ``platform`` names it in ``last_stats["cell_kernel"]``."""

    platform: str

    def shared_limit(self, device: torch.device) -> int:
        """The dynamic shared memory a block may use on ``device``."""
        ...

    def load(self, source: CellSource, device: torch.device) -> None:
        """Build and load ``source`` for ``device`` (once); ``RuntimeError`` saying why where it cannot."""
        ...

    def launch(self, source: CellSource, launch: Launch, args: list[int], device: torch.device) -> None:
        """Queue ``launch`` with the 64-bit argument words ``args`` (pointers as addresses)."""
        ...


class CudaCellKernel(CellKernel):
    """The compiled loop of one factored :class:`CellStructure` in one dtype on one CUDA device (or, with the
    emulated backend, on CPU tensors through the host emulation).

    Raises :class:`Unsupported` where the graph cannot be compiled or the state does not fit the kernels, and
    :class:`RuntimeError` where the kernels do not build or load (the backend says why).
    """

    def __init__(
        self,
        structure: CellStructure,
        dtype: torch.dtype,
        device: torch.device,
        backend: Backend | None = None,
    ) -> None:
        cell_kernel._check(structure, dtype)  # CellKernel's own conditions, without its C build
        if structure.width > MAX_THREADS:
            raise Unsupported(
                f"the state tensors are {structure.width} wide; the CUDA loop takes at most {MAX_THREADS}"
            )
        backend = CupyBackend() if backend is None else backend
        source, self._inputs, self._layout = generate(structure, dtype)
        limit = backend.shared_limit(device)
        for name in KERNELS:
            need = launch_config(source, name, 1, 1, limit).shared_bytes
            if need > limit:  # the buffers alone: weights that do not fit stay in global memory
                raise Unsupported(f"{name} needs {need} bytes of shared memory; the device gives {limit}")
        backend.load(source, device)
        self.structure, self.dtype, self.source, self.platform = structure, dtype, source, backend.platform
        self._library = _Launches(source, backend, device)
        self._start()


def _address(value: int | None) -> int:
    return 0 if value is None else int(value)


class _Launches:
    """The compiled loop's "library" as :class:`CellKernel` calls it (the C functions' arguments, pointers as
    ints or ``None``; OpenMP's ``threads`` unused), each call one kernel launch of :func:`launch_config`
    through the backend, its argument words in the kernel's order."""

    def __init__(self, source: CellSource, backend: Backend, device: torch.device) -> None:
        self._source, self._backend, self._device = source, backend, device
        self._shared_limit = backend.shared_limit(device)

    def _launch(self, kernel: str, batch: int, steps: int, words: list, tail: list[int] = ()) -> None:
        """``words`` (pointers as ints or None), then the ``staged`` word (forward, backward), then ``tail``."""
        if batch == 0 or steps == 0:
            return
        launch = launch_config(self._source, kernel, batch, steps, self._shared_limit)
        args = [_address(w) for w in words]
        if kernel != "bppsa_cell_cuda_cotangent":
            args.append(int(launch.staged))
        self._backend.launch(self._source, launch, [*args, *tail], self._device)

    def bppsa_cell_forward(self, batch, steps, threads, wc, offsets, pointers, strides, states, partials, scales,
                           diagonal, fpart) -> int:  # fmt: skip
        inputs = []
        for k in range(self._source.n_inputs):  # the ctypes arrays CellKernel.forward filled
            inputs += [_address(pointers[k]), int(strides[k])]
        words = [batch, steps, wc, offsets, states, int(partials), scales, diagonal, fpart]
        self._launch("bppsa_cell_cuda_forward", batch, steps, words, inputs)
        return 0

    def bppsa_cell_backward(self, batch, steps, threads, wt, scales, scale_width, diagonal, fpart, direct,
                            direct_width, batch_stride, step_stride, final, out, products) -> int:  # fmt: skip
        words = [
            batch,
            steps,
            wt,
            scales,
            scale_width,
            diagonal,
            fpart,
            direct,
            int(direct_width),
            int(batch_stride),
            int(step_stride),
            final,
            out,
            products,
        ]
        self._launch("bppsa_cell_cuda_backward", batch, steps, words)
        return 0

    def bppsa_cell_cotangent(self, batch, steps, threads, grad, scales, scale_width, fpart, out) -> int:
        self._launch(
            "bppsa_cell_cuda_cotangent", batch, steps, [batch, steps, grad, scales, scale_width, fpart, out]
        )
        return 0


# --------------------------------------------------------------------------------------------------
# NVRTC through CuPy: the package's one loader (lightning_bppsa.kernels.cupy_loader), imported when a kernel is
# built on a GPU (a machine without it keeps the torch path with the reason).
# --------------------------------------------------------------------------------------------------


class CupyBackend:
    """The kernels compiled with NVRTC by CuPy (once per source and device; CuPy caches the binary on disk) and
    launched on torch's current stream (no sync), through :mod:`lightning_bppsa.kernels.cupy_loader`."""

    platform = "cuda"

    def __init__(self) -> None:
        self._functions: dict[tuple[int, str, str], object] = {}  # (device, digest, kernel) -> CuPy Function

    def shared_limit(self, device: torch.device) -> int:
        return _loader().shared_limit(_index(device))

    def load(self, source: CellSource, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"the CUDA cell loop takes CUDA tensors, not {device.type}")
        loader = _loader()
        ok, reason = loader.available()  # CuPy >= 14, NVRTC, a device: what every CUDA kernel here needs
        if not ok:
            raise RuntimeError(f"the CUDA cell loop cannot run here: {reason}")
        index = _index(device)
        try:
            for name in KERNELS:
                self._functions[(index, source.digest, name)] = loader.load_function(index, source.text, name)
        except Exception as err:  # noqa: BLE001 - CuPy raises unrelated types (CompileException, CUDADriverError, ...)
            raise RuntimeError(
                f"the CUDA cell loop does not compile or load here ({type(err).__name__}: {err})"
            ) from err

    def launch(self, source: CellSource, launch: Launch, args: list[int], device: torch.device) -> None:
        index = _index(device)
        function = self._functions[(index, source.digest, launch.kernel)]
        _loader().launch(function, index, launch.grid, launch.block, launch.shared_bytes, args)


def _loader():
    """The package's CuPy loader; ``RuntimeError`` where this installation has none."""
    try:
        from lightning_bppsa.kernels import cupy_loader
    except ImportError as err:
        raise RuntimeError(f"the CUDA cell loop needs lightning_bppsa.kernels.cupy_loader ({err})") from err
    return cupy_loader


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
