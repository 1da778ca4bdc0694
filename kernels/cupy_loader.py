"""The one CuPy loader of every CUDA kernel of this package: availability, compilation, limits, launches.

Every CUDA kernel family (the scan's ``scan.cu`` in :mod:`.cuda`, the recurrent layers' ``recurrent.cu`` in
:mod:`.recurrent_cuda`, kernels generated per user cell) loads and launches through these functions:

- :func:`available` ``() -> (bool, reason)``: CuPy >= 14 imports, NVRTC loads and torch sees a CUDA device.
  Checked once per process (never while ``torch.compile`` traces: it then answers "not checked yet" without
  caching); every family reports the same reason.
- :func:`family_available` ``(label, load) -> (bool, reason)``: :func:`available`, then ``load(device)``
  compiles and loads a family's kernels on the current device, once per process; a failure's reason names
  ``label`` and the exception.
- :func:`load_function` ``(device_index, source, name, options=()) -> function``: the entry point ``name``
  (an ``extern "C" __global__`` function) of ``source`` compiled with NVRTC with :data:`NVRTC_OPTIONS` plus
  ``options``. Each ``(device, source, options)`` is compiled once per process (CuPy also keeps the binary
  in its on-disk cache, ``$CUPY_CACHE_DIR``); a function is looked up once. Refuses (``RuntimeError``) to
  compile inside a CUDA graph capture: load before capturing.
- :func:`shared_limit` ``(device_index) -> int``: the shared memory a block may use on the device with the
  opt-in attribute (static + dynamic; 227 KiB on an H100), at least the portable 48 KiB.
- :func:`reserve_shared` ``(function, nbytes)``: opt ``function`` in to ``nbytes`` of dynamic shared memory
  (a driver call, made once per function and size; :func:`launch` makes it itself when a launch needs more
  than 48 KiB, call it ahead to keep that call out of a CUDA graph capture).
- :func:`launch` ``(function, device_index, grid, block, shared_bytes, args) -> None``: queue the kernel on
  torch's current stream of the device (also while torch captures a CUDA graph): no copy, no sync.

A new kernel family needs nothing else::

    function = cupy_loader.load_function(index, source, "my_kernel")   # once, before the first launch
    cupy_loader.launch(function, index, grid, block, shared_bytes, (x.data_ptr(), out.data_ptr(), n))

Host cost per launch (issue 29): one raw stream query, one dict lookup, a current-device check, the CuPy
call (a family keeps its functions: :func:`load_function` is for loading, not for every launch). CuPy's
wrapper of a torch stream is made once per stream; ``args`` (a tuple, or a list made into one) are Python
ints that CuPy packs in C as 64-bit words, bit for bit the kernels' pointer and ``uint64`` parameters: no
per-argument object of ours. CuPy is imported only by these functions, never at module import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "NVRTC_OPTIONS",
    "PORTABLE_SHARED_BYTES",
    "available",
    "cupy_version",
    "family_available",
    "launch",
    "load_function",
    "reserve_shared",
    "shared_limit",
]

#: NVRTC options of every kernel of the package (a family's own ``options`` come after them)
NVRTC_OPTIONS = ("-std=c++17",)
#: shared memory per block (static + dynamic) every CUDA device gives without the opt-in attribute
PORTABLE_SHARED_BYTES = 48 * 1024
_NOT_CHECKED = (False, "not checked yet (first asked while torch.compile traces)")

#: the answers of the first eager checks: "" -> CuPy / device, a family label -> that family
_ANSWERS: dict[str, tuple[bool, str]] = {}
#: (device index, source, options) -> the compiled CuPy RawModule
_MODULES: dict[tuple[int, str, tuple[str, ...]], object] = {}
#: (device index, source, options, name) -> the loaded CuPy Function
_FUNCTIONS: dict[tuple[int, str, tuple[str, ...], str], object] = {}
#: id of a loaded function -> the dynamic shared memory it is opted in to (above 48 KiB)
_RESERVED: dict[int, int] = {}
#: (device index, torch stream handle) -> CuPy's wrapper of that stream
_STREAMS: dict[tuple[int, int], object] = {}
_LIMITS: dict[int, int] = {}  # device index -> shared_limit
_CLUSTERS: dict[int, int] = {}  # device index -> cluster_limit


def available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy >= 14 with NVRTC and a CUDA device are usable, else ``(False, why)``."""
    answer = _ANSWERS.get("")
    if answer is None:
        if torch.compiler.is_compiling():
            return _NOT_CHECKED
        answer = _ANSWERS[""] = _check()
    return answer


def _check() -> tuple[bool, str]:
    try:
        import cupy
    except ImportError as err:
        return (
            False,
            f"CuPy is not installed ({err}); install lightning-bppsa[cuda12] or [cuda13] (see README)",
        )
    if not hasattr(cupy.cuda.Stream, "from_external"):
        return False, f"CuPy {cupy.__version__} is too old: the CUDA kernels need CuPy >= 14"
    nvrtc = getattr(cupy.cuda, "nvrtc", None)
    try:
        if nvrtc is not None:
            nvrtc.getVersion()  # CuPy loads libnvrtc on first use: a missing one shows here, not in a compile
    except Exception as err:  # noqa: BLE001  (CuPy raises RuntimeError or its CUDA error types)
        return False, (
            f"CuPy {cupy.__version__} cannot load NVRTC ({type(err).__name__}: {err}); install "
            "lightning-bppsa[cuda12] or [cuda13], whose CuPy [ctk] extra brings it"
        )
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    return True, ""


