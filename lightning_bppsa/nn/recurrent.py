"""BPPSA versions of ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` (BPPSA Sec. 4.1-4.2, Appendix E).

Each class subclasses its torch module (same constructor, parameter names, ``state_dict`` keys, inputs
and outputs, incl. ``batch_first``, ``h0`` / ``(h0, c0)`` and unbatched input). With gradients enabled,
the stack runs layer by layer and direction by direction through
:class:`~lightning_bppsa.nn._scan_layer.LayerFunction` (the cell's forward op, scan backward op;
:mod:`lightning_bppsa.cells`);
dropout between layers is an ordinary autograd op on the time-major layer output, as torch lays it out,
so the same seed draws torch's mask and the backward uses the forward's.

``algorithm`` (``"auto"``, ``"linear"``, ``"blelloch"``, ``"chunked"``) picks the scan; with ``"auto"``,
when :func:`~lightning_bppsa.cost_model.recurrent_path` predicts that the scan does not pay, the module
runs torch's own forward under plain autograd instead. Where no gradient is needed (``torch.no_grad``,
inference, validation) on CPU in float32 / float64 the forward kernels run alone (no scan: B=16 T=1000
H=20 RNN 1.2 ms against torch's fused forward 9.8 ms; float64 equal to torch's to ~1e-15); on CUDA they do
where the first call of the shape measured them faster than cuDNN's forward (:meth:`_ScanRecurrent._inference_path`).
``last_stats`` records what the last forward did:
``path`` (``"scan"`` / ``"forward kernel"`` / ``"autograd"``), ``algorithm``, ``plan`` (``"scan linear [c]"``: the
algorithm and kernel the scan runs, planned before the forward, see :class:`~lightning_bppsa.backends.LayerCall`,
with ``", torch forward: why"`` where the device's forward kernel cannot launch; or ``"autograd (why)"``),
``scan_algorithm`` (the plan without the word "scan"), ``forward_seconds`` (the layers' forward op: states
and Jacobian factors) and ``scan_seconds`` (the backward op), timings in eager mode only. On CUDA an ``"auto"``
call that runs the scan replays its step from CUDA graphs from its second call on (:mod:`~lightning_bppsa.nn._replay`:
``plan`` then ends in ``"replayed from CUDA graphs"``, and no timings are taken; dropout between layers draws
afresh at every replay).

Torch's own forward (``path == "autograd"``) also runs where the scan has nothing to do or cannot run:
gradients disabled off the kernels (another device or dtype, autocast, no compiler; on CUDA where cuDNN's
forward measured faster or nothing measured), an empty batch or sequence, meta tensors, complex or integer dtypes, a
``PackedSequence`` (one warning), ``torch.func`` transforms (``grad``, ``vmap``, ...: the scan's
``autograd.Function`` has no functorch rules), and malformed input (so the error is torch's own). Input
sizes and dtypes are checked by torch's ``check_forward_args``. Under ``create_graph=True`` (double
backward, e.g. a gradient penalty) the backward is autograd's through a recomputed forward, so second
derivatives equal torch's. ``torch.compile`` with ``allow_rnn`` traces each layer as two opaque ops (forward,
backward): nothing is unrolled over time; without it dynamo refuses the module (an ``nn.RNN`` subclass) and
the module runs as in eager mode, dynamo's frame hook off inside it. ``torch.jit.script`` compiles the torch module instead (see ``__prepare_scriptable__``).

Not supported (raise ``NotImplementedError``; use the torch module): ``proj_size > 0`` (LSTM).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence

from lightning_bppsa import backends, cost_model, cuda_step_model, layer_plan
from lightning_bppsa._random import kept_generators
from lightning_bppsa.algorithms import compute_dtype
from lightning_bppsa.cells import RecurrentCell, cell_of
from lightning_bppsa.kernels import recurrent as native_kernels
from lightning_bppsa.layer_plan import LayerShape, time_training_steps
from lightning_bppsa.nn import _replay
from lightning_bppsa.nn._scan_layer import LayerFunction, forward_only
from lightning_bppsa.nn.convert import Conversion, carry_hooks, register_converter
from lightning_bppsa.plan import check_algorithm

__all__ = ["GRU", "LSTM", "RNN"]

#: call keys a module keeps its decision for (:meth:`_ScanRecurrent._memo_key`), the least recently used dropped
MEMO_KEYS = 4


class _ScanRecurrent:
    """Mixin over ``nn.RNNBase``: the layer-by-layer scan forward shared by the three cells."""

    def _init_scan(self, algorithm: str) -> None:
        if getattr(self, "proj_size", 0) > 0:
            raise NotImplementedError(
                f"lightning_bppsa.nn.{type(self).__name__} does not support proj_size > 0; use torch.nn.LSTM"
            )
        check_algorithm(algorithm)
        self.algorithm = algorithm
        self.last_stats: dict[str, Any] = {}

    def forward(self, input: Tensor, hx: Any = None):  # noqa: A002  (torch's argument name)
        # traced (allow_rnn): each layer's two ops go into the graph; eager (no frame hook): nothing to turn off
        if torch.compiler.is_compiling() or _frame_hook() is None:
            return self._forward(input, hx)
        # Run by a compiled caller only after dynamo refused this nn.RNN subclass (a graph break): then the
        # layers run as in eager mode, without dynamo's frame hook on every Python call inside, and without
        # a compiled graph of their own, whose runtime wrappers cost more (~0.2 ms a step) than the one op
        # each way they would hold.
        return _without_dynamo()(self._forward, input, hx)

    def _forward(self, input: Tensor, hx: Any):  # noqa: A002
        # A training loop calls with one shape every step: the decision memoised for this call's key answers
        # without the checks below, and torch's layer pays ~1 µs for asking (issue 28: <= ~30 µs on a GPU host).
        # The last MEMO_KEYS keys are kept: a training step after validation (no gradients: another key), or
        # two shapes in turn, still answer from the memo (and replay their graphs)
        key = self._memo_key(input, hx)
        memo = self.__dict__.get("_plan_memo")
        hit = None if memo is None or key is None else memo.get(key)
        pending = None  # the memo this call makes, kept once it ran (a call torch's checks refuse raises again)
        if hit is not None:
            memo.move_to_end(key)
            path, reason, stats, weights = hit
            self.__dict__["last_stats"] = dict(stats)  # a plain attribute: nn.Module's __setattr__ costs µs
        else:
            weights = None
            path, reason, keep = self._path(input, hx)
            stats = {
                "path": path,
                "algorithm": self.algorithm,
                "forward_seconds": 0.0,
                "scan_seconds": 0.0,
                "plan": f"autograd ({reason})" if path == "autograd" else "scan",
                "decision": reason,
            }
            self.last_stats = dict(stats)
            if keep and key is not None:  # the key holds the weights' ids: the same tensors while it matches
                pending = (key, (path, reason, stats, self._layer_weights()))
        if path == "autograd":
            result = super().forward(input, hx)
        else:
            if path == "forward kernel":
                self.last_stats["plan"] = "forward kernel (no gradient needed)"
            if weights is not None and (self.algorithm == "auto" or path == "forward kernel"):
                # a memoised call of the scan ("auto") or of the forward kernel: from CUDA graphs if it may
                replayed = _replay.run(self, key, input, hx, weights, grads=path == "scan")
                if replayed is not None:
                    return replayed
            result = self._scan_forward(input, hx, grads=path == "scan", weights=weights)
        if pending is not None:
            memo = self.__dict__.setdefault("_plan_memo", OrderedDict())
            memo[pending[0]] = pending[1]
            if len(memo) > MEMO_KEYS:
                memo.popitem(last=False)  # the least recently used
        return result

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, algorithm={self.algorithm!r} [BPPSA scan backward]"

    def _memo_key(self, input: Any, hx: Any) -> tuple | None:  # noqa: A002
        """What a memoised decision depends on, for the common call (a plain tensor, no initial state or plain
        tensors as the module's state: truncated backpropagation through time passes the last one); ``None``
        (never memoised) for any other."""
        states = _replay.initial_states(hx)
        if type(input) is not Tensor or not all(type(s) is Tensor for s in states):
            return None
        # the parameters themselves (not ``_flat_weights``): functional_call swaps the ones in _parameters
        try:
            weights = [self._parameters[name] for name in self._flat_weights_names]
        except KeyError:  # a parametrized weight (torch.nn.utils.parametrize): a new tensor at every access
            return None
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or any(w.requires_grad for w in (*weights, *states))
        )
        # the weights' dtype too: converting the module in place keeps their ids, and a memoised call skips
        # torch's checks (the input's dtype against theirs, the states' sizes, :meth:`_scan_forward`; a state of
        # another structure, e.g. an LSTM's single tensor, gives another key and torch's error); on CUDA, whether a CUDA graph
        # is being captured (a decision's LayerPlan.captured; asked directly: a CUDA input means CUDA is there, and
        # layer_plan.capturing's availability check is three more calls, one an environment lookup, every step);
        # autocast and tracing: a call without gradients runs torch's forward under either
        device_type = input.device.type
        return (
            input.shape, input.dtype, input.device, needs_grad, torch._C._are_functorch_transforms_active(),
            torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type),
            torch.compiler.is_compiling(), self.algorithm, layer_plan.generation(), weights[0].dtype,
            input.is_cuda and torch.cuda.is_current_stream_capturing(),
            *map(id, weights), *((s.shape, s.dtype, s.device, s.requires_grad) for s in states),
        )  # fmt: skip

    def _path(self, input: Any, hx: Any) -> tuple[str, str, bool]:  # noqa: A002
        """``("scan", why, keep)``, or ``("autograd", why, keep)``: torch's forward, where the scan has nothing
        to do or cannot run; ``keep``: whether the decision may be memoised (:meth:`_memo_key`)."""
        if isinstance(input, PackedSequence):
            if not getattr(self, "_warned_packed", False):
                self._warned_packed = True
                warnings.warn(
                    f"lightning_bppsa.nn.{type(self).__name__}: a PackedSequence runs torch's own "
                    "forward and autograd backward (the scan takes padded batches)",
                    stacklevel=3,
                )
            return "autograd", "PackedSequence input", False
        params = [getattr(self, name) for name in self._flat_weights_names]  # functional_call swaps them
        if input.dim() not in (2, 3) or not self._states_match(input, hx):
            return "autograd", "malformed input: torch's forward raises its own error", False
        if input.numel() == 0 or input.device.type == "meta":
            return "autograd", "empty or meta input: nothing to scan", False
        if not input.is_floating_point():
            return (
                "autograd",
                f"dtype {input.dtype}: the scan takes real floating dtypes (complex: torch's code)",
                False,
            )
        if torch._C._are_functorch_transforms_active():
            return "autograd", "torch.func transform: the scan's Function has no functorch rules", False
        cell = cell_of(self.mode)
        if not torch.is_grad_enabled() or not (input.requires_grad or any(p.requires_grad for p in params)):
            return self._inference_path(input, hx, cell, params)
        if self.algorithm != "auto":
            return "scan", f"algorithm={self.algorithm!r} as asked", True
        shape = self._layer_shape(input, self.mode)
        without = input.device.type == "cuda" and _without_cuda_kernels(
            cell, shape.batch, shape.steps, self.hidden_size, params
        )
        if without:  # the scan would run op by op in torch, or its states by torch's forward: never faster
            reason = f"auto on CUDA without the scan's kernels ({without})"
            return "autograd", reason, True
        plan = layer_plan.plan_layer(
            shape, functools.partial(_predict, shape), lambda: self._measure(input, hx)
        )
        if plan.path != "scan":  # graphs the measurement captured would only hold memory
            _replay.forget(self)
        # kept while the cache holds it (the memo's key has the cache's generation)
        return plan.path, plan.reason, layer_plan.cached(shape)

    def _inference_path(self, input: Tensor, hx: Any, cell: RecurrentCell, params: list[Tensor]) -> tuple[str, str, bool]:  # noqa: A002
        """Where no gradient is needed: ``("forward kernel", why, keep)`` (the forward kernel alone, nothing kept
        for a backward) or ``("autograd", why, keep)`` (torch's forward); ``keep``: whether the answer may be
        memoised (every answer but a CUDA shape's not yet decided; the memo key has autocast's state). The CPU kernels run wherever they run as in training
        (B=16 T=1000 H=20: ~1 ms, torch's fused forward ~10 ms; not under autocast, which casts to bfloat16). The
        CUDA kernels run where measured faster than cuDNN's forward for this shape, once per shape
        (:func:`~lightning_bppsa.layer_plan.plan_layer`; the forward of a GRU H=256 B=16 T=1000 took 1.2-1.3 ms as
        clusters of blocks on an H200, cuDNN's 16 ms, while cuDNN's persistent GRU / LSTM forward at H=20 is the
        faster); where nothing measures (tracing, measurements off, a shape too large to time twice), torch's."""
        device_type = input.device.type
        if torch.compiler.is_compiling() or (
            torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
        ):
            return "autograd", "no gradient needed", True
        kernels = backends.forward_backend(cell, self.hidden_size, (input, *params))[0]
        if kernels is backends.NATIVE:
            return "forward kernel", "", True
        if not isinstance(kernels, backends.CudaBackend):
            return "autograd", "no gradient needed", True
        shape = self._layer_shape(input, f"{self.mode} forward")
        # no model of cuDNN's forward: its modelled training step bounds its forward, and ours (a scan step the
        # model does not price is inf) at most as much; asked only before the shape's decision is made
        affordable = layer_plan.cached(shape)
        if not affordable:
            scan, torch_ = _predict(dataclasses.replace(shape, cell=self.mode))
            affordable = 3 * (torch_ + min(scan, torch_)) <= layer_plan.MEASURE_BUDGET_SECONDS
        plan = layer_plan.plan_layer(
            shape, lambda: "no model of cuDNN's forward", (lambda: self._measure_forward(input, hx)) if affordable else None,
            timed="a forward (no gradient needed)", unmeasured="autograd",
        )  # fmt: skip
        return ("forward kernel" if plan.path == "scan" else "autograd"), plan.reason, layer_plan.cached(shape)

    def _layer_shape(self, input: Tensor, cell: str) -> LayerShape:  # noqa: A002
        """This module's layer decision key for ``input`` (batched or not), under the cell name ``cell``."""
        batch_dim = 0 if self.batch_first else 1
        batch = input.shape[batch_dim] if input.dim() == 3 else 1
        length = input.shape[1 - batch_dim] if input.dim() == 3 else input.shape[0]
        return LayerShape(
            cell, self.num_layers, 2 if self.bidirectional else 1, batch, length, input.shape[-1], self.hidden_size,
            input.dtype, str(input.device),
        )  # fmt: skip

    def _measure_forward(self, input: Tensor, hx: Any) -> dict[str, float]:  # noqa: A002
        """Seconds of this call's forward without gradients on each path (:meth:`_inference_path`), the random
        state restored (dropout between layers in training mode)."""
        torch_forward = super().forward
        stats = self.last_stats
        device = input.device
        with torch.no_grad(), kept_generators(device):
            times = layer_plan.time_candidates(
                {"scan": lambda: self._scan_forward(input, hx, grads=False), "autograd": lambda: torch_forward(input, hx)},
                layer_plan.device_timer(device),
            )  # fmt: skip
        self.last_stats = stats
        return times

    def _measure(self, input: Tensor, hx: Any) -> dict[str, float]:  # noqa: A002
        """Seconds of a whole training step of this call on each path (:func:`~lightning_bppsa.layer_plan.plan_layer`):
        forward and the gradients of every input that needs one, returned, not accumulated; the random state
        (dropout) restored, so the call itself draws what it would have drawn."""
        states = _replay.initial_states(hx)
        params = [getattr(self, name) for name in self._flat_weights_names]
        wrt = [t for t in (*params, input, *states) if t.requires_grad]
        torch_forward = super().forward
        stats = self.last_stats
        key, weights = self._memo_key(input, hx), self._layer_weights()

        def scan_step() -> Tensor:  # the step as later calls run it: replayed from CUDA graphs where they may
            replayed = None if key is None else _replay.run(self, key, input, hx, weights)
            return (self._scan_forward(input, hx) if replayed is None else replayed)[0]

        times = time_training_steps({"scan": scan_step, "autograd": lambda: torch_forward(input, hx)[0]}, wrt, input.device)
        self.last_stats = stats
        return times

    def _states_match(self, input: Tensor, hx: Any) -> bool:  # noqa: A002
        """Whether ``hx`` has the structure torch's forward accepts with ``input`` (sizes: checked later)."""
        if hx is None:
            return True
        is_lstm = self.mode == "LSTM"
        if isinstance(hx, tuple) != is_lstm:
            return False
        states = hx if is_lstm else (hx,)
        dims_match = all(isinstance(s, Tensor) and s.dim() == input.dim() for s in states)
        return len(states) == 1 + is_lstm and dims_match

    def _layer_weights(self) -> list[tuple[Tensor, ...]]:
        """The weights of each layer and direction, in torch's order."""
        return [tuple(getattr(self, name) for name in names) for names in self._all_weights]

    def _scan_forward(
        self, input: Tensor, hx: Any, grads: bool = True, weights: list[tuple[Tensor, ...]] | None = None  # noqa: A002
    ):
        """The scan's forward; ``weights``: :meth:`_layer_weights` of a memoised call (:meth:`_memo_key`: the same
        input shape, dtype and device, no ``hx``), whose torch checks passed then and are not asked again."""
        is_lstm, unbatched = self.mode == "LSTM", input.dim() == 2
        batch_dim = 0 if self.batch_first else 1
        if unbatched:
            input = input.unsqueeze(batch_dim)
        batch, hidden, dirs = input.shape[batch_dim], self.hidden_size, 2 if self.bidirectional else 1
        if hx is None:
            zeros = input.new_zeros(self.num_layers * dirs, batch, hidden)
            hx = (zeros, zeros) if is_lstm else zeros
        elif unbatched:
            hx = tuple(s.unsqueeze(1) for s in hx) if is_lstm else hx.unsqueeze(1)
        if weights is None:
            self.check_forward_args(input, hx, None)  # torch's own checks and messages (sizes, dtype)
            weights = self._layer_weights()
        h0, c0 = hx if is_lstm else (hx, None)
        x = input if self.batch_first else input.transpose(0, 1)  # (B, n, I): the layers run batch first
        dropout = self.dropout if self.training else 0.0
        output, h_n_t, c_n_t = _run_layers(
            cell_of(self.mode).name,
            self.algorithm,
            self.last_stats,
            x,
            h0,
            c0,
            weights,
            dirs,
            dropout,
            self.batch_first,
            grads,
        )
        if unbatched:
            output = output.squeeze(batch_dim)
            h_n_t = h_n_t.squeeze(1)
            c_n_t = None if c_n_t is None else c_n_t.squeeze(1)
        return (output, (h_n_t, c_n_t)) if is_lstm else (output, h_n_t)

    def __prepare_scriptable__(self) -> nn.RNNBase:
        """What ``torch.jit.script`` compiles: the torch module with the same ``Parameter`` objects and hooks.

        TorchScript cannot compile the scan (an ``autograd.Function`` over Python objects), so a scripted
        module runs torch's own forward and autograd backward. Torch's protocol also puts that module into a
        parent being scripted (``torch.jit.script(model)`` swaps it in ``model`` itself): ``convert(model)``
        again to get the scan back in eager mode.
        """
        torch_cls = next(c for c in type(self).__mro__ if c in _TYPES)
        scripted = _rebuild(self, torch_cls)
        carry_hooks(self, scripted)
        return scripted


#: torch.compile's frame-evaluation callback, ``None`` when no compiled caller is running (a C function:
#: asking costs no Python frame for dynamo to see)
_frame_hook = torch._C._dynamo.eval_frame.get_eval_frame_callback


@functools.cache
def _without_dynamo() -> Any:
    """``call(fn, *args)`` = ``fn(*args)`` with torch.compile's frame evaluation off inside (made on first use:
    the decorator imports dynamo)."""
    return torch.compiler.disable(lambda fn, *args: fn(*args))


def _without_cuda_kernels(cell, batch: int, length: int, hidden: int, params: list[Tensor]) -> str:
    """Why a layer of ``params`` on CUDA would run without the CUDA kernels (``""``: it runs them): the scan's
    plan is not ``[cuda]``, or the forward kernel cannot launch (:meth:`~lightning_bppsa.backends.CudaBackend.refuses`)."""
    scan = backends.scan_plan(
        cell, "auto", batch=batch, n=length, hidden=hidden, device="cuda", dtype=params[0].dtype
    )
    if scan.kernel != "cuda":
        return scan.reason
    forward, why = backends.forward_backend(cell, hidden, params)
    return f"forward: {why}" if forward is backends.TORCH else ""


def _predict(shape: LayerShape) -> tuple[float, float]:
    """The model's ``(scan, autograd)`` seconds of a training step of ``shape``: on CUDA the calibrated model of
    cuDNN vs the CUDA kernels (asked only where those kernels load), elsewhere
    :func:`~lightning_bppsa.cost_model.recurrent_seconds`."""
    cell = cell_of(shape.cell)
    layers = shape.layers * shape.directions
    device = torch.device(shape.device).type
    chosen = backends.scan_plan(cell, "auto", batch=shape.batch, n=shape.steps, hidden=shape.hidden, device=device,
                                dtype=shape.dtype)  # fmt: skip
    if device == "cuda":
        fused = chosen.algorithm == "linear" and backends.fused_backward(cell, shape.hidden, shape.dtype, device)
        common = dict(gates=cell.gates, hidden=shape.hidden, d=cell.state_factor * shape.hidden,
                      m=cell.jacobian_width(shape.hidden), batch=shape.batch, n=shape.steps,
                      element_bytes=torch.finfo(compute_dtype(shape.dtype)).bits // 8)  # fmt: skip
        scan = cuda_step_model.step_seconds("scan", fused=fused, **common)
        torch_ = cuda_step_model.step_seconds("torch", **common)
    else:
        scan, torch_ = cost_model.recurrent_seconds(
            cell.cost, n=shape.steps, hidden=shape.hidden, batch=shape.batch, width=cell.jacobian_width(shape.hidden),
            device=device, native=chosen.kernel == "c", fused=backends.NATIVE.takes(chosen) and native_kernels.available(),
        )  # fmt: skip
    return layers * scan, layers * torch_


def _run_layers(
    cell: str,
    algorithm: str,
    stats: dict,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[tuple[Tensor, ...]],
    dirs: int,
    dropout: float,
    batch_first: bool,
    grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer and direction over batch-first ``x`` ``(B, n, I)``: ``(output, h_n, c_n)`` as torch's module
    returns them (``c_n`` ``None`` without a cell state). ``weights``: per layer and direction, in torch's order;
    ``grads=False``: the forward ops alone (no gradient needed).

    Under ``torch.compile`` with ``allow_rnn`` dynamo traces it into the caller's graph: every layer's two ops
    and what joins them.
    """
    h_n, c_n = [], []
    layers = len(weights) // dirs
    run_layer = LayerFunction.apply if grads else forward_only
    for layer in range(layers):
        outs = []
        for direction in range(dirs):
            idx = layer * dirs + direction
            seq = x if direction == 0 else x.flip(1)
            c_init = None if c0 is None else c0[idx]
            result = run_layer(cell, algorithm, stats, seq, h0[idx], c_init, *weights[idx])
            h_n.append(result[1])
            if c0 is not None:
                c_n.append(result[2])
            outs.append(result[0] if direction == 0 else result[0].flip(1))
        last = layer == layers - 1
        drop = not last and dropout > 0
        if drop or (last and not batch_first):
            # time major (n, B, dirs H) and contiguous, as torch's stack lays it out: dropout then draws its
            # mask in torch's order, so the same seed gives the same mask
            seq_out = (
                torch.cat([o.transpose(0, 1) for o in outs], -1)
                if dirs == 2
                else outs[0].transpose(0, 1).contiguous()
            )
            if drop:
                seq_out = F.dropout(seq_out, dropout, True)
            x = seq_out.transpose(0, 1)
        else:  # batch first already: no copy (torch's batch-first output is a transposed view anyway)
            x = torch.cat(outs, -1) if dirs == 2 else outs[0]
    output = x if batch_first else x.transpose(0, 1)
    return output, _stack(h_n), _stack(c_n) if c0 is not None else None


def _stack(states: list[Tensor]) -> Tensor:
    """``torch.stack(states)``; one layer's state as a view (no copy, a cheaper backward node)."""
    return states[0].unsqueeze(0) if len(states) == 1 else torch.stack(states, 0)


class RNN(_ScanRecurrent, nn.RNN):
    """``torch.nn.RNN`` whose backward runs through the scan (``J_t = diag(f'_t) W_hh``).

    Args: as ``torch.nn.RNN``, plus keyword ``algorithm`` (default ``"auto"``).

    Example:
        >>> rnn = RNN(1, 20, batch_first=True)
        >>> out, h_n = rnn(torch.randn(4, 100, 1))
        >>> out.shape, h_n.shape
        (torch.Size([4, 100, 20]), torch.Size([1, 4, 20]))
    """

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


class GRU(_ScanRecurrent, nn.GRU):
    """``torch.nn.GRU`` whose backward runs through the scan (Appendix E, Eq. 11). Args: as ``torch.nn.GRU``
    plus keyword ``algorithm``."""

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


class LSTM(_ScanRecurrent, nn.LSTM):
    """``torch.nn.LSTM`` whose backward runs through the scan over the joint state ``[h; c]``.
    Args: as ``torch.nn.LSTM`` plus keyword ``algorithm``; ``proj_size > 0`` is not supported."""

    def __init__(self, *args: Any, algorithm: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_scan(algorithm)


_TYPES = {nn.RNN: RNN, nn.GRU: GRU, nn.LSTM: LSTM}


def _rebuild(module: nn.RNNBase, cls: type[nn.RNNBase]) -> nn.RNNBase:
    """A ``cls`` configured like ``module`` that holds ``module``'s very ``Parameter`` objects (hooks: see callers).

    Built on the meta device, so nothing is allocated; ``algorithm`` (BPPSA classes) keeps its default.
    """
    kwargs = dict(
        input_size=module.input_size,
        hidden_size=module.hidden_size,
        num_layers=module.num_layers,
        bias=module.bias,
        batch_first=module.batch_first,
        dropout=module.dropout,
        bidirectional=module.bidirectional,
        device="meta",
    )
    if isinstance(module, nn.RNN):
        kwargs["nonlinearity"] = module.nonlinearity
    new = cls(**kwargs)
    for name in module._flat_weights_names:
        setattr(new, name, getattr(module, name))
    return new.train(module.training)


@register_converter
def _convert_recurrent(module: nn.Module) -> Conversion | None:
    """Swap an exact ``torch.nn.RNN/GRU/LSTM`` for its BPPSA class, keeping the same ``Parameter`` objects."""
    target = _TYPES.get(type(module))
    if target is None:
        # parametrize derived a class of its own, whose properties compute the weights: rebuilding the module
        # would lose the parametrizations (the BPPSA classes take them: parametrize one of those instead)
        base = type(module).__bases__[0]
        if base not in _TYPES or not parametrize.is_parametrized(module):
            return None
        return Conversion(
            None, f"parametrized weights (torch.nn.utils.parametrize): stays on torch autograd; build "
            f"lightning_bppsa.nn.{base.__name__} and parametrize it to scan",
        )  # fmt: skip
    if getattr(module, "proj_size", 0) > 0:
        return Conversion(None, "proj_size > 0 is not supported by the scan; stays on torch autograd")
    new = _rebuild(module, target)
    return Conversion(new, f"{type(module).__name__}: backward through the scan")
