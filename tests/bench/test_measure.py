"""How the benchmarks measure: peak memory, and no allocator tuning at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_bppsa.bench import measure
from lightning_bppsa.bench.measure import (
    default_threads,
    fastest_threads,
    interleaved_medians,
    median_seconds,
    peak_memory_bytes,
    set_threads,
    thread_counts,
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_sees_a_temporary_tensor() -> None:
    nbytes = 64 * 2**20
    peak = peak_memory_bytes(lambda: torch.ones(nbytes // 4).sum())
    assert nbytes * 0.9 < peak < nbytes * 2


def test_median_seconds_is_positive() -> None:
    assert median_seconds(lambda: torch.ones(10).sum(), min_run_time=0.01) > 0


def _topology(root: Path, cores: dict[int, tuple[int, int]]) -> str:
    """A fake sysfs: CPU -> (package, core)."""
    for cpu, (package, core) in cores.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return str(root)


def test_default_threads_count_physical_cores_the_process_may_use(tmp_path: Path) -> None:
    # 4 CPUs = 2 cores x 2 hyper-threads
    sysfs = _topology(tmp_path, {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    assert default_threads({0, 1, 2, 3}, sysfs) == 2
    assert default_threads({0, 2}, sysfs) == 1  # both hyper-threads of one core
    assert default_threads({1, 2}, sysfs) == 2
    assert default_threads({5}, sysfs) == 1  # no topology: a CPU counts as a core


def test_set_threads_sets_torch_and_refuses_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(measure, "default_threads", lambda: 1)
        assert set_threads(None) == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads must be >= 1; got 0"):
            set_threads(0)
    finally:
        torch.set_num_threads(threads)


def test_interleaved_medians_alternate_the_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(measure, "median_seconds", lambda fn, min_run_time: calls.append(fn()) or len(calls))
    times = interleaved_medians({"a": lambda: "a", "b": lambda: "b"}, rounds=3, min_run_time=0)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert times == {"a": [1, 3, 5], "b": [2, 4, 6]}
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleaved_medians({}, rounds=0, min_run_time=0)


@pytest.mark.slow
def test_importing_the_cli_does_not_tune_the_allocator() -> None:
    code = (
        "import ctypes\n"
        "opened = []\n"
        "original = ctypes.CDLL\n"
        "ctypes.CDLL = lambda name, *a, **k: opened.append(name) or original(name, *a, **k)\n"
        "import lightning_bppsa.cli, lightning_bppsa.cli.bench, lightning_bppsa.bench.rnn\n"
        "assert 'libc.so.6' not in opened, opened\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_thread_counts_double_up_to_the_usable_cpus() -> None:
    assert [thread_counts(n) for n in (1, 2, 3, 6, 16)] == [
        [1],
        [1, 2],
        [1, 2, 3],
        [1, 2, 4, 6],
        [1, 2, 4, 8, 16],
    ]
    with pytest.raises(ValueError, match="cpus must be >= 1; got 0"):
        thread_counts(0)


def test_fastest_threads_follows_the_measurements_and_names_them() -> None:
    asked: list[int] = []

    def seconds_at(measured: dict[int, float]):
        def at(threads: int) -> float:
            asked.append(threads)
            return measured[threads]

        return at

    # the 2-vCPU machine of the issue: two threads collapsed the baseline
    best, why = fastest_threads(seconds_at({1: 0.055, 2: 0.359}), [1, 2], "autograd step")
    assert best == 1 and asked == [1, 2]
    assert (
        why
        == "torch threads: 1 (measured autograd step 55 ms at 1 thread, 359 ms at 2; --threads to override)"
    )
    best, why = fastest_threads(seconds_at({1: 0.04, 2: 0.02, 4: 0.03}), [4, 1, 2])
    assert best == 2 and why.startswith(
        "torch threads: 2 (measured step 40 ms at 1 thread, 20 ms at 2, 30 ms at 4;"
    )
    assert fastest_threads(seconds_at({1: 0.01, 2: 0.01}), [1, 2])[0] == 1  # a tie: the fewer threads
    with pytest.raises(ValueError, match="at least one thread count"):
        fastest_threads(seconds_at({}), [])
