"""A recurrent module's scan step replayed from two CUDA graphs: the host's share of a small step, gone.

At T ~ 1000 and a small batch a training step on a GPU waits for its host: on an H200 our eager RNN step
(B=16 T=1000 H=20) took 1.21 ms of CPU to queue against 0.22 ms of GPU work, cuDNN's 1.23 ms
(``benchmarks/results/cuda-host-h200-c040340.md``), while the same scan step captured in a CUDA graph replayed
in 0.24 ms, 3.15x cuDNN's captured step (``cuda-step-h200-213b46c.md``). So an ``algorithm="auto"`` module whose
call may replay (:func:`replayable`) keeps, per call key, its scan's forward and backward captured as two CUDA
graphs (:class:`StepGraphs`, as ``torch.cuda.make_graphed_callables`` captures a module), and a call copies its
input (and initial state, if given) in and launches one graph each way (:class:`_Replayed`). The decision
between torch's layer and the scan times the scan's step replayed where it would replay
(``_ScanRecurrent._measure``).

What keeps this exact where a graphed module of one's own is not:

- a graph's static outputs and gradients are handed out as aliases, and a graph runs again only where nothing
  but the graph holds any of them (storage use counts): an output kept by the caller, a backward still to run
  (its context holds aliases of the outputs), or a ``.grad`` that took a gradient (autograd keeps one where it
  can) make the next call take a second graph, or the eager scan where :data:`GRAPHS_PER_KEY` are busy (the
  least recently used free pair of another key makes room past :data:`GRAPHS_PER_MODULE`; a module stops
  capturing after :data:`MAX_CAPTURES`);
- where an output was modified in place before the backward (the graphs' states could be stale), under
  double backward (``create_graph=True``) and :func:`~lightning_bppsa.nn.reference_backward`, the backward
  recomputes the call with the eager scan and differentiates that;
- dropout between layers (training mode) draws afresh at every replay: a CUDA graph's random ops read the
  generator's seed and offset at replay and advance it as the eager ops would (torch's graph-safe RNG); the
  capture's warm-up and capture leave the caller's random state as they found it, so a call draws what its
  eager scan would have drawn from the same state; a recomputation draws again from the state its replay
  started from (the same masks).

Not yet run on a GPU (written in a session without one): the bookkeeping is tested on CPU over a host
emulation of the graphs (:func:`lightning_bppsa.testing.graphs_on_cpu`), the graphs in ``tests/gpu``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_bppsa._random import generator_states, kept_generators
from lightning_bppsa.nn._reference_backward import ProcessSwitch, reference_backward_enabled
from lightning_bppsa.nn._scan_layer import _keeps_graph
from lightning_bppsa.nn.cell_kernel import _SOLE, _use_count

__all__ = ["GRAPHS_PER_KEY", "GRAPHS_PER_MODULE", "MAX_CAPTURES", "REPLAY_ELEMENTS", "CudaGraphs", "StepGraphs", "forget", "initial_states", "kept", "no_cuda_graphs", "replayable", "run"]

#: graph pairs kept per call key: a training loop alternates two (the last step's output is still referenced,
#: by the caller's variable, while the next forward runs)
GRAPHS_PER_KEY = 2
#: graph pairs kept per module, over all its call keys (free ones of other keys make room)
GRAPHS_PER_MODULE = 4
#: calls whose layers' outputs hold more elements than this run eagerly: there the GPU's work outweighs the
#: host's (RNN B=16 T=10000 H=20, 3.2e6: 2.1 ms a step, the host ~1.2), and a graph's memory stays held
REPLAY_ELEMENTS = 1 << 21

log = logging.getLogger(__name__)


class CudaGraphs:
    """Captures and replays CUDA graphs (``torch.cuda.CUDAGraph``); the tests swap in a host emulation."""

    def accepts(self, tensor: Tensor) -> bool:
        """Whether a call on ``tensor`` may be captured."""
        return tensor.is_cuda

    def warm_up(self, fn: Callable[[], object], device: torch.device) -> None:
        """``fn`` once on a side stream (lazy initialisation and the kernels' first-call compilation and
        measurements happen outside the capture, as torch's CUDA graph notes ask)."""
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                fn()
            current.wait_stream(side)

    def capture(
        self, fn: Callable[[], list], pool: Any, device: torch.device
    ) -> tuple[list, Callable[[list], None], Any]:
        """``(fn's result, replay, memory pool)``: ``replay(targets)`` reruns the captured work, which writes
        ``fn``'s result tensors in place (``targets``, the caller's aliases of them, need nothing more here).
        ``thread_local``: another thread's CUDA calls (a data loader's pinning) do not break the capture."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            result = fn()
        return result, lambda targets: graph.replay(), graph.pool()


#: the graphs' implementation (:func:`lightning_bppsa.testing.graphs_on_cpu` replaces it)
GRAPHS: Any = CudaGraphs()

_NO_GRAPHS = ProcessSwitch()


@contextlib.contextmanager
def no_cuda_graphs() -> Iterator[None]:
    """Inside it, ``"auto"`` recurrent layers run their scan steps eagerly: no step is captured in or replayed
    from CUDA graphs (the graphs hold a step's states, up to 4 steps a module; e.g. where memory is short).
    Graphs captured before stay with their module and replay again after the block. Process-wide::

        with lightning_bppsa.nn.no_cuda_graphs():
            trainer.fit(model)
    """
    with _NO_GRAPHS.block():
        yield


def initial_states(hx: Any) -> tuple[Tensor, ...]:
    """A module's initial state (``None``, a tensor, an LSTM's pair) as a tuple of tensors."""
    return () if hx is None else hx if isinstance(hx, tuple) else (hx,)


def _flat(outputs: tuple) -> list[Tensor]:
    """A module's ``(output, h_n)`` / ``(output, (h_n, c_n))`` as a list."""
    output, states = outputs
    return [output, *states] if isinstance(states, tuple) else [output, states]


def _nested(flat: tuple[Tensor, ...]) -> tuple:
    """:func:`_flat`'s inverse."""
    return (flat[0], flat[1]) if len(flat) == 2 else (flat[0], (flat[1], flat[2]))


class StepGraphs:
    """One call key's scan step captured: the forward (``input`` and the initial state ``hx`` -> outputs, the
    states kept for the backward in the graphs' memory) and the backward (the outputs' gradients -> the
    gradients of the input, the initial state and the weights that need them). Built by capturing ``module``'s
    eager scan after one warm-up step."""

    def __init__(
        self, module: torch.nn.Module, input: Tensor, hx: Any, weights: list[tuple[Tensor, ...]], grads: bool  # noqa: A002
    ) -> None:
        self.module = weakref.ref(module)  # the module keeps its graphs: no cycle
        self.used = 0  # when last used (_free_graphs: the least recently used free pair makes room)
        self.layer_weights = weights
        self.weights = [w for layer in weights for w in layer]
        self.paired = isinstance(hx, tuple)  # an LSTM's (h0, c0)
        states = initial_states(hx)
        self.input, *self.states = (t.detach().clone().requires_grad_(t.requires_grad) for t in (input, *states))
        self.wanted = [t.requires_grad for t in (input, *states, *self.weights)]
        # the weights' storage as captured (a graph reads those addresses; an in-place update shows, a swapped
        # .data does not: the caller's key has the addresses); kept, so that no other tensor takes that memory
        # while the graphs live
        own = self._captured_weights = [tuple(w.detach().requires_grad_(w.requires_grad) for w in layer) for layer in weights]
        wrt = [t for t in (self.input, *self.states, *(w for layer in own for w in layer)) if t.requires_grad]
        live: list[Tensor] = []  # the outputs of the last eager run, whose autograd graph the backward takes

        def forward() -> list[Tensor]:
            live[:] = _flat(self.module()._scan_forward(self.input, self.hx(self.states), grads, weights=own))
            return live

        def backward() -> list[Tensor]:
            return list(torch.autograd.grad(live, wrt, self.grad_outputs, retain_graph=True, allow_unused=True))

        def warm_up() -> None:
            forward()
            if grads:
                torch.autograd.grad(live, wrt, [torch.ones_like(o) for o in live], allow_unused=True)

        device = input.device
        #: whether a replay draws random numbers (dropout between layers): a recomputation then draws them again
        self.draws = module.training and module.dropout > 0 and module.num_layers > 1
        with kept_generators(device):  # the warm-up's draws (and the emulation's capture's) are not the caller's
            GRAPHS.warm_up(warm_up, device)
            # on the caller's stream, not the warm-up's (a block of a dropped stream could be handed out again)
            self.grad_outputs = [torch.zeros_like(o) for o in live] if grads else []
            live.clear()
            result, self._forward, pool = GRAPHS.capture(forward, None, device)
            self.outputs = [o.detach() for o in result]
            self.grads: list[Tensor | None] = []  # a forward without gradients (inference) has no backward graph
            if grads:
                computed, self._backward, _ = GRAPHS.capture(backward, pool, device)
                self.grads = list(computed)
                del computed
        del result
        live.clear()  # the eager graph of the capture: its states now live in the graphs' memory only
        # a replay runs no Python of the layers: their timings are not taken (as under torch.compile)
        stats = dict(module.last_stats, forward_seconds=0.0, scan_seconds=0.0)
        plan = stats.get("plan", "scan") if grads else "forward kernel (no gradient needed)"
        stats["plan"] = f"{plan}, replayed from CUDA graphs"
        self.stats = stats
        self._handed = [t for t in (*self.outputs, *self.grads) if t is not None]
        # counted with nothing handed out; two handed-out tensors on one storage would alias two gradients
        self._idle = [_use_count(t) for t in self._handed]
        self.shares_storage = len({t.untyped_storage().data_ptr() for t in self._handed}) < len(self._handed)

    def free(self) -> bool:
        """Whether nothing but these graphs holds an output or a gradient of theirs (a replay may overwrite)."""
        return all(_use_count(t) <= idle for t, idle in zip(self._handed, self._idle, strict=True))

    def hx(self, states: list[Tensor]) -> Any:
        """``states`` as the module takes its initial state (``None``, a tensor, or an LSTM's pair)."""
        return tuple(states) if self.paired else states[0] if states else None

    def replay_forward(self, input: Tensor, states: tuple[Tensor, ...]) -> list[Tensor]:  # noqa: A002
        """The forward on ``input`` from ``states``: aliases of the static outputs."""
        for static, value in zip((self.input, *self.states), (input, *states), strict=True):
            static.copy_(value)
        with torch.enable_grad():  # the emulation reruns the eager forward, whose graph its backward takes
            self._forward(self.outputs)
        return [o.detach() for o in self.outputs]

    def replay_backward(self, grads: tuple[Tensor | None, ...]) -> list[Tensor | None]:
        """The gradients of the input and every weight (``None`` where not wanted) for the outputs' ``grads``
        (``None``: zero)."""
        for static, grad in zip(self.grad_outputs, grads, strict=True):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        self._backward(self.grads)
        computed = iter(self.grads)
        return [_alias(next(computed)) if want else None for want in self.wanted]

    def recomputed_backward(
        self, input: Tensor, states: tuple[Tensor, ...], grads: tuple[Tensor | None, ...], rng: list[Tensor] | None  # noqa: A002
    ) -> list[Tensor | None]:
        """The same gradients through the eager scan on ``input`` from ``states`` (double backward:
        differentiable); ``rng``: the random state the replay drew from (its dropout masks drawn again)."""
        module = self.module()
        if module is None:
            raise RuntimeError("lightning_bppsa: the module of a replayed call was freed before its backward")
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad(), contextlib.ExitStack() as stack:
            if rng is not None:
                stack.enter_context(kept_generators(input.device, rng))
            outputs = _flat(module._scan_forward(input, self.hx(list(states)), weights=self.layer_weights))
            wrt = [t for t, want in zip((input, *states, *self.weights), self.wanted, strict=True) if want]
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
            computed = iter(
                torch.autograd.grad(
                    [o for o, _ in pairs], wrt, [g for _, g in pairs], create_graph=create_graph, allow_unused=True
                )
            )
        return [next(computed) if want else None for want in self.wanted]


def _alias(tensor: Tensor | None) -> Tensor | None:
    return None if tensor is None else tensor.detach()


class _Replayed(torch.autograd.Function):
    """``(graphs, input, *states, *weights) -> outputs`` from :class:`StepGraphs`' forward graph; the backward
    from its backward graph, or recomputed eagerly where that cannot serve (see the module docstring)."""

    @staticmethod
    def forward(ctx, graphs: StepGraphs, input: Tensor, *rest: Tensor):  # noqa: A002
        states = rest[: len(graphs.states)]
        ctx.rng = generator_states(input.device) if graphs.draws else None  # what a recomputation draws from
        outputs = graphs.replay_forward(input, states)
        ctx.graphs = graphs
        # aliases of the outputs, held until the backward, keep the graphs busy (StepGraphs.free); their versions
        # (shared with the outputs) say whether the caller modified an output in place since (the graphs'
        # states could then be stale). Not the outputs themselves: their grad_fn holds ctx (a cycle only gc frees)
        ctx.outs = [o.detach() for o in outputs]
        ctx.versions = [o._version for o in ctx.outs]
        ctx.save_for_backward(input, *states)
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        input, *states = ctx.saved_tensors  # autograd's error on a second backward without retain_graph
        outs = ctx.outs
        if not _keeps_graph():  # released as autograd releases saved tensors: the graphs are free again
            ctx.outs = None
        changed = any(o._version != v for o, v in zip(outs, ctx.versions, strict=True))
        if changed or torch.is_grad_enabled() or reference_backward_enabled():
            return None, *ctx.graphs.recomputed_backward(input, tuple(states), grads, ctx.rng)
        return None, *ctx.graphs.replay_backward(grads)


def replayable(module: torch.nn.Module, input: Tensor) -> bool:  # noqa: A002
    """Whether a memoised scan call of ``module`` on ``input`` may replay: not inside :func:`no_cuda_graphs`, the
    graphs take its device (CUDA),
    no graph is being captured (a caller's capture holds the eager scan), nothing traces or intercepts ops
    (``torch.compile``, dispatch and function modes, tensor subclasses), and outputs of at most
    :data:`REPLAY_ELEMENTS` elements."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    return (
        _SOLE is not None
        and not _NO_GRAPHS.on()
        and type(input) is Tensor
        and GRAPHS.accepts(input)
        and not (input.is_cuda and torch.cuda.is_current_stream_capturing())
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and input.numel() // input.shape[-1] * module.hidden_size * layers <= REPLAY_ELEMENTS
    )


def run(
    module: torch.nn.Module, key: tuple, input: Tensor, hx: Any, weights: list[tuple[Tensor, ...]], grads: bool = True  # noqa: A002
) -> tuple | None:
    """``module``'s outputs for a memoised scan call (``key``: its memo key, ``hx``: its initial state or
    ``None``, ``weights``: its layers' weights; ``grads=False``: the forward kernel alone, no gradient needed)
    replayed from graphs, or ``None``: the call runs eagerly (not :func:`replayable`, every graph of the key
    busy, or capturing failed, said once)."""
    if not replayable(module, input):
        return None
    graphs = _free_graphs(module, key, input, hx, weights, grads)
    if graphs is None:
        return None
    if grads:
        outputs = _Replayed.apply(graphs, input, *initial_states(hx), *graphs.weights)
    else:  # outside autograd: the aliases themselves
        outputs = graphs.replay_forward(input, initial_states(hx))
    module.__dict__["last_stats"] = dict(graphs.stats)
    return _nested(outputs)


def kept(module: torch.nn.Module) -> list[StepGraphs]:
    """The graphs ``module`` keeps (every call key's)."""
    return [graphs for per_key in _KEPT.get(module, {}).values() for graphs in per_key]


def forget(module: torch.nn.Module) -> None:
    """Drop ``module``'s graphs that nothing holds (a decision for torch's layer: they would only hold memory)."""
    per_key = _KEPT.get(module)
    if per_key:
        for key in list(per_key):
            per_key[key] = [g for g in per_key[key] if not g.free()]
            if not per_key[key]:
                del per_key[key]


#: per module, its graphs by call key, the keys whose capture failed (never tried again), and how many captures
#: it made. Beside the module, not in it: a deep copy or a pickle of the module must not carry graphs that
#: replay the original's memory
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: a module that captured this many times captures no more (its keys keep changing: weights moved every call,
#: as a sharding wrapper's may; a capture costs more than many eager steps), its graphs still replaying
MAX_CAPTURES = 4 * GRAPHS_PER_MODULE
#: what each module was told once: every graph busy, captures stopped
_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: the order graphs were last used in
_uses = itertools.count()


def _say_once(module: torch.nn.Module, what: str, message: str) -> None:
    said = _SAID.setdefault(module, set())
    if what not in said:
        said.add(what)
        log.info("lightning_bppsa: a %s call runs its scan eagerly: %s (said once)", type(module).__name__, message)


def _evict_one(module: torch.nn.Module) -> bool:
    """Drop ``module``'s least recently used graph pair that nothing holds; whether there was one."""
    per_key = _KEPT[module]
    free = [(graphs.used, key, graphs) for key, kept_graphs in per_key.items() for graphs in kept_graphs if graphs.free()]
    if not free:
        return False
    _, key, graphs = min(free, key=lambda entry: entry[0])
    per_key[key].remove(graphs)
    if not per_key[key]:
        del per_key[key]
    return True


def _free_graphs(
    module: torch.nn.Module, key: tuple, input: Tensor, hx: Any, weights: list[tuple[Tensor, ...]], grads: bool  # noqa: A002
) -> StepGraphs | None:
    """A free :class:`StepGraphs` of this call, captured if the limits allow, else ``None``."""
    flat = [w for layer in weights for w in layer]
    # storage addresses too: a weight's .data swapped keeps its id; training mode: dropout drawn or not;
    # autocast's state: the layers cast their outputs to its dtype (explicit casts, autocast itself off inside:
    # the captured work holds none of autocast's cached weight casts, which a capture must not)
    device_type = input.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    # inference mode: tensors made under it (the static ones) take no in-place copy outside it
    full_key = (key, grads, torch.is_inference_mode_enabled(), input.requires_grad, module.training, autocast,
                *(w.data_ptr() for w in flat), *(w.requires_grad for w in flat))  # fmt: skip
    per_key = _KEPT.setdefault(module, {})
    graphs = per_key.get(full_key, [])  # a key gets an entry with its first pair (keys may change every call)
    for candidate in graphs:
        if candidate.free():
            candidate.used = next(_uses)
            return candidate
    refused = _REFUSED.setdefault(module, set())
    if full_key in refused:
        return None
    if len(graphs) >= GRAPHS_PER_KEY or (len(kept(module)) >= GRAPHS_PER_MODULE and not _evict_one(module)):
        _say_once(module, "busy", "every CUDA graph of it is busy (outputs or gradients of earlier calls still held)")
        return None
    if _CAPTURES.get(module, 0) >= MAX_CAPTURES:
        _say_once(module, "captures", f"it captured CUDA graphs {MAX_CAPTURES} times, its call keys keep changing")
        return None
    _CAPTURES[module] = _CAPTURES.get(module, 0) + 1
    try:
        captured = StepGraphs(module, input, hx, weights, grads)
    except Exception as error:  # noqa: BLE001  (the eager scan runs; a capture the device refuses is not the caller's error)
        refused.add(full_key)
        log.warning("lightning_bppsa: %s runs its scan eagerly, capturing it in CUDA graphs failed: %s",
                    type(module).__name__, f"{type(error).__name__}: {error}")  # fmt: skip
        return None
    if captured.shares_storage:
        refused.add(full_key)
        return None
    captured.used = next(_uses)
    per_key.setdefault(full_key, []).append(captured)
    return captured
