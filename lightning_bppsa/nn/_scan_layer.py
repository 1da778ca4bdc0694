"""One recurrent layer in one direction as an ``autograd.Function`` over the cell's two ops.

:class:`LayerFunction` connects ``(x, h0[, c0], W_ih, W_hh[, b_ih, b_hh])`` to the layer's outputs
``out`` ``(B, n, H)`` (``h_1..h_n``; eagerly the forward op's own tensor, not a copy), ``h_n`` ``(B, H)``
(a copy of ``out[:, -1]``: its gradient reaches the kernel on its own, never added into a ``(B, n, H)`` one)
and, for cells with a cell state, ``c_n``:

- the call's plan (:func:`~lightning_bppsa.backends.plan_call`: forward and backward backends, the scan's
  plan), made once, eagerly, before the forward op runs, kept on the autograd context and reported in
  ``stats["plan"]``; while ``torch.compile`` traces nothing is planned, and each op plans at run time;
- forward: ``bppsa::recurrent_forward`` (states and Jacobian factors in one pass); under autocast it computes
  in the parameters' dtype and rounds its outputs to the dtype torch's layer returns there (exact states for
  the backward, as cuDNN keeps its state in float32; :func:`layer_autocast_dtype`);
- backward: ``bppsa::recurrent_backward`` (scan, gate gradients and the GEMMs of Eq. 2, in the parameters'
  dtype), with autocast off whatever autocast state ``backward()`` is called under; a recomputed forward
  runs under the forward's (:mod:`~lightning_bppsa.nn._autocast`);
- inside :func:`~lightning_bppsa.nn.reference_backward`, and under ``create_graph=True`` (double
  backward): plain autograd through the cell's torch forward, recomputed.

Eagerly, with nothing that could intercept the dispatcher (:func:`_dispatched`), the two ops' Python
implementations are called directly; traced, profiled or under a mode they are dispatched as ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa import backends
from lightning_bppsa.backends import LayerCall, plan_call
from lightning_bppsa.cells import CELLS
from lightning_bppsa.nn._autocast import autocast_state, replay_autocast, without_autocast
from lightning_bppsa.nn._clock import clock, record
from lightning_bppsa.nn._reference_backward import reference_backward_enabled
from lightning_bppsa.ops import owned, recurrent_forward

__all__ = ["LayerFunction", "forward_only"]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a recurrent layer in on ``device_type``, or ``None`` outside autocast."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return layer_autocast_dtype(device_type, torch.get_autocast_dtype(device_type))
    return None


def layer_autocast_dtype(device_type: str, autocast: torch.dtype) -> torch.dtype:
    """The dtype torch's own recurrent layer takes under autocast to ``autocast`` on ``device_type``: on CUDA
    with cuDNN, float16 whatever ``autocast`` is (torch's autocast wrapper of ``_cudnn_rnn`` casts to half,
    also under bfloat16 autocast), else ``autocast``. A BPPSA layer rounds its outputs to the same dtype, so
    that it returns what torch's does (bfloat16 outputs on an H100 gave input gradients 2x less exact than
    torch's float16 ones)."""
    if device_type == "cuda" and torch.backends.cudnn.enabled:
        return torch.float16
    return autocast


#: the argument types an op implementation may be called on directly (a tensor subclass may handle the op itself)
_PLAIN = frozenset((Tensor, torch.nn.Parameter, type(None)))


