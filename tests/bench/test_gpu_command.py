"""``benchmarks/gpu.py --all`` (the one GPU command) in its CPU smoke mode: tiny shapes, an injected clock.

Every stage runs for real on the CPU (no CUDA kernels: those rows say so); the clock decides only the
deadline and the CPU timings, so nothing here depends on how fast this machine is.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
#: a stand-in for ``pytest tests/gpu``: one failure, its summary line, exit 1
FAKE_TESTS = (
    sys.executable,
    "-c",
    "print('FAILED tests/gpu/test_x.py::test_y - boom'); print('==== 1 failed, 2 passed in 0.01s ===='); raise SystemExit(1)",
)


def _script():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _script()


class FakeClock:
    """Seconds that advance by ``tick`` on every reading; :meth:`jump` moves them on at once."""

    def __init__(self, tick: float = 1e-3) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


def _runner(tmp_path: Path, clock: FakeClock, budget: float = 1e4):
    return bench.Runner("cpu", bench.TINY_SHAPES, deadline=clock.now + budget, clock=clock, results=tmp_path)


def _read(tmp_path: Path, name: str) -> str:
    return (tmp_path / name).read_text()


def _table_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's body rows."""
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]  # past the names and the rule
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def _calibration(tmp_path: Path) -> list[dict[str, str]]:
    with (tmp_path / "cuda-calib.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def _committed_columns() -> list[str]:
    with bench.COMMITTED_CALIB.open(newline="") as f:
        return next(csv.reader(f))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One whole ``--all`` run in the smoke mode, with time to spare."""
    results = tmp_path_factory.mktemp("all")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BPPSA_COMMIT", "abc1234")
        bench._commit.cache_clear()
        bench.run_all(_runner(results, FakeClock()), tests_command=FAKE_TESTS)
    bench._commit.cache_clear()
    return results


def test_every_file_has_the_header(full_run: Path) -> None:
    for name in (
        "cuda-tests.md",
        "cuda-host.md",
        "cuda-step.md",
        "cuda-fused.md",
        "cuda-forward.md",
        "cuda-stalls.md",
        "cuda-overhead.md",
        "cuda-chain.md",
        "cuda-calib.md",
        "cuda-gpu.md",
    ):
        line = _read(full_run, name).splitlines()[2]
        for part in ("Device CPU", "torch ", "cuDNN ", "CuPy ", "commit abc1234", " UTC", "gpu.py"):
            assert part in line, (name, part, line)


def test_the_tests_stage_writes_the_summary_and_the_failures(full_run: Path) -> None:
    text = _read(full_run, "cuda-tests.md")
    assert "**exit 1: 1 failed, 2 passed in 0.01s**" in text
    assert "- `FAILED tests/gpu/test_x.py::test_y - boom`" in text


def test_the_step_table_has_every_workload_with_float64_checked_gradients(full_run: Path) -> None:
    text = _read(full_run, "cuda-step.md")
    assert "Rows done: 3 of 3" in text
    rows = _table_rows(text)
    assert [row[:5] for row in rows] == [list(map(str, w)) for w in bench.TINY_SHAPES.step]
    for row in rows:
        assert len(row) == len(bench.STEP_COLUMNS)
        step_ms = [float(row[i]) for i in (5, 6, 8, 9)]  # the CPU clock's (fake) ms: numbers, not reasons
        assert all(ms > 0 for ms in step_ms) and row[7].endswith("x")
        # no graph capture without CUDA: the columns say so
        assert row[10:13] == [bench.NO_CUDA, bench.NO_CUDA, "-"]
        # both float32 modules' gradients against float64 torch: the error is float32 rounding, not a bug
        assert float(row[13]) < 1e-4 and float(row[14]) < 1e-4
        assert row[15], "the BPPSA plan is reported"


def test_the_graphed_columns_capture_cudnn_and_the_scan_the_plan_ran_else_linear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (its capture stood in): cuDNN's module and ours with the scan named, chunked where "auto" ran the
    chunked scan, else linear (also where auto kept cuDNN); wider than GRAPHED_MAX_HIDDEN, the scan is not
    captured and the cell says why."""
    captured = []
    monkeypatch.setattr(bench, "graphed_seconds", lambda module, x: captured.append(module) or 1e-3)
    runner = dataclasses.replace(_runner(tmp_path, FakeClock()), device="cuda")
    ref, x = torch.nn.RNN(1, 4, batch_first=True), torch.zeros(2, 5, 1)
    for plan in ("scan chunked(c=16) [cuda]", "autograd (measured: scan 2 ms vs torch 1 ms a step)"):
        assert bench._graphed(runner, ref, x, plan, 4) == {"cudnn": 1e-3, "scan": 1e-3}
    assert [getattr(m, "algorithm", "cuDNN") for m in captured] == ["cuDNN", "chunked", "cuDNN", "linear"]
    wide = bench._graphed(runner, ref, x, "autograd (cost model)", bench.GRAPHED_MAX_HIDDEN + 1)
    assert wide["cudnn"] == 1e-3 and wide["scan"].startswith("not captured: H > ")


def test_the_calibration_csv_has_the_committed_columns_and_every_row(full_run: Path) -> None:
    header = (full_run / "cuda-calib.csv").read_text().splitlines()[0].split(",")
    assert header[:8] == _committed_columns() and header[8:] == ["plan", "note"]
    rows = _calibration(full_run)
    s = bench.TINY_SHAPES
    launches = {t: 1 + sum(c < t for c in s.kernel_chunks) for t in s.calib_length}
    expected = sum(8 + launches[t] for t in s.calib_length) * len(s.calib_d) * len(s.calib_batch)
    assert len(rows) == expected
    assert sum(row["what"] == "fused_kernel" for row in rows) == len(s.calib_d) * len(s.calib_batch) * len(s.calib_length)
    for row in rows:
        if row["what"] in ("kernel", "fused_kernel"):
            assert row["ms"] == "" and row["note"] == bench.NO_CUDA
        else:
            assert float(row["ms"]) > 0
            assert row["note"] == "" or row["note"].startswith("asked algorithm=")
    steps = [row for row in rows if row["what"] == "step_bppsa"]
    assert len(steps) == len(s.calib_d) * len(s.calib_batch) * len(s.calib_length)
    assert all(row["plan"] for row in steps)
    for row in (row for row in rows if row["what"] == "step_scan"):
        assert row["algorithm"] in ("linear", "chunked") and row["plan"].startswith("scan ")
        assert row["chunk"] == row["T"] if row["algorithm"] == "linear" else row["chunk"].isdigit()
    text = _read(full_run, "cuda-calib.md")
    assert f"Shapes done: {len(steps)} of {len(steps)}" in text and "measured shapes below 0.9x cuDNN" in text
    assert len(_table_rows(text)) == len(steps)
    # cuDNN's second copy, timed in the same rounds: each row gives its time and its ratio to the first
    again = {(r["d"], r["B"], r["T"]): float(r["ms"]) for r in rows if r["what"] == "step_cudnn_again"}
    assert len(again) == len(steps)
    for row in _table_rows(text):
        assert row[4] == f"{again[tuple(row[:3])]:.3f} (1.00x)"  # the fake clock: every call 1 ms
    assert f"cuDNN's second copy below 0.9x of the first on 0 of {len(steps)}" in text


def test_the_paper_grid_has_its_rows(full_run: Path) -> None:
    rows = _table_rows(_read(full_run, "cuda-gpu.md"))
    assert [row[:4] for row in rows] == [list(map(str, r)) for r in bench.TINY_SHAPES.paper]
    assert all(float(row[5]) > 0 and bench.NO_CUDA in row[8] for row in rows)


def test_past_the_deadline_every_later_stage_is_written_as_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    real = bench.tests_stage

    def tests_then_jump(*args, **kwargs) -> str:
        summary = real(*args, **kwargs)
        clock.jump(1e6)  # the clock passes the budget once the tests have run
        return summary

    monkeypatch.setattr(bench, "tests_stage", tests_then_jump)
    bench.run_all(_runner(tmp_path, clock), tests_command=FAKE_TESTS)
    assert "1 failed, 2 passed" in _read(tmp_path, "cuda-tests.md")
    rows = _table_rows(_read(tmp_path, "cuda-step.md"))
    assert len(rows) == 3 and all(cell == bench.SKIPPED for row in rows for cell in row[5:])
    calibration = [row for row in _calibration(tmp_path) if row["what"] not in ("kernel", "fused_kernel")]
    assert calibration and all(row["ms"] == "" and row["note"] == bench.SKIPPED for row in calibration)
    rows = _table_rows(_read(tmp_path, "cuda-gpu.md"))
    assert len(rows) == 2 and all(row[4] == bench.SKIPPED for row in rows)


def test_a_deadline_inside_the_calibration_skips_the_shapes_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    real = bench.calib_shape

    def shape_then_jump(*args, **kwargs) -> list[dict[str, str]]:
        rows = real(*args, **kwargs)
        clock.jump(1e6)
        return rows

    monkeypatch.setattr(bench, "calib_shape", shape_then_jump)
    runner = _runner(tmp_path, clock)
    bench.calib_stage(runner, bench.CommittedTimes([]))
    measured = {(r["d"], r["B"], r["T"]) for r in _calibration(tmp_path) if r["ms"]}
    skipped = {(r["d"], r["B"], r["T"]) for r in _calibration(tmp_path) if r["note"] == bench.SKIPPED}
    assert len(measured) == 1 and len(skipped) == 7 and not measured & skipped
    assert measured == {("2", "1", "4")}, "the cheapest shape runs first"


def test_a_run_already_past_its_deadline_starts_no_test_process(tmp_path: Path) -> None:
    clock = FakeClock()
    runner = _runner(tmp_path, clock, budget=-1.0)
    assert bench.tests_stage(runner, command=("/nonexistent/pytest",)) == bench.SKIPPED
    assert f"**{bench.SKIPPED}**" in _read(tmp_path, "cuda-tests.md")


def test_tests_that_run_too_long_are_stopped(tmp_path: Path) -> None:
    command = (sys.executable, "-c", "import time; print('.', flush=True); time.sleep(60)")
    summary = bench.tests_stage(_runner(tmp_path, FakeClock()), command=command, limit=1.0)
    assert summary == "stopped: did not finish in 1.0 s"
    assert "## Output" in _read(tmp_path, "cuda-tests.md")


def test_a_stopped_test_run_still_reports_what_its_log_holds(tmp_path: Path) -> None:
    """The tests log each finished test (tests/gpu/conftest.py): a run stopped at its limit keeps them. The
    tests run on one CPU thread a process (xdist's workers side by side)."""
    code = (
        "import os, time; assert os.environ['OMP_NUM_THREADS'] == '1'\n"
        "log = open(os.environ['BPPSA_TEST_LOG'], 'a')\n"
        "log.write('call\\tpassed\\t0.500\\ttests/gpu/test_a.py::test_quick\\n')\n"
        "log.write('call\\tfailed\\t9.250\\ttests/gpu/test_a.py::test_slow\\n')\n"
        "log.write('call\\tpassed\\t0.500\\ttests/gpu/test_a.py::test_quick\\n')\n"  # logged twice (xdist)
        "log.close(); time.sleep(60)"
    )
    summary = bench.tests_stage(_runner(tmp_path, FakeClock()), command=(sys.executable, "-c", code), limit=2.0)
    assert summary == "stopped: did not finish in 2.0 s"
    text = _read(tmp_path, "cuda-tests.md")
    assert "1 failed, 1 passed (test phases)" in text
    assert text.index("9.2 s `tests/gpu/test_a.py::test_slow` (call)") < text.index("0.5 s `tests/gpu/test_a.py::test_quick`")


def test_the_gpu_tests_log_each_test_as_it_finishes(tmp_path: Path) -> None:
    """tests/gpu's own hook writes the log the tests stage reads (a real pytest run of a few quick tests)."""
    command = (sys.executable, "-m", "pytest", "tests/gpu/test_gpu_fixture.py", "-p", "no:cacheprovider")
    summary = bench.tests_stage(_runner(tmp_path, FakeClock()), command=command, limit=300.0)
    assert summary.startswith("exit 0"), summary
    logged = (tmp_path / "cuda-tests-log.txt").read_text().splitlines()
    assert len(logged) == 7 and all("tests/gpu/test_gpu_fixture.py::" in line for line in logged)
    assert "7 passed (test phases)" in _read(tmp_path, "cuda-tests.md")


def test_measurements_the_h100_found_slow_are_skipped(tmp_path: Path) -> None:
    committed = io.StringIO(
        ",".join(_committed_columns()) + "\n"
        "kernel,RNN,2,1,4,linear,4,30.0\n"  # at T = 9: 30 * 9 / 4 = 67.5 ms > 50
        "kernel,RNN,2,1,9,chunked,2,10.0\n"
        "kernel,RNN,2,1,9,chunked,4,60.0\n"
    )
    times = bench.CommittedTimes(csv.DictReader(committed))
    assert times.ms("kernel", 2, 1, 9, "linear", 9) == pytest.approx(67.5)
    assert times.ms("kernel", 2, 1, 100, "chunked", 16) is None
    rows = bench.calib_shape(_runner(tmp_path, FakeClock()), times, 2, 1, 9, budget=1.0)
    scans = {row["algorithm"]: row for row in rows if row["what"] == "step_scan"}
    assert scans["linear"]["ms"] == ""
    assert (
        scans["linear"]["note"]
        == "skipped: its kernel alone took ~68 ms on the H100 (committed data; over 50 ms)"
    )
    assert float(scans["chunked"]["ms"]) > 0, "the fastest committed chunk (10 ms) is fast enough"


def test_the_calibration_steps_interleave_three_times_the_rounds_against_a_flat_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid's whole steps (cuDNN, its copy, ours) drift between rounds at T = 100: 3x the rounds; the copy's
    weights in one flat buffer as the original's (a deep copy's are compacted every call on cuDNN)."""
    seen, copies = {}, []
    real_interleaved, real_copy = bench.interleaved, bench._copy_of

    def spy(runner, fns, *args, **kwargs):
        seen[tuple(fns)] = runner.shapes.rounds
        return real_interleaved(runner, fns, *args, **kwargs)

    monkeypatch.setattr(bench, "interleaved", spy)
    monkeypatch.setattr(bench, "_copy_of", lambda ref: copies.append(ref) or real_copy(ref))
    bench.calib_shape(_runner(tmp_path, FakeClock()), bench.CommittedTimes([]), 2, 1, 9, budget=1.0)
    rounds = bench.TINY_SHAPES.rounds
    assert seen[("cudnn", "again", "bppsa")] == 3 * rounds and seen[("cudnn", "bppsa")] == rounds
    assert len(copies) == 1


def test_an_estimate_that_does_not_fit_skips_before_the_warm_up(tmp_path: Path) -> None:
    calls = []
    runner = _runner(tmp_path, FakeClock(), budget=1.0)
    result = bench.interleaved(runner, {"a": lambda: calls.append("a")}, budget=1.0, estimate=0.5)
    assert result == {"a": bench.SKIPPED} and calls == []


def test_interleaved_alternates_after_the_warm_up_and_times_with_the_clock(tmp_path: Path) -> None:
    calls = []
    clock = FakeClock(tick=0.25)
    runner = dataclasses.replace(
        _runner(tmp_path, clock), shapes=dataclasses.replace(bench.TINY_SHAPES, max_steps=2)
    )
    result = bench.interleaved(
        runner, {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, budget=1e3
    )
    warm = ["a"] * bench.WARMUP + ["b"] * bench.WARMUP
    assert calls == warm + ["a", "a", "b", "b"] * bench.TINY_SHAPES.rounds
    assert result == {"a": pytest.approx(0.25), "b": pytest.approx(0.25)}  # one clock tick per call


@pytest.mark.parametrize(
    ("plan", "columns"),
    [
        ("scan chunked(c=64) [cuda]", ("chunked", "64")),
        ("scan linear [cuda]", ("linear", "1000")),
        ("scan blelloch [c]", ("blelloch", "")),
        ("autograd (cost model: linear is not faster)", ("", "")),
    ],
)
def test_plan_columns(plan: str, columns: tuple[str, str]) -> None:
    assert bench.plan_columns(plan, 1000) == columns


def test_the_command_line_builds_the_smoke_runner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen = []
    monkeypatch.setattr(bench, "run_all", lambda runner, stages: seen.append((runner, stages)))
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--all", "--within", "100", "--device", "cpu", "--tiny",
                                      "--results", str(tmp_path)])  # fmt: skip
    bench.main()
    ((runner, stages),) = seen
    assert runner.device == "cpu" and runner.shapes == bench.TINY_SHAPES and runner.results == tmp_path
    assert 0 < runner.left() <= 100 * (1 - bench.MARGIN)
    assert stages == list(bench.STAGES)
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--all", "--device", "cpu", "--stages", "calib,cells"])
    bench.main()
    assert seen[-1][1] == ["calib", "cells"]
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--all", "--device", "cpu", "--tiny", "--cells", "HandLSTM,gated"])
    bench.main()
    assert seen[-1][0].shapes.cell_names == ("HandLSTM", "gated")
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--all", "--device", "cpu", "--stages", "calib,bogus"])
    with pytest.raises(SystemExit):
        bench.main()
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--all", "--within", "0", "--device", "cpu"])
    with pytest.raises(SystemExit):
        bench.main()


def test_the_chain_table_has_both_weights_and_says_which_path_ran(full_run: Path) -> None:
    rows = _table_rows(_read(full_run, "cuda-chain.md"))
    assert [row[:2] for row in rows] == [["dense", "1"], ["pruned 97%", "2"]]
    assert all(row[-1].startswith(("scan", "autograd")) and "" not in row[2:5] for row in rows)
    assert all("measured" in row[-1] for row in rows)  # auto's decision, on either path
    assert all(float(row[3]) > 0 for row in rows)  # the second copy of torch's model ran


def test_the_chain_table_gives_the_decision_where_the_scan_ran_too(tmp_path: Path, monkeypatch) -> None:
    from lightning_bppsa import layer_plan

    monkeypatch.setattr(layer_plan, "time_training_steps", lambda *a: {"scan": 1e-3, "autograd": 2e-3})
    with layer_plan.measurements(True):
        rows = bench.chain_stage(_runner(tmp_path, FakeClock()))
    assert [row[-1] for row in rows] == ["scan (measured: scan 1 ms vs torch 2 ms a forward + backward)"] * 2


def test_the_overhead_table_compares_torch_with_itself_and_with_ours(full_run: Path) -> None:
    text = _read(full_run, "cuda-overhead.md")
    assert "cProfile of torch's module" in text and "recurrent.py" in text.split("cProfile of lightning_bppsa")[1]
    rows = _table_rows(text)
    assert [row[:5] for row in rows] == [[str(v) for v in w] for w in bench.TINY_SHAPES.overhead]
    for row in rows:
        torch_ms, again_ms, ours_ms, ours_us, again_us = map(float, row[5:10])
        assert (
            abs(ours_us - (ours_ms - torch_ms) * 1e3) <= 1
            and abs(again_us - (again_ms - torch_ms) * 1e3) <= 1
        )


def test_the_host_table_has_torch_and_ours_per_workload_and_our_python_profile(full_run: Path) -> None:
    text = _read(full_run, "cuda-host.md")
    rows = _table_rows(text)
    ((cell, batch, length, inputs, hidden, algorithm),) = bench.TINY_SHAPES.host
    assert [row[:6] for row in rows] == [
        ["torch", cell, str(batch), str(length), str(inputs), str(hidden)],
        [f"BPPSA {algorithm}", cell, str(batch), str(length), str(inputs), str(hidden)],
        ["BPPSA auto, replayed", cell, str(batch), str(length), str(inputs), str(hidden)],
    ]
    assert all(float(row[6]) > 0 and float(row[7]) > 0 and float(row[8]) > 0 for row in rows)
    assert rows[1][-1].startswith(f"scan {algorithm}")  # the forced scan ran
    assert rows[2][-1].startswith("scan")  # "auto" made sure of the scan (no CUDA graphs on the CPU: eager)
    assert "cProfile, 20 steps" in text and "_scan_layer.py" in text  # ours, profiled by function


def test_stages_run_alone_and_leave_their_unused_time_to_the_next(tmp_path: Path) -> None:
    shares = []
    clock = FakeClock()
    runner = _runner(tmp_path, clock, budget=100.0)
    original = bench.Runner.until
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench.Runner, "until",
                      lambda self, seconds: shares.append((seconds, self.left())) or original(self, seconds))  # fmt: skip
        bench.run_all(runner, tests_command=FAKE_TESTS, stages=["overhead", "calib"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cuda-calib.csv",
        "cuda-calib.md",
        "cuda-overhead.md",
    ]
    # each stage may use its share of the time left among the chosen stages still to run: the first, overhead,
    # its part of overhead + calib; the last, calib, all that is left
    chosen = bench.STAGE_SHARES["overhead"] + bench.STAGE_SHARES["calib"]
    (first, left_first), (last, left_last) = shares
    assert first == pytest.approx(left_first * bench.STAGE_SHARES["overhead"] / chosen, rel=1e-3)
    assert left_first == pytest.approx(100.0, abs=0.1) and last == pytest.approx(left_last, abs=0.01)


def test_the_tests_stage_may_use_its_limit_whatever_its_share(tmp_path: Path) -> None:
    """pytest is stopped at its limit, so the tests stage gets up to TESTS_SECONDS even where its share of the
    run is less (a 520 s run of every stage gave it 74 s on an H200), and no more than the time left."""
    budgets = []
    original = bench.Runner.until
    for total in (520.0, 100.0):
        runner = _runner(tmp_path, FakeClock(), budget=total)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bench.Runner, "until", lambda self, seconds: budgets.append(seconds) or original(self, seconds))
            for stage in ("tests_stage", "cells_stage", "calib_stage"):  # the budgets are what is checked
                patch.setattr(bench, stage, lambda r, *a, **k: "")
            bench.run_all(runner, tests_command=FAKE_TESTS, stages=["tests", "cells", "calib"])
    chosen = sum(bench.STAGE_SHARES[stage] for stage in ("tests", "cells", "calib"))
    assert bench.STAGE_SHARES["tests"] / chosen * 520 < bench.TESTS_SECONDS  # its share would have stopped it
    # tests, cells, calib of each run: the tests get their limit, and no more than the time left
    assert budgets[0] == pytest.approx(bench.TESTS_SECONDS) and budgets[3] == pytest.approx(100.0, abs=0.1)


def test_the_plan_reports_every_kernel_s_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    # ptxas's report stood in: the generic module lacks the warp sweeps, compiled per (d, k) (a KeyError once)
    from lightning_bppsa.kernels import cuda, cuda_inspect

    def usage(archs, warp_shape=None):
        names = [k for k in cuda.KERNELS if ("warpsweep" in k) == (warp_shape is not None)]
        return {arch: {k: cuda_inspect.KernelUsage(40 + (warp_shape is not None), 0, 0, 0, 0) for k in names}
                for arch in archs}  # fmt: skip

    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/nvcc")
    monkeypatch.setattr(cuda_inspect, "ptxas_usage", usage)
    text = bench.plan()
    for kernel in cuda.KERNELS:
        registers = 41 if "warpsweep" in kernel else 40
        assert any(line.startswith(f"| {kernel}") and line.endswith(f"| {registers} | {registers} |")
                   for line in text.splitlines()), kernel  # fmt: skip


def test_the_fused_stage_compares_the_two_backwards_on_every_workload(full_run: Path) -> None:
    """In the smoke mode the fused kernel runs on its host emulation, the factored scan on the C sweeps: both
    timed, their gradients the same."""
    rows = _table_rows(_read(full_run, "cuda-fused.md"))
    assert [row[:4] for row in rows] == [list(map(str, w)) for w in bench.TINY_SHAPES.fused]
    for row in rows:
        assert float(row[4]) > 0 and float(row[5]) > 0 and row[7].startswith("linear")
        assert float(row[8]) < 1e-5, row


def test_the_forward_stage_names_every_workload(full_run: Path) -> None:
    """Without CUDA the forward kernels' table lists every workload of ``recurrent_forward_gpu`` as such."""
    forward = sys.modules["recurrent_forward_gpu"]
    rows = _table_rows(_read(full_run, "cuda-forward.md"))
    assert [row[0] for row in rows] == [f"{c} B{b} T{t} I{i} H{h}" for c, b, t, i, h in forward.WORKLOADS]
    assert all(row[1] == bench.NO_CUDA and len(row) == len(forward.COLUMNS) for row in rows)