def family_available(label: str, load: Callable[[int], object]) -> tuple[bool, str]:
    """:func:`available`, then ``load(current device)`` (a family compiling and loading its kernels): the
    first eager answer, kept for the process. A failure reads ``"<label> do not compile or load here (...)"``."""
    answer = _ANSWERS.get(label)
    if answer is None:
        ok, reason = available()
        if not ok:
            return ok, reason  # cached by available() (or not checked yet, while tracing)
        if torch.compiler.is_compiling():
            return _NOT_CHECKED
        try:  # a driver / CuPy mismatch shows here, once, instead of in the first launch
            load(torch.cuda.current_device())
            answer = (True, "")
        except Exception as err:  # noqa: BLE001  (CompileException, CUDADriverError, ...: unrelated types)
            answer = (False, f"{label} do not compile or load here ({type(err).__name__}: {err})")
        _ANSWERS[label] = answer
    return answer


def cupy_version() -> str:
    """The version of the CuPy in use, ``""`` where CuPy is unusable (:func:`available`)."""
    return sys.modules["cupy"].__version__ if available()[0] else ""


def load_function(device_index: int, source: str, name: str, options: Sequence[str] = ()):
    """The loaded entry point ``name`` of ``source`` on device ``device_index`` (see the module docstring).

    Raises ``RuntimeError`` when the module is not compiled yet and a CUDA graph is being captured, and what
    CuPy raises when the source does not compile (``CompileException``) or has no such entry point.
    """
    options = (*NVRTC_OPTIONS, *options)
    key = (device_index, source, options, name)
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    module = _MODULES.get(key[:3])
    if module is None and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the CUDA kernel {name} is not compiled yet and cannot be inside a CUDA graph capture: "
            "run it once (or its module's prepare) before capturing"
        )
    import cupy

    with cupy.cuda.Device(device_index):  # the module is loaded into that device's context
        if module is None:
            module = cupy.RawModule(code=source, options=options)
            module.compile()  # NVRTC errors here, with the log, rather than at the first get_function
            _MODULES[key[:3]] = module
        function = _FUNCTIONS[key] = module.get_function(name)
    return function


def shared_limit(device_index: int) -> int:
    """Shared memory a block may use on the device, static + dynamic: its opt-in maximum (cached)."""
    limit = _LIMITS.get(device_index)
    if limit is None:
        props = torch.cuda.get_device_properties(device_index)
        limit = _LIMITS[device_index] = max(
            PORTABLE_SHARED_BYTES, getattr(props, "shared_memory_per_block_optin", PORTABLE_SHARED_BYTES)
        )
    return limit


def cluster_limit(device_index: int) -> int:
    """The largest thread-block cluster a kernel of this package may declare on the device: 8 blocks (the
    portable size) from compute capability 9.0 on, else 1 (no clusters) (cached)."""
    limit = _CLUSTERS.get(device_index)
    if limit is None:
        limit = _CLUSTERS[device_index] = 8 if torch.cuda.get_device_capability(device_index)[0] >= 9 else 1
    return limit


def reserve_shared(function, nbytes: int) -> None:
    """Opt ``function`` in to at least ``nbytes`` of dynamic shared memory (one driver call per new maximum)."""
    if nbytes > _RESERVED.get(id(function), PORTABLE_SHARED_BYTES):
        function.max_dynamic_shared_size_bytes = nbytes
        _RESERVED[id(function)] = nbytes  # functions stay alive in _FUNCTIONS: their ids stay theirs


def launch(
    function,
    device_index: int,
    grid: int | tuple[int, ...],
    block: int | tuple[int, ...],
    shared_bytes: int,
    args: Sequence[int],
) -> None:
    """Queue ``function`` (from :func:`load_function`) with ``grid`` x ``block`` threads and ``shared_bytes``
    of dynamic shared memory on torch's current stream of ``device_index``. ``args`` are the kernel's
    argument words as Python ints (pointers: ``tensor.data_ptr()``, 0 for none). The tensors behind the
    pointers must stay alive until the launch is queued (torch's caching allocator hands a freed block only
    to work queued later on the same stream)."""
    if shared_bytes > PORTABLE_SHARED_BYTES:
        reserve_shared(function, shared_bytes)
    # torch.cuda.current_stream()'s handle without making a Stream object
    handle = torch._C._cuda_getCurrentRawStream(device_index)
    stream = _STREAMS.get((device_index, handle))
    if stream is None:
        stream = _STREAMS[(device_index, handle)] = _wrap_stream(handle)
    grid = grid if type(grid) is tuple else (grid,)
    block = block if type(block) is tuple else (block,)
    args = args if type(args) is tuple else tuple(args)
    if device_index == torch.cuda.current_device():
        function(grid, block, args, shared_mem=shared_bytes, stream=stream)
        return
    import cupy

    with cupy.cuda.Device(device_index):  # the function's module lives in that device's context
        function(grid, block, args, shared_mem=shared_bytes, stream=stream)


class _TorchStream:
    """torch's stream handle in the CUDA stream protocol (what ``cupy.cuda.Stream.from_external`` takes)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.handle


def _wrap_stream(handle: int):
    import cupy

    return cupy.cuda.Stream.from_external(_TorchStream(handle))
