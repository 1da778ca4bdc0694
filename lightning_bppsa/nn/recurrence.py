"""``Recurrence(cell)``: the exact parallel-scan backward for any recurrent cell a user writes (BPPSA Sec. 3).

A *cell* is any ``nn.Module`` with ``cell(x_t, state) -> state``: ``x_t`` is ``(B, I)``, ``state`` a
``(B, d)`` tensor or a tuple of ``(B, d_k)`` tensors (e.g. ``(h, c)``), flattened here into one vector of
``d = Σ d_k``. :class:`Recurrence` loops it over time like ``torch.nn.RNN`` and computes the backward as
a scan instead of ``T`` small autograd steps:

- forward: the loop over time *without* autograd recording; the states ``s_0..s_T`` are kept as
  ``(B, T + 1, d)``;
- backward: (1) the step Jacobians ``J_t = ∂s_t/∂s_{t-1}`` of all ``B T`` steps at once (rows ``(b, t)``
  flattened); (2) the scan :func:`~lightning_bppsa.backprop_scan` with the per-step gradients of the
  states as direct gradients, giving ``g_t = ∇_{s_t} l``; (3) every parameter and input gradient in one
  vector-Jacobian product over all steps with cotangents ``g_1..g_T`` (Eq. 2: no sequential
  dependency); ``state0``'s gradient is ``g_0``.

**The traced step** (:mod:`~lightning_bppsa.nn.cell_structure`). Before the first scan for a batch shape
the cell's step is traced into its aten graph (``make_fx``, fake tensors). The forward then runs the
input-only nodes (the input projection) once for all ``B T`` rows and only the state-dependent nodes per
step. Where the state reaches the new state only through parameter-only linear maps and pointwise ops,
(1) is the factored ``J = diag(c) + Σ_k diag(s_k) W_k`` (:class:`~lightning_bppsa.jacobians.FactoredJacobians`,
``k`` gate pieces of ``B T d`` scales each), from one pass of the graph over all rows that also records
(3); otherwise (1) is dense: the transposed Jacobians from ``d`` cotangents batched over calls of the cell
on all steps (``torch.autograd.grad(..., is_grads_batched=True)``), and (3) is the VJP of those calls.
The trace is checked once, on the batch's first steps, against the cell: its loop's states, the dense
Jacobians and the parameter gradients (``eps ** 0.75``); a cell that does not trace (data-dependent
control flow, ``.item()``, in-place ops, random numbers, a row count baked into a view, autocast) or fails
a check is called per step and gets dense Jacobians. ``last_stats`` says which: ``jacobians``
(``"factored"`` / ``"dense"``), ``dense_reason``, ``traced_forward``, ``trace_reason``.

**The compiled loop** (:mod:`~lightning_bppsa.nn.cell_kernel` on the CPU, :mod:`~lightning_bppsa.nn.cell_cuda`
on CUDA: the same generated step as kernels built with NVRTC; float32 / float64). A factored step's
pointwise part is generated as C with its forward-mode partials and built once (cached on disk): the forward
loop writes the states and the factors in one pass, and the backward is one C sweep (the linear scan fused
with the products the parameter VJP needs; ``"blelloch"`` / ``"chunked"``, or a plan that picks them, run
:func:`~lightning_bppsa.backprop_scan` instead), then the weights' GEMMs. It is checked once per trace
against the traced step (states, factors, VJP); an op it does not generate, a failed build or a failed
check keeps the torch path (``last_stats["cell_kernel"]``: ``"cpu"``, ``"cuda"`` or ``None``; ``cell_kernel_reason``
says why none, e.g. CuPy missing on a GPU). Without gradients
(``torch.no_grad``, evaluation) the compiled loop runs the forward alone (``path == "compiled loop"``;
under ``inference_mode`` only with a trace made before for the batch shape, since the checks need
autograd).

The per-step output is ``cell.output_fn(state)`` where the cell defines it, else the first tensor of the
state; ``output_fn`` is applied once to the states of all steps after the loop (an ordinary autograd op).

**Assumption: the cell treats batch rows independently** (row ``b`` of the new state depends only on
row ``b`` of ``x_t`` and of the state), which is what makes one call on all ``B T`` steps equal to ``T``
calls on ``B`` rows. With ``verify=True`` (default) the backward checks that the batched call reproduces
the forward's states (to ``sqrt(eps)``); a cell that mixes rows (batch norm over the batch, a
``.item()`` read over the whole batch that steers the computation, ...) fails that check. Gradients flow
to ``input``, ``state0`` and the cell's own parameters; tensors the cell captures from elsewhere get none.
The dense backward (and ``"auto"``'s probe, and the trace's checks) calls the cell again on batched rows:
side effects of a call (forward hooks, counters, running statistics) happen again there; the traced
forward and the factored backward run the traced graph and do not call the cell at all. The cell must return its state in the
state's dtype, also under autocast (cast it, e.g. ``h_new.to(h.dtype)``). The backward calls the cell under
the forward's autocast state, whatever state ``backward()`` is called under, and scans with autocast off.

**Falling back.** A cell the batched calls cannot handle never crashes training: the backward then
replays the loop with autograd (exact), ``last_stats["reason"]`` says why, one warning per module says
so, and later calls of that module run autograd through the loop directly. That covers a failing check
above, cells the batched gradient cannot run (ops without vmap support, in-place ops on the state), and
cells that modify their input state in place (seen in the forward). A cell that **draws random numbers**
(dropout in training mode; detected from the RNG state, CPU and the input's CUDA device) runs autograd
through the loop for that call, re-drawn from the same RNG state, so the same seed gives the same masks
as a plain loop. A cell drawing from its own ``torch.Generator`` is not detected and not supported.

``algorithm="auto"`` runs autograd through the loop when ``T == 1`` or the Jacobians (dense: ``B T d²``
elements, factored: ``B T (k + 1) d``, plus ``B T n d`` partials by ``n`` input values for the compiled
loop) exceed ``memory_budget`` bytes (1 GiB by default; the batched
gradient needs a few times that at peak). Otherwise it decides through the layer plan
(:func:`~lightning_bppsa.layer_plan.plan_layer`, as the built-in layers do). There is no cost model of a user
cell, so the first call of a shape *measures* (the plan's ``measure``): autograd's backward through the first
``k ≤ 256`` steps of the batch against the scan's whole backward over the same steps, and the scan runs
where it is faster. Both grow linearly with ``T``, so the decision is keyed by ``k``, not ``T``: the cell,
``B``, ``k``, the input's and state's widths, dtype and device. A cell whose step traced is named by a digest
of what runs (the traced graphs, whether they factor and where their compiled loop runs, the modules'
classes and training modes, the tensors' shapes, dtypes and ``requires_grad``, autocast, ``verify``): equal
cells share a decision, also with a later process where the on-disk plan cache is on; a cell that did not
trace is named by its object as well, and its decision stays in this process. Where nothing may measure
(``layer_plan.measurements(False)``) autograd runs, and the plan says why; ``layer_plan.forget()`` drops the
decisions. ``last_stats["plan"]`` says what ran (``"scan"``, ``"autograd (why)"``) and
``last_stats["decision"]`` which rule or decision chose it, e.g. ``measured: scan 1.2 ms vs torch 3.4 ms for
a backward through 256 steps``. Dense
Jacobians cost ``~d`` times a batched backward of the cell, so the dense scan pays for small ``B d²``
(e.g. ``B = 1``) only; the factored scan pays far more often, but its ``O(B (k + 1) d²)`` steps still lose
to autograd for wide joint states at larger ``B`` (measured on earlier commits); a fixed rule would
get it wrong for some cells. The probe runs under a forked RNG and also finds cells that draw random numbers
or cannot be batched before the scan's forward: those run autograd (the fallback as above, not cached as a
timing). Other values (``"linear"``, ``"blelloch"``, ``"chunked"``)
always run the scan with that algorithm. Autograd through the loop also runs where the scan has nothing
to do or cannot run: gradients disabled or not needed, an empty batch or sequence, the meta device,
``torch.func`` transforms, and while ``torch.compile`` traces (it traces the plain loop). Under
``create_graph=True`` (double backward) and inside :func:`~lightning_bppsa.nn.reference_backward` the
backward replays the loop with autograd.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor, fx, nn

from lightning_bppsa import layer_plan
from lightning_bppsa._random import generator_states, kept_generators, set_generator_states
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.layer_plan import LayerShape
from lightning_bppsa.nn._autocast import autocast_state, replay_autocast, without_autocast
from lightning_bppsa.nn._clock import clock, record
from lightning_bppsa.nn._reference_backward import reference_backward_enabled
from lightning_bppsa.nn.cell_cuda import CudaCellKernel
from lightning_bppsa.nn.cell_kernel import CellFactors, CellKernel, Unsupported
from lightning_bppsa.nn.cell_structure import CellStructure, NotTraceable, cell_tensors, describe, trace_cell
from lightning_bppsa.plan import check_algorithm, choose
from lightning_bppsa.scan import backprop_scan

__all__ = ["Recurrence"]

State = Union[Tensor, tuple[Tensor, ...]]

#: rows x d of one batched-gradient call: its (d, rows, k d) intermediates stay a few MiB, which measured
#: ~2x faster than one call over all B T rows (GRU-like cell, d = 32, B T = 16000, one core)
_JACOBIAN_ELEMENTS = 2**15

#: at most this many steps of a batch are run by the ``"auto"`` probe (see ``Recurrence._probe``)
_PROBE_STEPS = 256
#: the probe's clock (tests inject one)
_timer = time.perf_counter
#: what the layer plan says where it cannot measure a user cell
_NO_MODEL = "no cost model for a user cell"
_RANDOM = "the cell draws random numbers (e.g. dropout in training mode)"

#: a number per cell object (held weakly): the plan's key for a cell whose step did not trace
_CELL_NUMBERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_next_number = itertools.count(1)

#: steps of the batch's first rows on which a traced step is checked against the cell (once per trace)
_CHECK_STEPS, _CHECK_ROWS = 2, 4

_NO_GRADIENT = "no gradient is needed"

#: errors a cell or torch raises where the batched calls cannot run the cell (vmap rules, in-place ops)
_BATCHING_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError)


class _Unbatchable(Exception):
    """Raised inside the scan's forward when the cell must run through autograd instead."""

    def __init__(self, reason: str, rng: list[Tensor], sticky: bool) -> None:
        super().__init__(reason)
        self.reason, self.rng, self.sticky = reason, rng, sticky


