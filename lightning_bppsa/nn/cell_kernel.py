"""A factored cell's traced step compiled to C: the loop over time that also writes the Jacobians' factors.

Where :class:`~lightning_bppsa.nn.cell_structure.CellStructure` factors, the step is ``pieces = offsets +
s @ W`` (the state's linear maps; their input-only terms, e.g. ``x W_x + b``, precomputed for all rows)
followed by a pointwise part. :class:`CellKernel` generates C for the pointwise part from its aten graph:
each value with its forward-mode derivatives by every input the part reads (the states it reads directly,
the pieces, the input part's values), per coordinate (the part is pointwise, so these are all its partials).
The generated source is compiled with ``kernels/cell_loop.h`` (the loop over rows and steps, the per-step
product) through the package's one builder, so a forward computes in one pass what the backward needs (the
same statements are spelled for CUDA by :mod:`~lightning_bppsa.nn.cell_cuda`: a :class:`Target` says what
differs):

- the states ``(B, T + 1, d)``;
- the scales (and diagonal) of the :class:`~lightning_bppsa.jacobians.FactoredJacobians`, in the layout
  ``CellStructure.scale_columns`` gives, less the partials that are zero by the graph's structure (no
  differentiable path from the piece or state to the new state: an LSTM's memory by its output gate, most of a
  state traced as many narrow blocks): those are neither stored nor swept (:class:`_Layout`);
- the partials by the input part's values (those not structurally zero).

The backward (:meth:`CellKernel.scan`) is one C sweep: the linear scan of those Jacobians with, per row and
step, the products ``g ⊙ partials`` by every piece and input value; :meth:`CellKernel.vjp` turns them into
the parameter and input gradients (Eq. 2): ``prevᵀ products`` for the weights, and autograd through the
input part the forward recorded.

A graph with an op outside :data:`_UNARY`, :data:`_BINARY`, :data:`_COMPARE` and a few with constant
arguments (``pow``, ``where``, clamps, ``hardtanh``, ``leaky_relu``), or other dtypes, or values that do not
broadcast per row or per coordinate, raises :class:`Unsupported`: the traced graph then runs in torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, fx

from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.kernels import _build, _native
from lightning_bppsa.nn.cell_structure import CellStructure, KernelView, _adjacent

__all__ = ["C", "CellFactors", "CellKernel", "Target", "Unsupported"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: unary ops: (value, partial by the operand) as C templates of the operand ``{a}``, the result ``{y}``
#: and the precision's suffix ``{f}`` (``f`` / empty for libm) / ``{s}`` (``f32`` / ``f64``); partials as
#: torch's own backward formulas (e.g. relu's is 0 at 0, sqrt's ``1 / (2 y)``)
_UNARY = {
    aten.neg.default: ("(-{a})", "((REAL)-1)"),
    aten.sigmoid.default: ("sigmoid_{s}({a})", "({y} * (1 - {y}))"),
    aten.tanh.default: ("tanh_{s}({a})", "(1 - {y} * {y})"),
    aten.relu.default: ("({a} < 0 ? (REAL)0 : {a})", "({y} > 0 ? (REAL)1 : (REAL)0)"),
    aten.exp.default: ("exp{f}({a})", "{y}"),
    aten.log.default: ("log{f}({a})", "(1 / {a})"),
    aten.sqrt.default: ("sqrt{f}({a})", "(1 / (2 * {y}))"),
    aten.rsqrt.default: ("(1 / sqrt{f}({a}))", "((REAL)-0.5 * {y} * {y} * {y})"),
    aten.reciprocal.default: ("(1 / {a})", "(-{y} * {y})"),
    aten.abs.default: ("fabs{f}({a})", "(REAL)(({a} > 0) - ({a} < 0))"),
    aten.silu.default: (
        "({a} * sigmoid_{s}({a}))",
        "(sigmoid_{s}({a}) * (1 + {a} * (1 - sigmoid_{s}({a}))))",
    ),
    aten.clone.default: ("{a}", "1"),
    aten.alias.default: ("{a}", "1"),
}
#: binary ops on two operands ``{a}``, ``{b}`` (a tensor or a scalar) and ``alpha``: value and both partials
_BINARY = {
    aten.add.Tensor: ("({a} + {alpha} * {b})", "1", "{alpha}"),
    aten.add.Scalar: ("({a} + {alpha} * {b})", "1", "{alpha}"),
    aten.sub.Tensor: ("({a} - {alpha} * {b})", "1", "(-{alpha})"),
    aten.sub.Scalar: ("({a} - {alpha} * {b})", "1", "(-{alpha})"),
    aten.rsub.Tensor: ("({b} - {alpha} * {a})", "(-{alpha})", "1"),
    aten.rsub.Scalar: ("({b} - {alpha} * {a})", "(-{alpha})", "1"),
    aten.mul.Tensor: ("({a} * {b})", "{b}", "{a}"),
    aten.mul.Scalar: ("({a} * {b})", "{b}", "{a}"),
    aten.div.Tensor: ("({a} / {b})", "(1 / {b})", "(-{y} / {b})"),
    aten.div.Scalar: ("({a} / {b})", "(1 / {b})", "(-{y} / {b})"),
}
#: comparisons: a 0 / 1 value without partials (for ``where`` and masks)
_COMPARE = {
    aten.gt.Tensor: ">",
    aten.gt.Scalar: ">",
    aten.lt.Tensor: "<",
    aten.lt.Scalar: "<",
    aten.ge.Tensor: ">=",
    aten.ge.Scalar: ">=",
    aten.le.Tensor: "<=",
    aten.le.Scalar: "<=",
}


class Unsupported(Exception):
    """The traced step's pointwise part has something the generator does not compile (the message says what)."""


