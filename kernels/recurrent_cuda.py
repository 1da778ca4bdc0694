"""CUDA forward kernels of whole recurrent layers (``kernels/recurrent.cu``): states AND Jacobian factors.

One single-layer, single-direction layer per call, torch's gate order, batch-major contiguous tensors,
float32 or float64. ``gi`` is the input projection the caller computes with one GEMM (``x W_ihᵀ + b_ih``;
for RNN and LSTM the caller may fold ``b_hh`` into it):

- :func:`rnn_forward` ``(gi (B,T,H), w_hh (H,H), b_hh (H,)|None, h0 (B,H), relu) -> (out,)``, ``(B, T, H)``
  (no factor: the backward's ``f'`` is a function of ``out``).
- :func:`gru_forward` ``(gi (B,T,3H), w_hh (3H,H), b_hh (3H,)|None, h0) -> (out, scales (B,T,3H), z, dn)``:
  exactly the factors of ``FactoredJacobians(w_hh, scales, z)`` (``jacobians/recurrent.gru_jacobians``).
- :func:`lstm_forward` ``(gi (B,T,4H), w_hh (4H,H), h0, c0) -> (out, cells (B,T,H), gates (B,T,4H))``, the
  cells ``c_1..c_T`` and the activated gates ``[i, f, g, o]``.
- :func:`lstm_backward` ``(gates, cells, c0, w_hh, grad_out, grad_cn, grad_h=) -> (d_gates (B,T,4H), gh0, gc0)``:
  the LSTM's backward recursion over ``(h, c)`` with its gate gradients in one launch (the CPU kernels'
  :func:`lightning_bppsa.kernels.recurrent.lstm_backward`, without the parameter sums); :func:`backward_refusal`
  says where it cannot launch (the layer's scan then runs the factored Jacobians).

Float32 layers with ``H <= 32`` run kernels compiled for their ``H`` (``bppsa_<cell>_forward_f32_h<H>``: one
module per ``H``, compiled on the first launch of that ``H`` with ``-DBPPSA_REC_HIDDEN=<H>``; ``W_hh`` in
registers, ``gi`` staged :data:`RING_DEPTH` steps ahead through shared memory); the others keep ``W_hh`` in
shared memory (:data:`KERNELS`, one module compiled by :func:`available`). ``recurrent.cu``'s header says
why. :func:`refusal` says where and why a launch cannot be made (the caller plans torch's
forward there before anything runs); each function returns ``None`` where the kernels cannot run:
a dtype other than float32 / float64 or mismatched dtypes, tensors not on one CUDA device, ``H > 256``
(one thread per hidden unit), or the packed ``W_hh`` plus two state buffers above the device's shared memory
per block (opt-in limit: 163 KiB on sm_80, 227 KiB on sm_90), i.e. beyond about

    ===========  =====  =====  =====
    max H        RNN    GRU    LSTM
    ===========  =====  =====  =====
    sm_80 f32    202    116    100
    sm_80 f64    142    82     71
    sm_90 f32    240    137    120
    sm_90 f64    168    98     84
    ===========  =====  =====  =====

A malformed shape raises ``ValueError`` naming the argument. :func:`available` says whether CuPy and a
device are usable. The kernels load through the package's one CuPy loader
(:mod:`lightning_bppsa.kernels.cupy_loader`): each module is compiled once per process and device with
NVRTC (CuPy caches the binary on disk), and a launch passes raw data pointers on
``torch.cuda.current_stream()``: no copy (but of non-contiguous inputs), no synchronisation.

:func:`prepare` is the ONE place computing a launch (kernel, grid, block, shared memory, argument words);
the host emulation (:mod:`lightning_bppsa.kernels.recurrent_emulated`) runs the same launches on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from lightning_bppsa.kernels import cuda, cupy_loader
from lightning_bppsa.kernels._build import kernel_path
from torch import Tensor

__all__ = [
    "CELLS",
    "KERNELS",
    "Launch",
    "RING_DEPTH",
    "available",
    "backward_refusal",
    "forward",
    "gru_forward",
    "lstm_backward",
    "lstm_forward",
    "module_options",
    "prepare",
    "refusal",
    "rnn_forward",
    "shared_bytes",
    "source",
]

#: gates per cell kind (the rows of ``W_hh`` are ``G * H``)
CELLS = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
#: factor outputs per cell kind, as multiples of ``H`` in the last dimension
_FACTORS = {"rnn_tanh": (), "rnn_relu": (), "gru": (3, 1, 1), "lstm": (1, 4)}
#: the kernels of the module :func:`available` compiles: W_hh in shared memory, any H that fits
KERNELS = (
    *(f"bppsa_{cell}_forward_{suffix}" for cell in CELLS for suffix in ("f32", "f64")),
    "bppsa_lstm_backward_f32",
    "bppsa_lstm_backward_f64",
)
MAX_THREADS = 256  # kMaxThreads in recurrent.cu: one thread per hidden unit
FIXED_HIDDEN = 32  # float32 with H <= 32: the kernels compiled for their H (W_hh in registers, one warp)
#: steps of gi the H <= 32 kernels stage ahead in shared memory (BPPSA_REC_RING; a lead of RING_DEPTH - 2
#: steps must cover a global load's latency: ~0.5-1 us on an H100 against ~0.1-0.2 us a step)
RING_DEPTH = 16
PORTABLE_SHARED_BYTES = cupy_loader.PORTABLE_SHARED_BYTES  # shared memory a block gets without the opt-in
SM80_OPTIN_SHARED_BYTES = 163 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an A100
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as :func:`prepare` computed it."""

    kernel: str  # entry point in recurrent.cu
    grid: int  # blocks: one per batch row
    block: int  # threads: H rounded up to a whole warp
    shared_bytes: int  # dynamic shared memory per block
    args: tuple[int, ...]  # the kernel's argument words (pointers as addresses)
    # the tensors behind the pointers (contiguous copies included): alive until the launch is queued
    buffers: tuple[Tensor, ...] = field(default=(), repr=False, compare=False)
    #: the -D options of the kernel's module (NVRTC's and the host emulation's g++'s): () for :data:`KERNELS`
    options: tuple[str, ...] = ()


