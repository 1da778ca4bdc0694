"""The shared kernel builder (kernels/_build.py): cache, checks before dlopen, concurrent builds, errors.

Where a regression would crash the interpreter (dlopen of a damaged library), the library is loaded
in a subprocess that imports only the builder (by file path: no torch, well under a second).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from lightning_bppsa.kernels import _build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")

PROBE = "int bppsa_probe(int x) { return x + 1; }\n"
LOAD = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("_build", sys.argv[1])
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    lib = build.load_library("probe", [sys.argv[2]], ["cc", "-std=c99"], symbols=["bppsa_probe"])
    print(lib.bppsa_probe(41))
    """
)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def probe(tmp_path):
    source = tmp_path / "probe.c"
    source.write_text(PROBE)
    return source


def load_in_subprocess(probe, cache):
    """Start a subprocess that loads the probe from ``cache``; returns it (not yet waited for)."""
    env = {"BPPSA_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-c", LOAD, _build.__file__, str(probe)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process):
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, f"exit {process.returncode} (negative: killed by signal): {err[-2000:]}"
    assert out.strip() == "42"
    return err


def build_probe(probe, cache):
    """Build the probe in a subprocess: this process must not map a file that the test then damages."""
    finished(load_in_subprocess(probe, cache))
    (library,) = cache.glob("probe_*.so")
    return library


def test_builds_once_with_a_checksum_beside_it(cache, probe):
    library = build_probe(probe, cache)
    recorded = json.loads(library.with_name(library.name + ".sha256").read_text())
    assert recorded["size"] == library.stat().st_size
    mtime = library.stat().st_mtime_ns
    assert finished(load_in_subprocess(probe, cache)) == ""  # cached: loaded as is, nothing logged
    assert library.stat().st_mtime_ns == mtime


def test_cut_short_library_is_rebuilt_not_loaded(cache, probe):
    library = build_probe(probe, cache)
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(4096)
    err = finished(load_in_subprocess(probe, cache))
    assert "is unusable" in err and "does not match" in err and "rebuilding" in err
    assert library.stat().st_size == size


def build_probe_then_a_foreign_one_in_its_place(cache, probe, tmp_path) -> tuple[Path, Path]:
    """Build the probe, then copy over it a library built from other source: a valid ELF that is not ours,
    its checksum not the recorded one. Returns (the probe's library, the foreign one)."""
    library = build_probe(probe, cache)
    other = tmp_path / "other.c"
    other.write_text("int something_else(void) { return 0; }\n")
    _build.load_library("other", [other], ["cc", "-std=c99"])
    (foreign,) = cache.glob("other_*.so")
    shutil.copy(foreign, library)
    return library, foreign


def test_foreign_library_is_rejected(cache, probe, tmp_path):
    build_probe_then_a_foreign_one_in_its_place(cache, probe, tmp_path)
    assert "does not match" in finished(load_in_subprocess(probe, cache))


def test_foreign_library_with_a_matching_checksum_fails_the_symbol_check(cache, probe, tmp_path):
    library, foreign = build_probe_then_a_foreign_one_in_its_place(cache, probe, tmp_path)
    shutil.copy(foreign.with_name(foreign.name + ".sha256"), library.with_name(library.name + ".sha256"))
    err = finished(load_in_subprocess(probe, cache))
    assert "does not export bppsa_probe" in err and err.count("rebuilding") == 1


def test_concurrent_first_builds_agree(cache, probe):
    processes = [load_in_subprocess(probe, cache) for _ in range(3)]
    for process in processes:
        finished(process)
    assert len(list(cache.glob("probe_*.so"))) == 1
    assert not list(cache.glob(".build-*"))  # temporary build folders are removed


def test_cache_key_follows_the_source(cache, probe):
    first = build_probe(probe, cache)
    probe.write_text(PROBE.replace("x + 1", "x + 2"))
    lib = _build.load_library("probe", [probe], ["cc", "-std=c99"], symbols=["bppsa_probe"])
    assert lib.bppsa_probe(40) == 42
    assert len(list(cache.glob("probe_*.so"))) == 2 and first.exists()


def test_failing_compiler_says_which_command_failed_and_why(cache, probe):
    noisy = ["sh", "-c", "echo 'fatal: no such flag' >&2; exit 3", "sh"]  # ignores the arguments appended
    with pytest.raises(_build.BuildError) as raised:
        _build.load_library("probe", [probe], noisy, flag_sets=[["-O3", "-fopenmp"], ["-O3"]])
    message = str(raised.value)
    assert message.count("exited with status 3") == 2 and "fatal: no such flag" in message
    assert "-O3 -fopenmp" in message and str(probe) in message
    assert not list(cache.glob("*.so"))