@dataclass(frozen=True)
class _Layout:
    """Which partials the compiled loop keeps: those of ``structure.scale_columns`` (at ``scale_columns``) and of
    the new states by the input values (``input_columns``: ``(input i, new state p)``) that are not zero by the
    traced graph's structure (no path from the leaf to the new state through differentiable operands: zero
    for every input, e.g. an LSTM's memory by its output gate), ``H`` columns each, in that order."""

    structure: CellStructure
    view: KernelView  # what of the structure the loop reads
    scale_columns: tuple[int, ...]
    input_columns: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class CellFactors:
    """What a forward with partials wrote: the step Jacobians' factors in the loop's layout (:class:`_Layout`:
    structurally zero partials are neither stored nor swept), the partials by the input part's values, and
    the input part itself recorded by autograd from ``x_flat`` and the cell's tensors (the backward pulls the
    products back through it without running it again). :attr:`jacobians` is the same Jacobians as
    :class:`~lightning_bppsa.jacobians.FactoredJacobians` (for scans other than the loop's own sweep)."""

    layout: _Layout
    scales: Tensor  # (B, T, kept scale columns H)
    diagonal: Tensor | None  # (B, T, d): one state read directly
    piece_weight: Tensor | None  # (pieces H, d): the pieces' linear maps as rows (CellStructure.piece_weight)
    input_partials: Tensor  # (B T, kept input columns H)
    frontier: list[Tensor]
    offsets: list[Tensor | None]  # per piece its input-only terms (None: zero; empty: none at all), recorded
    x_flat: Tensor

    @functools.cached_property
    def jacobians(self) -> FactoredJacobians:
        """The step Jacobians as :class:`~lightning_bppsa.jacobians.FactoredJacobians` in the structure's full
        layout: its weight and scales are made on their first read (the loop's own sweep reads neither)."""
        # not the factors themselves: a cycle through this cache would keep their buffers until a collection
        return _ExpandedJacobians(self.layout, self.scales, self.diagonal, self.frontier)


class _ExpandedJacobians(FactoredJacobians):
    """:class:`CellFactors` as :class:`~lightning_bppsa.jacobians.FactoredJacobians`: ``weight`` (the structure's
    :meth:`~lightning_bppsa.nn.cell_structure.CellStructure.factor_weight`) and ``scales`` (the kept columns in
    their places, zeros elsewhere) made on first read; the sizes without either."""

    def __init__(  # noqa: D107 - the fields are made on demand
        self, layout: _Layout, compact: Tensor, diagonal: Tensor | None, frontier: list[Tensor | None]
    ) -> None:
        object.__setattr__(self, "_layout", layout)
        object.__setattr__(self, "_compact", compact)
        object.__setattr__(self, "_frontier", frontier)
        object.__setattr__(self, "diagonal", diagonal)

    @functools.cached_property
    def weight(self) -> Tensor:  # type: ignore[override]
        frontier = [None if v is None else v.detach() for v in self._frontier]
        return self._layout.structure.factor_weight(frontier, self._compact)

    @functools.cached_property
    def scales(self) -> Tensor:  # type: ignore[override]
        compact, layout = self._compact, self._layout
        batch, steps = compact.shape[:2]
        h = layout.structure.width
        full = compact.new_zeros(batch, steps, len(layout.structure.scale_columns), h)
        full[:, :, list(layout.scale_columns)] = compact.view(batch, steps, -1, h)
        return full.view(batch, steps, -1)

    @property
    def batch_size(self) -> int:
        return self._compact.shape[0]

    @property
    def length(self) -> int:
        return self._compact.shape[1]

    @property
    def state_size(self) -> int:
        structure = self._layout.structure
        return structure.n_states * structure.width

    @property
    def width(self) -> int:
        structure = self._layout.structure
        return len(structure.scale_columns) * structure.width

    @property
    def device(self) -> torch.device:
        return self._compact.device

    @property
    def dtype(self) -> torch.dtype:
        return self._compact.dtype


@dataclass(frozen=True)
class _Input:
    """An input-part value the pointwise part reads: its index in the frontier and how it broadcasts."""

    frontier: int
    layout: str  # "full" (rows, H), "column" (H,), "row" (rows, 1), "scalar"