@dataclass(frozen=True)
class _Traced:
    """What tracing the cell gave for one batch shape: ``structure`` (``None``: the forward calls the cell,
    ``reason`` says why), whether its Jacobians factor (``dense_reason``: why the backward is dense) and
    its compiled loop (``kernel``; ``None``: ``kernel_reason`` says why)."""

    structure: CellStructure | None
    reason: str | None
    dense_reason: str | None
    kernel: CellKernel | None = None
    kernel_reason: str | None = "the Jacobians do not factor"

    @property
    def factored(self) -> bool:
        return self.structure is not None and self.dense_reason is None


@dataclass(frozen=True)
class _StateSpec:
    """How a state is laid out: the width of each tensor, whether it is a tuple, its dtype."""

    sizes: tuple[int, ...]
    is_tuple: bool
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return sum(self.sizes)

    def flatten(self, state: State) -> Tensor:
        """``(..., d)``: the state's tensors concatenated along the last dimension."""
        return torch.cat(state, -1) if self.is_tuple else state

    def unflatten(self, flat: Tensor) -> State:
        """The state as the cell sees it: views of ``flat``."""
        return tuple(flat.split(self.sizes, -1)) if self.is_tuple else flat

    def tensors(self, state: State) -> tuple[Tensor, ...]:
        return state if self.is_tuple else (state,)

    def check(self, new: Any, batch: int) -> State:
        """``new`` (a cell's returned state) has this layout; else a ``ValueError`` naming the rule."""
        if self.is_tuple:
            if not isinstance(new, (tuple, list)) or len(new) != len(self.sizes):
                got = f"a tuple of {len(new)}" if isinstance(new, (tuple, list)) else type(new).__name__
                raise ValueError(
                    f"Recurrence: the cell returned {got} but received a tuple of {len(self.sizes)} state "
                    "tensors; a cell must return its state with the same tuple arity it receives"
                )
            new = tuple(new)
        elif not isinstance(new, Tensor):
            raise ValueError(
                f"Recurrence: the cell returned a {type(new).__name__} but received a Tensor state; "
                "a cell must return its state with the same structure it receives"
            )
        for k, (tensor, size) in enumerate(zip(self.tensors(new), self.sizes, strict=True)):
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != (batch, size):
                shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(
                    f"Recurrence: the cell returned state tensor {k} of shape {shape} but received "
                    f"{(batch, size)}; the output state shape must equal the input state shape"
                )
            if tensor.dtype != self.dtype:
                raise ValueError(
                    f"Recurrence: the cell returned state tensor {k} in {tensor.dtype} but the state is "
                    f"{self.dtype}; state dtypes must not differ"
                )
        return new


