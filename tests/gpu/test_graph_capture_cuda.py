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
