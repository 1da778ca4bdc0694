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

The cache is trusted only where no other user can write: a library there is executed by this process.
The directory is created private (``0700``); a cache directory, a library or its sidecar that is owned by
another user or writable by group or others (``BPPSA_CACHE_DIR`` pointed at ``/tmp`` or a team's scratch
space) is refused with one warning naming it and why, and a private directory is used instead for the rest
of the process: the default cache where that one is safe, else a fresh ``tempfile.mkdtemp``. Files this
builder writes are never writable by group or others, whatever the umask.

The package's other on-disk caches (:mod:`lightning_bppsa.layer_plan`'s measured decisions) use the same
directory and rules: :func:`trusted_path` (a file in the cache, refused with one warning and a private
fallback where another user could have planted or replaced it), :func:`exclusive` (an ``flock``),
:func:`write_private` (an atomic, private write) and :func:`cpu_name`.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

__all__ = ["BuildError", "cache_dir", "cpu_name", "exclusive", "kernel_path", "load_library", "trusted_path",
           "write_private"]  # fmt: skip

log = logging.getLogger(__name__)

_KERNEL_DIR = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """A kernel could not be compiled or loaded; the message says which command failed and why."""


def kernel_path(name: str | os.PathLike) -> Path:
    """The absolute path of ``name`` (a file of this package, e.g. ``"linear_scan.c"``)."""
    return _KERNEL_DIR / name


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "lightning_bppsa"


#: a refused cache directory -> the private directory used instead (for the rest of the process)
_REPLACED: dict[Path, Path] = {}


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$BPPSA_CACHE_DIR`` or ``~/.cache/lightning_bppsa``, created private
    (``0700``); one that is not this user's own and private gives a private fallback (see the module
    docstring), with one warning."""
    directory = Path(os.environ.get("BPPSA_CACHE_DIR") or _default_cache_dir())
    while directory in _REPLACED:
        directory = _REPLACED[directory]
    reason = _directory_refusal(directory)
    return directory if reason is None else _refuse(directory, directory, reason)


def _directory_refusal(directory: Path) -> str | None:
    """Create ``directory`` private if it is missing; why it cannot be trusted, or ``None``."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        return f"it cannot be created ({err.strerror})"
    return _refusal(directory, os.geteuid())


def _refusal(path: Path, uid: int) -> str | None:
    """Why ``path`` cannot be trusted by user ``uid`` (another user owns it or could replace it: it, or the
    symbolic link it is, is owned by someone else, or it is writable by group or others); ``None`` if it
    can, or does not exist."""
    try:
        link, info = os.lstat(path), os.stat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        return f"it is a symbolic link owned by uid {link.st_uid}, not by this user (uid {uid})"
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by this user (uid {uid})"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit]
    if writable:
        return f"it is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _refuse(directory: Path, path: Path, reason: str) -> Path:
    """Warn that ``path`` (``directory`` or a file in it) is refused; the private directory used instead."""
    fallback = _default_cache_dir()
    if fallback == directory or fallback in _REPLACED or _directory_refusal(fallback) is not None:
        fallback = Path(tempfile.mkdtemp(prefix="lightning_bppsa-"))  # created 0700, ours, empty
        atexit.register(shutil.rmtree, fallback, ignore_errors=True)
    log.warning("lightning_bppsa: refusing the kernel cache %s: %s; using %s instead", path, reason, fallback)
    _REPLACED[directory] = fallback
    return fallback


def trusted_path(filename: str) -> Path:
    """``filename`` in the cache, where neither it nor its sidecar is refused (a planted file moves the
    cache to the private fallback, with one warning). Other caches of the package (e.g. the layer plan's
    measured decisions) keep their files here too."""
    while True:
        directory = cache_dir()
        target = directory / filename
        for path in (target, _sidecar(target)):
            reason = _refusal(path, os.geteuid())
            if reason is not None:
                _refuse(directory, path, reason)
                break
        else:
            return target


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
    target = trusted_path(
        f"{name}_{_cache_key(argv, flag_sets, [*source_paths, *map(kernel_path, depends)])}.so"
    )

    lib, _ = _load_verified(target, symbols)
    if lib is not None:
        return lib
    with exclusive(target.with_name(target.name + ".lock")):
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
    for part in [*argv, repr([list(f) for f in flag_sets]), platform.machine(), cpu_name()]:
        digest.update(part.encode() + b"\0")
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s line; ``platform.processor()`` where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` of ``lock_path`` (created if missing) for the block: one process at a time."""
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
        return (
            None,
            f"it is {actual['size']} bytes with a checksum that does not match {_sidecar(target).name}",
        )
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
                _publish(built, target)
                _publish(sidecar_tmp, _sidecar(target))
                return
            tail = "\n    ".join(result.stderr.strip().splitlines()[-5:]) or "(nothing on stderr)"
            failures.append(f"`{shlex.join(cmd)}` exited with status {result.returncode}:\n    {tail}")
    raise BuildError("\n".join(failures))


def _publish(path: Path, target: Path) -> None:
    """Rename a finished ``path`` onto ``target`` (same file system: atomic), never group- or world-writable
    (a umask of 002 would make it so)."""
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    os.replace(path, target)


def write_private(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` atomically: complete in a private folder beside it, then renamed into
    place (a reader sees the old file or the new one, never a part), not writable by group or others."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        written = Path(tmp) / target.name
        written.write_text(text)
        _publish(written, target)