class Recurrence(nn.Module):
    """Loop a user-written recurrent ``cell`` over time; its backward runs through the scan.

    Args:
        cell: ``nn.Module`` with ``cell(x_t, state) -> state`` (``x_t`` ``(B, I)``, ``state`` a ``(B, d)``
            tensor or a tuple of ``(B, d_k)`` tensors). It may define ``state_size`` (an int for a tensor
            state, a tuple of ints for a tuple state; needed when ``state0`` is not given) and
            ``output_fn(state) -> Tensor`` (the per-step output; default: the first state tensor).
            It must treat batch rows independently (see the module docstring).
        batch_first: input and output are ``(B, T, *)`` instead of ``(T, B, *)``.
        algorithm: ``"auto"`` (scan where it fits ``memory_budget``, ``T > 1`` and the Jacobians factor or
            the scan measures faster than autograd; see the module docstring), ``"linear"``, ``"blelloch"`` or ``"chunked"`` (always
            the scan, with that algorithm of :func:`~lightning_bppsa.backprop_scan`).
        memory_budget: bytes the Jacobians (dense ``(B, T, d, d)`` or their factors) may take under ``"auto"``.
        verify: check in the backward that the batched cell calls reproduce the forward's states.

    ``last_stats`` records the last forward: ``path`` (``"scan"`` / ``"autograd"``), ``reason`` (why
    autograd, else ``None``), ``algorithm``, ``plan`` and ``decision`` (what ran and which rule or decision
    of ``"auto"`` chose it: module docstring); for a scan ``jacobians`` (``"factored"`` / ``"dense"``),
    ``dense_reason``, ``traced_forward``, ``trace_reason`` (module docstring); after a scan backward
    ``jacobian_seconds`` and ``scan_seconds``.

    Example:
        >>> class Cell(nn.Module):
        ...     state_size = 4
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(3 + 4, 4)
        ...     def forward(self, x, h):
        ...         return torch.tanh(self.lin(torch.cat([x, h], -1)))
        >>> rnn = Recurrence(Cell(), algorithm="linear")    # "auto": measures which backward is faster
        >>> out, h_n = rnn(torch.randn(10, 2, 3))           # (T, B, I)
        >>> out.sum().backward()
        >>> out.shape, h_n.shape, rnn.last_stats["path"]
        (torch.Size([10, 2, 4]), torch.Size([2, 4]), 'scan')
    """

    def __init__(
        self,
        cell: nn.Module,
        batch_first: bool = False,
        algorithm: str = "auto",
        *,
        memory_budget: int = 2**30,
        verify: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(cell, nn.Module):
            raise TypeError(
                f"cell must be an nn.Module with cell(x_t, state) -> state; got {type(cell).__name__}"
            )
        check_algorithm(algorithm)
        if memory_budget < 0:
            raise ValueError(f"memory_budget must be >= 0 bytes; got {memory_budget}")
        self.cell, self.batch_first, self.algorithm = cell, batch_first, algorithm
        self.memory_budget, self.verify = memory_budget, verify
        self.last_stats: dict[str, Any] = {}
        self._unbatchable: str | None = None  # set once the batched calls failed for this cell
        # "auto"'s shapes whose probe found the cell drawing random numbers
        self._random: set[LayerShape] = set()
        # "auto"'s key in the layer plan per trace key, verify and probed steps (_planned)
        self._plan_shapes: dict[tuple, LayerShape] = {}
        self._traced: dict[tuple, _Traced] = {}  # the traced step per batch shape
        self._warned = False

    def extra_repr(self) -> str:
        return f"batch_first={self.batch_first}, algorithm={self.algorithm!r}"

    def __getstate__(self) -> dict[str, Any]:
        """The module without its traces (their fake tensors and compiled kernels neither copy nor pickle): a
        deep copy or an unpickled module traces its cell again on its first call."""
        state = super().__getstate__()
        state.update(_traced={}, _plan_shapes={})
        return state

    def forward(self, input: Tensor, state0: State | None = None) -> tuple[Tensor, State]:  # noqa: A002
        """Run the cell over the sequence.

        Args:
            input: ``(T, B, I)`` (``(B, T, I)`` with ``batch_first``) or unbatched ``(T, I)``.
            state0: initial state, ``(B, d)`` or a tuple of ``(B, d_k)`` (unbatched: without ``B``);
                zeros of ``cell.state_size`` when ``None``.

        Returns:
            ``(outputs, final_state)``: ``outputs`` ``(T, B, *)`` (``(B, T, *)`` with ``batch_first``,
            ``(T, *)`` unbatched), the per-step outputs; ``final_state`` as ``state0``.
        """
        if not isinstance(input, Tensor) or input.dim() not in (2, 3):
            shape = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            layout = "(B, T, I)" if self.batch_first else "(T, B, I)"
            raise ValueError(f"input must be {layout} or unbatched (T, I); got {shape}")
        unbatched = input.dim() == 2
        x = input.unsqueeze(0) if unbatched else input if self.batch_first else input.transpose(0, 1)
        spec, s0 = self._initial_state(state0, x, unbatched)
        params = tuple(p for p in self.cell.parameters() if p.requires_grad)
        path, decision = self._path(x, s0, spec, params)
        reason = None if path == "scan" else decision
        if path == "scan":
            traced = self._trace(x, s0, spec)
            try:
                # the new states' columns the outputs read (a view of them), and the final state
                new_states, final_flat = _ScanFunction.apply(self, spec, traced, x, s0, *params)
            except _Unbatchable as failed:
                set_generator_states(x.device, failed.rng)  # the rerun draws the same random numbers
                path, reason = "autograd", failed.reason
                decision = f"{decision}; then {reason}"
                self._fell_back(reason, failed.sticky)
        if path == "autograd" and reason == _NO_GRADIENT and (kernel := self._inference_kernel(x, s0, spec)):
            path, reason = "compiled loop", None
            states, _ = _kernel_forward(self, kernel, x, s0, partials=False)
            new_states, final_flat = states[:, 1:], states[:, -1]
        if path == "autograd":
            states = self._loop(x, s0, spec)
            new_states, final_flat = states[:, 1:], states[:, -1]
        self.last_stats = {
            "path": path, "reason": reason, "algorithm": self.algorithm,
            "plan": path if reason is None else f"{path} ({reason})", "decision": decision,
        }  # fmt: skip
        if path == "scan":
            self.last_stats.update(
                jacobians="factored" if traced.factored else "dense",
                dense_reason=traced.dense_reason,
                traced_forward=traced.structure is not None,
                trace_reason=traced.reason,
                cell_kernel=_platform(traced.kernel),
                cell_kernel_reason=traced.kernel_reason,
            )
        outputs = self._outputs(new_states, spec)
        final = spec.unflatten(final_flat)
        if unbatched:
            outputs = outputs.squeeze(0 if self.batch_first else 1)
            final = tuple(s.squeeze(0) for s in final) if spec.is_tuple else final.squeeze(0)
        return outputs, final

    # ----------------------------------------------------------------------------------------------

    def _initial_state(self, state0: State | None, x: Tensor, unbatched: bool) -> tuple[_StateSpec, Tensor]:
        """The state's layout and the flat ``(B, d)`` initial state."""
        batch = x.shape[0]
        if state0 is None:
            sizes = getattr(self.cell, "state_size", None)
            ints = isinstance(sizes, tuple) and sizes and all(isinstance(s, int) and s > 0 for s in sizes)
            if not (ints or (isinstance(sizes, int) and sizes > 0)):
                raise ValueError(
                    f"Recurrence: state0 is None and {type(self.cell).__name__}.state_size is {sizes!r}; "
                    "give state0, or set cell.state_size (an int for a tensor state, a tuple of ints for a "
                    "tuple state)"
                )
            dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
            spec = _StateSpec(
                sizes if isinstance(sizes, tuple) else (sizes,), isinstance(sizes, tuple), dtype
            )
            return spec, x.new_zeros(batch, spec.width, dtype=dtype)
        is_tuple = isinstance(state0, (tuple, list))
        tensors = tuple(state0) if is_tuple else (state0,)
        expected = "(d,)" if unbatched else f"(B={batch}, d)"
        for k, s in enumerate(tensors):
            ok = isinstance(s, Tensor) and s.dim() == 2 - unbatched and (unbatched or s.shape[0] == batch)
            if not ok:
                shape = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
                raise ValueError(f"state0 tensor {k} must have shape {expected}; got {shape}")
        if not tensors or len({s.dtype for s in tensors}) > 1:
            raise ValueError(
                f"state0 must be a tensor or a non-empty tuple of tensors of one dtype (state dtypes must not "
                f"differ); got dtypes {[s.dtype for s in tensors]}"
            )
        if unbatched:
            tensors = tuple(s.unsqueeze(0) for s in tensors)
        spec = _StateSpec(tuple(s.shape[-1] for s in tensors), is_tuple, tensors[0].dtype)
        return spec, spec.flatten(tensors if is_tuple else tensors[0])

    def _path(self, x: Tensor, s0: Tensor, spec: _StateSpec, params: tuple[Tensor, ...]) -> tuple[str, str]:
        """``(path, why)``: ``"scan"`` or ``"autograd"``, and which rule or decision chose it."""
        batch, steps = x.shape[:2]
        if not torch.is_grad_enabled() or not (x.requires_grad or s0.requires_grad or params):
            return "autograd", _NO_GRADIENT
        if batch == 0 or steps == 0 or x.device.type == "meta":
            return "autograd", "empty batch or sequence, or the meta device: nothing to scan"
        if torch._C._are_functorch_transforms_active():
            return "autograd", "inside a torch.func transform (the scan's Function has no functorch rules)"
        if torch.compiler.is_compiling():
            return "autograd", "torch.compile traces the loop (the scan's backward calls autograd itself)"
        if self._unbatchable is not None:
            return "autograd", self._unbatchable
        if self.algorithm != "auto":
            return "scan", f"algorithm={self.algorithm!r} as asked"
        if steps == 1:
            return "autograd", "auto: one step, nothing to scan"
        key = self._trace_key(x, spec)
        traced = self._trace(x, s0, spec, key)
        form, per_step = (
            ("factored", traced.structure.factor_elements) if traced.factored else ("dense", spec.width**2)
        )
        if traced.kernel is not None:  # the compiled loop keeps its nonzero columns and the input partials
            per_step = traced.kernel.factor_elements + traced.kernel.input_partial_elements
        need = batch * steps * per_step * spec.dtype.itemsize
        if need > self.memory_budget:
            return (
                "autograd",
                f"auto: the {form} Jacobians need {need} bytes > memory_budget={self.memory_budget}",
            )
        return self._planned(x, s0, spec, params, traced, key)

    def _planned(
        self, x: Tensor, s0: Tensor, spec: _StateSpec, params: tuple[Tensor, ...], traced: _Traced, key: tuple
    ) -> tuple[str, str]:
        """``"auto"``'s decision by :func:`~lightning_bppsa.layer_plan.plan_layer`, measured by :meth:`_probe`
        (there is no cost model of a user cell) on the first call of its shape: the cell (:meth:`_plan_cell`),
        ``B``, the probe's steps (both backwards grow linearly with ``T``: the probe times ``k`` of them, so
        every ``T`` with the same ``k`` has the same answer), the input's and state's widths, dtype, device.
        A cell the probe finds drawing random numbers or unbatchable runs autograd (nothing is cached)."""
        batch, steps = x.shape[:2]
        k = _probe_steps(batch, steps, spec.width, traced.factored)
        shape = self._plan_shapes.get((key, self.verify, k))
        if shape is None:  # made once: a user's training loop asks every step
            cell, persist = self._plan_cell(key, traced)
            inputs = math.prod(x.shape[2:])
            shape = LayerShape(cell, 1, 1, batch, k, inputs, spec.width, spec.dtype, str(x.device), persist)
            self._plan_shapes[(key, self.verify, k)] = shape
        if shape in self._random:
            return "autograd", _RANDOM
        try:
            plan = layer_plan.plan_layer(
                shape, lambda: _NO_MODEL, lambda: self._probe(x, s0, spec, params, traced, k),
                timed=f"for a backward through {k} steps",
            )  # fmt: skip
        except _Unbatchable as found:
            if not found.sticky:
                self._random.add(shape)
            self._fell_back(found.reason, found.sticky)
            return "autograd", found.reason
        return plan.path, plan.reason

    def _plan_cell(self, key: tuple, traced: _Traced) -> tuple[str, bool]:
        """The layer plan's name of the cell for this trace key, and whether its decisions may persist on disk.

        Where the cell traced, a digest of what both paths run: the traced step's graphs (their code and
        constants' shapes), whether its Jacobians factor and where its compiled loop runs, the cell's module
        classes and training modes, its tensors' shapes, dtypes and ``requires_grad``, the input's and the
        state's layout, autocast and ``verify``: equal in another process for the same cell, different for
        cells that compute differently. A cell that did not trace (its Python is all there is to tell it by)
        is also named by this object's number in the process, and kept in memory only.
        """
        number, _, inputs, x_dtype, spec, _, modes, tensors, autocast = key  # B, device: the shape's own
        classes = tuple(f"{type(m).__module__}.{type(m).__qualname__}" for m in self.cell.modules())
        what = (classes, inputs, x_dtype, spec, modes, tensors, autocast, self.verify)
        parts = [repr(what), repr((traced.factored, _platform(traced.kernel)))]
        traced_ok = traced.structure is not None
        if traced_ok:
            parts += _graph_texts(traced.structure)
        digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        name = f"Recurrence({type(self.cell).__qualname__}) {digest}"
        return (name, True) if traced_ok else (f"{name} cell#{number}", False)

    def _inference_kernel(self, x: Tensor, s0: Tensor, spec: _StateSpec) -> CellKernel | None:
        """The compiled loop for a call without gradients (the cell's trace for this batch shape, made here
        if needed), or ``None``: the cell is called per step. Under ``inference_mode`` a trace is not made
        (its checks need autograd) but one made before is used."""
        batch, steps = x.shape[:2]
        if batch == 0 or steps == 0 or x.device.type not in ("cpu", "cuda") or self._unbatchable is not None:
            return None
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return None
        if torch.is_inference_mode_enabled():
            traced = self._traced.get(self._trace_key(x, spec))
        else:
            with torch.no_grad():
                traced = self._trace(x, s0, spec)
        return None if traced is None else traced.kernel

    def _trace_key(self, x: Tensor, spec: _StateSpec) -> tuple:
        """What a traced step depends on: the cell object (:func:`_cell_number`: a cell put in its place, or
        this module's deep copy, is traced anew), the batch shape, dtypes, device, the modules' modes, the
        cell's tensors (shape, dtype, ``requires_grad``: what the checks' VJP covers) and autocast."""
        modes, tensors = [], []
        for module in self.cell.modules():  # one walk (asked on every call): modes, and what a graph takes
            modes.append(module.training)
            tensors += [
                (t.dtype, t.shape, t.requires_grad)
                for t in (*module._parameters.values(), *module._buffers.values())
                if t is not None
            ]
        autocast = torch.is_autocast_enabled(x.device.type)
        number = _cell_number(self.cell)
        return (
            number,
            x.shape[0],
            x.shape[2:],
            x.dtype,
            spec,
            x.device,
            tuple(modes),
            tuple(tensors),
            autocast,
        )

    def _trace(self, x: Tensor, s0: Tensor, spec: _StateSpec, key: tuple | None = None) -> _Traced:
        """The cell's traced step for this batch shape (cached; ``key``: its :meth:`_trace_key`, where known),
        checked on the batch's first steps.

        The traced forward must reproduce the cell's own loop and the factored Jacobians the dense ones
        (``eps ** 0.75`` relative); otherwise the forward calls the cell, or the backward stays dense.
        """
        key = self._trace_key(x, spec) if key is None else key
        if key not in self._traced:
            if torch.is_autocast_enabled(
                x.device.type
            ):  # the trace would bake in this autocast state's casts
                reason = "autocast is on: the cell is called"
                self._traced[key] = _Traced(None, reason, reason)
            else:
                self._traced[key] = self._checked_trace(x, s0, spec)
        return self._traced[key]

    def _checked_trace(self, x: Tensor, s0: Tensor, spec: _StateSpec) -> _Traced:
        """Trace the cell and check the trace on the first steps of the batch's first rows."""
        try:
            structure = trace_cell(
                self.cell, x[:, 0].detach(), spec.tensors(spec.unflatten(s0.detach())), spec.is_tuple
            )
        except NotTraceable as error:
            return _Traced(None, str(error), str(error))
        x_k, s0_k = x[:_CHECK_ROWS, :_CHECK_STEPS].detach(), s0[:_CHECK_ROWS].detach()
        with torch.no_grad(), kept_generators(x.device):
            expected = self._loop(x_k, s0_k.clone(), spec)  # a cell breaking the rules raises its error here
            try:
                ours = _traced_loop(self, structure, spec, x_k, s0_k)
            except Exception as error:  # noqa: BLE001 - a graph that does not run keeps calling the cell
                reason = f"the traced step failed ({describe(error)})"
                return _Traced(None, reason, reason)
        tolerance = torch.finfo(spec.dtype).eps ** 0.75
        if ours.shape != expected.shape or not torch.allclose(ours, expected, rtol=tolerance, atol=tolerance):
            reason = "the traced step does not reproduce the cell's loop"
            return _Traced(None, reason, reason)
        dense_reason = structure.reason or _check_factored(self, structure, spec, x_k, expected)
        if dense_reason is not None:
            return _Traced(structure, None, dense_reason)
        kernel, kernel_reason = _checked_kernel(self, structure, spec, x_k, s0_k, expected)
        return _Traced(structure, None, None, kernel, kernel_reason)

    def _probe(
        self, x: Tensor, s0: Tensor, spec: _StateSpec, params: tuple[Tensor, ...], traced: _Traced, k: int
    ) -> dict[str, float]:
        """``"auto"``'s measurement (the layer plan's ``measure``): ``{"scan": s, "autograd": s}``, the seconds
        of the scan's whole backward (Jacobians, scan, parameter VJP) and of autograd's backward through the
        loop, over the batch's first ``k`` steps (:func:`_probe_steps`).

        Runs under a forked RNG (the batch's own random numbers are not consumed); a cell that draws random
        numbers or cannot be batched is found here, before the scan's forward, and raises
        :class:`_Unbatchable` (not a timing: nothing is cached).
        """
        x_k = x[:, :k].detach()
        with (
            kept_generators(x.device),
            torch.enable_grad(),
        ):
            rng = generator_states(x.device)
            s0_leaf = s0.detach().requires_grad_()
            states = self._loop(x_k, s0_leaf.clone(), spec)  # a clone: a cell may modify its state in place
            if not _same_rng(x.device, rng):
                raise _Unbatchable(_RANDOM, rng, sticky=False)
            needs = (False, True, *(True for _ in params))  # what autograd's backward below computes
            # the compiled loop's factors come from its forward (not timed: it replaces the loop's forward)
            factors = _kernel_forward(self, traced.kernel, x_k, s0)[1] if traced.kernel is not None else None
            args = (self, spec, traced, x_k, states.detach(), list(params), needs, torch.ones_like(states[:, 1:]), None,
                    factors)  # fmt: skip
            try:
                with torch.no_grad():  # as in a backward
                    _scan_grads(*args)  # once untimed: the first call loads the scan's compiled kernel
            except (*_BATCHING_ERRORS, _RowsMixed) as error:
                raise _Unbatchable(_failure_reason(error), rng, sticky=True) from None
            start = _synchronized_time(x.device)
            torch.autograd.grad(states.sum(), [s0_leaf, *params], allow_unused=True)
            middle = _synchronized_time(x.device)
            with torch.no_grad():
                _scan_grads(*args)
            end = _synchronized_time(x.device)
        return {"scan": end - middle, "autograd": middle - start}

    def _loop(
        self,
        x: Tensor,
        s0: Tensor,
        spec: _StateSpec,
        rng: list[Tensor] | None = None,
        traced: _Traced | None = None,
    ) -> Tensor:
        """The states ``(B, T + 1, d)`` of the Python loop over time (recorded by autograd where grad mode is on).

        With ``rng`` (the scan's forward, grad mode off), raise :class:`_Unbatchable` for a cell that
        draws random numbers or modifies its input state in place; with a traced step, run that instead
        of calling the cell (its graph has neither).
        """
        if traced is not None and traced.structure is not None:
            return _traced_loop(self, traced.structure, spec, x, s0)
        batch, steps = x.shape[:2]
        state, flats = spec.unflatten(s0), [s0]
        for t, x_t in enumerate(x.unbind(1)):  # one call for all steps' views: cheaper than x[:, t]
            if rng is not None:
                given = spec.tensors(state)
                versions = [s._version for s in given]
            state = self.cell(x_t, state)
            # the layout is checked on the first and last steps (~7 µs a check): a shape changed in between
            # reaches the last step, or fails in torch.stack below
            if t == 0 or t == steps - 1:
                state = spec.check(state, batch)
            elif spec.is_tuple:
                state = tuple(state)
            if rng is not None:
                if any(s._version != v for s, v in zip(given, versions, strict=True)):
                    raise _Unbatchable("the cell modifies its input state in place", rng, sticky=True)
                if (t == 0 or t == steps - 1) and not _same_rng(x.device, rng):
                    reason = "the cell draws random numbers (e.g. dropout in training mode)"
                    raise _Unbatchable(reason, rng, sticky=False)
            flats.append(spec.flatten(state))
        return torch.stack(flats, 1)

    def _outputs(self, new_states: Tensor, spec: _StateSpec) -> Tensor:
        """The per-step outputs, ``(T, B, *)`` or batch first, from the new states ``(B, T, d)``, or from their
        first :func:`_output_columns` (the scan's output: it reads the gradient of those alone)."""
        batch, steps = new_states.shape[:2]
        output_fn = getattr(self.cell, "output_fn", None)
        if output_fn is None:
            first = spec.sizes[0]  # no slice where the output is all there is: its backward would copy
            outputs = new_states if new_states.shape[-1] == first else new_states[..., :first]
        else:
            flat = output_fn(spec.unflatten(new_states.reshape(batch * steps, spec.width)))
            if not isinstance(flat, Tensor) or flat.dim() == 0 or flat.shape[0] != batch * steps:
                shape = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
                raise ValueError(
                    f"Recurrence: cell.output_fn must return a Tensor with the state's batch rows first "
                    f"({batch * steps} rows here); got {shape}"
                )
            outputs = flat.unflatten(0, (batch, steps))
        result = (outputs if self.batch_first else outputs.transpose(0, 1)).contiguous()
        # a tensor of its own (e.g. at B=1 the states' view is contiguous): the caller may modify the outputs
        # in place, as torch's RNN allows, and the states are what the scan's backward keeps
        states = new_states if new_states._base is None else new_states._base
        return result.clone() if result is states or result._base is states else result

    def _fell_back(self, reason: str, sticky: bool) -> None:
        """Remember (``sticky``) and warn once that this module's cell runs through autograd."""
        if sticky:
            self._unbatchable = f"the batched cell calls failed before: {reason}"
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"Recurrence({type(self.cell).__name__}): {reason}; autograd through the loop runs instead "
                "(exact, slower)",
                RuntimeWarning,
                stacklevel=3,
            )