def _fixed(hidden: int, element_bytes: int) -> bool:
    return element_bytes == 4 and hidden <= FIXED_HIDDEN


def module_options(hidden: int) -> tuple[str, ...]:
    """The -D options of the module of the float32 kernels compiled for ``hidden`` (<= :data:`FIXED_HIDDEN`)."""
    return (f"-DBPPSA_REC_HIDDEN={hidden}", f"-DBPPSA_REC_RING={RING_DEPTH}")


def shared_bytes(cell: str, hidden: int, element_bytes: int) -> int:
    """Dynamic shared memory of a block: two state buffers (padded to 16-byte vectors), plus ``W_hh`` packed
    in 16-byte vectors, or, in the kernels compiled per ``H`` (float32, ``H <= 32``: ``W_hh`` in registers),
    the ring of :data:`RING_DEPTH` steps of ``gi``."""
    return _shared_bytes(cell, hidden, element_bytes, fixed=_fixed(hidden, element_bytes))


def _shared_bytes(cell: str, hidden: int, element_bytes: int, *, fixed: bool) -> int:
    width = 16 // element_bytes
    padded = math.ceil(hidden / width) * width
    if fixed:
        return (2 * padded + RING_DEPTH * CELLS[cell] * hidden) * element_bytes
    return (CELLS[cell] * hidden + 2) * padded * element_bytes


