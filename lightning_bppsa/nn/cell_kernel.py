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
  ``CellStructure.scale_columns`` gives;
- the partials by the input part's values.

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
from lightning_bppsa.nn.cell_structure import CellStructure, _adjacent

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
class CellFactors:
    """What a forward with partials wrote: the step Jacobians, the partials by the input part's values, and
    the input part itself recorded by autograd from ``x_flat`` and the cell's tensors (the backward pulls the
    products back through it without running it again)."""

    jacobians: FactoredJacobians
    input_partials: Tensor  # (B T, n_inputs m H): the partial of new state p by input value i at [i, p]
    frontier: list[Tensor]
    offsets: list[Tensor | None]  # per piece its input-only terms (None: zero; empty: none at all), recorded
    x_flat: Tensor


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
        source, self._inputs = _generate(structure, dtype)
        self._library = _load(source)
        self._buffers = threading.local()
        #: elements per step of the partials by the input values that a forward with partials keeps
        self.input_partial_elements = len(self._inputs) * structure.n_states * structure.width

    def forward(
        self, tensors: list[Tensor], x_flat: Tensor, s0: Tensor, batch: int, partials: bool
    ) -> tuple[Tensor, CellFactors | None]:
        """The states ``(B, T + 1, d)`` from ``s0`` over the rows of ``x_flat`` (``(b, t)`` flattened), and with
        ``partials`` the factors the backward needs (then autograd records the input part, from ``x_flat``
        and ``tensors`` where they require grad; nothing else is recorded)."""
        structure = self.structure
        m, h, d = structure.n_states, structure.width, s0.shape[-1]
        rows = x_flat.shape[0]
        steps = rows // batch
        with torch.set_grad_enabled(partials):
            recorded, recorded_offsets = structure.kernel_inputs(tensors, x_flat)
        with torch.no_grad():
            frontier = [None if v is None else v.detach() for v in recorded]
            weight = structure.factor_weight(frontier, s0)
            pieces = len(structure.pieces)
            wc = offsets = None
            if pieces:  # the pieces' linear maps, and their input-only terms once for all rows (recorded)
                wc = _piece_rows(weight, structure).T.contiguous()
                if structure.has_offsets:
                    offsets = _joined([None if v is None else v.detach() for v in recorded_offsets], rows, h)
            inputs = [_laid_out(frontier[i.frontier], i.layout, rows) for i in self._inputs]
            states = s0.new_empty(batch, steps + 1, d)
            states[:, 0] = s0
            scales = diagonal = input_partials = None
            if partials:
                scales = s0.new_empty(batch, steps, len(structure.scale_columns) * h)
                diagonal = s0.new_empty(batch, steps, d) if structure.has_diagonal else None
                input_partials = s0.new_empty(rows, len(self._inputs) * m * h)
            pointers = (ctypes.c_void_p * max(1, len(inputs)))(*(t.data_ptr() for t, _ in inputs))
            strides = (ctypes.c_int64 * max(1, len(inputs)))(*(s for _, s in inputs))
            self._library.bppsa_cell_forward(
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
        if not partials:
            return states, None
        return states, CellFactors(
            FactoredJacobians(weight, scales, diagonal), input_partials, recorded, recorded_offsets, x_flat
        )

    def scan(
        self, factors: CellFactors, grad_steps: Tensor | None, grad_final: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The linear scan of the factored Jacobians fused with the backward's products (``kernels/cell_loop.h``):
        from the new states' direct gradients ``grad_steps`` ``(B, T, d)`` (``None``: none but the final
        state's) and the final state's own ``grad_final`` ``(B, d)`` (or ``None``), the initial state's
        gradient ``(B, d)`` and the products :meth:`vjp` takes (which carry what the VJP needs of the other
        states' gradients). Both results are this thread's scratch buffers: valid until the next backward
        of this kernel (copy what must outlive it)."""
        jacobians, structure = factors.jacobians, self.structure
        batch, steps, h = jacobians.batch_size, jacobians.length, structure.width
        d, pieces = jacobians.state_size, len(structure.pieces)
        grad_steps, grad_final = (None if g is None else g.contiguous() for g in (grad_steps, grad_final))
        like = jacobians.scales
        wt = _piece_rows(jacobians.weight, structure).contiguous() if pieces else None
        out = self._buffer("out", like, (batch, d))
        products = self._buffer("products", like, (batch * steps, (pieces + len(self._inputs)) * h))
        self._library.bppsa_cell_backward(
            batch,
            steps,
            _native.threads(batch),
            _pointer(wt),
            _pointer(jacobians.scales),
            jacobians.scales.shape[-1],
            _pointer(jacobians.diagonal),
            _pointer(factors.input_partials),
            _pointer(grad_steps),
            int(grad_steps is not None),
            _pointer(grad_final),
            _pointer(out),
            _pointer(products),
        )
        return out, products

    def products(self, factors: CellFactors, grad: Tensor) -> Tensor:
        """The backward's products ``(B T, (pieces + input values) H)``: the states' gradient ``grad`` ``(B, T + 1,
        d)`` (a scan's) times the partials by each piece and input value, summed over the new states."""
        scales, grad = factors.jacobians.scales, grad.contiguous()
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
            # pieces = offsets + prev @ (blocks of the weights): the blocks' gradient is prevᵀ @ the pieces'
            # gradients; the offsets' (input-only terms) goes through their recorded graph
            low = min(q for piece in pieces for q, _ in piece.reads)  # only the states the pieces read
            high = max(q for piece in pieces for q, _ in piece.reads) + 1
            prev = states[:, :-1, low * h : high * h].reshape(rows, (high - low) * h)
            blocks = prev.T @ products[:, : len(pieces) * h]
            weights: dict[int, Tensor] = {}
            for k, piece in enumerate(pieces):
                if frontier[piece.weight].requires_grad:
                    grad = weights.setdefault(piece.weight, torch.zeros_like(frontier[piece.weight]))
                    for q, row in piece.reads:
                        block = blocks[(q - low) * h : (q - low + 1) * h, k * h : (k + 1) * h]
                        grad[row : row + h, piece.offset : piece.offset + h] += block
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
    if not structure.input_terms_separate:
        raise Unsupported("the pieces' input-only terms do not separate from the states")


def _piece_rows(weight: Tensor, structure: CellStructure) -> Tensor:
    """``(pieces H, d)``: the factored weight's rows of each piece once (its row block for new state 0; the
    blocks of the other new states repeat it)."""
    m, h = structure.n_states, structure.width
    pieces = len(structure.pieces)
    return weight.view(-1, h, weight.shape[-1])[: pieces * m : m].reshape(pieces * h, weight.shape[-1])


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


def _direct(structure: CellStructure) -> list[int]:
    """The states read directly that the loop treats as identity tiles (one state read directly: the diagonal)."""
    return structure.direct_states if structure.n_states > 1 else []


def _c_epilogue(structure: CellStructure, n_inputs: int) -> list[str]:
    direct = _direct(structure)
    return [
        f"static const int64_t DIRECT_STATES[] = {{{', '.join(map(str, direct)) or '0'}}};",
        '#include "cell_loop.h"',
    ]


#: the CPU loop: C compiled with kernels/cell_loop.h, one coordinate per iteration
C = Target(
    generator="lightning_bppsa/nn/cell_kernel.py",
    prologue=('#include "activations.h"',),
    qualifier="static inline",
    loop="for (int64_t j = 0; j < {h}; ++j) {{",
    epilogue=_c_epilogue,
)


def _generate(structure: CellStructure, dtype: torch.dtype, target: Target = C) -> tuple[str, list[_Input]]:
    """The source of ``structure``'s loop in ``dtype`` for ``target`` and the input-part values it reads, in
    order."""
    graph = structure.pointwise.graph
    n_frontier, m, h = len(structure.frontier_is_row), structure.n_states, structure.width
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    rows = structure.trace_rows
    leaves: dict[fx.Node, str] = {}  # placeholder -> its C value (a leaf of the derivatives)
    loads, inputs = [], []
    for i, node in enumerate(placeholders):
        if not node.users:
            continue
        if i < n_frontier:
            layout = _layout(node, structure.frontier_is_row[i], rows, h, dtype)
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
    stores_values = [f"next[{p * h} + j] = {emitter.value(out)};" for p, out in enumerate(outputs)]
    stores_partials = list(stores_values)
    width = len(structure.scale_columns) * h
    for c, (p, leaf) in enumerate(structure.scale_columns):
        stores_partials.append(
            f"scales[row * {width} + {c * h} + j] = {emitter.partial(outputs[p], by_position(leaf))};"
        )
    if structure.has_diagonal:
        stores_partials.append(f"diagonal[row * {h} + j] = {emitter.partial(outputs[0], state_leaf[0])};")
    n_inputs = len(inputs) * m * h
    for i, node in enumerate(input_leaf):
        for p in range(m):
            stores_partials.append(
                f"fpart[row * {n_inputs} + {(i * m + p) * h} + j] = {emitter.partial(outputs[p], node)};"
            )
    signature = "int64_t row, const REAL* restrict prev, const REAL* restrict piece, const REAL* const* in, const int64_t* stride, REAL* restrict next"
    body = lambda lines, stores: "\n".join(  # noqa: E731
        ["    " + line for line in loads]
        + ["    " + target.loop.format(h=h)]
        + ["        " + line for line in (*lines, *stores)]
        + ["    }"]
    )
    real = "float" if dtype == torch.float32 else "double"
    read = sorted({q for piece in structure.pieces for q, _ in piece.reads})
    source = "\n".join(
        [
            f"/* Generated by {target.generator} from a cell's traced step. */",
            *target.prologue,
            f"typedef {real} REAL;",
            f"#define H {h}",
            f"#define M {m}",
            f"#define D {m * h}",
            f"#define NK {len(structure.pieces)}",
            f"#define KH {len(structure.pieces) * h}",
            f"#define NI {len(inputs)}",
            f"#define CLO {min(read, default=0) * h}",
            f"#define CHI {(max(read) + 1) * h if read else 0}",
            f"#define NDIRECT {len(_direct(structure))}",
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
    return source, inputs


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
        ctypes.c_int,
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