# --------------------------------------------------------------------------------------------------
# The scan's autograd.Function.
# --------------------------------------------------------------------------------------------------


class _ScanFunction(torch.autograd.Function):
    """``(module, spec, traced, x (B, T, I), s0 (B, d), *params) -> (new states (B, T, w), final state (B, d))``;
    see the module docstring. Two outputs, not the states ``(B, T + 1, d)`` sliced by the caller: each slice's
    backward would fill and copy a whole ``(B, T + 1, d)`` gradient (measured ~0.4 ms a step at B=16 T=1000
    d=32), and a loss on the final state alone then needs no ``(B, T + 1, d)`` gradient at all. Of the new
    states only the ``w`` columns the outputs read (:func:`_output_columns`): where they are the first state
    tensor of several, slicing them off a ``(B, T, d)`` output cost a zero-filled ``(B, T, d)`` gradient and a
    copy into it (~3 ms of WideFirst's ~15 ms backward, state widths (2H, H), H=32 B=16 T=1000, one thread);
    the compiled loop's sweep reads the ``(B, T, w)`` gradient as it is, the torch path widens it."""

    @staticmethod
    def forward(
        ctx, module: Recurrence, spec: _StateSpec, traced: _Traced, x: Tensor, s0: Tensor, *params: Tensor
    ) -> Tensor:
        if traced.kernel is not None:  # the compiled loop: the Jacobians' factors come with the states
            states, ctx.factors = _kernel_forward(module, traced.kernel, x, s0)
        else:
            states, ctx.factors = module._loop(x, s0, spec, rng=generator_states(x.device), traced=traced), None
        ctx.module, ctx.spec, ctx.traced = module, spec, traced
        ctx.autocast = autocast_state(x.device.type)
        ctx.save_for_backward(x, s0, states, *params)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros (B, T, d)
        # the new states' columns the outputs read as a view (the caller's outputs copy them), the final state a
        # copy of its own
        return states[:, 1:, : _output_columns(module.cell, spec)], states[:, -1].clone()

    @staticmethod
    def backward(ctx, grad_steps: Tensor | None, grad_final: Tensor | None):
        with replay_autocast(ctx.autocast):  # not the caller's: manual_backward runs inside autocast
            return _ScanFunction._backward(ctx, grad_steps, grad_final)

    @staticmethod
    def _backward(ctx, grad_steps: Tensor | None, grad_final: Tensor | None):
        x, s0, states, *params = ctx.saved_tensors
        module, spec = ctx.module, ctx.spec
        needs = ctx.needs_input_grad[3:]
        # grad mode is on in a backward only under create_graph=True: the scan's result is not differentiable
        create_graph = torch.is_grad_enabled()
        grads = None
        if not create_graph and not reference_backward_enabled():
            try:
                grads = _scan_grads(module, spec, ctx.traced, x, states, params, needs, grad_steps, grad_final,
                                    ctx.factors)  # fmt: skip
            except (*_BATCHING_ERRORS, _RowsMixed) as error:
                _record_fallback(module, _failure_reason(error))
        if grads is None:
            grad_states = _state_gradients(grad_steps, grad_final, states)
            grads = _replay_grads(module, spec, x, s0, params, needs, grad_states, create_graph)
        return (None, None, None, *(g if need else None for g, need in zip(grads, needs, strict=True)))