@functools.lru_cache(maxsize=256)
def refusal(cell: str, hidden: int, dtype: torch.dtype, shared_limit: int) -> str | None:
    """Why the forward kernel of a ``cell`` layer of hidden size ``hidden`` in ``dtype`` cannot launch on a
    device giving a block ``shared_limit`` bytes of shared memory (one line), ``None`` where it can.

    The ONE statement of the kernels' limits: :func:`prepare` declines exactly where this refuses, and the
    layer's plan (:meth:`lightning_bppsa.backends.CudaBackend.refuses`) asks it before anything runs.
    Cached: a training loop asks with one shape every step.
    """
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {sorted(CELLS)}; got {cell!r}")
    if dtype not in _SUFFIX:
        return _limits("forward", hidden, dtype, shared_limit, 0)
    return _limits("forward", hidden, dtype, shared_limit, shared_bytes(cell, hidden, torch.finfo(dtype).bits // 8))


@functools.lru_cache(maxsize=256)
def backward_refusal(hidden: int, dtype: torch.dtype, shared_limit: int) -> str | None:
    """As :func:`refusal`, for :func:`lstm_backward` (its block stages ``W_hh`` and two rows of gate gradients:
    :func:`lstm_backward_shared_bytes`)."""
    if dtype not in _SUFFIX:
        return _limits("LSTM backward", hidden, dtype, shared_limit, 0)
    return _limits("LSTM backward", hidden, dtype, shared_limit,
                   lstm_backward_shared_bytes(hidden, torch.finfo(dtype).bits // 8))  # fmt: skip


def _limits(kernel: str, hidden: int, dtype: torch.dtype, shared_limit: int, needed: int) -> str | None:
    """Why the CUDA ``kernel`` (one thread per hidden unit, ``needed`` bytes of shared memory) cannot launch."""
    if dtype not in _SUFFIX:
        return f"dtype {dtype} (the CUDA {kernel} kernels take float32 / float64)"
    if hidden > MAX_THREADS:
        return f"the CUDA {kernel} kernel runs one thread per hidden unit, at most {MAX_THREADS}: H={hidden}"
    if needed > shared_limit:
        return (
            f"the CUDA {kernel} kernel of H={hidden} needs {needed} B of shared memory per block, "
            f"the device has {shared_limit} B"
        )
    return None


def lstm_backward_shared_bytes(hidden: int, element_bytes: int) -> int:
    """Dynamic shared memory of an :func:`lstm_backward` block: ``W_hh`` and two buffers of ``4H`` gate
    gradients."""
    return (4 * hidden * hidden + 8 * hidden) * element_bytes


def _check_shapes(
    cell: str, gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, c0: Tensor | None
) -> None:
    gates = CELLS[cell]
    if w_hh.dim() != 2 or w_hh.shape[0] != gates * w_hh.shape[1]:
        raise ValueError(f"w_hh must be ({gates} H, H) for a {cell} cell; got {tuple(w_hh.shape)}")
    hidden = w_hh.shape[1]
    if gi.dim() != 3 or gi.shape[2] != gates * hidden:
        raise ValueError(
            f"gi must be (B, T, {gates * hidden}) for hidden size {hidden}; got {tuple(gi.shape)}"
        )
    batch = gi.shape[0]
    if b_hh is not None and tuple(b_hh.shape) != (gates * hidden,):
        raise ValueError(f"b_hh must be ({gates * hidden},) or None; got {tuple(b_hh.shape)}")
    for name, state in (("h0", h0), ("c0", c0)):
        if state is not None and tuple(state.shape) != (batch, hidden):
            raise ValueError(f"{name} must be (B, H) = ({batch}, {hidden}); got {tuple(state.shape)}")


def prepare(
    cell: str,
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    c0: Tensor | None,
    *,
    device_type: str,
    shared_limit: int,
) -> tuple[Launch | None, tuple[Tensor, ...]] | None:
    """Check the inputs, allocate the outputs and compute the launch of one layer forward.

    Returns ``None`` where the kernel cannot run (tensors of mixed dtypes or not all on one ``device_type``
    device, or what :func:`refusal` refuses); else ``(launch, outputs)``
    with ``outputs = (out, *factors)`` (empty tensors, filled by the launch) and ``launch = None`` when
    there is nothing to compute (``B``, ``T`` or ``H`` is 0). Raises ``ValueError`` on a malformed shape.
    """
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {sorted(CELLS)}; got {cell!r}")
    if (c0 is not None) != (cell == "lstm"):
        raise ValueError(f"c0 is {'required' if cell == 'lstm' else 'only for an LSTM'} ({cell} cell)")
    _check_shapes(cell, gi, w_hh, b_hh, h0, c0)
    tensors = [t for t in (gi, w_hh, b_hh, h0, c0) if t is not None]
    if gi.dtype not in _SUFFIX or any(t.dtype != gi.dtype for t in tensors):
        return None
    if any(t.device.type != device_type or t.device != gi.device for t in tensors):
        return None
    batch, steps, hidden = gi.shape[0], gi.shape[1], w_hh.shape[1]
    if refusal(cell, hidden, gi.dtype, shared_limit) is not None:
        return None
    outputs = tuple(gi.new_empty(batch, steps, k * hidden) for k in (1, *_FACTORS[cell]))
    if batch == 0 or steps == 0 or hidden == 0:
        return None, outputs

    # no detach: a pointer is all a launch takes, and detach() is one more torch call per tensor
    inputs = [None if t is None else t.contiguous() for t in (gi, w_hh, b_hh, h0, c0)]
    pointers = [0 if t is None else t.data_ptr() for t in inputs]
    factors = [t.data_ptr() for t in outputs[1:]] + [0] * (4 - len(outputs))
    kernel, block, nbytes, options = _kernel_and_block(cell, gi.dtype, hidden)
    launch = Launch(
        kernel=kernel,
        grid=batch,
        block=block,
        shared_bytes=nbytes,
        args=(*pointers, outputs[0].data_ptr(), *factors, batch, steps, hidden),
        buffers=(*(t for t in inputs if t is not None), *outputs),
        options=options,
    )
    # After the launch is queued the copies may be freed: torch's caching allocator hands a freed block
    # only to work queued later on the same stream, so the kernel still reads valid memory.
    return launch, outputs


@functools.lru_cache(maxsize=64)
def _kernel_and_block(cell: str, dtype: torch.dtype, hidden: int) -> tuple[str, int, int, tuple[str, ...]]:
    """The entry point, threads per block, dynamic shared memory and module options of a layer (once per
    shape: a training loop asks every step)."""
    element_bytes = torch.finfo(dtype).bits // 8
    nbytes = shared_bytes(cell, hidden, element_bytes)
    if _fixed(hidden, element_bytes):
        return f"bppsa_{cell}_forward_f32_h{hidden}", 32, nbytes, module_options(hidden)
    return f"bppsa_{cell}_forward_{_SUFFIX[dtype]}", 32 * math.ceil(hidden / 32), nbytes, ()


Launcher = Callable[[Launch, torch.device], None]


def forward(
    cell: str,
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    c0: Tensor | None,
    *,
    launcher: Launcher,
    device_type: str,
    shared_limit: int,
) -> tuple[Tensor, ...] | None:
    """:func:`prepare`, then ``launcher(launch, device)``; shared by the CUDA path and the host emulation."""
    prepared = prepare(cell, gi, w_hh, b_hh, h0, c0, device_type=device_type, shared_limit=shared_limit)
    if prepared is None:
        return None
    launch, outputs = prepared
    if launch is not None:
        launcher(launch, gi.device)
    return outputs


def prepare_lstm_backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_h: Tensor | None,
    grad_cn: Tensor | None, *, device_type: str, shared_limit: int,
) -> tuple[Launch | None, tuple[Tensor, Tensor, Tensor]] | None:  # fmt: skip
    """As :func:`prepare`, for :func:`lstm_backward`: ``(launch, (d_gates, gh0, gc0))`` (outputs empty, filled
    by the launch; ``launch = None`` where ``B``, ``T`` or ``H`` is 0), ``None`` where the kernel cannot run.
    Raises ``ValueError`` on a malformed shape."""
    if gates.dim() != 3 or gates.shape[2] % 4:
        raise ValueError(f"gates must be (B, T, 4H); got {tuple(gates.shape)}")
    batch, steps, hidden = gates.shape[0], gates.shape[1], gates.shape[2] // 4
    expected = {"cells": (batch, steps, hidden), "c0": (batch, hidden), "w_hh": (4 * hidden, hidden),
                "grad_out": (batch, steps, hidden), "grad_h": (batch, hidden), "grad_cn": (batch, hidden)}  # fmt: skip
    given = {"cells": cells, "c0": c0, "w_hh": w_hh, "grad_out": grad_out, "grad_h": grad_h, "grad_cn": grad_cn}
    for name, tensor in given.items():
        if tensor is not None and tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name} must be {expected[name]}; got {tuple(tensor.shape)}")
    tensors = [t for t in (gates, *given.values()) if t is not None]
    if any(t.dtype != gates.dtype or t.device.type != device_type or t.device != gates.device for t in tensors):
        return None
    if backward_refusal(hidden, gates.dtype, shared_limit) is not None:
        return None
    outputs = (gates.new_empty(batch, steps, 4 * hidden), gates.new_empty(batch, hidden),
               gates.new_empty(batch, hidden))  # fmt: skip
    if batch == 0 or steps == 0 or hidden == 0:
        # no step: the initial state is the last one, its gradients the ones given for that
        for given_grad, result in ((grad_h, outputs[1]), (grad_cn, outputs[2])):
            result.zero_() if given_grad is None else result.copy_(given_grad)
        return None, outputs
    inputs = [None if t is None else t.contiguous() for t in (gates, cells, c0, w_hh, grad_out, grad_h, grad_cn)]
    launch = Launch(
        kernel=f"bppsa_lstm_backward_{_SUFFIX[gates.dtype]}",
        grid=batch,
        block=32 * math.ceil(hidden / 32),
        shared_bytes=lstm_backward_shared_bytes(hidden, gates.element_size()),
        args=(*(0 if t is None else t.data_ptr() for t in inputs), *(t.data_ptr() for t in outputs), batch,
              steps, hidden),  # fmt: skip
        buffers=(*(t for t in inputs if t is not None), *outputs),
    )
    return launch, outputs


def backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_h: Tensor | None,
    grad_cn: Tensor | None, *, launcher: Launcher, device_type: str, shared_limit: int,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """:func:`prepare_lstm_backward`, then ``launcher(launch, device)``; shared by the CUDA path and the host
    emulation."""
    prepared = prepare_lstm_backward(gates, cells, c0, w_hh, grad_out, grad_h, grad_cn, device_type=device_type,
                                     shared_limit=shared_limit)  # fmt: skip
    if prepared is None:
        return None
    launch, outputs = prepared
    if launch is not None:
        launcher(launch, gates.device)
    return outputs


# --------------------------------------------------------------------------------------------------
# CuPy (through the package's one loader, :mod:`.cupy_loader`): availability, the kernels, the launch.
# --------------------------------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy and a CUDA device are usable and the kernels load, else ``(False, why)``.

    The first eager call compiles the module (once; CuPy caches the binary on disk). While ``torch.compile``
    traces it only reports what an earlier eager call found: tracing never imports CuPy or compiles.
    """
    ok, reason = cuda.available()  # the scan's kernels: a layer's backward runs them
    return cupy_loader.family_available("the recurrent CUDA kernels", _functions) if ok else (ok, reason)


def source() -> str:
    """``recurrent.cu`` with its headers inlined (CuPy's cache key is the source text: a header edit counts)."""
    text = kernel_path("recurrent.cu").read_text()
    for header in ("cuda_host_emulation.h", "recurrent_emulation.h"):
        text = text.replace(f'#include "{header}"', kernel_path(header).read_text())
    return text


_KERNELS_ON: dict[int, dict] = {}  # device index -> {kernel name: loaded cupy Function}


def _functions(device_index: int) -> dict:
    """The :data:`KERNELS` of ``recurrent.cu``, compiled and loaded on a device once, in the dict that also
    takes the kernels compiled per ``H`` (each launch opts its kernel in beyond 48 KiB of shared memory the
    first time it needs more: :func:`cupy_loader.launch`)."""
    functions = _KERNELS_ON.get(device_index)
    if functions is None:
        code = source()
        functions = {name: cupy_loader.load_function(device_index, code, name) for name in KERNELS}
        _KERNELS_ON[device_index] = functions
    return functions


def _load(device_index: int, launch: Launch) -> tuple[object, Launch]:
    """The function of ``launch`` (compiling its module on first use), and the launch to make with it.

    NVRTC cannot compile inside a CUDA graph capture: a kernel compiled per ``H`` whose first launch is
    captured runs as the shared-memory kernel of the same cell (same arguments, same results), with a
    warning; a warm-up launch before capturing avoids it."""
    functions = _functions(device_index)
    if not launch.options:
        return functions[launch.kernel], launch
    try:
        function = cupy_loader.load_function(device_index, source(), launch.kernel, launch.options)
    except RuntimeError:
        if not torch.cuda.is_current_stream_capturing():
            raise
        cell = launch.kernel[len("bppsa_") : launch.kernel.index("_forward")]
        hidden = launch.args[-1]
        nbytes = _shared_bytes(cell, hidden, 4, fixed=False)
        fallback = dataclasses.replace(
            launch, kernel=f"bppsa_{cell}_forward_f32", shared_bytes=nbytes, options=()
        )
        warnings.warn(
            f"{launch.kernel} is first launched inside a CUDA graph capture, where it cannot be compiled: "
            f"the capture runs {fallback.kernel} (slower); run the layer once before capturing",
            stacklevel=3,
        )
        return functions[fallback.kernel], fallback
    functions[launch.kernel] = function
    return function, launch


def _launch_cuda(launch: Launch, device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _KERNELS_ON.get(index, _NO_FUNCTIONS).get(launch.kernel)
    if function is None:
        function, launch = _load(index, launch)
    cupy_loader.launch(function, index, launch.grid, launch.block, launch.shared_bytes, launch.args)


_NO_FUNCTIONS: dict = {}


def _forward_cuda(cell: str, gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, c0: Tensor | None):
    if gi.device.type != "cuda" or not available()[0]:
        return None
    index = gi.device.index if gi.device.index is not None else torch.cuda.current_device()
    limit = cupy_loader.shared_limit(index)
    return forward(
        cell, gi, w_hh, b_hh, h0, c0, launcher=_launch_cuda, device_type="cuda", shared_limit=limit
    )


def rnn_forward(
    gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, relu: bool
) -> tuple[Tensor] | None:
    """Elman RNN layer on CUDA: ``(out,)``, ``(B, T, H)``; ``None`` where the kernel cannot run."""
    return _forward_cuda("rnn_relu" if relu else "rnn_tanh", gi, w_hh, b_hh, h0, None)


def gru_forward(
    gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """GRU layer on CUDA: ``(out, scales (B,T,3H), z, dn)``; ``None`` where the kernel cannot run."""
    return _forward_cuda("gru", gi, w_hh, b_hh, h0, None)


def lstm_forward(gi: Tensor, w_hh: Tensor, h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """LSTM layer on CUDA: ``(out, cells (B,T,H), gates (B,T,4H))``; ``None`` where the kernel cannot run."""
    return _forward_cuda("lstm", gi, w_hh, None, h0, c0)


def lstm_backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_cn: Tensor | None,
    sums: object = None, keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """LSTM backward on CUDA: ``(d_gates (B,T,4H), gh0 (B,H), gc0 (B,H))``, the arguments of the CPU kernels'
    :func:`lightning_bppsa.kernels.recurrent.lstm_backward` (``sums`` must be ``None``: the parameter
    gradients are the caller's GEMMs; ``keep_gate_grads`` is moot: ``d_gates`` is always returned);
    ``None`` where the kernel cannot run."""
    if sums is not None:
        raise ValueError("the CUDA LSTM backward does not sum the parameter gradients: pass sums=None")
    if gates.device.type != "cuda" or not available()[0]:
        return None
    index = gates.device.index if gates.device.index is not None else torch.cuda.current_device()
    return backward(gates, cells, c0, w_hh, grad_out, grad_h, grad_cn, launcher=_launch_cuda, device_type="cuda",
                    shared_limit=cupy_loader.shared_limit(index))  # fmt: skip
