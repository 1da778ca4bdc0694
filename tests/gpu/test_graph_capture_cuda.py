"""Issue 29: a training step through the recurrent layers stays capturable in a CUDA graph.

On a GPU the whole step (zero the gradients, forward, loss, backward: the forward kernel, the scan's CuPy
launches, the torch ops around them) is captured once with ``torch.cuda.graph`` and replayed on new input
data; the replayed gradients must be eager's for that data (the chunked scan's look-back flags are the graph's
own, reset by a captured memset before every replay). ``torch.cuda.make_graphed_callables`` (forward and
backward graphed separately) is checked the same way, and so is ``torch.compile(mode="reduce-overhead")``
(the compiled forward and backward replayed from CUDA graphs by torch's cudagraph trees). Emulated (no GPU),
``graph_capture`` runs the body eagerly and the compiled layer runs without graphs: the same comparisons on
the CPU path.
"""

import pytest
import torch

import lightning_bppsa.nn as bnn


def _eager_grads(layer: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x)
    (out[:, -1] ** 2).sum().backward()
    return [p.grad.clone() for p in layer.parameters()]


def _close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_the_whole_step_replays_from_a_cuda_graph_with_eagers_gradients(backend, kind, algorithm):
    torch.manual_seed(0)
    layer = getattr(bnn, kind)(3, 8, batch_first=True, algorithm=algorithm).to(backend.device)
    first, second = (torch.randn(4, 50, 3, device=backend.device) for _ in range(2))
    expected_first, expected_second = _eager_grads(layer, first), _eager_grads(layer, second)
    assert layer.last_stats["plan"].startswith(f"scan {algorithm}")

    x = first.clone()  # the graph's static input
    with backend.side_stream():  # warm-up off the capturing stream, as torch.cuda.graph asks
        for _ in range(2):
            _eager_grads(layer, x)
    if backend.is_cuda:
        torch.cuda.synchronize()
    with backend.graph_capture() as replay:
        layer.zero_grad(set_to_none=False)  # the gradients' buffers exist: the replay refills them
        out, _ = layer(x)
        (out[:, -1] ** 2).sum().backward()
    replay()
    _close([p.grad for p in layer.parameters()], expected_first)
    if backend.is_cuda:  # a second replay on new data (emulated, the body ran once, eagerly)
        x.copy_(second)
        replay()
        torch.cuda.synchronize()
        _close([p.grad for p in layer.parameters()], expected_second)


@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_make_graphed_callables_gives_eagers_gradients(backend, kind):
    torch.manual_seed(1)
    layer = getattr(bnn, kind)(3, 8, batch_first=True, algorithm="linear").to(backend.device)
    data = [torch.randn(4, 50, 3, device=backend.device) for _ in range(2)]
    expected = [_eager_grads(layer, x) for x in data]
    # a module given to make_graphed_callables comes back with its forward graphed (same parameters)
    graphed = torch.cuda.make_graphed_callables(layer, (data[0],)) if backend.is_cuda else layer
    for x, grads in zip(data, expected, strict=True):
        _close(_eager_grads(graphed, x), grads)


@pytest.mark.parametrize("kind", ["RNN", "GRU"])
def test_reduce_overhead_compilation_gives_eagers_gradients(backend, kind):
    """Issue 29: ``torch.compile(mode="reduce-overhead")`` (CUDA graphs through torch's cudagraph trees on a
    GPU) of a layer whose scan runs, traced into the graph (dynamo's ``allow_rnn``; without it dynamo leaves
    every ``nn.RNN`` to eager mode): three steps on new data, each with eager's gradients."""
    torch.manual_seed(2)
    layer = getattr(bnn, kind)(3, 8, batch_first=True, algorithm="linear").to(backend.device)
    data = [torch.randn(4, 50, 3, device=backend.device) for _ in range(3)]
    expected = [_eager_grads(layer, x) for x in data]
    assert layer.last_stats["plan"].startswith("scan linear")
    compiled = torch.compile(layer, mode="reduce-overhead")
    with torch._dynamo.config.patch(allow_rnn=True):
        for x, grads in zip(data, expected, strict=True):
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the last replay's outputs may go
            _close(_eager_grads(compiled, x), grads)


def _gpu_only(backend) -> torch.device:
    if not backend.is_cuda:  # the emulation has neither a GPU clock nor a capture to decide for
        pytest.skip("the queued timer and the captured decision need a GPU")
    return backend.device


def test_auto_inside_a_capture_runs_the_path_the_gpus_time_alone_chose(backend):
    """``algorithm="auto"``'s first (eager) call of a shape measures each path's whole step twice, eagerly and
    queued behind the GPU (the GPU's time alone, what a graph replays); calls inside a CUDA graph capture
    (``make_graphed_callables``' own) run the path the second chose, saying so, with eager's gradients. What it
    chooses is the GPU's to say (a host-bound B=16 T=1000 RNN: the scan on an H200's GPU time, cuDNN eagerly);
    this checks that the capture runs the captured decision and that it is a measured one."""
    from lightning_bppsa import layer_plan

    device = _gpu_only(backend)
    torch.manual_seed(3)
    layer = bnn.RNN(1, 20, batch_first=True).to(device)
    data = [torch.randn(16, 1000, 1, device=device) for _ in range(2)]
    with layer_plan.measurements(True):
        expected = [_eager_grads(layer, x) for x in data]
        decided = layer.last_stats["decision"]
        graphed = torch.cuda.make_graphed_callables(layer, (data[0],))
        captured = layer.last_stats["decision"]  # the forward's capture was the last call
        for x, grads in zip(data, expected, strict=True):
            _close(_eager_grads(graphed, x), grads)
    assert decided.startswith("measured: scan "), decided
    assert captured.startswith("measured, inside a CUDA graph capture (the GPU's time alone): scan "), captured
    layer_plan.forget()


def test_the_queued_timer_waits_longer_where_the_host_queued_too_slowly(backend):
    """The queued timer's spin grows where the host took longer to queue the work than the GPU spun (a 50 ms
    host stall here, against a first spin of ~2 ms), and the time it gives is then the GPU's alone (the stall
    is on the host, before the kernels: not counted)."""
    import time

    from lightning_bppsa import layer_plan

    device = _gpu_only(backend)
    x = torch.randn(256, 256, device=device)
    before = layer_plan._queue_cycles.get(device)
    seconds = layer_plan.device_timer(device, queued=True)(lambda: (time.sleep(0.05), x @ x))
    assert layer_plan._queue_cycles[device] > (before or 4_000_000)
    assert 0 < seconds < 0.05, seconds