class _RowsMixed(Exception):
    """The batched cell calls did not reproduce the forward's states."""


def _failure_reason(error: Exception) -> str:
    if isinstance(error, _RowsMixed):
        return str(error)
    return f"the batched cell calls failed ({describe(error)})"


def _record_fallback(module: Recurrence, reason: str) -> None:
    if not torch.compiler.is_compiling():
        module.last_stats.update(path="autograd", reason=reason)
    module._fell_back(reason, sticky=True)


def _scan_grads(
    module: Recurrence,
    spec: _StateSpec,
    traced: _Traced,
    x: Tensor,
    states: Tensor,
    params: list[Tensor],
    needs: tuple[bool, ...],
    grad_steps: Tensor | None,
    grad_final: Tensor | None,
    factors: CellFactors | None = None,
) -> list[Tensor | None]:
    """Gradients of ``(x, s0, *params)``: step Jacobians, scan, one VJP (module docstring, 1-3); with
    ``factors`` (the compiled loop's forward) the Jacobians are those, and the VJP is the kernel's."""
    batch, steps, d = states.shape[0], states.shape[1] - 1, spec.width
    rows = batch * steps
    start = clock()
    x_flat = (
        x.reshape(rows, *x.shape[2:]).detach().requires_grad_(needs[0]) if factors is None else factors.x_flat
    )
    outs: list[tuple[Tensor, int, int]] = []
    if factors is not None:
        jacobians_t = factors.jacobians
    elif traced.factored:
        jacobians_t, new = _factored_pass(module, traced.structure, spec, x_flat, states)
        outs = [(new, 0, rows)] if new.requires_grad else []
    else:
        dense, outs = _step_jacobians(module, spec, x_flat, states)
        jacobians_t = dense.view(batch, steps, d, d)
    record(module.last_stats, "jacobian_seconds", clock() - start, add=True)
    start = clock()
    # a loss on the last state only needs no affine rows
    only_last = grad_steps is None or steps == 1 or _all_zero(grad_steps[:, :-1])
    products = g = None
    if factors is not None and _linear_plan(module.algorithm, factors.jacobians):
        # the sweep with the VJP's products in the same pass; it hands out s_0's gradient alone (both in the
        # kernel's scratch buffers: the gradient is copied)
        per_step = (
            (None, _final_gradient(grad_steps, grad_final, d)) if only_last else (grad_steps, grad_final)
        )
        g0, products = traced.kernel.scan(factors, *per_step)
        s0_grad = g0.clone()
    else:
        direct = (
            _final_gradient(grad_steps, grad_final, d)
            if only_last
            else _state_gradients(grad_steps, grad_final, states)
        )
        with without_autocast(x.device.type):  # in the Jacobians' dtype, not autocast's
            g = backprop_scan(jacobians_t, direct, algorithm=module.algorithm)
        s0_grad = g[:, 0]
    record(module.last_stats, "scan_seconds", clock() - start, add=True)
    # Eq. 2: parameter and input gradients of all steps in one VJP with the scan's state gradients
    wanted = ([x_flat] if needs[0] else []) + [p for p, need in zip(params, needs[2:], strict=True) if need]
    found: tuple[Tensor | None, ...] = ()
    if wanted and factors is not None:
        products = traced.kernel.products(factors, g) if products is None else products
        found = traced.kernel.vjp(factors, states, products, wanted)
    elif wanted and outs:
        cotangent = g[:, 1:].reshape(rows, d)
        found = torch.autograd.grad(
            [new for new, _, _ in outs], wanted, [cotangent[lo:hi] for _, lo, hi in outs], allow_unused=True
        )
    found_iter = iter(found)
    x_grad = next(found_iter, None) if needs[0] else None
    param_grads = [next(found_iter, None) if need else None for need in needs[2:]]
    return [None if x_grad is None else x_grad.view_as(x), s0_grad, *param_grads]


