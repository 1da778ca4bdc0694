"""BPPSA version of ``nn.Sequential`` chains of supported layers (BPPSA Sec. 3.3-3.4, 4.3, 5.3).

:class:`SparseChain` is an ``nn.Sequential`` (same children, names, ``Parameter`` objects and
``state_dict`` keys) whose backward runs through :func:`~lightning_bppsa.sparse_scan.sparse_backprop_scan`:

- forward: every layer runs its ordinary forward through :func:`~lightning_bppsa.jacobians.linearize`,
  which also returns its CSR transposed Jacobian ``J_iᵀ`` (pattern cached per layer and shape, values
  from this forward: ReLU masks, pooling indices, dropout masks);
- backward: the scan gives ``g_i = ∇_{x_i} l`` for every state (Eq. 3-5); each layer's parameter gradients
  come from its own input ``x_{i-1}`` and output gradient ``g_i`` (Eq. 2, no sequential dependency);
- inside :func:`~lightning_bppsa.nn.reference_backward`, and under ``create_graph=True`` (double
  backward), the backward is plain autograd through the recorded forward instead (same dropout masks).

A call runs the layers' own forward under plain autograd (``last_stats["path"] == "autograd"``, with
the ``reason``) when there is nothing to scan or the scan cannot run: gradients disabled, an empty
batch, meta tensors, ``torch.func`` transforms, ``torch.compile`` tracing, a layer whose configuration or
mode has no analytic Jacobian (``Conv2d(padding_mode="reflect")``, ``BatchNorm2d`` in training mode or
without running statistics, ``MaxPool2d(return_indices=True)``, any unsupported module), an input the
layers take but not as a batch (an unbatched ``(C, H, W)`` image, a 1-D ``Linear`` input), or a layer with
hooks. So a chain never fails where the equivalent ``nn.Sequential`` runs, and input torch rejects gets
torch's own error from the layer's forward.
``torch.jit.script`` compiles the equivalent ``nn.Sequential`` (see :meth:`SparseChain.__prepare_scriptable__`).

With ``algorithm="auto"`` the first call of each input shape times both whole forward + backward passes on
its own data (CUDA events on CUDA) and keeps the faster (:func:`~lightning_bppsa.layer_plan.plan_layer`,
``last_stats["decision"]``; on a CPU the scan measured 1.5-23x slower than autograd on VGG-11's
convolutions, on an H200 13-65x slower than cuDNN), so a converted chain never pays for the scan unasked;
where nothing may measure (``layer_plan.measurements(False)``) a chain on CUDA keeps cuDNN's autograd and one
elsewhere scans. A named algorithm always scans.

Precision: the scan computes in one dtype, :func:`~lightning_bppsa.sparse_scan.scan_dtype` of the
Jacobians and the output gradient (float32 for float16 / bfloat16 chains, with or without autocast:
torch's CPU sparse products have no half kernels); the input and parameter gradients come back in
their own dtypes. Under autocast the layers' parameter gradients are replayed under the same autocast
state as the forward, as torch's would be.

``last_stats`` records what the last forward did, like the recurrent modules' (``nn/recurrent.py``):
``path`` (``"scan"`` / ``"autograd"``), ``reason`` (why autograd; ``None`` on the scan), ``algorithm``,
``layers``, ``scan_dtype`` (the dtype the scan computes in, ``None`` on autograd), ``linearize_seconds``
(the layers' forward together with their Jacobian generation: :func:`~lightning_bppsa.jacobians.linearize`
does both in one call, so the Jacobian part alone is not measured and no ``jacobian_seconds`` is
reported), ``scan_seconds`` and ``param_seconds`` (the backward's scan and parameter gradients, filled
in by the backward; they stay 0 under ``reference_backward``).

Where conversion pays off (the converter is conservative): the scan's per-step work is sparse
matrix-vector / matrix-matrix products whose cost follows the Jacobians' sparsity. Convolution, pooling
and element-wise layers have very sparse Jacobians (Table 1), and pruned convolutions sparser still
(Sec. 5.3); a dense ``nn.Linear`` Jacobian is a dense block, and products with it are dense. So only
chains with at least :data:`MIN_LAYERS` layers that contain an ``nn.Conv2d`` are converted; chains
with a layer the scan cannot take (see :func:`~lightning_bppsa.jacobians.refusal`: e.g.
``Conv2d(padding_mode="reflect")``, ``MaxPool2d(return_indices=True)``), with ``nn.BatchNorm2d`` in any
mode (in training mode its Jacobian couples the batch) or with hooks on a layer (the scan does not call
the layers) stay on autograd, and the conversion report says why. Even
then, on CPU the sparse scan is slower than autograd's fused convolution backward
(``benchmarks/results/vgg-cpu.md``): conversion is meant for the paper's setting (many workers, pruned
weights), and exactness is what the tests guarantee. On CUDA, where cuDNN's convolutions measured 13-65x
faster than the scan with its Jacobians' linearisation (``benchmarks/results/sparse-chain-h200-2026-11-26.txt``),
``algorithm="auto"`` measures the same way and says which ran; an explicit algorithm forces the scan.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

from lightning_bppsa import layer_plan
from lightning_bppsa.jacobians import BatchedCSR, CSRPattern, is_supported, linearize, output_dims, refusal
from lightning_bppsa.nn._autocast import AutocastState, autocast_state, replay_autocast
from lightning_bppsa.nn._clock import clock
from lightning_bppsa.nn._reference_backward import reference_backward_enabled
from lightning_bppsa.nn.convert import Conversion, carry_hooks, register_converter
from lightning_bppsa.plan import check_algorithm
from lightning_bppsa.sparse_scan import (
    ScanStepFlops,
    scan_dtype,
    scan_flop_report,
    sparse_backprop_scan,
)

__all__ = ["MIN_LAYERS", "SparseChain"]

#: the shortest chain the converter wraps
MIN_LAYERS = 3


class SparseChain(nn.Sequential):
    """``nn.Sequential`` of supported layers whose backward is a sparse BPPSA scan.

    Args:
        *args: as ``nn.Sequential`` (modules, or one ``OrderedDict``).
        algorithm: passed to :func:`~lightning_bppsa.sparse_scan.sparse_backprop_scan`, one of
            :data:`~lightning_bppsa.sparse_scan.ALGORITHMS` (``"auto"``: the tree's depth from predicted
            FLOPs; ``"chunked"``: reduce-then-scan over chunks).

    Inputs are batches ``(B, *sample_shape)``. A layer the scan cannot take in its current
    configuration and mode (``BatchNorm2d`` in training mode, ...) or input it cannot take as a batch
    make the whole chain run on plain autograd for that call (``last_stats["reason"]`` says why).
    Its ``repr`` names it ``SparseChain(BPPSA sparse scan, algorithm=...)`` above the layers.

    Example:
        >>> chain = SparseChain(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten())
        >>> chain(torch.randn(4, 1, 5, 5, requires_grad=True)).sum().backward()
        >>> chain.last_stats["path"], chain.last_stats["scan_dtype"]
        ('scan', 'torch.float32')
    """

    def __init__(self, *args: nn.Module, algorithm: str = "auto") -> None:
        check_algorithm(algorithm)
        super().__init__(*args)
        self.algorithm = algorithm
        self._last_patterns: list[CSRPattern] | None = None
        self.last_stats: dict[str, Any] = {}

    @classmethod
    def from_sequential(cls, sequential: nn.Sequential, algorithm: str = "auto") -> SparseChain:
        """Wrap the children of ``sequential`` (the same module and ``Parameter`` objects, same names)."""
        chain = cls(OrderedDict(sequential.named_children()), algorithm=algorithm)
        return chain.train(sequential.training)

    def _get_name(self) -> str:
        # what nn.Module's repr prints before the layers: say that this is not a plain nn.Sequential
        return f"SparseChain(BPPSA sparse scan, algorithm={self.algorithm!r})"

    def _why_autograd(self, x: Tensor, params: tuple[nn.Parameter, ...]) -> str | None:
        """Why this call runs on plain autograd, or ``None`` when the scan runs it."""
        if not isinstance(x, Tensor):
            return f"the input is a {type(x).__name__}, not a Tensor"
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            return "no gradient is needed"
        if x.numel() == 0 or x.device.type == "meta":
            return "no values to scan (an empty batch or the meta device)"
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return "torch.func / torch.compile: the sparse scan has no functorch rules and no trace"
        ndim = x.dim()
        for i, layer in enumerate(self):
            reason = _unscannable(layer, runtime=True)
            if reason is not None:
                return f"layer {i}, {reason}"
            out = output_dims(layer, ndim)
            if out is None:
                return f"layer {i}, {type(layer).__name__} does not take a {ndim}-dim input as a batch"
            ndim = out
        return None

    def forward(self, input: Tensor) -> Tensor:  # named as nn.Sequential's, which callers may pass by name
        known = plan = self._decided(input)
        if known is not None and known.path == "autograd":
            # autograd decided for this input shape: what else could keep the call off the scan needs no check
            # (~30 us a call for VGG-11's 21 layers on a CPU, more on a GPU host)
            params, reason = (), f"auto: {known.reason}"
        else:
            params, plan = tuple(p for p in self.parameters() if p.requires_grad), None
            reason = self._why_autograd(input, params)
            if reason is None and self.algorithm == "auto":
                plan = known or self._auto(input, params)
                reason = None if plan.path == "scan" else f"auto: {plan.reason}"
        # a fresh dict per call: the backward of this forward updates the one it was given
        self.last_stats = self._new_stats(reason)
        if plan is not None:
            self.last_stats["decision"] = plan.reason
        if reason is not None:
            return super().forward(input)
        return _ChainFunction.apply(self, input, *params)

    def _new_stats(self, reason: str | None) -> dict[str, Any]:
        """``last_stats`` of a call on the scan (``reason`` ``None``) or on autograd (why), before it runs."""
        return {
            "path": "scan" if reason is None else "autograd",
            "reason": reason,
            "algorithm": self.algorithm,
            "layers": len(self),
            "scan_dtype": None,
            "linearize_seconds": 0.0,
            "scan_seconds": 0.0,
            "param_seconds": 0.0,
        }

    def _auto(self, x: Tensor, params: tuple[nn.Parameter, ...]) -> layer_plan.LayerPlan:
        """``algorithm="auto"``: the scan or autograd for this call, and why. The faster of the two whole
        forward + backward passes, measured once per input shape on the call's own data
        (:func:`~lightning_bppsa.layer_plan.plan_layer`, CUDA events on CUDA; the scan measured 1.5-23x slower
        than autograd on VGG-11's convolutions on a CPU, ``benchmarks/results/vgg-cpu.md``, and 13-65x slower
        than cuDNN on an H200, so a converted chain must not pay for it unasked). No model prices a chain:
        where nothing may measure (``layer_plan.measurements(False)``) a chain on CUDA runs cuDNN's autograd
        (:data:`_CUDA_UNMEASURED`), elsewhere the scan it was converted to. A kept decision is kept on the chain
        too, for :meth:`_decided` (the forward asks it first)."""
        shape = layer_plan.LayerShape(
            f"SparseChain {id(self):x}", len(self), 1, x.shape[0], 0, math.prod(x.shape[1:]), 0, x.dtype,
            str(x.device), persist=False,
        )  # fmt: skip
        on_cuda = x.device.type == "cuda"
        plan = layer_plan.plan_layer(
            shape, lambda: _CUDA_UNMEASURED if on_cuda else "no model for layer chains",
            lambda: self._measure(x, params), timed="a forward + backward",
            unmeasured="autograd" if on_cuda else "scan",
        )  # fmt: skip
        if layer_plan.cached(shape):
            self._plan_memo = (_memo_key(x), plan)
        return plan

    def _decided(self, x: object) -> layer_plan.LayerPlan | None:
        """``algorithm="auto"``'s kept decision for an input like ``x`` (eager calls only), or ``None``."""
        if self.algorithm != "auto" or not isinstance(x, Tensor) or torch.compiler.is_compiling():
            return None
        memo = self.__dict__.get("_plan_memo")
        return memo[1] if memo is not None and memo[0] == _memo_key(x) else None

    def _measure(self, x: Tensor, params: tuple[nn.Parameter, ...]) -> dict[str, float]:
        """Seconds of this call's forward + backward on each path (the gradients returned, not accumulated),
        the random state restored so that the call itself draws what it would have drawn."""
        wrt = [t for t in (x, *params) if t.requires_grad]
        stats, self.last_stats = self.last_stats, self._new_stats(None)  # what the scan's backward fills in
        sequential = super().forward
        times = layer_plan.time_training_steps(
            {"scan": lambda: _ChainFunction.apply(self, x, *params), "autograd": lambda: sequential(x)},
            wrt,
            x.device,
        )
        self.last_stats = stats
        return times

    def __prepare_scriptable__(self) -> nn.Sequential:
        """What ``torch.jit.script`` compiles: an ``nn.Sequential`` of the same layers and this chain's hooks.

        A scripted chain runs the layers' own forward and autograd backward (TorchScript cannot compile the
        sparse scan). Torch's protocol also puts it into a parent being scripted (``torch.jit.script(model)``
        swaps it in ``model`` itself): ``convert(model)`` again to get the scan back in eager mode.
        """
        sequential = nn.Sequential(OrderedDict(self.named_children()))
        carry_hooks(self, sequential)
        return sequential.train(self.training)

    def flop_report(self) -> list[ScanStepFlops]:
        """:func:`~lightning_bppsa.sparse_scan.scan_flop_report` of the last scanned forward's Jacobians."""
        if self._last_patterns is None:
            raise RuntimeError("SparseChain.flop_report needs a forward with gradients enabled first")
        return scan_flop_report(self._last_patterns, algorithm=self.algorithm)


