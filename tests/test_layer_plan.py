"""The layer plan's once-per-shape decision: model, measurement (injected timer), cache, tracing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

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
def measuring():
    with layer_plan.measurements(True):
        yield
    layer_plan.forget()


def test_first_call_measures_later_calls_read_the_cache(measuring):
    measure = Counter({"scan": 2e-3, "autograd": 1e-3})
    first = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)  # the model would take the scan
    again = plan_layer(SHAPE, lambda: (1.0e-3, 1.2e-3), measure)
    assert measure.calls == 1 and first == again
    assert first.path == "autograd" and first.reason.startswith("measured: scan 2 ms vs torch 1 ms")


def test_sure_or_too_large_shapes_are_not_measured(measuring):
    measure = Counter({"scan": 1.0, "autograd": 0.0})
    sure = plan_layer(SHAPE, lambda: (1e-3, 5e-3), measure)  # 5x apart: the model decides
    large = plan_layer(dataclasses.replace(SHAPE, device="cuda:1"), lambda: (2.0, 2.5), measure)
    assert measure.calls == 0
    assert sure == LayerPlan("scan", "cost model: scan 1 ms vs torch 5 ms a step")
    assert large.path == "scan" and "too large to time twice" in large.reason


def test_nothing_is_measured_or_cached_while_tracing_and_a_cached_decision_survives_it(monkeypatch, measuring):
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


def test_the_module_runs_what_the_measurement_chose_and_the_call_draws_the_same_dropout(monkeypatch, measuring):
    timed = []

    def timer_for(device):
        def timer(fn):
            fn()
            timed.append(fn)
            return 1e-3 if len(timed) % 2 == 0 else 2e-3  # turns: scan first (2 ms), then torch (1 ms)

        return timer

    monkeypatch.setattr(recurrent, "device_timer", timer_for)
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
    path, reason = rnn._path(x, None)
    plan_module._choose.cache_clear()
    assert path == "autograd" and reason.startswith("auto on CUDA without the scan's kernels (torch implementation")