def test_missing_compiler_is_named(cache, probe):
    with pytest.raises(_build.BuildError, match="compiler 'no-such-cc' not found on PATH"):
        _build.load_library("probe", [probe], ["no-such-cc"])


# ---- the cache is trusted only where no other user can write (issue 27 item 10) ----------------------------


@pytest.fixture
def home(monkeypatch, tmp_path):
    """A fresh home (the default cache, the first fallback, lies in it) and no cache refused yet."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(_build, "_REPLACED", {})
    return tmp_path / "home"


def load_probe(probe):
    return _build.load_library("probe", [probe], ["cc", "-std=c99"], symbols=["bppsa_probe"])


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refusing the kernel cache" in r.getMessage()]


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_cache_directory_is_created_private(cache, probe, home):
    assert load_probe(probe).bppsa_probe(41) == 42
    assert mode(cache) == 0o700


@pytest.mark.parametrize(("bits", "who"), [(0o770, "group"), (0o707, "others")])
def test_a_cache_directory_writable_by_others_is_refused_for_a_private_one(
    cache, probe, home, caplog, bits, who
):
    cache.mkdir()
    cache.chmod(bits)
    assert load_probe(probe).bppsa_probe(41) == 42
    assert load_probe(probe).bppsa_probe(41) == 42  # the fallback is kept: one warning per process
    (message,) = refusals(caplog)
    fallback = home / ".cache" / "lightning_bppsa"
    assert f"{cache}: it is writable by {who} (mode 0{bits:o})" in message and f"using {fallback}" in message
    assert "\n" not in message
    assert not list(cache.glob("probe_*")) and len(list(fallback.glob("probe_*.so"))) == 1
    assert mode(fallback) == 0o700


def test_a_world_writable_library_is_refused(cache, probe, home, caplog):
    library = build_probe(probe, cache)
    library.chmod(0o757)
    assert load_probe(probe).bppsa_probe(41) == 42
    (message,) = refusals(caplog)
    assert f"{library}: it is writable by others (mode 0757)" in message
    assert len(list((home / ".cache" / "lightning_bppsa").glob("probe_*.so"))) == 1


def test_a_planted_library_owned_by_another_user_is_never_loaded(
    cache, probe, home, caplog, tmp_path, monkeypatch
):
    library = build_probe(probe, cache)
    # another user plants a library exporting the same symbol, with a sidecar that matches it
    planted = tmp_path / "planted.c"
    planted.write_text(PROBE.replace("x + 1", "x + 100"))
    foreign = _build.load_library("planted", [planted], ["cc", "-std=c99"])
    shutil.copy(foreign._name, library)
    shutil.copy(foreign._name + ".sha256", library.with_name(library.name + ".sha256"))
    # we are root here: "owned by another user" is simulated by checking that file against another uid
    check = _build._refusal
    monkeypatch.setattr(
        _build, "_refusal", lambda path, uid: check(path, uid + 1 if path == library else uid)
    )
    assert load_probe(probe).bppsa_probe(41) == 42  # the planted one would answer 141
    (message,) = refusals(caplog)
    assert (
        f"{library}: it is owned by uid {os.geteuid()}, not by this user (uid {os.geteuid() + 1})" in message
    )


def test_a_refused_default_cache_falls_back_to_a_fresh_temporary_directory(
    monkeypatch, probe, home, caplog, tmp_path
):
    monkeypatch.delenv("BPPSA_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    default = home / ".cache" / "lightning_bppsa"
    default.mkdir(parents=True)
    default.chmod(0o777)
    assert load_probe(probe).bppsa_probe(41) == 42
    (fallback,) = tmp_path.glob("lightning_bppsa-*")
    (message,) = refusals(caplog)
    assert f"{default}: it is writable by group and others" in message and f"using {fallback}" in message
    assert mode(fallback) == 0o700 and len(list(fallback.glob("probe_*.so"))) == 1


def test_libraries_are_written_atomically_and_never_writable_by_others(
    cache, probe, home, caplog, monkeypatch
):
    renames = []
    replace = os.replace
    monkeypatch.setattr(
        _build.os, "replace", lambda src, dst: (renames.append((Path(src), Path(dst))), replace(src, dst))
    )
    previous = os.umask(0o002)  # a umask that makes new files group-writable
    try:
        load_probe(probe)
    finally:
        os.umask(previous)
    (library,) = cache.glob("probe_*.so")
    sidecar = library.with_name(library.name + ".sha256")
    # each file is complete in a private folder of the cache (same file system) and renamed into place
    assert [dst for _, dst in renames] == [library, sidecar]
    assert all(src.parent.parent == cache and src.parent.name.startswith(".build-") for src, _ in renames)
    assert not mode(library) & 0o022 and not mode(sidecar) & 0o022
    assert load_probe(probe).bppsa_probe(41) == 42 and not refusals(caplog)  # our own files are trusted