#: why a chain on CUDA runs cuDNN's autograd where ``algorithm="auto"`` may not measure (a measured ratio, far
#: outside any noise)
_CUDA_UNMEASURED = (
    "no model for layer chains on CUDA (the sparse scan measured 13-65x slower than cuDNN on an H200, the "
    "Jacobians' linearisation dominating: benchmarks/results/sparse-chain-h200-2026-11-26.txt)"
)


def _memo_key(x: Tensor) -> tuple:
    """What a chain's kept ``"auto"`` decision is for: the input's shape, dtype and device, the plans'
    generation (:func:`~lightning_bppsa.layer_plan.forget` drops them) and, on CUDA, whether a CUDA graph is
    being captured (:attr:`~lightning_bppsa.layer_plan.LayerPlan.captured`)."""
    return (x.shape, x.dtype, x.device, layer_plan.generation(), x.is_cuda and torch.cuda.is_current_stream_capturing())


def _unscannable(layer: nn.Module, *, runtime: bool) -> str | None:
    """Why ``layer`` keeps its chain on autograd, or ``None``. ``runtime``: judge its current mode only
    (the converter, ``runtime=False``, refuses ``BatchNorm2d`` in any mode: it may be trained later)."""
    name = type(layer).__name__
    reason = refusal(layer)
    if reason is not None:
        return reason
    if isinstance(layer, nn.BatchNorm2d) and not runtime:
        return "BatchNorm2d: its training-mode Jacobian couples the batch"
    if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks:
        return f"{name} has hooks: the scan does not call its layers, so they would not run"
    return None