def _output_columns(cell: nn.Module, spec: _StateSpec) -> int:
    """How many of the flat state's first columns the per-step outputs read: the first state tensor's, or all of
    them where the cell's ``output_fn`` makes the outputs."""
    return spec.width if getattr(cell, "output_fn", None) is not None else spec.sizes[0]


def _final_gradient(grad_steps: Tensor | None, grad_final: Tensor | None, d: int) -> Tensor:
    """The final state's whole gradient ``(B, d)``, contiguous: its output step's (``grad_steps``' last, of the
    first ``w <= d`` columns) plus its own."""
    last = None if grad_steps is None else grad_steps[:, -1]
    if last is not None and last.shape[-1] < d:
        last = torch.nn.functional.pad(last, (0, d - last.shape[-1]))
    parts = [g for g in (last, grad_final) if g is not None]
    return (parts[0] if len(parts) == 1 else parts[0] + parts[1]).contiguous()


def _state_gradients(grad_steps: Tensor | None, grad_final: Tensor | None, states: Tensor) -> Tensor:
    """The states' gradient ``(B, T + 1, d)`` (zero at ``s_0``) from the outputs' gradients (either may be
    ``None``; ``grad_steps`` ``(B, T, w)``: of the new states' first ``w <= d`` columns); differentiable in them
    (a double backward replays through it)."""
    if grad_steps is None:
        full = torch.zeros_like(states)
    else:  # one zero row before the steps, zero columns after the outputs' (one copy)
        full = torch.nn.functional.pad(grad_steps, (0, states.shape[2] - grad_steps.shape[2], 1, 0))
    if grad_final is not None:
        full[:, -1] += grad_final
    return full