class CellKernel:
    """The compiled loop of one factored :class:`CellStructure` in one dtype (CPU).

    Raises :class:`Unsupported` where the graph cannot be compiled and :class:`RuntimeError` where the
    build failed (the builder logged why).
    """

    def __init__(self, structure: CellStructure, dtype: torch.dtype) -> None:
        _check(structure, dtype)
        d = structure.n_states * structure.width
        stack = max(len(structure.pieces) * structure.width, 7 * d) * dtype.itemsize  # the loops' arrays
        if stack > _STACK_BYTES:
            raise Unsupported(f"the state is too wide for the compiled loop's stack arrays ({stack} bytes)")
        self.structure, self.dtype = structure, dtype
        source, self._inputs, self._layout = _generated(structure, dtype, C)
        self._library = _load(source)
        self._start()

    def _start(self) -> None:
        """What every kernel keeps beside its library (the CUDA twin's constructor calls it too)."""
        self._buffers = threading.local()
        self._pool: dict[str, list[Tensor]] = {}
        self._pool_lock = threading.Lock()
        h = self.structure.width
        #: elements per step of the partials by the input values that a forward with partials keeps
        self.input_partial_elements = len(self._layout.input_columns) * h
        #: elements per step of the Jacobians' factors a forward with partials keeps (the kept scales, the diagonal)
        self.factor_elements = len(self._layout.scale_columns) * h + (h if self.structure.has_diagonal else 0)

    def forward(
        self, tensors: list[Tensor], x_flat: Tensor, s0: Tensor, batch: int, partials: bool
    ) -> tuple[Tensor, CellFactors | None]:
        """The states ``(B, T + 1, d)`` from ``s0`` over the rows of ``x_flat`` (``(b, t)`` flattened), and with
        ``partials`` the factors the backward needs (then autograd records the input part, from ``x_flat``
        and ``tensors`` where they require grad; nothing else is recorded)."""
        structure = self.structure
        h, d = structure.width, s0.shape[-1]
        rows = x_flat.shape[0]
        steps = rows // batch
        with torch.set_grad_enabled(partials):
            recorded, recorded_offsets = self._layout.view.values(tensors, x_flat)
        with torch.no_grad():
            frontier = [None if v is None else v.detach() for v in recorded]
            pieces = len(structure.pieces)
            weight = wc = offsets = None
            if pieces:  # the pieces' linear maps, and their input-only terms once for all rows (recorded)
                weight = structure.piece_weight(frontier, s0)
                wc = weight.T.contiguous()
                if structure.has_offsets:
                    offsets = _joined([None if v is None else v.detach() for v in recorded_offsets], rows, h)
            inputs = [_laid_out(frontier[i.frontier], i.layout, rows) for i in self._inputs]
            states = self._output("states", (batch, steps + 1, d), s0)
            states[:, 0] = s0
            scales = diagonal = input_partials = None
            if partials:
                layout = self._layout
                scales = self._output("scales", (batch, steps, len(layout.scale_columns) * h), s0)
                diagonal = self._output("diagonal", (batch, steps, d), s0) if structure.has_diagonal else None
                input_partials = self._output("input_partials", (rows, len(layout.input_columns) * h), s0)
            pointers = (ctypes.c_void_p * max(1, len(inputs)))(*(t.data_ptr() for t, _ in inputs))
            strides = (ctypes.c_int64 * max(1, len(inputs)))(*(s for _, s in inputs))
            status = self._library.bppsa_cell_forward(
                batch,
                steps,
                _native.threads(batch),
                _pointer(wc),
                _pointer(offsets),
                pointers,
                strides,
                _pointer(states),
                int(partials),
                _pointer(scales),
                _pointer(diagonal),
                _pointer(input_partials),
            )
        _check_status(status)
        if not partials:
            return states, None
        return states, CellFactors(
            self._layout, scales, diagonal, weight, input_partials, recorded, recorded_offsets, x_flat
        )

    def scan(
        self, factors: CellFactors, grad_steps: Tensor | None, grad_final: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The linear scan of the factored Jacobians fused with the backward's products (``kernels/cell_loop.h``):
        from the new states' direct gradients ``grad_steps`` ``(B, T, w)`` (``None``: none but the final
        state's), those of their first ``w <= d`` columns (the others' are zero: the outputs are the first
        state tensor of several) read where they lie (any strides over ``B`` and ``T``: time-major outputs'
        gradients are not copied), and the final state's own ``grad_final`` ``(B, d)`` (or ``None``), the
        initial state's gradient ``(B, d)`` and the products :meth:`vjp` takes (which carry what the VJP needs
        of the other states' gradients). Both results are this thread's scratch buffers: valid until the next
        backward of this kernel (copy what must outlive it)."""
        structure, like = self.structure, factors.scales
        batch, steps, h = like.shape[0], like.shape[1], structure.width
        d, pieces = structure.n_states * h, len(structure.pieces)
        grad_final = None if grad_final is None else grad_final.contiguous()
        width = 0 if grad_steps is None else grad_steps.shape[-1]
        if grad_steps is not None and (grad_steps.shape != (batch, steps, width) or width > d):
            raise ValueError(
                f"the new states' gradients must be (B={batch}, T={steps}, w <= {d}); got {tuple(grad_steps.shape)}"
            )
        if grad_steps is not None and grad_steps.stride(-1) != 1:  # the sweep reads a row's columns in a run
            grad_steps = grad_steps.contiguous()
        out = self._buffer("out", like, (batch, d))
        products = self._buffer("products", like, (batch * steps, (pieces + len(self._inputs)) * h))
        status = self._library.bppsa_cell_backward(
            batch,
            steps,
            _native.threads(batch),
            _pointer(factors.piece_weight),
            _pointer(like),
            like.shape[-1],
            _pointer(factors.diagonal),
            _pointer(factors.input_partials),
            _pointer(grad_steps),
            width,
            *((0, 0) if grad_steps is None else grad_steps.stride()[:2]),
            _pointer(grad_final),
            _pointer(out),
            _pointer(products),
        )
        _check_status(status)
        return out, products

    def products(self, factors: CellFactors, grad: Tensor) -> Tensor:
        """The backward's products ``(B T, (pieces + input values) H)``: the states' gradient ``grad`` ``(B, T + 1,
        d)`` (a scan's) times the partials by each piece and input value, summed over the new states."""
        scales, grad = factors.scales, grad.contiguous()
        batch, steps = scales.shape[:2]
        products = self._buffer(
            "products",
            grad,
            (batch * steps, (len(self.structure.pieces) + len(self._inputs)) * self.structure.width),
        )
        self._library.bppsa_cell_cotangent(
            batch,
            steps,
            _native.threads(batch * steps),
            _pointer(grad),
            _pointer(scales),
            scales.shape[-1],
            _pointer(factors.input_partials),
            _pointer(products),
        )
        return products

    def _output(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A forward's states or factor buffer (kept until the backward): on the CPU one of this kernel's buffers
        that nothing references any more (the last backward's graph was freed, no view of it is held), as a new
        view, else a new one. A new multi-MB buffer every forward costs its page faults: above glibc's mmap
        threshold (32 MB at most) every allocation is fresh pages, measured 20 ms of a 35 ms forward for a 55 MB
        buffer (WideMemory, H = 32); the states' 6 MB ~0.6 ms of WideFirst's ~9.6 ms forward (H=32 B=16
        T=1000, one thread)."""
        if like.device.type != "cpu" or _SOLE is None:
            return like.new_empty(shape)
        with self._pool_lock:
            held = self._pool.setdefault(name, [])
            free = [i for i, t in enumerate(held) if _use_count(t) == _SOLE]
            for i in free:
                if held[i].shape == shape and held[i].dtype == like.dtype:
                    return held[i].view(shape)
            buffer = like.new_empty(shape)
            if free:
                held[free[0]] = buffer
            elif len(held) < _POOLED:
                held.append(buffer)
            return buffer.view(shape)

    def _buffer(self, name: str, like: Tensor, shape: tuple[int, ...]) -> Tensor:
        """A backward's scratch buffer, reused from this thread's last backward of the same shape: the products
        and the states' gradients live only until the backward returns (it hands out a copy of what it keeps),
        and a fresh multi-MB buffer every step costs its page faults (~0.25 ms a MB here)."""
        cached = getattr(self._buffers, name, None)
        if (
            cached is None
            or cached.shape != shape
            or cached.dtype != like.dtype
            or cached.device != like.device
        ):
            cached = like.new_empty(shape)
            setattr(self._buffers, name, cached)
        return cached

    def vjp(
        self, factors: CellFactors, states: Tensor, products: Tensor, wanted: list[Tensor]
    ) -> tuple[Tensor | None, ...]:
        """Gradients of ``wanted`` (``factors.x_flat`` and the cell's tensors) from the backward's ``products``
        (:meth:`scan`, :meth:`products`) and the states ``(B, T + 1, d)``: the products pulled back through the
        linear maps and the input part the forward recorded (kept: the backward may run again). The maps'
        weights get ``prevᵀ products`` directly (``prev`` the old states); autograd records the maps only
        where the pieces have input-only terms."""
        structure, frontier = self.structure, factors.frontier
        h, pieces = structure.width, structure.pieces
        rows = states.shape[0] * (states.shape[1] - 1)
        piece_grads = products[:, : len(pieces) * h].view(rows, len(pieces), h)
        input_grads = products[:, len(pieces) * h :].view(rows, len(self._inputs), h)
        outs, grads = [], []
        if pieces:
            # pieces = offsets + prev @ rowsᵀ (the weights' blocks, CellStructure.piece_weight): the rows' gradient
            # is the pieces' gradientsᵀ @ prev; the offsets' (input-only terms) goes through their recorded graph
            low = min(q for piece in pieces for q, _ in piece.reads)  # only the states the pieces read
            high = max(q for piece in pieces for q, _ in piece.reads) + 1
            # per batch row, on the states as they lie ((B, T + 1, d): a (B T, d) copy of the old states cost more
            # than the product, e.g. 3.5 ms of WideFirst's 24 ms backward)
            batch = states.shape[0]
            per_row = products[:, : len(pieces) * h].view(batch, rows // batch, -1).transpose(1, 2)
            grad = torch.bmm(per_row, states[:, :-1, low * h : high * h]).sum(0)
            weights = structure.piece_weight_grads(grad, low * h, frontier)
            outs += [frontier[w] for w in weights]
            grads += list(weights.values())
            terms = [(k, v) for k, v in enumerate(factors.offsets) if v is not None and v.requires_grad]
            outs += [v for _, v in terms]
            grads += [piece_grads[:, k].sum_to_size(v.shape) for k, v in terms]
        for i, spec in enumerate(self._inputs):
            value = frontier[spec.frontier]
            if value.requires_grad:
                outs.append(value)
                grads.append(input_grads[:, i].sum_to_size(value.shape))
        if not outs:
            return (None,) * len(wanted)
        return torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True)


def _check(structure: CellStructure, dtype: torch.dtype) -> None:
    """:class:`Unsupported` where a structure in a dtype has no compiled loop on any target: its Jacobians do not
    factor, the dtype is not float32 / float64, or the pieces' input-only terms do not separate."""
    if structure.reason is not None:
        raise Unsupported(f"the Jacobians do not factor ({structure.reason})")
    if dtype not in (torch.float32, torch.float64):
        raise Unsupported(f"{dtype} (float32 and float64 are compiled)")
    if not structure.kernel_views:
        raise Unsupported("the pieces' input-only terms do not separate from the states")


def _joined(terms: list[Tensor | None], rows: int, h: int) -> Tensor:
    """The pieces' input-only terms as one ``(rows, pieces H)`` row-major tensor: without a copy where they
    are its column blocks already (the structure makes them so where it can), else concatenated."""
    first = terms[0]
    if first is not None and all(t is not None and t.shape == (rows, h) for t in terms) and _adjacent(terms):
        total = len(terms) * h
        if first.stride(0) == total:
            return first.as_strided((rows, total), (total, 1), first.storage_offset())
    zero = next(t for t in terms if t is not None).new_zeros(1, h)  # the structure has some term
    return torch.cat([(zero if t is None else t).expand(rows, h) for t in terms], -1)


def _laid_out(value: Tensor, layout: str, rows: int) -> tuple[Tensor, int]:
    """``value`` as the generated code reads it (unit stride along H) and its row stride."""
    if layout == "full":
        value = value if value.stride(-1) == 1 else value.contiguous()
        return value, value.stride(0)
    if layout == "row":
        value = value.reshape(rows)
        return value, value.stride(0)
    return value.reshape(-1).contiguous(), 0


def _use_count(tensor: Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s storage."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


#: factor buffers a kernel keeps per name for reuse: a training loop's last forward's factors live until its next
#: forward returns (its outputs are replaced then), so two alternate; one more for a graph kept for later
_POOLED = 3
try:  # the count of a tensor nothing else shares (its own, and the storage handle asked)
    _SOLE: int | None = _use_count(torch.empty(1))
except (AttributeError, RuntimeError):  # a release without the count: every forward allocates
    _SOLE = None


def _check_status(status: int) -> None:
    """The compiled loops return -1 where their scratch (a thread's rows, the padded weights) could not be allocated."""
    if status != 0:
        raise MemoryError("the compiled cell loop could not allocate its scratch memory")


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# --------------------------------------------------------------------------------------------------
# The generator.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """What :func:`_generate` spells differently per compiler; the step's statements are the same for all."""

    generator: str  # named in the source's first comment
    prologue: tuple[str, ...]  # lines before the defines: what the step's spelling needs (types, activations)
    qualifier: str  # of the step functions cell_values and cell_partials
    loop: str  # the head of the step's loop over the coordinates j, formatted with ``h`` (H); closed by "}"
    # (structure, NI) -> the lines after the step: its loop
    epilogue: Callable[[CellStructure, int], list[str]]


def _c_epilogue(structure: CellStructure, n_inputs: int) -> list[str]:
    return ['#include "cell_loop.h"']


#: the CPU loop: C compiled with kernels/cell_loop.h, one coordinate per iteration
C = Target(
    generator="lightning_bppsa/nn/cell_kernel.py",
    prologue=('#include "activations.h"',),
    qualifier="static inline",
    loop="for (int64_t j = 0; j < {h}; ++j) {{",
    epilogue=_c_epilogue,
)

_ZERO = "(REAL)0"  # the emitter's partial where the graph has no path from the leaf (zero for every input)


def _generated(
    structure: CellStructure, dtype: torch.dtype, target: Target
) -> tuple[str, list[_Input], _Layout]:
    """:func:`_generate` of the first of the structure's kernel views it compiles (the input part's pointwise
    values taken into the step where they can be); :class:`Unsupported` where none compiles (the last reason)."""
    error = Unsupported("the pieces' input-only terms do not separate from the states")
    for view in structure.kernel_views:
        try:
            return _generate(structure, dtype, target, view)
        except Unsupported as failed:
            error = failed
    raise error


def _generate(
    structure: CellStructure, dtype: torch.dtype, target: Target = C, view: KernelView | None = None
) -> tuple[str, list[_Input], _Layout]:
    """The source of ``structure``'s loop in ``dtype`` for ``target`` reading ``view`` (default: the structure's
    last, the pointwise part as the torch path runs it), the input-part values it reads, in order, and which
    partials it keeps (:class:`_Layout`: those the emitter's forward mode does not find zero)."""
    view = structure.kernel_views[-1] if view is None else view
    graph = view.pointwise.graph
    n_frontier, m, h = len(view.frontier_is_row), structure.n_states, structure.width
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    rows = structure.trace_rows
    leaves: dict[fx.Node, str] = {}  # placeholder -> its C value (a leaf of the derivatives)
    loads, inputs = [], []
    for i, node in enumerate(placeholders):
        if not node.users:
            continue
        if i < n_frontier:
            layout = _layout(node, view.frontier_is_row[i], rows, h, dtype)
            k = len(inputs)
            inputs.append(_Input(i, layout))
            index = {"full": "in{k}[j]", "column": "in{k}[j]", "row": "in{k}", "scalar": "in{k}"}[layout]
            leaves[node] = index.format(k=k)
        elif i < n_frontier + m:
            leaves[node] = f"prev[{(i - n_frontier) * h} + j]"
        else:
            leaves[node] = f"piece[{(i - n_frontier - m) * h} + j]"
    for k, spec in enumerate(inputs):
        if spec.layout in ("full", "column"):
            offset = f" + row * stride[{k}]" if spec.layout == "full" else ""
            loads.append(f"const REAL* restrict in{k} = in[{k}]{offset};")
        else:
            offset = f"row * stride[{k}]" if spec.layout == "row" else "0"
            loads.append(f"const REAL in{k} = in[{k}][{offset}];")
    emitter = _Emitter(dtype, list(leaves))
    for node, expr in leaves.items():
        emitter.leaf(node, expr)
    for node in graph.nodes:
        if node.op == "call_function":
            emitter.node(node)
    outputs = list(next(n for n in graph.nodes if n.op == "output").args[0])
    # the leaves by position: states q, pieces k, input values i
    state_leaf = {q: placeholders[n_frontier + q] for q in range(m)}
    piece_leaf = {k: placeholders[n_frontier + m + k] for k in range(len(structure.pieces))}
    input_leaf = [placeholders[spec.frontier] for spec in inputs]
    by_position = lambda leaf: state_leaf[leaf] if leaf < m else piece_leaf[leaf - m]  # noqa: E731
    # the kept partials: (column, new state p, leaf, expression), the scales' then the input values'
    scales = [(c, p, leaf, emitter.partial(outputs[p], by_position(leaf)))
              for c, (p, leaf) in enumerate(structure.scale_columns)]  # fmt: skip
    scales = [column for column in scales if column[3] != _ZERO]
    by_inputs = [
        (i, p, emitter.partial(outputs[p], node)) for i, node in enumerate(input_leaf) for p in range(m)
    ]
    by_inputs = [column for column in by_inputs if column[2] != _ZERO]
    layout = _Layout(structure, view, tuple(c for c, *_ in scales), tuple((i, p) for i, p, _ in by_inputs))
    stores_values = [f"next[{p * h} + j] = {emitter.value(out)};" for p, out in enumerate(outputs)]
    stores_partials = list(stores_values)
    for n, (_, _, _, expr) in enumerate(scales):
        stores_partials.append(f"scales[row * {len(scales) * h} + {n * h} + j] = {expr};")
    if structure.has_diagonal:
        stores_partials.append(f"diagonal[row * {h} + j] = {emitter.partial(outputs[0], state_leaf[0])};")
    for n, (_, _, expr) in enumerate(by_inputs):
        stores_partials.append(f"fpart[row * {len(by_inputs) * h} + {n * h} + j] = {expr};")
    signature = "int64_t row, const REAL* restrict prev, const REAL* restrict piece, const REAL* const* in, const int64_t* stride, REAL* restrict next"
    body = lambda lines, stores: "\n".join(  # noqa: E731
        ["    " + line for line in loads]
        + ["    " + target.loop.format(h=h)]
        + ["        " + line for line in (*lines, *stores)]
        + ["    }"]
    )
    real = "float" if dtype == torch.float32 else "double"
    read = sorted({q for piece in structure.pieces for q, _ in piece.reads})
    pieces = len(structure.pieces)
    # the backward's sums over the kept partials, spelled by the loop through its accessors G(p) (the new states'
    # gradient at state p), S(n) / F(n) (kept scale / input column n), OUT(k, e) (product k), ADD(q, e) (state q)
    total = lambda terms: " + ".join(terms) or _ZERO  # noqa: E731
    products = [
        f"OUT({k}, {total([f'S({n}) * G({p})' for n, (_, p, leaf, _) in enumerate(scales) if leaf == m + k])})"
        for k in range(pieces)
    ] + [
        f"OUT({pieces + i}, {total([f'F({n}) * G({p})' for n, (j, p, _) in enumerate(by_inputs) if j == i])})"
        for i in range(len(inputs))
    ]
    direct = [
        f"ADD({q}, {total(terms)})"
        for q in (structure.direct_states if m > 1 else [])
        if (terms := [f"S({n}) * G({p})" for n, (_, p, leaf, _) in enumerate(scales) if leaf == q])
    ]
    source = "\n".join(
        [
            f"/* Generated by {target.generator} from a cell's traced step. */",
            *target.prologue,
            f"typedef {real} REAL;",
            f"#define H {h}",
            f"#define M {m}",
            f"#define D {m * h}",
            f"#define NK {pieces}",
            f"#define KH {pieces * h}",
            f"#define NI {len(inputs)}",
            f"#define NS {len(scales)}",
            f"#define NF {len(by_inputs)}",
            f"#define CLO {min(read, default=0) * h}",
            f"#define CHI {(max(read) + 1) * h if read else 0}",
            f"#define CELL_PRODUCTS(G, S, F, OUT) {' '.join(products)}",
            f"#define CELL_DIRECT(G, S, ADD) {' '.join(direct)}",
            f"{target.qualifier} void cell_values({signature}) {{",
            "    (void)stride;",
            body(emitter.lines(values_only=True), stores_values),
            "}",
            f"{target.qualifier} void cell_partials({signature}, REAL* restrict scales, REAL* restrict diagonal, REAL* restrict fpart) {{",
            "    (void)stride; (void)scales; (void)diagonal; (void)fpart;",
            body(emitter.lines(values_only=False), stores_partials),
            "}",
            *target.epilogue(structure, len(inputs)),
            "",
        ]
    )
    return source, inputs, layout


def _layout(node: fx.Node, is_row: bool, rows: int, h: int, dtype: torch.dtype) -> str:
    val = node.meta.get("val")
    if not isinstance(val, Tensor) or val.dtype != dtype:
        raise Unsupported(
            f"the pointwise part reads {node.name} in {getattr(val, 'dtype', type(val).__name__)}, not {dtype}"
        )
    shape = tuple(val.shape)
    if is_row and shape == (rows, h):
        return "full"
    if is_row and shape == (rows, 1):
        return "row"
    if not is_row and shape in ((h,), (1, h)):
        return "column"
    if not is_row and math.prod(shape) == 1 and len(shape) <= 2:
        return "scalar"
    raise Unsupported(f"the pointwise part reads a value of shape {shape} (rows {rows}, width {h})")


class _Emitter:
    """C statements for the pointwise graph: each node's value and its partials by the leaves (forward mode,
    zeros dropped), per coordinate ``j``."""

    def __init__(self, dtype: torch.dtype, leaves: list[fx.Node]) -> None:
        self._f, self._s = ("f", "f32") if dtype == torch.float32 else ("", "f64")
        self._dtype = dtype
        self._leaves = leaves
        self._values: dict[fx.Node, str] = {}
        self._partials: dict[fx.Node, dict[fx.Node, str]] = {}  # node -> leaf -> C name (or "1")
        self._all_lines: list[tuple[bool, str]] = []  # (only for partials, statement)

    def leaf(self, node: fx.Node, expr: str) -> None:
        name = f"v_{node.name}"
        self._emit(False, f"const REAL {name} = {expr};")
        self._values[node], self._partials[node] = name, {node: "1"}

    def value(self, node: fx.Node) -> str:
        return self._values[node]

    def partial(self, out: fx.Node, leaf: fx.Node) -> str:
        return self._partials.get(out, {}).get(leaf, "(REAL)0")

    def lines(self, values_only: bool) -> list[str]:
        return [line for partial, line in self._all_lines if not (values_only and partial)]

    def _emit(self, partial: bool, line: str) -> None:
        self._all_lines.append((partial, line))

    def _operand(self, arg) -> tuple[str, dict[fx.Node, str]]:
        if isinstance(arg, fx.Node):
            if arg not in self._values:
                raise Unsupported(f"{arg.name} is read before it is computed")
            return self._values[arg], self._partials[arg]
        if isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise Unsupported(f"a constant argument {arg!r}")
        if math.isnan(arg):
            return "((REAL)NAN)", {}
        if math.isinf(arg):
            return f"((REAL){'-' if arg < 0 else ''}INFINITY)", {}
        return f"((REAL){float(arg)!r})", {}

    def node(self, node: fx.Node) -> None:
        target, args, kwargs = node.target, node.args, dict(node.kwargs)
        val = node.meta.get("val")
        name = f"v_{node.name}"
        fmt = {"f": self._f, "s": self._s}
        if target in _COMPARE:
            if kwargs:
                raise Unsupported(f"{target} with {kwargs}")
            (a, _), (b, _) = self._operand(args[0]), self._operand(args[1])
            self._emit(False, f"const REAL {name} = (REAL)({a} {_COMPARE[target]} {b});")
            self._values[node], self._partials[node] = name, {}
            return
        if not isinstance(val, Tensor) or val.dtype != self._dtype:
            raise Unsupported(
                f"{node.name} ({target}) is {getattr(val, 'dtype', type(val).__name__)}, not {self._dtype}"
            )
        if target in _UNARY and len(args) == 1 and not kwargs:
            a, da = self._operand(args[0])
            value, derivative = _UNARY[target]
            self._emit(False, f"const REAL {name} = {value.format(a=a, **fmt)};")
            terms = [(derivative.format(a=a, y=name, **fmt), da)]
        elif target in _BINARY and set(kwargs) <= {"alpha"} and len(args) <= 3:
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            (a, da), (b, db) = self._operand(args[0]), self._operand(args[1])
            alpha, _ = self._operand(alpha)
            value, d_a, d_b = _BINARY[target]
            self._emit(False, f"const REAL {name} = {value.format(a=a, b=b, alpha=alpha)};")
            terms = [
                (d_a.format(a=a, b=b, y=name, alpha=alpha), da),
                (d_b.format(a=a, b=b, y=name, alpha=alpha), db),
            ]
        elif target is aten.pow.Tensor_Scalar and not kwargs:
            a, da = self._operand(args[0])
            n, _ = self._operand(args[1])
            self._emit(False, f"const REAL {name} = pow{self._f}({a}, {n});")
            # torch: 0 where the exponent is 0, else n a^(n - 1)
            terms = [(f"({n} == 0 ? (REAL)0 : {n} * pow{self._f}({a}, {n} - 1))", da)]
        elif target is aten.where.self and not kwargs:
            (c, _), (a, da), (b, db) = (self._operand(x) for x in args)
            self._emit(False, f"const REAL {name} = {c} != 0 ? {a} : {b};")
            terms = [(f"({c} != 0 ? (REAL)1 : (REAL)0)", da), (f"({c} != 0 ? (REAL)0 : (REAL)1)", db)]
        elif (
            target
            in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default)
            and not kwargs
        ):
            a, da = self._operand(args[0])
            low, high = _bounds(target, args)
            lo = self._operand(low)[0] if low is not None else None
            hi = self._operand(high)[0] if high is not None else None
            value = a if lo is None else f"({a} < {lo} ? {lo} : {a})"
            value = value if hi is None else f"({value} > {hi} ? {hi} : {value})"
            self._emit(False, f"const REAL {name} = {value};")
            # torch's clamp passes the gradient where low <= a <= high; hardtanh's where low < a < high
            strict = target is aten.hardtanh.default
            inside = (
                " && ".join(
                    ([f"{a} {'>' if strict else '>='} {lo}"] if lo is not None else [])
                    + ([f"{a} {'<' if strict else '<='} {hi}"] if hi is not None else [])
                )
                or "1"
            )
            terms = [(f"(({inside}) ? (REAL)1 : (REAL)0)", da)]
        elif target is aten.leaky_relu.default and not kwargs:
            a, da = self._operand(args[0])
            slope, _ = self._operand(args[1] if len(args) > 1 else 0.01)
            self._emit(False, f"const REAL {name} = {a} > 0 ? {a} : {a} * {slope};")
            terms = [(f"({a} > 0 ? (REAL)1 : {slope})", da)]
        else:
            raise Unsupported(f"the op {target} (args {len(args)}, kwargs {sorted(kwargs)})")
        self._values[node] = name
        self._partials[node] = self._combine(name, terms)

    def _combine(self, name: str, terms: list[tuple[str, dict[fx.Node, str]]]) -> dict[fx.Node, str]:
        """The chain rule: ``Σ coefficient · partial`` per leaf, each as one named statement."""
        out: dict[fx.Node, str] = {}
        for leaf in self._leaves:
            parts = [(c, d[leaf]) for c, d in terms if leaf in d]
            if not parts:
                continue
            expr = " + ".join(c if d == "1" else d if c == "1" else f"{c} * {d}" for c, d in parts)
            out[leaf] = f"d_{name}_{leaf.name}"
            self._emit(True, f"const REAL {out[leaf]} = {expr};")
        return out


def _bounds(target, args) -> tuple[object, object]:
    if target is aten.clamp.default:
        return (args[1] if len(args) > 1 else None), (args[2] if len(args) > 2 else None)
    if target is aten.clamp_min.default:
        return args[1], None
    if target is aten.clamp_max.default:
        return None, args[1]
    return (args[1] if len(args) > 1 else -1.0), (args[2] if len(args) > 2 else 1.0)


#: the most the generated loops keep on a thread's stack (a piece row, the sweep's partial sums): OpenMP
#: worker threads may have small stacks
_STACK_BYTES = 2**18

_SIGNATURES = {
    "bppsa_cell_forward": [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        *[ctypes.c_void_p] * 5,
        ctypes.c_int,
        *[ctypes.c_void_p] * 3,
    ],
    "bppsa_cell_cotangent": [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ],
    "bppsa_cell_backward": [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        *[ctypes.c_void_p] * 3,
        *[ctypes.c_int64] * 3,
        *[ctypes.c_void_p] * 3,
    ],
}
_LIBRARIES: dict[str, ctypes.CDLL] = {}
#: on x86, vectors as wide as the CPU has (gcc's -march=native keeps AVX-512 CPUs at 256 bits): the loops'
#: products and activations ran 10-20% faster with 512 (LSTM, leaky-memory cells, H = 32); no effect elsewhere
_VECTOR_FLAGS = ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()


def _load(source: str) -> ctypes.CDLL:
    """Build (cached on disk by the source's hash) and load a generated source; RuntimeError if it fails."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    if digest not in _LIBRARIES:
        folder = _build.cache_dir() / "cells"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"bppsa_cell_{digest}.c"
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            tmp.replace(path)
        library = _native.load(
            f"bppsa_cell_{digest}",
            str(path),
            _SIGNATURES,
            logger=log,
            fallback="The cell's traced step runs in torch",
            extra_flags=(
                "-ffp-contract=fast",
                "-fno-trapping-math",
                f"-I{_build.kernel_path('')}",
                *_VECTOR_FLAGS,
            ),
            depends=("activations.h", "cell_loop.h"),
        )
        if library is None:
            raise RuntimeError("the generated cell kernel could not be built (see the log)")
        _LIBRARIES[digest] = library
    return _LIBRARIES[digest]