def _replay(layer: nn.Module, x: Tensor, jac: BatchedCSR) -> Tensor:
    """``layer(x)`` under autograd, with training-mode dropout reusing the recorded mask ``diag(Jᵀ)``."""
    if isinstance(layer, nn.Dropout) and layer.training and layer.p > 0:
        return x * jac.values.reshape(x.shape)
    return layer(x)


class _ChainFunction(torch.autograd.Function):
    """``y = chain(x)``; backward: the sparse scan for every state, then per-layer parameter gradients."""

    @staticmethod
    def forward(ctx, chain: SparseChain, x: Tensor, *params: nn.Parameter) -> Tensor:
        h, inputs, jacs = x, [], []
        start = clock()
        for layer in chain:
            inputs.append(h)
            h, jac = linearize(layer, h)
            jacs.append(jac)
        ctx.stats = chain.last_stats
        ctx.stats["linearize_seconds"] = clock() - start
        ctx.stats["scan_dtype"] = str(scan_dtype([h.dtype, *(j.values.dtype for j in jacs)]))
        ctx.chain, ctx.inputs, ctx.jacs, ctx.params = chain, inputs, jacs, params
        ctx.autocast = autocast_state(x.device.type)
        chain._last_patterns = [j.pattern for j in jacs]
        return h.clone() if h is x or h._base is x else h  # an autograd.Function must not return a view of x

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        chain, inputs, jacs, params = ctx.chain, ctx.inputs, ctx.jacs, ctx.params
        needs_x = ctx.needs_input_grad[1]
        # grad mode is on in a backward only under create_graph=True (double backward): the scan's result
        # is not differentiable, autograd's through the recorded forward is
        create_graph = torch.is_grad_enabled()
        if create_graph or reference_backward_enabled():
            grad_x, param_grads = _autograd_backward(
                chain, inputs[0], jacs, params, grad_out, needs_x, create_graph, ctx.autocast
            )
        else:
            grad_x, param_grads = _scan_backward(
                chain, inputs, jacs, params, grad_out, needs_x, ctx.stats, ctx.autocast
            )
        # the scan computes in one dtype: every gradient in the dtype of what it is the gradient of
        param_grads = [None if g is None else g.to(p.dtype) for g, p in zip(param_grads, params, strict=True)]
        return (None, None if grad_x is None else grad_x.to(inputs[0].dtype), *param_grads)