def test_the_forward_stage_measures_while_time_is_left(tmp_path: Path, monkeypatch) -> None:
    """On CUDA each workload is measured (``measure``, here a stand-in that takes 5 s of the clock) until the
    deadline, the rest written as skipped; the row's microseconds to 0.1, its differences in 3 digits."""
    forward = sys.modules["recurrent_forward_gpu"]
    clock = FakeClock()
    measured = []

    def measure(cell, batch, steps, inputs, hidden, calls):
        measured.append((cell, batch, steps, inputs, hidden, calls))
        clock.jump(5.0)
        row = dict.fromkeys(forward.COLUMNS, 1.234567)
        return {**row, "workload": f"{cell} B{batch}"}

    monkeypatch.setattr(forward, "measure", measure)
    monkeypatch.setattr(forward.recurrent_cuda, "available", lambda: (True, ""))
    monkeypatch.setattr(forward, "header", lambda runner, title: f"# {title}\n\n")
    runner = dataclasses.replace(_runner(tmp_path, clock, budget=12.0), device="cuda")
    rows = forward.forward_stage(runner, calls=7)
    assert measured == [(*w, 7) for w in forward.WORKLOADS[:3]]
    assert rows[0] == ["rnn_tanh B16", "1.2", "1.2", "1.2", "1.2", "1.2", "1.23e+00", "1.23e+00"]
    assert [row[1] for row in rows[3:]] == [bench.SKIPPED] * (len(forward.WORKLOADS) - 3)
    assert _table_rows(_read(tmp_path, "cuda-forward.md")) == rows


