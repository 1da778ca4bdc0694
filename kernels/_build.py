"""Compile a kernel source of this package into a cached shared library and load it with ctypes.

One builder for every compiled kernel (the CPU scan in ``linear_scan.c``, the CUDA ``.cu`` files
compiled for the host with an emulation header in tests). API:

``load_library(name, sources, compiler, *, flag_sets=((),), depends=(), symbols=(), timeout=300)``
    -> :class:`ctypes.CDLL`, or raises :class:`BuildError` whose message says why (compiler not
    found; the exact command that failed, its exit status and the tail of its stderr; a freshly built
    library that still fails the checks).

    - ``name``: stem of the cached file, e.g. ``"bppsa_linear"``.
    - ``sources``: files to compile; a relative path is taken inside this package's folder
      (:func:`kernel_path`), an absolute one as is.
    - ``compiler``: the compiler's argv prefix, e.g. ``["cc", "-std=c99"]`` or
      ``["g++", "-std=c++20", "-x", "c++", "-pthread"]``; ``compiler[0]`` is looked up on ``PATH``.
    - ``flag_sets``: alternative flag lists tried best first (e.g. with and without ``-fopenmp``); the
      first that compiles is kept. The command is
      ``[*compiler, *flags, *sources, "-shared", "-fPIC", "-o", <tmp>.so]``.
    - ``depends``: more files whose contents key the cache (headers the sources include).
    - ``symbols``: names the library must export. A loaded library missing any of them is rejected
      with one warning and rebuilt once (a foreign file at the cached path).

The cache is ``$BPPSA_CACHE_DIR`` (default ``~/.cache/lightning_bppsa``); the file name holds a hash
of the sources, ``depends``, the compiler command, the flag sets and the CPU (``-march=native``
builds are per CPU). Several processes may build at once: builds happen in a private temporary
folder under an exclusive ``flock`` of ``<file>.lock``, the library is renamed into place atomically
and a sidecar ``<file>.so.sha256`` (size and SHA-256) is written after it. Before every ``dlopen`` the
library is checked against its sidecar: a cut-short or replaced file (which ``dlopen`` would map and
crash on with a bus error) is rebuilt instead of loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BuildError", "cache_dir", "kernel_path", "load_library"]

log = logging.getLogger(__name__)

_KERNEL_DIR = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """A kernel could not be compiled or loaded; the message says which command failed and why."""


def kernel_path(name: str | os.PathLike) -> Path:
    """The absolute path of ``name`` (a file of this package, e.g. ``"linear_scan.c"``)."""
    return _KERNEL_DIR / name


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$BPPSA_CACHE_DIR`` or ``~/.cache/lightning_bppsa``."""
    return Path(os.environ.get("BPPSA_CACHE_DIR") or Path.home() / ".cache" / "lightning_bppsa")


def load_library(
    name: str,
    sources: Sequence[str | os.PathLike],
    compiler: Sequence[str],
    *,
    flag_sets: Sequence[Sequence[str]] = ((),),
    depends: Sequence[str | os.PathLike] = (),
    symbols: Sequence[str] = (),
    timeout: float = 300,
) -> ctypes.CDLL:
    """Build (once, cached) and load a shared library; see the module docstring for the arguments.

    Raises:
        BuildError: no such compiler, every flag set failed to compile, or the built library is unusable.
    """
    if not compiler:
        raise BuildError("compiler must be a non-empty argv list, e.g. ['cc', '-std=c99']")
    executable = shutil.which(compiler[0])
    if executable is None:
        raise BuildError(f"compiler {compiler[0]!r} not found on PATH")
    argv = [executable, *compiler[1:]]
    source_paths = [kernel_path(s) for s in sources]  # an absolute path stays as it is
    target = cache_dir() / f"{name}_{_cache_key(argv, flag_sets, [*source_paths, *map(kernel_path, depends)])}.so"

    lib, _ = _load_verified(target, symbols)
    if lib is not None:
        return lib
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(target.name + ".lock")):
        lib, reason = _load_verified(target, symbols)  # another process may have built it meanwhile
        if lib is not None:
            return lib
        if target.exists():
            log.warning("lightning_bppsa: cached kernel %s is unusable (%s); rebuilding it", target, reason)
        _compile(argv, flag_sets, source_paths, target, timeout)
        lib, reason = _load_verified(target, symbols)
        if lib is None:
            raise BuildError(f"the freshly built {target} is unusable: {reason}")
        return lib


def _cache_key(argv: list[str], flag_sets: Sequence[Sequence[str]], files: list[Path]) -> str:
    digest = hashlib.sha256()
    for part in [*argv, repr([list(f) for f in flag_sets]), platform.machine(), _cpu_name()]:
        digest.update(part.encode() + b"\0")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sidecar(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _fingerprint(path: Path) -> dict[str, object]:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _load_verified(target: Path, symbols: Sequence[str]) -> tuple[ctypes.CDLL | None, str]:
    """The library at ``target`` if it matches its sidecar and exports ``symbols``; else ``None`` and why."""
    try:
        recorded = json.loads(_sidecar(target).read_text())
        actual = _fingerprint(target)
    except FileNotFoundError as err:
        return None, f"{Path(err.filename).name} is missing"
    except (OSError, ValueError) as err:
        return None, f"cannot read it or its checksum ({err})"
    if recorded != actual:
        return None, f"it is {actual['size']} bytes with a checksum that does not match {_sidecar(target).name}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return None, f"dlopen failed: {err}"
    missing = [s for s in symbols if not hasattr(lib, s)]
    if missing:
        # unload it, or dlopen of the rebuilt file at the same path would hand back this library
        _ctypes_dlclose(lib)
        return None, f"it does not export {', '.join(missing)}"
    return lib, ""


def _ctypes_dlclose(lib: ctypes.CDLL) -> None:
    import _ctypes

    _ctypes.dlclose(lib._handle)


def _compile(
    argv: list[str], flag_sets: Sequence[Sequence[str]], sources: list[Path], target: Path, timeout: float
) -> None:
    """Try ``flag_sets`` best first; rename the first success onto ``target``, then write its sidecar."""
    failures = []
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = Path(tmp) / target.name
        for flags in flag_sets:
            cmd = [*argv, *flags, *map(str, sources), "-shared", "-fPIC", "-o", str(built)]
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.SubprocessError) as err:
                failures.append(f"`{shlex.join(cmd)}` could not run: {err}")
                continue
            if result.returncode == 0:
                sidecar_tmp = Path(tmp) / "sidecar"
                sidecar_tmp.write_text(json.dumps(_fingerprint(built)))
                os.replace(built, target)
                os.replace(sidecar_tmp, _sidecar(target))
                return
            tail = "\n    ".join(result.stderr.strip().splitlines()[-5:]) or "(nothing on stderr)"
            failures.append(f"`{shlex.join(cmd)}` exited with status {result.returncode}:\n    {tail}")
    raise BuildError("\n".join(failures))