def _scan_backward(
    chain: SparseChain,
    inputs: list[Tensor],
    jacs: list[BatchedCSR],
    params: tuple[nn.Parameter, ...],
    grad_out: Tensor,
    needs_x: bool,
    stats: dict[str, Any],
    autocast: AutocastState | None,
) -> tuple[Tensor | None, list[Tensor | None]]:
    first = 0 if needs_x else 1  # without x's gradient the scan starts at x_1
    start = clock()
    states = sparse_backprop_scan(
        jacs[first:], grad_out.reshape(grad_out.shape[0], -1), algorithm=chain.algorithm
    )
    scanned = clock()
    stats["scan_seconds"] += scanned - start
    grad_x = states[0].reshape(inputs[0].shape) if needs_x else None
    wanted = {id(p) for p in params}
    grads: dict[int, Tensor] = {}
    for i, layer in enumerate(chain):
        own = [p for p in layer.parameters() if id(p) in wanted]
        if not own:
            continue
        with torch.enable_grad(), replay_autocast(autocast):
            y = _replay(layer, inputs[i].detach(), jacs[i])
        g = states[i + 1 - first].reshape(y.shape).to(y.dtype)
        for p, grad in zip(own, torch.autograd.grad(y, own, g, allow_unused=True), strict=True):
            if grad is not None:
                grads[id(p)] = grads[id(p)] + grad if id(p) in grads else grad
    stats["param_seconds"] += clock() - scanned
    return grad_x, [grads.get(id(p)) for p in params]


