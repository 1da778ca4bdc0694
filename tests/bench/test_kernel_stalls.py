"""``benchmarks/kernel_stalls.py`` (the ``stalls`` stage of ``benchmarks/gpu.py``) without a GPU: ncu's CSV read
into per-step figures, the profile command, the retry without the stall metrics, and what is written where
there is no CUDA or no ncu. ncu itself is stood in by a function that returns what ncu prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_stalls.py"
_spec = importlib.util.spec_from_file_location("kernel_stalls", SCRIPT)
stalls = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = stalls  # dataclasses look their module up there
_spec.loader.exec_module(stalls)
runner_module = sys.modules["device_runner"]  # the module kernel_stalls.py imported

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _row(launch: int, kernel: str, grid: str, metric: str, value: str) -> str:
    return (
        f'"{launch}","7","python","h","{kernel}","1","7","(32, 1, 1)","{grid}","0","9.0",'
        f'"Command line profiler metrics","{metric}","",' + f'"{value}"'
    )


def _stall(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


#: what ncu prints for one step of LSTM T=1034: the program's and ncu's lines first, then the CSV. The forward
#: kernel: 1,034,000 ns (1000 a step), 16 one-warp blocks issuing 300 instructions a step; the backward half as
#: long; a copy kernel far below the shown share; the forward's cycles-per-issue is "n/a"
NCU_OUTPUT = "\n".join([
    "==PROF== Connected to process 7 (python)",
    "scan linear [cuda], fused backward kernel",
    HEADER,
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", stalls.DURATION, "1,034,000"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", stalls.INSTRUCTIONS, "4,963,200"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", stalls.CYCLES_PER_ISSUE, "n/a"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", _stall("long_scoreboard"), "1.5"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", _stall("wait"), "2.25"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", _stall("barrier"), "0.5"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", _stall("short_scoreboard"), "4"),
    _row(0, "bppsa_lstm_forward_f32_h20", "(16, 1, 1)", _stall("selected"), "1"),
    _row(1, "copy_kernel", "(4, 1, 1)", stalls.DURATION, "2,000"),
    "==WARNING== a line printed between the rows,with,as,many,commas,as,a,row,has,so,that,it,reads,as,1",
    _row(2, "bppsa_lstm_backward_f32_h20", "(16, 1, 1)", stalls.DURATION, "517,000"),
    _row(2, "bppsa_lstm_backward_f32_h20", "(16, 1, 1)", stalls.CYCLES_PER_ISSUE, "6.5"),
    "==PROF== Disconnected from process 7",
])  # fmt: skip

LSTM = ("LSTM", 16, 1034, 12, 20, "linear")


def test_parse_reads_every_kernel_in_launch_order_with_numbers():
    kernels = stalls.parse(NCU_OUTPUT)
    assert [k.name for k in kernels] == [
        "bppsa_lstm_forward_f32_h20",
        "copy_kernel",
        "bppsa_lstm_backward_f32_h20",
    ]
    forward = kernels[0]
    assert forward.grid == (16, 1, 1) and forward.block == (32, 1, 1) and forward.warps == 16
    assert forward.metrics[stalls.DURATION] == 1_034_000.0 and forward.metrics[_stall("wait")] == 2.25
    assert stalls.CYCLES_PER_ISSUE not in forward.metrics  # "n/a" is no number
    assert stalls.parse("==ERROR== no kernels were profiled") == []


def test_rows_give_per_step_figures_and_the_largest_stalls_of_the_kernels_that_matter():
    rows = stalls.rows_of("bppsa", LSTM, stalls.parse(NCU_OUTPUT))
    assert [row[2] for row in rows] == ["`bppsa_lstm_forward_f32_h20`", "`bppsa_lstm_backward_f32_h20`"]
    forward, backward = rows
    assert forward[:2] == ["bppsa", "LSTM 16 1034 12 20 linear"] and forward[3] == "16x1x1 x 32x1x1"
    assert forward[4:8] == ["1034.0", "67%", "1000", "300"]  # us, share, ns / step, warp instructions / step
    assert (
        forward[8] == "-"
        and forward[9] == "short_scoreboard 4.0, wait 2.2, long_scoreboard 1.5, selected 1.0"
    )
    assert backward[4:10] == ["517.0", "33%", "500", "-", "6.5", "-"]


def _cuda_runner(tmp_path: Path, monkeypatch, budget: float = 1e4, device: str = "cuda"):
    """A runner on a (stood-in) GPU whose clock stands still at 0: ``budget`` seconds are left throughout."""
    monkeypatch.setattr(stalls, "header", lambda runner, title: f"# {title}\n\n")  # no GPU to name
    return runner_module.Runner(device, None, deadline=budget, clock=lambda: 0.0, results=tmp_path)


def _written_rows(tmp_path: Path) -> list[list[str]]:
    """The body rows of the written table, cell by cell."""
    lines = [line for line in (tmp_path / "cuda-stalls.md").read_text().splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_stage_profiles_every_module_and_workload_and_writes_the_table(tmp_path, monkeypatch):
    commands = []

    def ncu(command, timeout):
        commands.append(command)
        return 0, NCU_OUTPUT

    done = stalls.stalls_stage(_cuda_runner(tmp_path, monkeypatch), ncu="/opt/ncu", run=ncu)
    assert len(commands) == len(stalls.STALL_WORKLOADS) * len(stalls.MODULES)
    first = commands[0]
    assert first[:5] == ["/opt/ncu", "--csv", "--profile-from-start", "off", "--metrics"]
    assert first[5].split(",") == list(stalls.METRICS)
    assert first[-8:] == ["--run", "bppsa", "GRU", "16", "1034", "12", "20", "linear"]
    assert commands[-1][-8:] == ["--run", "cudnn", "RNN", "16", "1000", "1", "128", "linear"]
    rows = _written_rows(tmp_path)
    assert rows == [[cell.strip() for cell in row] for row in done] and len(rows) == 2 * len(commands)


def test_a_refused_stall_metric_is_retried_without_the_stall_metrics_and_said(tmp_path, monkeypatch):
    def ncu(command, timeout):
        if _stall("wait") in command[5]:
            return 1, "==ERROR== Failed to find metric smsp__average_warps_issue_stalled_wait"
        return 0, NCU_OUTPUT

    stalls.stalls_stage(_cuda_runner(tmp_path, monkeypatch), ncu="/opt/ncu", run=ncu)
    text = (tmp_path / "cuda-stalls.md").read_text()
    assert "without the stall metrics (exit 1: ==ERROR== Failed to find metric" in text
    assert len(_written_rows(tmp_path)) == 2 * len(stalls.STALL_WORKLOADS) * len(stalls.MODULES)


def test_a_profile_that_gives_nothing_says_why(tmp_path, monkeypatch):
    def ncu(command, timeout):
        return (
            1,
            "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters",
        )

    done = stalls.stalls_stage(_cuda_runner(tmp_path, monkeypatch), ncu="/opt/ncu", run=ncu)
    assert len(done) == len(stalls.STALL_WORKLOADS) * len(stalls.MODULES)
    assert all(row[2].startswith("exit 1: ==ERROR== ERR_NVGPUCTRPERM") and "without the stall metrics" in row[2]
               for row in done)  # fmt: skip


@pytest.mark.parametrize(("device", "which", "expected"), [("cpu", "/opt/ncu", "n/a: no CUDA"),
                                                           ("cuda", None, "n/a: ncu not found")])  # fmt: skip
def test_without_cuda_or_ncu_nothing_runs_and_the_table_says_so(
    tmp_path, monkeypatch, device, which, expected
):
    runner = _cuda_runner(tmp_path, monkeypatch, device=device)
    monkeypatch.setattr(stalls.shutil, "which", lambda name: which)
    ran = []
    done = stalls.stalls_stage(runner, run=lambda *a: ran.append(a))
    assert not ran and {row[2] for row in done} == {expected}


def test_out_of_time_profiles_are_written_as_skipped(tmp_path, monkeypatch):
    runner = _cuda_runner(tmp_path, monkeypatch, budget=-1.0)
    done = stalls.stalls_stage(runner, ncu="/opt/ncu", run=lambda *a: pytest.fail("ran past the deadline"))
    assert {row[2] for row in done} == {runner_module.SKIPPED}