def _linear_plan(algorithm: str, jacobians: FactoredJacobians) -> bool:
    """Whether the scan's plan for these Jacobians is the linear sweep (``"auto"``: as the cost model picks)."""
    plan = choose(
        algorithm,
        n=jacobians.length,
        d=jacobians.state_size,
        batch=jacobians.batch_size,
        width=jacobians.width,  # sizes only: the compiled loop's Jacobians build weight / scales on first read
        device=jacobians.device.type,
        dtype=jacobians.dtype,
    )
    return plan.algorithm == "linear"


def _all_zero(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` ``(B, n, d)`` is zero (NaN is not): min-max passes, several times
    faster than ``count_nonzero`` on a strided slice; its last step first, which a loss on every step
    makes nonzero (the whole tensor is then not read). Off the CPU the answer is ``False`` without reading
    the tensor (reading a device value would wait for the device every backward): the general path is
    exact for any gradient."""
    if tensor.device.type != "cpu":
        return False
    for part in (tensor[:, -1], tensor):
        low, high = torch.aminmax(part)
        if not (bool(low == 0) and bool(high == 0)):
            return False
    return True


def _cell_rows(
    module: Recurrence, spec: _StateSpec, x_flat: Tensor, states: Tensor, lo: int, hi: int
) -> tuple[Tensor, Tensor]:
    """``(new, prev)``: the cell called on rows ``lo:hi`` of all steps at once, recorded by autograd, and the
    state leaf it read; :class:`_RowsMixed` (``module.verify``) where it does not reproduce the forward's states."""
    d = spec.width
    rows = x_flat.shape[0]
    prev = states[:, :-1].reshape(rows, d)[lo:hi].detach().requires_grad_()
    with torch.enable_grad():
        new = spec.flatten(spec.check(module.cell(x_flat[lo:hi], spec.unflatten(prev)), hi - lo))
    _check_rows(module, new, states[:, 1:].reshape(rows, d)[lo:hi])
    return new, prev


def _check_rows(module: Recurrence, new: Tensor, expected: Tensor) -> None:
    """:class:`_RowsMixed` (``module.verify``) where the batched step does not reproduce the forward's states."""
    tolerance = torch.finfo(new.dtype).eps ** 0.5
    # normwise (max over all rows): a third of allclose's passes over B T d elements
    if module.verify and (new - expected).abs_().amax() > tolerance * (1 + expected.abs().amax()):
        raise _RowsMixed(
            "calling the cell on all steps at once does not reproduce the loop's states: the cell must "
            "treat batch rows independently"
        )


def _step_jacobians(
    module: Recurrence, spec: _StateSpec, x_flat: Tensor, states: Tensor
) -> tuple[Tensor, list[tuple[Tensor, int, int]]]:
    """The dense transposed step Jacobians ``(B T, d, d)`` of all steps (rows ``(b, t)``), from batched cell calls.

    Returns them and the calls' outputs ``(new states, lo, hi)`` (graphs kept for the parameter VJP).
    Raises :class:`_RowsMixed` (``module.verify``) when the calls do not reproduce ``states``.
    """
    batch, steps, d = states.shape[0], states.shape[1] - 1, spec.width
    rows = batch * steps
    jacobians_t = states.new_empty(rows, d, d)
    eye = torch.eye(d, dtype=states.dtype, device=states.device)
    chunk = _chunk_rows(d)
    outs = []
    for lo in range(0, rows, chunk):
        hi = min(lo + chunk, rows)
        new, prev = _cell_rows(module, spec, x_flat, states, lo, hi)
        if not new.requires_grad:  # depends on nothing that needs a gradient: J = 0
            jacobians_t[lo:hi] = 0
            continue
        cotangents = eye.unsqueeze(1).expand(d, hi - lo, d)  # row k of every step's Jacobian at once
        (jac,) = torch.autograd.grad(
            new,
            prev,
            cotangents,
            retain_graph=True,
            is_grads_batched=True,
            allow_unused=True,
            materialize_grads=True,
        )
        jacobians_t[lo:hi] = jac.permute(1, 2, 0)  # jac[k, r, j] = ∂s_r[k]/∂s_{r-1}[j]
        outs.append((new, lo, hi))
    return jacobians_t, outs


def _factored_pass(
    module: Recurrence, structure: CellStructure, spec: _StateSpec, x_flat: Tensor, states: Tensor
) -> tuple[FactoredJacobians, Tensor]:
    """The step Jacobians of all steps (rows ``(b, t)``) from the traced step's factors, and the new states
    ``(B T, d)`` recorded by autograd back to ``x_flat`` and the cell's parameters; :class:`_RowsMixed`
    (``module.verify``) where they do not reproduce the forward's states."""
    rows = x_flat.shape[0]
    tensors = cell_tensors(module.cell)
    prev = spec.tensors(spec.unflatten(states[:, :-1].reshape(rows, spec.width)))
    with torch.enable_grad():  # the backward runs with grad mode off
        jacobians, outs = structure.linearize(tensors, x_flat, prev, states.shape[0])
        new = spec.flatten(tuple(outs) if spec.is_tuple else outs[0])
    _check_rows(module, new, states[:, 1:].reshape(rows, spec.width))
    return jacobians, new


def _check_factored(
    module: Recurrence, structure: CellStructure, spec: _StateSpec, x: Tensor, states: Tensor
) -> str | None:
    """``None`` where the traced step's Jacobians and parameter VJP equal the cell's on these steps, else why
    not (once per trace: a custom ``autograd.Function`` in the cell, for one, is not in the traced graph)."""
    x_flat = x.reshape(-1, *x.shape[2:]).requires_grad_()
    params = [p for p in module.cell.parameters() if p.requires_grad]
    try:
        dense, outs = _step_jacobians(module, spec, x_flat, states)
    except (*_BATCHING_ERRORS, _RowsMixed) as error:  # the dense path will meet it too and fall back
        return f"the dense check failed: {_failure_reason(error)}"
    try:
        factored, new = _factored_pass(module, structure, spec, x_flat, states)
    except Exception as error:  # noqa: BLE001 - the dense Jacobians then
        return f"the factored pass failed ({describe(error)})"
    tolerance = torch.finfo(spec.dtype).eps ** 0.75
    scale = max(1.0, dense.abs().max().item())
    if not torch.allclose(
        factored.dense().reshape(dense.shape), dense, rtol=tolerance, atol=tolerance * scale
    ):
        return "the factored Jacobians do not match the dense ones"
    cotangent = torch.linspace(-1.0, 1.0, new.numel(), dtype=new.dtype, device=new.device).view_as(new)
    leaves = [x_flat, *params]
    none = [None] * len(leaves)
    theirs = (
        torch.autograd.grad([o for o, _, _ in outs], leaves, [cotangent], allow_unused=True) if outs else none
    )
    ours = torch.autograd.grad(new, leaves, cotangent, allow_unused=True) if new.requires_grad else none
    for a, b in zip(ours, theirs, strict=True):
        if (a is None) != (b is None) or (
            a is not None and not torch.allclose(a, b, rtol=tolerance, atol=tolerance * scale)
        ):
            return "the traced step's parameter gradients do not match the cell's"
    return None


def _kernel_forward(
    module: Recurrence, kernel: CellKernel, x: Tensor, s0: Tensor, partials: bool = True
) -> tuple[Tensor, CellFactors | None]:
    """The states ``(B, T + 1, d)`` and (``partials``) the backward's factors from the compiled loop (no cell
    calls); the input part recorded from a leaf ``x_flat`` (``(b, t)`` rows; requiring grad as ``x`` does)."""
    batch, steps = x.shape[:2]
    x_flat = x.detach().reshape(batch * steps, *x.shape[2:]).requires_grad_(partials and x.requires_grad)
    return kernel.forward(cell_tensors(module.cell), x_flat, s0.detach(), batch, partials=partials)


def _checked_kernel(
    module: Recurrence, structure: CellStructure, spec: _StateSpec, x: Tensor, s0: Tensor, expected: Tensor
) -> tuple[CellKernel | None, str | None]:
    """The compiled loop of a factored structure, checked on the batch's first steps against the cell's loop
    (``expected``) and the traced step's factors and parameter VJP; ``(None, why not)`` where it is not used."""
    try:
        kernel = _compiled_loop(structure, spec.dtype, x.device)
    except Unsupported as error:
        return None, f"not compiled: {error}"
    except RuntimeError as error:  # no compiler, BPPSA_NATIVE=0, a failed build (logged); no CuPy / NVRTC
        return None, str(error)
    rows = x.shape[0] * x.shape[1]
    try:
        states, factors = _kernel_forward(module, kernel, x.detach().requires_grad_(), s0)
    except Exception as error:  # noqa: BLE001 - a launch the device refuses (CuPy's errors are no RuntimeErrors)
        return None, f"the compiled loop's first run failed ({describe(error)})"
    x_flat = x.reshape(rows, *x.shape[2:]).detach().requires_grad_()
    reference, new = _factored_pass(module, structure, spec, x_flat, expected)
    tolerance = torch.finfo(spec.dtype).eps ** 0.75

    def close(a: Tensor, b: Tensor) -> bool:
        if a.shape != b.shape:
            return False
        return torch.allclose(a, b, rtol=tolerance, atol=tolerance * max(1.0, b.abs().max().item()))

    params = [p for p in module.cell.parameters() if p.requires_grad]
    leaves = [x_flat, *params]
    cotangent = torch.linspace(-1.0, 1.0, new.numel(), dtype=new.dtype, device=new.device).view_as(new)
    grad = torch.cat([torch.zeros_like(expected[:, :1]), cotangent.view(x.shape[0], x.shape[1], -1)], 1)
    ours = kernel.vjp(factors, expected, kernel.products(factors, grad), [factors.x_flat, *params])
    theirs = (
        torch.autograd.grad(new, leaves, cotangent, allow_unused=True)
        if new.requires_grad
        else [None] * len(leaves)
    )
    same_vjp = all(
        (a is None) == (b is None) and (a is None or close(a, b)) for a, b in zip(ours, theirs, strict=True)
    )
    if not (close(states, expected) and close(factors.jacobians.dense(), reference.dense()) and same_vjp):
        return (
            None,
            "the compiled loop does not reproduce the traced step (a generator bug: please report it)",
        )
    return kernel, None


def _compiled_loop(structure: CellStructure, dtype: torch.dtype, device: torch.device) -> CellKernel:
    """The compiled loop on ``device``: C on the CPU, CUDA kernels on a GPU; :class:`Unsupported` elsewhere or
    where the graph or the state does not fit it, ``RuntimeError`` where it does not build or load."""
    if device.type == "cpu":
        return CellKernel(structure, dtype)
    if device.type == "cuda":
        return CudaCellKernel(structure, dtype, device)
    raise Unsupported(f"no compiled loop on {device.type}")


def _traced_loop(
    module: Recurrence, structure: CellStructure, spec: _StateSpec, x: Tensor, s0: Tensor
) -> Tensor:
    """The loop's states ``(B, T + 1, d)`` from the traced step (no cell calls)."""
    batch, steps = x.shape[:2]
    x_tb = x.transpose(0, 1).reshape(steps * batch, *x.shape[2:])
    news = structure.loop(cell_tensors(module.cell), x_tb, spec.tensors(spec.unflatten(s0)), steps)
    flats = [spec.flatten(tuple(new)) if spec.is_tuple else new[0] for new in news]
    return torch.stack([s0, *flats], 1)


def _platform(kernel: CellKernel | None) -> str | None:
    """``last_stats["cell_kernel"]``: where the compiled loop runs (``"cpu"``, ``"cuda"``), ``None`` without one."""
    return None if kernel is None else getattr(kernel, "platform", "cpu")


def _chunk_rows(d: int) -> int:
    """Rows per batched-gradient call."""
    return max(1, _JACOBIAN_ELEMENTS // d)


def _cell_number(cell: nn.Module) -> int:
    """``cell``'s number in this process (the first cell seen is 1): it tells cell objects apart for as long
    as they live (held weakly: an ``id`` could be reused by a later cell)."""
    number = _CELL_NUMBERS.get(cell)
    if number is None:
        number = _CELL_NUMBERS[cell] = next(_next_number)
    return number


def _probe_steps(batch: int, steps: int, d: int, factored: bool) -> int:
    """The steps ``k`` the ``"auto"`` probe times: as many as fill one batched-gradient call (the per-row cost is
    then the real one), at most :data:`_PROBE_STEPS`; factored Jacobians have no call to fill: that many."""
    fill = _PROBE_STEPS if factored else max(16, -(-_chunk_rows(d) // batch))
    return min(steps, _PROBE_STEPS, fill)


def _graph_texts(structure: CellStructure) -> list[str]:
    """The traced step's graphs as text, in a fixed order: each one's generated code and its constants' shapes
    and dtypes (the same in every process for the same cell: the plan's key, :meth:`Recurrence._plan_cell`)."""
    texts = []
    for name, graph in sorted(vars(structure).items()):
        if isinstance(graph, fx.GraphModule):
            constants = [
                (node.target, *_layout(functools.reduce(getattr, node.target.split("."), graph)))
                for node in graph.graph.nodes
                if node.op == "get_attr"
            ]
            texts.append(f"{name}\n{graph.code}\n{constants}")
    return texts


def _layout(value: object) -> tuple:
    return (tuple(value.shape), value.dtype) if isinstance(value, Tensor) else (repr(value),)


def _replay_grads(
    module: Recurrence,
    spec: _StateSpec,
    x: Tensor,
    s0: Tensor,
    params: list[Tensor],
    needs: tuple[bool, ...],
    grad_states: Tensor,
    create_graph: bool,
) -> list[Tensor | None]:
    """Autograd through the loop replayed from the saved inputs: the gradients the scan must equal.

    With ``create_graph`` the replay starts from the inputs themselves, so the gradients are functions
    of them that autograd can differentiate again.
    """
    if create_graph:
        x_leaf, s0_leaf = x, s0
    else:
        x_leaf, s0_leaf = x.detach().requires_grad_(needs[0]), s0.detach().requires_grad_(needs[1])
    leaves = [x_leaf, s0_leaf, *params]
    with torch.enable_grad():
        states = module._loop(x_leaf, s0_leaf, spec)
    wanted = [t for t, need in zip(leaves, needs, strict=True) if need]
    found = iter(
        torch.autograd.grad(states, wanted, grad_states, allow_unused=True, create_graph=create_graph)
    )
    return [next(found) if need else None for need in needs]


def _synchronized_time(device: torch.device) -> float:
    """The probe's clock once ``device`` has finished its queued work (a sync on CUDA, once per batch shape)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _timer()


def _same_rng(device: torch.device, states: list[Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(generator_states(device), states, strict=True))