def _autograd_backward(
    chain: SparseChain,
    x: Tensor,
    jacs: list[BatchedCSR],
    params: tuple[nn.Parameter, ...],
    grad_out: Tensor,
    needs_x: bool,
    create_graph: bool,
    autocast: AutocastState | None,
) -> tuple[Tensor | None, list[Tensor | None]]:
    """The reference: plain autograd through the recorded forward. With ``create_graph`` the replay starts
    from the chain's own input, so the gradients are functions of it that autograd can differentiate again."""
    with torch.enable_grad():
        h = x0 = x if create_graph else x.detach().requires_grad_(needs_x)
        with replay_autocast(autocast):
            for layer, jac in zip(chain, jacs, strict=True):
                h = _replay(layer, h, jac)
        wrt = ([x0] if needs_x else []) + list(params)
        grads = list(torch.autograd.grad(h, wrt, grad_out, allow_unused=True, create_graph=create_graph))
    grad_x = grads.pop(0) if needs_x else None
    return grad_x, grads


@register_converter
def convert_chain(module: nn.Module) -> Conversion | None:
    """Wrap a plain ``nn.Sequential`` of supported layers in a :class:`SparseChain` where it may pay off.

    Answers ``None`` (not a chain of supported layers: conversion recurses into it) or a
    :class:`~lightning_bppsa.nn.Conversion` with the replacement, or with ``None`` and the reason it
    stays on autograd.
    """
    if type(module) is not nn.Sequential or len(module) == 0 or not all(is_supported(m) for m in module):
        return None
    kinds = ", ".join(type(m).__name__ for m in module)
    if not any(isinstance(m, nn.Conv2d) for m in module):
        return Conversion(
            None, f"chain without Conv2d ({kinds}): dense Jacobians, the sparse scan cannot pay off"
        )
    for i, layer in enumerate(module):
        reason = _unscannable(layer, runtime=False)
        if reason is not None:
            return Conversion(None, f"layer {i}, {reason}")
    if len(module) < MIN_LAYERS:
        return Conversion(None, f"chain of {len(module)} layers: shorter than MIN_LAYERS={MIN_LAYERS}")
    return Conversion(
        SparseChain.from_sequential(module), f"sparse BPPSA scan over {len(module)} layers ({kinds})"
    )