def _dispatched(tensors) -> bool:
    """Whether an op call must go through torch's dispatcher: something may intercept it (torch.compile or
    jit tracing, a dispatch or function mode, the profiler, a tensor subclass). Otherwise the layer calls the
    op's implementation directly: the same Python function, without the ~16 µs the dispatcher takes to reach
    it with these arguments (measured, twice per training step)."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._autograd._profiler_enabled()
        or torch._C._get_tracing_state() is not None
        or not _PLAIN.issuperset(map(type, tensors))
    )


def _lowered(cell: str, device_type: str, autocast: torch.dtype | None, weights) -> torch.dtype | None:
    """The dtype autocast (``autocast``: :func:`_autocast_dtype`) gives this layer's outputs, ``None`` where
    they keep the parameters' dtype, as torch's layer's do (its CPU GRU: the float32 state enters each output).

    Under autocast the layer computes its states and Jacobian factors in the parameters' dtype and rounds
    only its outputs: the backward then reads exact states, as cuDNN's half-precision layers keep their
    state in float32 (states rounded to bfloat16 each step made the gradients 3-20x less accurate than
    cuDNN's on an H100)."""
    if autocast == weights[0].dtype or (device_type == "cpu" and cell == "gru"):
        return None
    return autocast


def _op_inputs(dtype: torch.dtype | None, x: Tensor, h0: Tensor, c0: Tensor | None, weights) -> list:
    """``[x, h0, c0, *weights]`` as the forward op takes them: cast to ``dtype`` if given (autocast)."""
    tensors = [x, h0, c0, *weights]
    return tensors if dtype is None else [None if t is None else t.to(dtype) for t in tensors]


def _forward_op(cell: str, call: LayerCall | None, args: list) -> list[Tensor]:
    """``bppsa::recurrent_forward`` on ``args`` (:func:`_op_inputs`), eagerly under ``call``."""
    if _dispatched(args):
        return torch.ops.bppsa.recurrent_forward(cell, args[0], args[1], args[2], list(args[3:]))
    return recurrent_forward(cell, args[0], args[1], args[2], list(args[3:]), call)


def _timed_forward(cell: str, call: LayerCall | None, stats: dict, autocast: bool, args: list):
    """:func:`_forward_op`, its seconds added to ``stats["forward_seconds"]`` (eager mode). ``autocast`` (on):
    the op runs with autocast off, so its input projection, a torch GEMM, computes in the parameters' dtype
    too."""
    start = clock()
    if not autocast:
        results = _forward_op(cell, call, args)
    else:
        with without_autocast(args[0].device.type):
            results = _forward_op(cell, call, args)
    record(stats, "forward_seconds", clock() - start, add=True)
    return results


def _outputs(cell: str, out: Tensor, results: list[Tensor], low: torch.dtype | None) -> tuple[Tensor, ...]:
    """The layer's outputs: ``out``, ``h_n`` (a copy of ``out[:, -1]``) and for a cell state ``c_n`` (rounded
    to ``low`` if given)."""
    cell_state = [
        c if low is None else c.to(low) for c in results[1 : 2 if CELLS[cell].has_cell_state else 1]
    ]
    return (out, out[:, -1].clone(), *cell_state)


def forward_only(cell: str, algorithm: str, stats: dict, x: Tensor, h0: Tensor, c0: Tensor | None, *weights):
    """:class:`LayerFunction`'s outputs where no gradient is needed (inference, also under
    ``torch.inference_mode``): the forward op alone, nothing kept for a backward. Same arguments."""
    autocast = _autocast_dtype(x.device.type)
    low = _lowered(cell, x.device.type, autocast, weights)
    args = _op_inputs(None if autocast is None else weights[0].dtype, x, h0, c0, weights)
    results = _timed_forward(cell, None, stats, autocast is not None, args)
    return _outputs(cell, results[0] if low is None else results[0].to(low), results, low)


class LayerFunction(torch.autograd.Function):
    """See the module docstring. Args: ``cell`` (a name of :data:`~lightning_bppsa.cells.CELLS`),
    ``algorithm``, ``stats`` (dict updated in place), then ``x`` ``(B, n, I)``, ``h0`` ``(B, H)``,
    ``c0`` ``(B, H)`` or ``None``, the weights. Returns ``(out, h_n)`` or ``(out, h_n, c_n)``."""

    @staticmethod
    def forward(
        ctx, cell: str, algorithm: str, stats: dict, x: Tensor, h0: Tensor, c0: Tensor | None, *weights
    ):
        ctx.low = _autocast_dtype(x.device.type)  # the reference backward recomputes torch's forward in it
        low = _lowered(cell, x.device.type, ctx.low, weights)
        ctx.compute = None if ctx.low is None else weights[0].dtype
        args = _op_inputs(ctx.compute, x, h0, c0, weights)
        ctx.call = None
        if not torch.compiler.is_compiling():  # traced: each op plans when it runs, never in the graph
            ctx.call = plan_call(CELLS[cell], algorithm, args[0], args[1], args[2], args[3:])
            stats["scan_algorithm"], stats["plan"] = ctx.call.scan.text, str(ctx.call)
        results = _timed_forward(cell, ctx.call, stats, ctx.compute is not None, args)
        outputs = 2 if CELLS[cell].has_cell_state else 1
        ctx.cell, ctx.algorithm, ctx.stats = cell, algorithm, stats
        ctx.autocast = autocast_state(x.device.type)
        out = results[0]
        # The backward needs the states as the forward left them; torch's RNN / GRU let the caller modify
        # their output in place. Eagerly the caller gets out itself and the backward recomputes the states
        # if out's version moved (rare; a copy each step costs more). Compiled graphs keep a copy.
        if low is not None:  # the caller gets the rounded copy
            saved, returned, ctx.out = out, out.to(low), None
        elif torch.compiler.is_compiling():
            saved, returned, ctx.out = out, out.clone(), None
        else:
            saved, returned = None, out
            ctx.out, ctx.out_version = out.detach(), out._version  # shares out's version counter
        ctx.save_for_backward(x, h0, c0, saved, *weights, *results[outputs:])
        ctx.weights = len(weights)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, no zeros (B, n, H)
        return _outputs(cell, returned, results, low)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None = None):
        with replay_autocast(ctx.autocast):  # not the caller's: manual_backward runs inside autocast
            return LayerFunction._backward(ctx, grad_out, grad_hn, grad_cn)

    @staticmethod
    def _backward(ctx, grad_out: Tensor | None, grad_hn: Tensor | None, grad_cn: Tensor | None):
        x, h0, c0, out, *rest = ctx.saved_tensors
        if out is None:  # eager: out itself, unless modified in place since the forward (then recomputed)
            kept = ctx.out
            if not _keeps_graph():  # released as autograd releases saved tensors; a retained graph keeps it
                ctx.out = None
            unchanged = kept is not None and kept._version == ctx.out_version
            if unchanged:
                out = kept
            else:
                out = _forward_op(
                    ctx.cell, ctx.call, _op_inputs(ctx.compute, x, h0, c0, rest[: ctx.weights])
                )[0]
        weights, factors = rest[: ctx.weights], rest[ctx.weights :]
        needs = ctx.needs_input_grad[3:]
        # grad mode is on in a backward only under create_graph=True (double backward, e.g. a gradient
        # penalty): the scan's result is not differentiable, autograd's through the recomputed forward is
        create_graph = torch.is_grad_enabled()
        if create_graph or reference_backward_enabled():
            if grad_hn is not None:  # differentiably: under create_graph the gradients are functions of it
                last = torch.cat([torch.zeros_like(out[:, :-1]), grad_hn.unsqueeze(1)], 1)
                grad_out = last if grad_out is None else grad_out + last
            grads = CELLS[ctx.cell].autograd_gradients(
                ctx.low, (x, h0, c0, *weights), needs, (grad_out, grad_cn), create_graph
            )
        else:
            start = clock()
            tensors = (x, h0, c0, *weights, out, *factors, grad_out, grad_hn, grad_cn)
            args = (ctx.cell, ctx.algorithm, x, h0, c0, list(weights), out, list(factors), grad_out, grad_hn, grad_cn,
                    needs[0])  # fmt: skip
            with without_autocast(x.device.type):  # it computes in the dtypes it chose, not autocast's
                if _dispatched(tensors):
                    grads = torch.ops.bppsa.recurrent_backward(*args)
                else:  # eagerly only the gradients asked for are copied out of the scan's buffer (h0's seldom is)
                    grads = backends.backward(CELLS[ctx.cell], ctx.algorithm, ctx.call, *args[2:])
                    grads = [owned(g) if need else g for g, need in zip(grads, _with_c0(needs, c0), strict=True)]
            if c0 is None:
                grads = [*grads[:2], None, *grads[2:]]
            record(ctx.stats, "scan_seconds", clock() - start, add=True)
        return (None, None, None, *[g if need else None for g, need in zip(grads, needs, strict=True)])


#: whether the running backward keeps the graph (``retain_graph=True``): torch's own query, private (present in
#: torch 2.11-2.13); without it every backward releases the states and a second one recomputes them
_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: False)


def _with_c0(needs: tuple[bool, ...], c0: Tensor | None) -> tuple[bool, ...]:
    """``needs`` (of ``x, h0, c0, *weights``) without ``c0``'s where the layer has none (nor a gradient for it)."""
    return needs if c0 is not None else (*needs[:2], *needs[3:])
