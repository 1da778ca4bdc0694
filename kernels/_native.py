"""How every C kernel of this package is built for the CPU: one compiler, flags and switch for all of them.

The compiler is ``$CC`` (default ``cc``; it may hold flags, e.g. ``CC="gcc -m64"``) in C99; the flag sets
are tried best first (``-O3 -march=native -fopenmp``, then without ``-march=native``, then without
OpenMP), so a kernel builds wherever a C99 compiler exists. ``BPPSA_NATIVE=0`` builds nothing. The build
itself (cache, checksums, concurrent builds) is :func:`lightning_bppsa.kernels._build.load_library`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence

import torch
from lightning_bppsa.kernels import _build

__all__ = ["FLAG_SETS", "build_expected", "load", "threads"]

#: compiler flags, best first
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp"],
    ["-O3", "-fopenmp"],
    ["-O3"],
)


def _enabled() -> bool:
    return os.environ.get("BPPSA_NATIVE", "1") != "0"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def build_expected() -> bool:
    """Whether a build is attempted and can succeed: ``BPPSA_NATIVE`` is not 0 and ``$CC`` (or ``cc``) is on
    ``PATH``. Tests use it to FAIL, not skip, when a compiler exists but a kernel does not build."""
    compiler = _compiler()
    return _enabled() and bool(compiler) and shutil.which(compiler[0]) is not None


def load(
    name: str,
    source: str,
    signatures: Mapping[str, Sequence[type]],
    *,
    logger: logging.Logger,
    fallback: str,
    extra_flags: Sequence[str] = (),
    depends: Sequence[str] = (),
) -> ctypes.CDLL | None:
    """Build (cached) and load ``source``, a C file of this package; ``None`` when it cannot be.

    Args:
        name: stem of the cached library, e.g. ``"bppsa_linear"``.
        source: the C file, e.g. ``"linear_scan.c"``.
        signatures: exported symbol -> ``argtypes``; the library must export all of them.
        logger: where the one message about a disabled or failed build goes.
        fallback: what runs instead, as a sentence start, e.g. ``"The linear scan runs its torch loop"``.
        extra_flags: appended to every flag set (e.g. ``-ffp-contract=fast``).
        depends: headers the source includes (they key the cache).
    """
    if not _enabled():
        logger.info("lightning_bppsa: BPPSA_NATIVE=0: %s", fallback[:1].lower() + fallback[1:])
        return None
    compiler = [*_compiler(), "-std=c99"]
    flag_sets = [[*flags, *extra_flags] for flags in FLAG_SETS]
    try:
        lib = _build.load_library(
            name, [source], compiler, flag_sets=flag_sets, depends=depends, symbols=list(signatures)
        )
    except (_build.BuildError, OSError) as err:
        logger.warning(
            "lightning_bppsa: could not build the compiled CPU kernel (%s; compiler from $CC, default cc): "
            "%s\n%s instead (same results, slower); set BPPSA_NATIVE=0 to skip this build.",
            _build.kernel_path(source),
            err,
            fallback,
        )
        return None
    for symbol, argtypes in signatures.items():
        getattr(lib, symbol).argtypes = list(argtypes)
    return lib


def threads(batch: int) -> int:
    """OpenMP threads for a kernel over ``batch`` independent rows: never more than torch's thread count,
    the CPUs this process may run on, or the rows (so a kernel never oversubscribes)."""
    return max(1, min(torch.get_num_threads(), len(os.sched_getaffinity(0)), batch))


class LazyLibrary:
    """A compiled library built and loaded on first use by ``load`` (``None`` when it cannot be).

    :meth:`available` answers without building while ``torch.compile`` traces: it reports what an earlier
    eager call found (a plain bool the tracer can read), so tracing never touches the compiler or the disk.
    """

    def __init__(self, load: Callable[[], ctypes.CDLL | None]) -> None:
        self._load = load
        self.reset()

    def reset(self) -> None:
        """Forget the library: the next use builds (or fails) again."""
        self._state: dict[str, object] = {}

    def get(self) -> ctypes.CDLL | None:
        if "lib" not in self._state:
            self._state["lib"] = self._load()
            self._state["ok"] = self._state["lib"] is not None
        return self._state["lib"]  # type: ignore[return-value]

    def available(self) -> bool:
        if torch.compiler.is_compiling():
            return bool(self._state.get("ok", False))
        return self.get() is not None