def test_the_backward_alone_is_timed_on_a_fresh_graph_without_a_recomputed_forward(monkeypatch) -> None:
    """The paper grid's backward alone: each timed call consumes a graph its untimed ``prepare`` recorded, so
    our layer's backward uses the states its forward kept; a graph reused with ``retain_graph`` made it
    recompute its forward in every backward after the first (that forward was timed as ours)."""
    from lightning_bppsa import nn as bnn
    from lightning_bppsa.nn import _scan_layer

    recomputed = []
    real = _scan_layer._forward_op
    monkeypatch.setattr(_scan_layer, "_forward_op", lambda *a: recomputed.append(1) or real(*a))
    torch.manual_seed(0)
    module = bnn.RNN(1, 4, batch_first=True, algorithm="linear")
    call = bench._backward_of(module, torch.randn(2, 6, 1))
    forwards = len(recomputed)
    for _ in range(3):
        call.prepare()
        assert len(recomputed) == forwards + 1  # the forward, untimed
        forwards = len(recomputed)
        call()
        assert len(recomputed) == forwards and module.weight_hh_l0.grad is not None


def test_the_gpu_session_script_parses_and_passes_only_flags_its_scripts_take() -> None:
    """``benchmarks/gpu_session.sh`` (one call of a lent GPU machine): bash parses it, and every flag it passes to
    a benchmark script is one that script's ``--help`` lists."""
    script = SCRIPT.with_name("gpu_session.sh")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    calls = re.findall(r"python3 (benchmarks/\w+\.py)([^\n]*)", script.read_text())
    assert sorted(name for name, _ in calls) == ["benchmarks/cluster_layouts.py", "benchmarks/gpu.py"]
    for name, arguments in calls:
        usage = subprocess.run(
            [sys.executable, str(SCRIPT.parents[1] / name), "--help"], capture_output=True, text=True, check=True
        ).stdout
        flags = re.findall(r"(--[a-z-]+)", arguments)
        assert flags and all(flag in usage for flag in flags), (name, flags)
