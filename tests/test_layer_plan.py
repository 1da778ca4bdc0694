"""The layer plan's once-per-shape decision: model, measurement (injected timer), cache, tracing."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning_bppsa.kernels import _build, cupy_loader

from lightning_bppsa import layer_plan
from lightning_bppsa import nn as bnn
from lightning_bppsa.layer_plan import LayerPlan, LayerShape, plan_layer, time_candidates
from lightning_bppsa.nn import recurrent

SHAPE = LayerShape("RNN_TANH", 1, 1, 16, 1000, 1, 20, torch.float32, "cuda:0")


class Counter:
    def __init__(self, times: dict[str, float]):
        self.times, self.calls = times, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return self.times


@pytest.fixture
def measuring(monkeypatch):
    """Measured decisions allowed, in this process only (the on-disk cache has its own tests below)."""
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    with layer_plan.measurements(True):
        yield
    layer_plan.forget()


def test_first_call_measures_later_calls_read_the_cache(measuring):
    measure = Counter({"scan": 2e-3, "autograd": 1e-3})
    first = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)  # the model would take the scan
    again = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)
    assert measure.calls == 1 and first == again
    assert first.path == "autograd" and first.reason.startswith("measured: scan 2 ms vs torch 1 ms")


@pytest.mark.parametrize(
    "scan_ms, path",
    [(0.97, "autograd"), (0.955, "autograd"), (0.95, "scan"), (0.5, "scan"), (1.0, "autograd"), (1.2, "autograd")],
)
def test_a_measured_scan_must_win_by_the_margin(measuring, scan_ms, path):
    """Against torch's 1 ms, the scan is kept only where at least SCAN_MARGIN (5%) faster: a near-tie, within
    one measurement's noise, keeps torch's layer."""
    assert layer_plan.SCAN_MARGIN == 1.05
    plan = plan_layer(SHAPE, lambda: (1.0e-3, 1.1e-3), Counter({"scan": scan_ms * 1e-3, "autograd": 1e-3}))
    assert plan.path == path and plan.reason.startswith("measured: ")


#: a host-bound CUDA step: eagerly cuDNN's is the faster, the GPU's time alone the scan's (3x)
HOST_BOUND = {"scan": 1.86e-3, "autograd": 1.56e-3, "scan queued": 0.24e-3, "autograd queued": 0.74e-3}


def test_a_call_inside_a_cuda_graph_capture_runs_the_faster_path_on_the_gpus_time_alone(measuring, monkeypatch):
    """A measurement with the GPU's time of each path queued (CUDA) decides two things: eager calls by the eager
    times (host included: cuDNN's layer here), calls inside a CUDA graph capture by the GPU's alone (a graph
    replays no host work: the scan here, with the margin a near-tie needs); measured once, read from the
    cache in both. Without queued times a capture runs the eager decision."""
    capturing = {"now": False}
    monkeypatch.setattr(layer_plan, "capturing", lambda: capturing["now"])
    measure = Counter(HOST_BOUND)
    eager = plan_layer(SHAPE, unsure, measure)
    assert eager.path == "autograd" and eager.reason == "measured: scan 1.86 ms vs torch 1.56 ms a step"
    capturing["now"] = True
    captured = plan_layer(SHAPE, unsure, measure)
    assert captured == eager.captured and captured.path == "scan" and measure.calls == 1
    assert captured.reason == (
        "measured, inside a CUDA graph capture (the GPU's time alone): scan 0.24 ms vs torch 0.74 ms a step"
    )
    capturing["now"] = False
    assert plan_layer(SHAPE, unsure, measure) is eager and measure.calls == 1
    tie = Counter({**HOST_BOUND, "scan queued": 0.72e-3})  # within SCAN_MARGIN: torch's layer
    assert plan_layer(dataclasses.replace(SHAPE, batch=32), unsure, tie).captured.path == "autograd"
    eager_only = plan_layer(dataclasses.replace(SHAPE, batch=64), unsure, Counter({"scan": 1e-3, "autograd": 2e-3}))
    capturing["now"] = True
    assert eager_only.captured is None and plan_layer(dataclasses.replace(SHAPE, batch=64), unsure, never) == eager_only


def test_a_cuda_measurement_times_each_path_eagerly_and_queued_and_leaves_out_one_that_raised(monkeypatch):
    """On CUDA each path's step is timed by both timers (eager, then queued: no second warm-up); a path whose
    warm-up raised is inf in both (never run again). The device is a label here: injected timers, CPU tensors."""
    runs = []
    monkeypatch.setattr(
        layer_plan, "device_timer", lambda device, queued=False: lambda fn: runs.append(queued) or fn() or (0.5 if queued else 1.0)
    )
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: contextlib.nullcontext())
    weight = torch.ones(3, requires_grad=True)

    def raises():
        raise RuntimeError("no kernel for this dtype")

    times = layer_plan.time_training_steps(
        {"scan": raises, "autograd": lambda: (weight * 2).sum()}, [weight], torch.device("cuda")
    )
    assert times == {"scan": math.inf, "autograd": 1.0, "scan queued": math.inf, "autograd queued": 0.5}
    assert runs == [False, False, True, True]  # two timed runs each way, of the path that ran
    monkeypatch.delattr(torch.cuda, "_sleep")  # private: where a torch lacks it, the eager times alone
    times = layer_plan.time_training_steps({"autograd": lambda: (weight * 2).sum()}, [weight], torch.device("cuda"))
    assert times == {"autograd": 1.0}


class Sequence:
    """A measure returning each of ``times`` in turn."""

    def __init__(self, *times: dict[str, float]):
        self.times, self.calls = times, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return self.times[self.calls - 1]


def test_a_near_tie_is_measured_again_and_the_faster_of_each_paths_two_measurements_decides(measuring):
    """Two paths measured within RETIME (15%) of each other are measured once more: a scan that measured 1.66 ms
    against torch's 1.68 (kept torch's layer) and 1.44 the second time runs the scan; a clear first measurement
    is not repeated."""
    assert layer_plan.RETIME == 1.15
    tie = Sequence({"scan": 1.66e-3, "autograd": 1.68e-3}, {"scan": 1.44e-3, "autograd": 1.70e-3})
    plan = plan_layer(SHAPE, lambda: (1.0e-3, 1.1e-3), tie)
    assert tie.calls == 2 and plan.path == "scan"
    assert plan.reason == "measured: scan 1.44 ms vs torch 1.68 ms a step (a near-tie: timed twice)"
    clear = Sequence({"scan": 1.0e-3, "autograd": 1.2e-3}, {"scan": 9.0, "autograd": 9.0})
    plan = plan_layer(dataclasses.replace(SHAPE, batch=32), lambda: (1.0e-3, 1.1e-3), clear)
    assert clear.calls == 1 and plan.reason == "measured: scan 1 ms vs torch 1.2 ms a step"
    # a near-tie whose second measurement would take more than the budget is not measured again
    costly = Sequence({"scan": 1.3, "autograd": 1.4}, {"scan": 0.1, "autograd": 9.0})
    plan = plan_layer(dataclasses.replace(SHAPE, batch=64), lambda: "no model", costly)
    assert 3 * (1.3 + 1.4) > layer_plan.MEASURE_BUDGET_SECONDS
    assert costly.calls == 1 and plan.reason == "measured: scan 1.3e+03 ms vs torch 1.4e+03 ms a step"


def test_sure_or_too_large_shapes_are_not_measured(measuring):
    measure = Counter({"scan": 1.0, "autograd": 0.0})
    sure = plan_layer(SHAPE, lambda: (1e-3, 5e-3), measure)  # 5x apart: the model decides
    large = plan_layer(dataclasses.replace(SHAPE, device="cuda:1"), lambda: (2.0, 2.5), measure)
    assert measure.calls == 0
    assert sure == LayerPlan("scan", "cost model: scan 1 ms vs torch 5 ms a step")
    assert large.path == "scan" and "too large to time twice" in large.reason


def test_nothing_is_measured_or_cached_while_tracing_and_a_cached_decision_survives_it(
    monkeypatch, measuring
):
    measure = Counter({"scan": 2e-3, "autograd": 1e-3})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)
    assert measure.calls == 0 and traced.path == "scan" and "while tracing" in traced.reason
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    eager = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)  # not cached by the traced call
    assert measure.calls == 1 and eager.path == "autograd"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure) == eager and measure.calls == 1


def test_time_candidates_warms_up_then_keeps_each_ones_fastest_run_taking_turns():
    order, clock = [], iter([5.0, 3.0, 4.0, 6.0])

    def timer(fn):
        fn()
        return next(clock)

    times = time_candidates({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, timer)
    assert order == ["a", "b", "a", "b", "a", "b"]  # one warm-up each, then turns
    assert times == {"a": 4.0, "b": 3.0}


def test_the_module_runs_what_the_measurement_chose_and_the_call_draws_the_same_dropout(
    monkeypatch, measuring
):
    timed = []

    def timer_for(device):
        def timer(fn):
            fn()
            timed.append(fn)
            return 1e-3 if len(timed) % 2 == 0 else 2e-3  # turns: scan first (2 ms), then torch (1 ms)

        return timer

    monkeypatch.setattr(layer_plan, "device_timer", timer_for)
    monkeypatch.setattr(recurrent, "_predict", lambda shape: (1.0e-3, 1.2e-3))  # unsure: measure
    torch.manual_seed(1)
    ours = bnn.RNN(3, 8, num_layers=2, dropout=0.5, batch_first=True, dtype=torch.float64)
    twin = torch.nn.RNN(3, 8, num_layers=2, dropout=0.5, batch_first=True, dtype=torch.float64)
    twin.load_state_dict(ours.state_dict())
    x = torch.randn(4, 9, 3, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    out = ours(x)[0]
    torch.manual_seed(7)
    expected = twin(x)[0]
    assert len(timed) == 4  # two timed turns of each path
    assert ours.last_stats["path"] == "autograd" and ours.last_stats["decision"].startswith("measured")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the measurement left the dropout draw alone
    grads = torch.autograd.grad(out.sum(), [x, *ours.parameters()])
    expected_grads = torch.autograd.grad(expected.sum(), [x, *twin.parameters()])
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    ours(x)  # the same shape again: no second measurement
    assert len(timed) == 4


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")
@pytest.mark.parametrize("faster", ["forward kernel", "autograd"])
def test_inference_on_the_cuda_kernels_runs_the_forward_measured_faster(monkeypatch, measuring, cuda_on_cpu, faster):
    """Without gradients a layer whose forward the CUDA kernels take (their host emulation here) runs the forward
    kernel alone or torch's forward, whichever the first call of the shape measured faster (once; an injected
    clock), with torch's outputs either way; a shape nothing may measure runs torch's forward."""
    timed = []

    def timer_for(device):
        def timer(fn):
            fn()
            timed.append(fn)
            kernel_turn = len(timed) % 2 == 1  # turns: the forward kernel first, then torch's forward
            return 1e-3 if kernel_turn == (faster == "forward kernel") else 3e-3

        return timer

    monkeypatch.setattr(layer_plan, "device_timer", timer_for)
    torch.manual_seed(0)
    ours = bnn.GRU(3, 6, num_layers=2, batch_first=True).eval()
    twin = torch.nn.GRU(3, 6, num_layers=2, batch_first=True).eval()
    twin.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 3)
    for _ in range(2):
        with torch.no_grad():
            got, want = ours(x), twin(x)
        assert ours.last_stats["path"] == faster and len(timed) == 4, (ours.last_stats, len(timed))
        assert ours.last_stats["decision"].startswith("measured: scan "), ours.last_stats
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with layer_plan.measurements(False), torch.no_grad():
        ours(torch.randn(3, 5, 3))
    assert ours.last_stats["path"] == "autograd" and "not measured (measurements off)" in ours.last_stats["decision"]
    monkeypatch.setattr(recurrent, "_predict", lambda shape: (math.inf, 3.0))  # cuDNN's step modelled at 3 s
    with torch.no_grad():
        ours(torch.randn(4, 5, 3))
    assert ours.last_stats["path"] == "autograd" and "not measured (cannot measure)" in ours.last_stats["decision"]
    assert len(timed) == 4


def test_a_candidate_that_raises_is_ruled_out_and_all_raising_raises():
    def broken():
        raise RuntimeError("could not create a primitive descriptor")

    times = time_candidates({"scan": lambda: None, "autograd": broken}, lambda fn: (fn(), 1.0)[1])
    assert times == {"scan": 1.0, "autograd": float("inf")}
    with pytest.raises(RuntimeError, match="primitive descriptor"):
        time_candidates({"scan": broken, "autograd": broken}, lambda fn: 1.0)


def test_a_module_asks_the_plan_once_per_shape_until_the_cache_is_forgotten(monkeypatch):
    asked = []
    real = layer_plan.plan_layer

    def counting(shape, predict, measure):
        asked.append(shape)
        return real(shape, predict, measure)

    monkeypatch.setattr(layer_plan, "plan_layer", counting)
    rnn = bnn.RNN(2, 4, batch_first=True)
    x = torch.randn(3, 5, 2, requires_grad=True)
    for _ in range(3):
        rnn(x)
    assert len(asked) == 1
    rnn(torch.randn(3, 6, 2, requires_grad=True))  # another shape: asked
    layer_plan.forget()
    rnn(x)  # forgotten: asked again
    assert len(asked) == 3


def test_on_cuda_without_the_scans_kernels_auto_keeps_torchs_layer_and_says_why(monkeypatch):
    from lightning_bppsa import plan as plan_module

    rnn = bnn.RNN(2, 4, batch_first=True)
    x = torch.randn(3, 5, 2, requires_grad=True)
    # the layer on a CPU tensor, planned as if it were on a CUDA device whose kernels cannot load
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(recurrent, "_predict", lambda shape: pytest.fail("no model without the kernels"))
    path, reason, _ = rnn._path(x, None)
    plan_module._choose.cache_clear()
    assert path == "autograd" and reason.startswith(
        "auto on CUDA without the scan's kernels (torch implementation"
    )


# --------------------------------------------------------------------------------------------------
# Measured decisions on disk
# --------------------------------------------------------------------------------------------------

CPU_SHAPE = LayerShape("GRU", 1, 1, 16, 300, 4, 64, torch.float32, "cpu")


@pytest.fixture
def disk(monkeypatch, tmp_path):
    """Measuring on, the on-disk plan cache on (``BPPSA_PLAN_CACHE=1``), in a private cache directory of this test (the fallback for a
    refused one too); the process's memory of the cache's files and warnings emptied."""
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "1")
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # _build's fallback for a refused cache: ~/.cache/...
    monkeypatch.setattr(_build, "_REPLACED", {})
    monkeypatch.setattr(layer_plan, "_warned", set())
    layer_plan.forget()
    with layer_plan.measurements(True):
        yield tmp_path / "cache"
    layer_plan.forget()


class Clocked:
    """``measure`` of :func:`plan_layer`: both paths timed by :func:`time_candidates` with an injected clock
    (scan 2 ms, torch 1 ms); counts the measurements."""

    def __init__(self, scan: float = 2e-3, autograd: float = 1e-3) -> None:
        self.seconds, self.calls = {"scan": scan, "autograd": autograd}, 0

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        ran = []

        def timer(fn) -> float:
            fn()
            return self.seconds[ran[-1]]

        return time_candidates({name: (lambda name=name: ran.append(name)) for name in self.seconds}, timer)


def unsure() -> tuple[float, float]:
    return 1.0e-3, 1.2e-3  # the model leans to the scan, unsure: a call measures


def never() -> dict[str, float]:
    pytest.fail("measured although the decision is on disk")


def plan_files(cache) -> list:
    return sorted(cache.glob("layer-plans-*.json"))


def test_a_measured_decision_is_read_back_from_disk_without_measuring(disk):
    clocked = Clocked()
    first = plan_layer(CPU_SHAPE, unsure, clocked)
    assert clocked.calls == 1 and first == LayerPlan("autograd", "measured: scan 2 ms vs torch 1 ms a step")
    (path,) = plan_files(disk)
    assert stat.S_IMODE(os.stat(disk).st_mode) == 0o700 and not stat.S_IMODE(os.stat(path).st_mode) & 0o022
    layer_plan.forget()  # this process forgets: the disk still knows
    again = plan_layer(CPU_SHAPE, unsure, never)
    assert again == LayerPlan("autograd", "measured: scan 2 ms vs torch 1 ms a step (on-disk plan cache)")
    assert layer_plan.cached(CPU_SHAPE)  # and kept in memory: the next call reads no file
    other = dataclasses.replace(CPU_SHAPE, batch=32)
    assert plan_layer(other, unsure, Clocked(scan=1e-3, autograd=3e-3)).path == "scan"  # a new shape measures
    layer_plan.forget()
    assert plan_layer(other, unsure, never).path == "scan" and plan_files(disk) == [
        path
    ]  # one file per setup


def test_a_second_process_reads_the_decision_without_measuring(disk):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    script = textwrap.dedent(
        f"""
        import sys, torch
        torch.set_num_threads({torch.get_num_threads()})  # the thread count is part of a CPU setup
        from lightning_bppsa import layer_plan
        from lightning_bppsa.layer_plan import LayerShape
        shape = LayerShape("GRU", 1, 1, 16, 300, 4, 64, torch.float32, "cpu")
        def measure():
            sys.exit("measured")
        print(layer_plan.plan_layer(shape, lambda: (1.0e-3, 1.2e-3), measure))
        """
    )
    env = {**os.environ, "BPPSA_CACHE_DIR": str(disk)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = LayerPlan("autograd", "measured: scan 2 ms vs torch 1 ms a step (on-disk plan cache)")
    assert result.stdout.strip() == repr(expected)


@pytest.mark.parametrize(
    "change",
    ["torch", "package", "code", "threads", "cpu"],
)
def test_a_changed_setup_measures_again(disk, monkeypatch, change):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    layer_plan.forget()
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0.0")
    elif change == "package":
        monkeypatch.setattr(layer_plan, "_package_version", lambda: "0.2.0")
    elif change == "code":
        monkeypatch.setattr(layer_plan, "_code_digest", lambda: "an-edited-kernel")
    elif change == "threads":
        threads = torch.get_num_threads() + 1
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    else:
        monkeypatch.setattr(layer_plan, "_device_name", lambda device: "Another CPU")
    clocked = Clocked(scan=1e-3, autograd=2e-3)  # faster scan on the new setup
    assert plan_layer(CPU_SHAPE, unsure, clocked).path == "scan" and clocked.calls == 1
    assert len(plan_files(disk)) == 2  # the first setup's file stays for it
    monkeypatch.undo()  # back to the first setup (and its fixture's cache, on, in its directory)
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "1")
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(disk))
    layer_plan.forget()
    with layer_plan.measurements(True):
        assert plan_layer(CPU_SHAPE, unsure, never).path == "autograd"


def test_a_cuda_setup_is_keyed_by_device_name_and_cuda_and_cupy_versions(disk, monkeypatch):
    shape = dataclasses.replace(CPU_SHAPE, device="cuda:0")
    monkeypatch.setattr(layer_plan, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cupy_loader, "cupy_version", lambda: "14.0.0")
    plan_layer(shape, unsure, Clocked())
    (path,) = plan_files(disk)
    environment = json.loads(path.read_text())["environment"]
    assert environment["device"] == "NVIDIA H100 80GB HBM3" and environment["cupy"] == "14.0.0"
    assert {"cuda", "torch", "package", "code"} <= set(environment) and "threads" not in environment
    layer_plan.forget()
    assert (
        plan_layer(dataclasses.replace(shape, device="cuda:1"), unsure, never).path == "autograd"
    )  # same name
    layer_plan.forget()
    monkeypatch.setattr(cupy_loader, "cupy_version", lambda: "14.1.0")
    clocked = Clocked()
    plan_layer(shape, unsure, clocked)
    assert clocked.calls == 1 and len(plan_files(disk)) == 2


def test_the_queued_times_are_kept_on_disk_with_the_eager_ones(disk, monkeypatch):
    """A CUDA decision's file entry holds the four times; read back, calls inside a capture get the scan the GPU's
    time chose, saying it came from the cache."""
    shape = dataclasses.replace(CPU_SHAPE, device="cuda:0")
    monkeypatch.setattr(layer_plan, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cupy_loader, "cupy_version", lambda: "14.0.0")
    plan_layer(shape, unsure, Counter(HOST_BOUND))
    (path,) = plan_files(disk)
    (entry,) = json.loads(path.read_text())["decisions"].values()
    assert entry == HOST_BOUND
    layer_plan.forget()
    assert plan_layer(shape, unsure, never).path == "autograd"  # an eager call reads it
    monkeypatch.setattr(layer_plan, "capturing", lambda: True)
    read = plan_layer(shape, unsure, never)
    assert read.path == "scan" and read.reason.endswith("a step (on-disk plan cache)"), read


def refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    "damage",
    ['{"format": 1, "environment": {', "not utf-8", "[]", '{"format": 2}', "environment", "entries"],
)
def test_a_corrupted_file_is_ignored_with_one_warning_and_rewritten(disk, caplog, damage):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    (path,) = plan_files(disk)
    document = json.loads(path.read_text())
    if damage == "environment":  # a file of another setup under this setup's name
        document["environment"]["torch"] = "0.0.1"
        path.write_text(json.dumps(document))
    elif damage == "entries":
        (key,) = document["decisions"]
        document["decisions"][key] = {"scan": float("nan"), "autograd": 1e-3}
        document["decisions"]["bad"] = {"scan": -1.0, "autograd": 1e-3}
        document["decisions"]["worse"] = "fast"
        path.write_text(json.dumps(document))
    elif damage == "not utf-8":
        path.write_bytes(b"\xff\xfe not text")
    else:
        path.write_text(damage)
    layer_plan.forget()
    caplog.set_level(logging.WARNING, logger="lightning_bppsa.layer_plan")
    clocked = Clocked(scan=1e-3, autograd=2e-3)
    assert plan_layer(CPU_SHAPE, unsure, clocked).path == "scan" and clocked.calls == 1  # measured again
    (message,) = refusals(caplog)
    assert message.startswith("lightning_bppsa: ignoring ") and str(path) in message
    rewritten = json.loads(path.read_text())  # replaced by a valid file holding the new measurement
    assert list(rewritten["decisions"].values()) == [{"scan": 1e-3, "autograd": 2e-3}]
    layer_plan.forget()
    assert plan_layer(CPU_SHAPE, unsure, never).path == "scan" and len(refusals(caplog)) == 1


@pytest.mark.parametrize("foreign", ["writable by others", "owned by another user"])
def test_a_file_another_user_could_have_planted_is_refused_with_a_warning(disk, caplog, monkeypatch, foreign):
    if foreign == "owned by another user" and os.geteuid() != 0:
        pytest.skip("making a file another user's needs root")
    plan_layer(CPU_SHAPE, unsure, Clocked(scan=1e-3, autograd=2e-3))  # the scan, on disk
    (path,) = plan_files(disk)
    if foreign == "writable by others":
        path.chmod(0o666)
    else:
        os.chown(path, 4242, 4242)
    planted = path.read_bytes()
    layer_plan.forget()
    caplog.set_level(logging.WARNING)
    clocked = Clocked()
    assert (
        plan_layer(CPU_SHAPE, unsure, clocked).path == "autograd" and clocked.calls == 1
    )  # not read: measured
    (message,) = refusals(caplog)
    assert f"refusing the kernel cache {path}" in message
    assert (
        path.read_bytes() == planted
    )  # left alone; this process now keeps its cache in the private fallback
    fallback = _build.cache_dir()
    assert fallback != disk and plan_files(fallback)


@pytest.mark.parametrize("setting", ["0", "unset"])
def test_off_by_default_or_by_the_environment_nothing_is_read_or_written(disk, monkeypatch, setting):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    layer_plan.forget()
    if setting == "unset":
        monkeypatch.delenv("BPPSA_PLAN_CACHE")
    else:
        monkeypatch.setenv("BPPSA_PLAN_CACHE", setting)
    before = plan_files(disk)[0].read_bytes()
    clocked = Clocked(scan=1e-3, autograd=2e-3)
    assert plan_layer(CPU_SHAPE, unsure, clocked).path == "scan" and clocked.calls == 1  # not read
    assert plan_files(disk)[0].read_bytes() == before  # not written


def test_nothing_is_read_from_disk_while_tracing_or_with_measurements_off(disk, monkeypatch):
    plan_layer(CPU_SHAPE, unsure, Clocked())  # autograd measured faster; the model leans to the scan
    layer_plan.forget()
    monkeypatch.setattr(layer_plan, "_disk_read", lambda shape: pytest.fail("read the disk"))
    with layer_plan.measurements(False):
        assert plan_layer(CPU_SHAPE, unsure, never).path == "scan"  # the model: deterministic in tests
    layer_plan.forget()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "while tracing" in plan_layer(CPU_SHAPE, unsure, never).reason


def test_decisions_of_other_processes_are_merged_not_overwritten(disk):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    (path,) = plan_files(disk)
    document = json.loads(path.read_text())  # another process adds a shape after this one read the file
    document["decisions"]["LSTM layers=1 directions=1 B=1 T=9 input=1 H=1 torch.float64"] = {
        "scan": 1.0,
        "autograd": 2.0,
    }
    path.write_text(json.dumps(document))
    plan_layer(dataclasses.replace(CPU_SHAPE, batch=8), unsure, Clocked())
    assert len(json.loads(path.read_text())["decisions"]) == 3


def test_an_unwritable_cache_warns_once_and_keeps_the_decision_in_memory(disk, monkeypatch, caplog):
    def full(target, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_build, "write_private", full)
    caplog.set_level(logging.WARNING, logger="lightning_bppsa.layer_plan")
    for batch in (CPU_SHAPE.batch, 2):
        plan = plan_layer(dataclasses.replace(CPU_SHAPE, batch=batch), unsure, Clocked())
        assert plan.path == "autograd"
    (message,) = refusals(caplog)
    assert "cannot be written (OSError: [Errno 28] No space left on device)" in message
    assert plan_layer(CPU_SHAPE, unsure, never).path == "autograd" and not plan_files(disk)


def test_forget_disk_deletes_the_measured_decisions(disk):
    plan_layer(CPU_SHAPE, unsure, Clocked())
    layer_plan.forget(disk=True)
    assert not plan_files(disk)
    clocked = Clocked()
    plan_layer(CPU_SHAPE, unsure, clocked)
    assert clocked.calls == 1


def test_a_shape_kept_in_memory_only_is_neither_written_nor_read(disk):
    memory_only = dataclasses.replace(CPU_SHAPE, persist=False)
    plan_layer(memory_only, unsure, Clocked())
    assert not plan_files(disk)  # measured, not written
    plan_layer(CPU_SHAPE, unsure, Clocked())  # the same fields, persisted: written
    layer_plan.forget()
    clocked = Clocked(scan=1e-3, autograd=2e-3)
    assert plan_layer(memory_only, unsure, clocked).path == "scan" and clocked.calls == 1  # not read


def test_no_test_writes_a_plan_cache_unless_it_opts_in(monkeypatch):
    """tests/conftest.py keeps the cache off, whatever the environment running the tests says."""
    monkeypatch.setattr(_build, "write_private", lambda target, text: pytest.fail(f"wrote {target}"))
    with layer_plan.measurements(True):
        assert plan_layer(CPU_SHAPE, unsure, Clocked()).reason == "measured: scan 2 ms vs torch 1 ms a step"


# --------------------------------------------------------------------------------------------------
# Callers without a model (a user cell), and measurements that find something else
# --------------------------------------------------------------------------------------------------


def no_model() -> str:
    return "no cost model for this cell"


def test_without_a_model_the_call_measures_else_runs_torchs_path_and_says_why(monkeypatch, measuring):
    clocked = Clocked(scan=1e-3, autograd=2e-3)
    timed = "for a backward through 9 steps"
    assert plan_layer(SHAPE, no_model, clocked, timed=timed) == LayerPlan(
        "scan", f"measured: scan 1 ms vs torch 2 ms {timed}"
    )
    assert plan_layer(SHAPE, no_model, never, timed=timed).path == "scan" and clocked.calls == 1
    other = dataclasses.replace(SHAPE, batch=2)
    with layer_plan.measurements(False):
        assert plan_layer(other, no_model, never) == LayerPlan(
            "autograd", "no cost model for this cell; not measured (measurements off): torch's path"
        )
    layer_plan.forget()
    assert plan_layer(other, no_model, None).reason.endswith("not measured (cannot measure): torch's path")
    layer_plan.forget()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = plan_layer(other, no_model, never)
    assert traced == LayerPlan(
        "autograd", "no cost model for this cell; not measured (while tracing): torch's path"
    )
    assert not layer_plan.cached(other)  # an eager call measures it


def test_a_measurement_that_raises_leaves_nothing_cached_nor_written(disk):
    class Found(Exception):
        pass

    def finds() -> dict[str, float]:
        raise Found("the cell draws random numbers")

    with pytest.raises(Found):
        plan_layer(CPU_SHAPE, no_model, finds)
    assert not layer_plan.cached(CPU_SHAPE) and not plan_files(disk)
    clocked = Clocked()
    assert plan_layer(CPU_SHAPE, no_model, clocked).path == "autograd" and clocked.calls == 1
