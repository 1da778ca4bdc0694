"""Scan steps replayed from CUDA graphs (``lightning_bppsa.nn._replay``) on the GPU: an ``"auto"`` module whose
decision is the scan captures its step's forward and backward once per call key and replays them; every step's
gradients must be torch's (float64, cuDNN's layer on the same device), on new data each step, with the last
step's outputs still held (a second graph), after an output modified in place (the eager recompute: on a GPU
the backward graph would read the modified output), and with gradients accumulated over steps. Emulated (no
GPU), the same bodies run over :func:`lightning_bppsa.testing.graphs_on_cpu`."""

from contextlib import nullcontext

import pytest
import torch

import lightning_bppsa.nn as bnn
from lightning_bppsa import layer_plan
from lightning_bppsa.nn import _replay, recurrent
from lightning_bppsa.testing import assert_derived_close, graphs_on_cpu


@pytest.fixture
def replaying(backend, monkeypatch):
    """"auto" decides for the scan (the model patched sure, nothing measured); the graphs (emulated off a GPU)."""
    monkeypatch.setattr(recurrent, "_predict", lambda shape: (1e-3, 1e-2))
    layer_plan.forget()
    with nullcontext() if backend.is_cuda else graphs_on_cpu(), layer_plan.measurements(False):
        yield backend
    layer_plan.forget()


def _pair(kind, device):
    torch.manual_seed(0)
    ours = getattr(bnn, kind)(3, 20, num_layers=2, batch_first=True, algorithm="auto", dtype=torch.float64)
    ref = getattr(torch.nn, kind)(3, 20, num_layers=2, batch_first=True, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    return ours.to(device), ref.to(device)


def _check(ours, ref):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert_derived_close(p.grad, q.grad, name=name)


@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_replayed_steps_give_torchs_gradients_on_new_data(replaying, kind):
    device = replaying.device
    ours, ref = _pair(kind, device)
    out = None
    for step in range(5):
        x = torch.randn(4, 64, 3, device=device, dtype=torch.float64)
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out, _ = ours(x)  # the last step's output is held while this forward runs: two graphs alternate
        (out[:, -1] ** 2).sum().backward()
        expected, _ = ref(x)
        (expected[:, -1] ** 2).sum().backward()
        assert_derived_close(out, expected, name="output")
        _check(ours, ref)
        assert ("replayed from CUDA graphs" in ours.last_stats["plan"]) == (step > 0), ours.last_stats["plan"]
    assert len(_replay.kept(ours)) == 2


def test_an_in_place_change_and_accumulated_gradients_match_torch(replaying):
    device = replaying.device
    ours, ref = _pair("GRU", device)
    x = torch.randn(4, 64, 3, device=device, dtype=torch.float64)
    ours(x)
    ours(x)  # decided, then captured
    for modify in (True, False, True):  # no zeroing: the gradients add up over the three steps
        out, _ = ours(x)
        expected, _ = ref(x)
        assert "replayed from CUDA graphs" in ours.last_stats["plan"]
        if modify:
            out.mul_(3.0)
            expected.mul_(3.0)
        out.square().sum().backward()
        expected.square().sum().backward()
    _check(ours, ref)


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
def test_inference_replays_the_forward_kernel_with_torchs_outputs(replaying, kind, monkeypatch):
    """Without gradients (validation) a memoised forward-kernel call replays a forward graph; the decision for
    the forward kernel over cuDNN's forward forced (injected measurement: what it picks is the GPU's to say)."""
    device = replaying.device
    monkeypatch.setattr(recurrent._ScanRecurrent, "_measure_forward", lambda self, i, h: {"scan": 1e-3, "autograd": 2e-3})
    ours, ref = _pair(kind, device)
    ours.eval(), ref.eval()
    with torch.no_grad(), layer_plan.measurements(True):
        for step in range(4):
            x = torch.randn(4, 64, 3, device=device, dtype=torch.float64)
            out, _ = ours(x)
            assert_derived_close(out, ref(x)[0], name="output")
            assert ("replayed from CUDA graphs" in ours.last_stats["plan"]) == (step > 0), ours.last_stats["plan"]


def test_dropout_replays_draw_what_the_eager_scan_draws(replaying, monkeypatch):
    """Dropout between layers (training mode) replays: from the same seed a replayed step draws the masks the
    eager scan draws (on a GPU: torch's graph-safe RNG, a graph's random ops reading the generator's state at
    replay), so its output and gradients are the eager step's; an output modified in place recomputes the call
    with the masks its replay drew; two replays in a row draw afresh."""
    device = replaying.device
    torch.manual_seed(0)
    ours = bnn.LSTM(3, 20, num_layers=2, dropout=0.5, batch_first=True, algorithm="auto", dtype=torch.float64)
    ours = ours.to(device)
    x = torch.randn(4, 64, 3, device=device, dtype=torch.float64)

    def step(seed: int, change: bool) -> tuple[torch.Tensor, list[torch.Tensor], str]:
        ours.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the CPU's generator and every CUDA device's
        out, _ = ours(x)
        plan = ours.last_stats["plan"]
        if change:
            out.mul_(2.0)
        out.square().sum().backward()
        return out.detach().clone(), [p.grad.clone() for p in ours.parameters()], plan

    cases = [(seed, change) for seed in (1, 2) for change in (False, True)]
    with monkeypatch.context() as eager_only:
        eager_only.setattr(_replay, "REPLAY_ELEMENTS", 0)
        eager = {case: step(*case) for case in cases}
    step(0, False)
    step(0, False)  # decided, then captured
    for case in cases:
        out, grads, plan = step(*case)
        assert "replayed from CUDA graphs" in plan and "replayed" not in eager[case][2], (plan, eager[case][2])
        assert_derived_close(out, eager[case][0], name=f"output {case}")
        for (name, _), got, expected in zip(ours.named_parameters(), grads, eager[case][1], strict=True):
            assert_derived_close(got, expected, name=f"{name} {case}")
    torch.manual_seed(3)
    first = ours(x)[0].detach().clone()
    assert not torch.equal(first, ours(x)[0].detach()), "two replays drew the same masks"
