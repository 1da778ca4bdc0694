"""A recurrent cell's step traced into its aten graph, split by what each node depends on.

:func:`trace_cell` traces ``cell(x, state) -> state`` once with ``make_fx(tracing_mode="fake")`` (data-
dependent Python control flow and ``.item()`` raise instead of being baked in) and splits the graph:

- the *input part*: nodes depending on the parameters and ``x`` only (e.g. the input projection), which
  :meth:`CellStructure.loop` evaluates once for all ``B T`` rows;
- the *state part*: nodes depending on the state, which it runs per step (calling torch's own functions
  rather than the aten overloads: several µs less per op).

The trace writes torch's fused CUDA cell ops (``aten._thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell``, which
``nn.LSTMCell`` / ``nn.GRUCell`` call on CUDA) as their pointwise math (:mod:`~lightning_bppsa.nn.cell_fused`):
those cells trace on CUDA to the graph they trace to on the CPU. Any other op stays as it is.

Before the split the graph is rewritten into one canonical form (:func:`_canonical`), so that a cell factors
the same whichever way it is written and on every supported torch release: in-place ops on the step's own
values become their out-of-place forms where that provably computes the same
(:func:`~lightning_bppsa.nn.cell_inplace.out_of_place`: torch's ``nn.LSTMCell`` / ``nn.GRUCell`` trace so),
``unsafe_split`` becomes ``split``, ``lerp`` / ``addcmul`` /
``addcdiv`` become the adds and products they are, and pointwise ops on a whole ``(rows, m H)`` gate block
split into ``(rows, H)`` pieces afterwards (``chunk``, ``split``, slicing, ``unbind`` of a ``(rows, m, H)``
view) are written per piece; which ops are pointwise is the tag ``pointwise`` plus the ops some supported
release leaves untagged. State tensors of different widths are traced as blocks of one width ``H`` (their
widths' greatest common divisor), so a wide state tensor's pointwise ops are written per block the same way.

The cell is *factorable* when the state reaches the new state only through (a) linear maps by weights
that depend on parameters only (``mm`` / ``addmm`` of a state tensor, or of a ``cat`` of state tensors and
input-only tensors along the last dimension, optionally split or sliced along the last dimension into
pieces of the state's width ``H``) and (b) pointwise ops whose state-dependent operands all have the
output's shape ``(rows, H)``. Then the step Jacobian is, per row,
``J = Σ_{p,q} diag(c_pq) E_pq + Σ_k Σ_p diag(s_kp) [W_k at the column blocks of the states it reads]``,
``c`` and ``s`` being per-coordinate partials of the pointwise part, which :meth:`CellStructure.linearize`
gets from one reverse pass per state tensor over all rows (the part is pointwise, so the gradient of a
sum is each coordinate's own partial) and returns as :class:`~lightning_bppsa.jacobians.FactoredJacobians`.
Anything else is not factorable (``reason`` says why).

A compiled loop (:mod:`~lightning_bppsa.nn.cell_kernel`) reads a factored structure through a
:class:`KernelView`: the pointwise part, and the input part's values it reads made for all rows in one graph
(each projection split once into its ``H``-wide blocks). Its first view also computes, per step, the input
part's pointwise ``(rows, H)`` values that only the pointwise part reads (minLSTM's ``f / (f + i)``): one
pass in the loop instead of several over all rows and their autograd backward; the last view is the
pointwise part as the torch path runs it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import types
from dataclasses import dataclass

import torch
from torch import Tensor, fx, nn
from torch.func import functional_call

from lightning_bppsa import gemm
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.nn.cell_fused import FUSED_CELL_DECOMPOSITIONS
from lightning_bppsa.nn.cell_inplace import out_of_place

__all__ = ["CellStructure", "NotTraceable", "cell_tensors", "describe", "trace_cell"]

aten = torch.ops.aten
_LINEAR = (aten.mm.default, aten.addmm.default)
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)

#: pointwise ops that some supported torch release does not tag ``pointwise`` (2.11 leaves leaky_relu untagged,
#: 2.13 tags it): what factors must not depend on the release's tags
_UNTAGGED_POINTWISE = frozenset({aten.leaky_relu.default})

_CONST, _INPUT, _STATE = 0, 1, 2  # what a node depends on: parameters only, x too, the state too


class NotTraceable(Exception):
    """The cell's step could not be traced into a graph that replaces calling it."""


@dataclass(frozen=True)
class _Piece:
    """One ``(rows, H)`` column block ``[offset, offset + H)`` of a linear map ``z = a @ Wt`` of the state."""

    weight: int  # index of ``Wt`` (``(in, out)``) among the frontier values
    offset: int
    reads: tuple[tuple[int, int], ...]  # (state index, row offset of its block in Wt)


@dataclass(frozen=True)
class KernelView:
    """What a compiled loop reads of a factored :class:`CellStructure`: its pointwise graph ``(*frontier, *states,
    *pieces) -> new states``, per frontier value whether it has a row per input row, and the graph making the
    frontier values the loop reads (the pieces' weights, the values the pointwise graph reads) and the pieces'
    input-only terms from the cell's tensors and ``x``. The pieces' weights are at the structure's frontier
    indices."""

    pointwise: fx.GraphModule
    frontier_is_row: tuple[bool, ...]
    inputs: fx.GraphModule

    def values(self, tensors: list[Tensor], x: Tensor) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """``(frontier, terms)`` for all rows of ``x`` (``None`` for the frontier values the loop does not read)."""
        values = list(self.inputs.forward(*tensors, x))
        n = len(self.frontier_is_row)
        return values[:n], values[n:]


class CellStructure:
    """The traced step of a cell: an input part evaluated once, a state part per step, maybe factored Jacobians.

    Built by :func:`trace_cell`; ``reason`` is ``None`` where the Jacobians factor, else why not.
    """

    def __init__(self, gm: fx.GraphModule, n_tensors: int, groups: tuple[int, ...], width: int) -> None:
        # the traced step's state placeholders are ``width``-wide blocks; ``groups[i]`` of them make the cell's
        # state tensor i (concatenated along the last dimension: the flat state's layout is the blocks' order)
        self._groups = groups
        nodes = list(gm.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        tensor_nodes = placeholders[:n_tensors]
        x_node, states = placeholders[n_tensors], placeholders[n_tensors + 1 :]
        outputs = list(next(n for n in nodes if n.op == "output").args[0])
        origin = _origins(gm, n_tensors)
        state_part = [n for n in nodes if n.op == "call_function" and origin[n] == _STATE]
        # the input part's values the state part (or the output) reads: computed once for all rows
        frontier = list(
            dict.fromkeys(a for n in state_part for a in n.all_input_nodes if origin[a] != _STATE)
        )
        frontier += [o for o in dict.fromkeys(outputs) if origin[o] != _STATE and o not in frontier]
        # a value whose column blocks the state part reads (the input projection's gates, split) joins them: the
        # pieces' input-only terms are then made from it whole, and the compiled loop reads them as they are
        frontier += [
            s
            for s in dict.fromkeys(_split_source(n) for n in frontier)
            if s is not None and s not in frontier
        ]
        rows = x_node.meta["val"].shape[0]
        for node in frontier:
            val = node.meta.get("val")
            if origin[node] == _INPUT and not (
                isinstance(val, Tensor) and val.dim() > 0 and val.shape[0] == rows
            ):
                raise NotTraceable(f"an input-only value ({node.name}) does not keep the batch rows first")
        self._frontier_is_row = [origin[n] == _INPUT for n in frontier]
        self._precompute = _thin_aware(_extract(gm, [*tensor_nodes, x_node], frontier))
        self._step = _eager(_extract(gm, [*frontier, *states], outputs))
        # the frontier values a step reads (the others are passed as None)
        self._step_reads = [bool(n.users) for n in self._step.graph.nodes if n.op == "placeholder"][
            : len(frontier)
        ]
        self.reason, self._pieces = _factor(state_part, outputs, origin, states, frontier, rows, width)
        if self.reason is None:
            computing = _ancestors([p for p, _ in self._pieces], set(state_part))
            linear = [n for n in state_part if n in computing]
            pointwise = [n for n in state_part if n not in linear]
            self._linear = _thin_aware(
                _extract(gm, [*frontier, *states], [p for p, _ in self._pieces], linear)
            )
            # the pieces' input-only terms (a bias, input values concatenated with the states), without the states;
            # only the compiled loop needs them: a graph they do not separate from leaves it None
            self._input_terms: fx.GraphModule | None = None
            self._views: list[KernelView] = []
            pieces = [p for p, _ in self._pieces]
            self._pointwise = _extract(gm, [*frontier, *states, *pieces], outputs, pointwise)
            view = lambda front, part: _kernel_view(  # noqa: E731
                gm, [*tensor_nodes, x_node], front, states, linear, pieces, part, outputs, origin, width
            )
            try:
                self._input_terms = _thin_aware(_input_terms(gm, frontier, states, linear, pieces, width))
                self._views.append(view(frontier, pointwise))
            except Exception:  # noqa: BLE001 - the torch path does not use them
                pass
            absorbed = _absorbable(gm, pointwise, origin, rows, width, states[0].meta["val"].dtype)
            if self._views and absorbed:
                # the input part's pointwise values that only the pointwise part reads, computed in the compiled
                # step instead (one pass, no autograd through them): the frontier's values they replace are None
                # (positions kept: the pieces' weights are frontier indices), their operands appended
                # in the graph's order: a split's pieces then stay in its order, so that their gradients (the
                # loop's adjacent product columns) join without a copy
                extra = {
                    a for n in absorbed for a in n.all_input_nodes if a not in absorbed and a not in frontier
                }
                front = [None if n in absorbed else n for n in frontier] + [
                    n for n in gm.graph.nodes if n in extra
                ]
                with contextlib.suppress(Exception):  # the view without them stays
                    self._views.insert(
                        0, view(front, [n for n in gm.graph.nodes if n in absorbed] + pointwise)
                    )
            terms = (
                []
                if self._input_terms is None
                else next(n for n in self._input_terms.graph.nodes if n.op == "output").args[0]
            )
            self.has_offsets = any(t is not None for t in terms)
        self.n_states, self.width, self.trace_rows = len(states), width, rows
        # the states the pointwise part reads (not only through the linear maps): each is one more tile
        inputs = (
            [n for n in self._pointwise.graph.nodes if n.op == "placeholder"] if self.reason is None else []
        )
        self._direct = [
            q for q, node in enumerate(inputs[len(frontier) : len(frontier) + len(states)]) if node.users
        ]
        # elements of one step's factors (scales and diagonal): what "auto"'s memory budget weighs
        self.factor_elements = (len(self._pieces) + len(self._direct)) * self.n_states * width

    # what the compiled loop (:mod:`~lightning_bppsa.nn.cell_kernel`) reads of a factored structure

    @property
    def pointwise(self) -> fx.GraphModule:
        """The pointwise part: ``(*frontier, *states, *pieces) -> new states``."""
        return self._pointwise

    @property
    def pieces(self) -> list[_Piece]:
        """The ``(rows, H)`` column blocks of the state's linear maps, in the pointwise part's order."""
        return [piece for _, piece in self._pieces]

    @property
    def frontier_is_row(self) -> list[bool]:
        """Per frontier value: whether it has a row per input row (else it depends on parameters only)."""
        return list(self._frontier_is_row)

    @property
    def direct_states(self) -> list[int]:
        """The states the pointwise part reads directly (not only through the linear maps)."""
        return list(self._direct)

    def precompute(self, tensors: list[Tensor], x: Tensor) -> list[Tensor]:
        """The frontier: the input part's values for all rows of ``x``."""
        return list(self._precompute.forward(*tensors, x))

    @property
    def input_terms_separate(self) -> bool:
        """Whether :meth:`input_terms` can run (the linear part's graph let the states be dropped)."""
        return self._input_terms is not None

    @property
    def kernel_views(self) -> list[KernelView]:
        """What a compiled loop may read of the structure, the one to try first first: the input part's pointwise
        values that only the pointwise part reads taken into the step (where there are such), then the
        pointwise part as the torch path runs it (``[]`` where the pieces' input-only terms do not separate)."""
        return list(self._views)

    def input_terms(self, frontier: list[Tensor]) -> list[Tensor | None]:
        """Per piece, its input-only terms (``(rows, H)``, or ``(H,)`` for a bias alone; ``None``: zero): the
        piece with the states set to zero, computed without them (``cat([x, h]) @ W`` as ``x @ W[:I]``)."""
        if self._input_terms is None:
            raise NotTraceable("the pieces' input-only terms do not separate from the states")
        return list(self._input_terms.forward(*frontier))

    def kernel_inputs(
        self, tensors: list[Tensor], x: Tensor
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """``(frontier, terms)``: the input part's values for all rows of ``x`` that the compiled loop reads (the
        pieces' weights and the values the pointwise part reads; ``None`` for the others) and :meth:`input_terms`,
        computed together (a bias added to an input projection's product is taken into its GEMM's bias)."""
        if not self._views:
            raise NotTraceable("the pieces' input-only terms do not separate from the states")
        return self._views[-1].values(tensors, x)

    def loop(
        self, tensors: list[Tensor], x: Tensor, states: tuple[Tensor, ...], steps: int
    ) -> list[list[Tensor]]:
        """The new state tensors of every step: the input part once for all rows of ``x`` (rows ``(t, b)``,
        so that a step's rows are contiguous), then only the state part per step."""
        batch = x.shape[0] // steps
        states = self._blocks(states)
        frontier = self._precompute.forward(*tensors, x)
        # each step's arguments as one tuple, made in C: row-shaped values as T views, the others repeated
        columns = [
            v.unflatten(0, (steps, batch)).unbind(0)
            if row and read
            else itertools.repeat(v if read else None, steps)
            for v, row, read in zip(frontier, self._frontier_is_row, self._step_reads, strict=True)
        ]
        step, out = self._step.forward, []
        for args in zip(*columns, strict=True) if columns else itertools.repeat((), steps):
            states = step(*args, *states)
            out.append(self._joined(states))
        return out

    def _blocks(self, states: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The cell's state tensors as the traced step's ``width``-wide blocks (views)."""
        if len(states) == self.n_states:
            return tuple(states)
        return tuple(
            b
            for s, n in zip(states, self._groups, strict=True)
            for b in (s.split(self.width, -1) if n > 1 else (s,))
        )

    def _joined(self, blocks: list[Tensor]) -> list[Tensor]:
        """The traced step's blocks as the cell's state tensors."""
        if len(self._groups) == len(blocks):
            return list(blocks)
        out, at = [], 0
        for n in self._groups:
            out.append(blocks[at] if n == 1 else torch.cat(blocks[at : at + n], -1))
            at += n
        return out

    def linearize(
        self, tensors: list[Tensor], x: Tensor, states: tuple[Tensor, ...], batch: int
    ) -> tuple[FactoredJacobians, list[Tensor]]:
        """The step Jacobians of all rows (``(b, t)`` flattened, ``batch`` = ``B``), factored, and the new
        state tensors recorded by autograd back to ``tensors`` and ``x`` (for the parameter VJP)."""
        m, h = self.n_states, self.width
        d = m * h
        states = tuple(s.detach() for s in self._blocks(states))
        frontier = self._precompute.forward(*tensors, x)
        pieces = [
            p if p.requires_grad else p.detach().requires_grad_()
            for p in self._linear.forward(*frontier, *states)
        ]
        # the states as leaves only after the pieces are made: their gradients are the pointwise part's own reads
        direct = [s.requires_grad_() for s in states]
        outs = self._pointwise.forward(*frontier, *direct, *pieces)
        leaves = [*direct, *pieces]
        # one reverse pass per new state tensor p: the part is pointwise, so the gradient of Σ out_p
        # w.r.t. each of its inputs is that input's per-coordinate partial
        partials = []
        for out in outs:
            if out.requires_grad:
                grads = torch.autograd.grad(
                    out,
                    leaves,
                    torch.ones_like(out),
                    retain_graph=True,
                    allow_unused=True,
                    materialize_grads=True,
                )
            else:  # a new state that does not depend on the old one
                grads = tuple(torch.zeros_like(t) for t in leaves)
            partials.append(grads)
        rows = states[0].shape[0]
        weight = self.factor_weight([v.detach() for v in frontier], states[0])
        columns = [partials[p][leaf] for p, leaf in self.scale_columns]
        # one copy of every partial
        scale = torch.cat(columns, -1) if columns else states[0].new_zeros(rows, 0)
        diagonal = partials[0][0].reshape(batch, rows // batch, d) if self.has_diagonal else None
        return FactoredJacobians(weight, scale.view(batch, rows // batch, -1), diagonal), self._joined(outs)

    @property
    def scale_columns(self) -> list[tuple[int, int]]:
        """The factored Jacobians' scales, ``H`` columns each: ``(p, leaf)`` = the partial of new state ``p``
        by leaf ``leaf`` of the pointwise part (the ``m`` states, then the pieces): per piece ``k`` its
        tile's row blocks ``p``; then, for several states, an identity tile per state read directly, again
        per row block ``p`` (one state read directly is the diagonal)."""
        m = self.n_states
        columns = [(p, m + k) for k in range(len(self._pieces)) for p in range(m)]
        if m > 1:
            columns += [(p, q) for q in self._direct for p in range(m)]
        return columns

    @property
    def has_diagonal(self) -> bool:
        """Whether the factored Jacobians have a diagonal (one state, read directly)."""
        return self.n_states == 1 and bool(self._direct)

    def factor_weight(self, frontier: list[Tensor], like: Tensor) -> Tensor:
        """The factored Jacobians' shared weight ``(len(scale_columns) H, d)`` from the input part's values: each
        piece's rows (:meth:`piece_weight`) once per new state, then an identity tile per state read directly."""
        m, h = self.n_states, self.width
        rows = self.piece_weight(frontier, like)
        pieces = len(self._pieces)
        weights = [rows.view(pieces, 1, h, m * h).expand(pieces, m, h, m * h).reshape(pieces * m * h, m * h)]
        if m > 1:  # ∂s'_p/∂s_q for the states q read directly: identity tiles
            eye = torch.eye(h, dtype=like.dtype, device=like.device)
            for q in self._direct:
                tile = like.new_zeros(h, m * h)
                tile[:, q * h : (q + 1) * h] = eye
                weights.append(tile.repeat(m, 1))
        return torch.cat(weights, 0) if len(weights) > 1 else weights[0]

    def piece_weight(self, frontier: list[Tensor], like: Tensor) -> Tensor:
        """``(pieces H, d)``: the pieces' linear maps as rows, ``piece_k = s @ rows[k H:(k + 1) H].T`` (the blocks of
        the weights the pieces read, transposed, at the column blocks of the states they read; one indexed copy
        per weight, not a copy per piece and state block)."""
        m, h = self.n_states, self.width
        out = like.new_zeros(len(self._pieces) * h, m * h)
        for w, (dst, src) in self._piece_indices(frontier, out.device).items():
            out.view(-1).index_put_((dst,), frontier[w].reshape(-1)[src], accumulate=True)
        return out

    def piece_weight_grads(self, grad: Tensor, low: int, frontier: list[Tensor]) -> dict[int, Tensor]:
        """The gradients of the weights the pieces read (frontier index -> gradient, for those requiring grad)
        from the gradient ``grad`` of :meth:`piece_weight`'s columns from ``low`` on (``(pieces H, columns)``)."""
        full = grad
        if low or grad.shape[-1] != self.n_states * self.width:
            full = grad.new_zeros(grad.shape[0], self.n_states * self.width)
            full[:, low : low + grad.shape[-1]] = grad
        grads = {}
        for w, (dst, src) in self._piece_indices(frontier, grad.device).items():
            if frontier[w].requires_grad:
                out = grad.new_zeros(frontier[w].shape)
                out.view(-1).index_put_((src,), full.reshape(-1)[dst], accumulate=True)
                grads[w] = out
        return grads

    def _piece_indices(
        self, frontier: list[Tensor], device: torch.device
    ) -> dict[int, tuple[Tensor, Tensor]]:
        """Per weight the pieces read, ``(dst, src)``: flat indices into :meth:`piece_weight`'s rows and into the
        weight (``Wt``, row-major), ``rows[k H + a, q H + b] += Wt[row + b, offset_k + a]`` for every piece ``k``
        and state block ``(q, row)`` it reads. Made once per weight shape and device."""
        key = (device, tuple(tuple(frontier[p.weight].shape) for _, p in self._pieces))
        cached = getattr(self, "_indices", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        h, d = self.width, self.n_states * self.width
        a = torch.arange(h).view(h, 1)  # the piece's coordinate (a row of its block)
        b = torch.arange(h).view(1, h)  # the state block's coordinate
        parts: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for k, (_, piece) in enumerate(self._pieces):
            columns = frontier[piece.weight].shape[-1]
            dst, src = parts.setdefault(piece.weight, ([], []))
            for q, row in piece.reads:
                dst.append(((k * h + a) * d + q * h + b).reshape(-1))
                src.append(((row + b) * columns + piece.offset + a).reshape(-1))
        indices = {
            w: (torch.cat(dst).to(device), torch.cat(src).to(device)) for w, (dst, src) in parts.items()
        }
        self._indices = (key, indices)
        return indices


def trace_cell(cell: nn.Module, x: Tensor, states: tuple[Tensor, ...], is_tuple: bool) -> CellStructure:
    """Trace ``cell`` at ``x``'s row count into a :class:`CellStructure`; :class:`NotTraceable` says why not.

    The step is traced at two row counts: a graph that differs between them bakes the row count in
    (e.g. a ``view``) and could not run the input part on all ``B T`` rows at once.

    State tensors of different widths are traced as blocks of their widths' greatest common divisor: the
    step's inputs are the blocks (concatenated into the cell's tensors), its outputs the new tensors' blocks,
    so that the analysis sees one width (a wide tensor's pointwise ops are then written per block, as a gate
    block's are; :class:`_Blocks`).
    """
    names = [n for n, _ in (*cell.named_parameters(), *cell.named_buffers())]
    tensors = [t.detach() for t in cell_tensors(cell)]
    sizes = [s.shape[-1] for s in states]
    width = math.gcd(*sizes)
    groups = tuple(n // width for n in sizes) if width else (1,) * len(sizes)

    def step(*flat: Tensor) -> list[Tensor]:
        given, x_t, blocks = flat[: len(names)], flat[len(names)], flat[len(names) + 1 :]
        state, at = [], 0
        for n in groups:
            state.append(blocks[at] if n == 1 else torch.cat(blocks[at : at + n], -1))
            at += n
        new = functional_call(
            cell, dict(zip(names, given, strict=True)), (x_t, tuple(state) if is_tuple else state[0])
        )
        new = list(new) if is_tuple else [new]
        if len(new) != len(sizes) or any(
            not isinstance(t, Tensor) or t.shape[-1:] != (n,) for t, n in zip(new, sizes, strict=False)
        ):
            raise ValueError("the cell's new state does not have its state's widths")
        return [b for t, n in zip(new, groups, strict=True) for b in (t.split(width, -1) if n > 1 else (t,))]

    graphs = []
    for rows in (x.shape[0], x.shape[0] + 1):
        blocks = [
            s.new_empty(rows, *s.shape[1:-1], width)
            for s, n in zip(states, groups, strict=True)
            for _ in range(n)
        ]
        inputs = [x.new_empty(rows, *x.shape[1:]), *blocks]
        # (a fake CUDA tensor on a build without CUDA has no generator to fork)
        devices = [x.device] if x.device.type == "cuda" and torch.cuda.is_available() else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                # torch's fused CUDA cell ops as their pointwise math: nn.LSTMCell / nn.GRUCell factor on CUDA too
                gm = torch.fx.experimental.proxy_tensor.make_fx(
                    step, FUSED_CELL_DECOMPOSITIONS, tracing_mode="fake"
                )(*tensors, *inputs)
        except Exception as error:  # noqa: BLE001 - any failure to trace keeps calling the cell
            raise NotTraceable(f"tracing failed ({describe(error)})") from None
        roles = ["a parameter or buffer"] * len(tensors) + ["its input x"] + ["its state"] * sum(groups)
        reason = out_of_place(gm, roles)
        if reason is not None:
            raise NotTraceable(reason)
        _check_pure(gm)
        _canonical(gm, len(tensors), width)
        graphs.append(gm)
    if _signature(graphs[0]) != _signature(graphs[1]):
        raise NotTraceable("the traced step depends on the row count")
    try:
        return CellStructure(graphs[0], len(tensors), groups, width)
    except NotTraceable:
        raise
    except Exception as error:  # noqa: BLE001 - a graph the analysis does not expect keeps calling the cell
        raise NotTraceable(f"the traced step could not be split ({describe(error)})") from None


def describe(error: Exception) -> str:
    """``"Type: first line of the message"``: a reason short enough for ``last_stats`` and a warning."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def cell_tensors(cell: nn.Module) -> list[Tensor]:
    """The cell's parameters and buffers in the order the traced graph takes them."""
    return [t for _, t in (*cell.named_parameters(), *cell.named_buffers())]


def _check_pure(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if target._schema.is_mutable:
                raise NotTraceable(f"the cell modifies a tensor in place ({target})")
            if torch.Tag.nondeterministic_seeded in target.tags:
                raise NotTraceable(f"the cell draws random numbers ({target})")


def _origins(gm: fx.GraphModule, n_tensors: int) -> dict[fx.Node, int]:
    """What each node depends on (``_CONST``, ``_INPUT``, ``_STATE``): the placeholders are the cell's
    ``n_tensors`` tensors, then ``x``, then the state tensors."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    origin = {
        n: _CONST if i < n_tensors else _INPUT if i == n_tensors else _STATE
        for i, n in enumerate(placeholders)
    }
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            origin[node] = _CONST
        elif node.op == "call_function":
            origin[node] = max((origin[a] for a in node.all_input_nodes), default=_CONST)
    return origin


def _canonical(gm: fx.GraphModule, n_tensors: int, width: int) -> None:
    """Rewrite the traced step in place into the one form the analysis reads, whatever the cell's style or the
    torch release: ``unsafe_split`` as ``split``, ``lerp`` / ``addcmul`` / ``addcdiv`` as the adds, products and quotients they are (which the
    compiled loop generates), and the gate-block-first style (pointwise ops on a ``(rows, m H)`` block of the
    state's linear maps, split into ``(rows, H)`` pieces afterwards) written per piece (:class:`_Blocks`)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target in _RENAMED:
            node.target = _RENAMED[node.target]
        elif node.target is aten.cat.default and _last_dim(_dim(node, 1), node):
            # nested concatenations as one (a wide state tensor, traced as its blocks, in cat([x, h, c]))
            parts = [q for p in node.args[0] for q in (p.args[0] if _is_column_cat(p) else [p])]
            node.args = (parts, -1)
        elif node.target in _DECOMPOSED:
            with graph.inserting_before(node):
                node.replace_all_uses_with(_DECOMPOSED[node.target](graph, *node.args, **node.kwargs))
            graph.erase_node(node)
    _Blocks(gm, _origins(gm, n_tensors), width).rewrite()
    graph.eliminate_dead_code()
    gm.recompile()


def _call(graph: fx.Graph, target: object, *args: object, **kwargs: object) -> fx.Node:
    """A new node ``target(*args, **kwargs)`` at the graph's insertion point, its ``val`` from its operands'."""
    node = graph.call_function(target, args, kwargs)
    vals, kw = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = target(*vals, **kw)
    return node


def _scaled(graph: fx.Graph, a: fx.Node, value: object) -> fx.Node:
    return a if value == 1 else _call(graph, aten.mul.Tensor, a, value)


#: ops that compute the same as another in a pure graph (the unsafe splits' pieces are not views for autograd: the
#: difference matters only to in-place ops, which :func:`~lightning_bppsa.nn.cell_inplace.out_of_place` removed)
_RENAMED = {
    aten.unsafe_split.Tensor: aten.split.Tensor,
    aten.unsafe_split_with_sizes.default: aten.split_with_sizes.default,
}

#: ops written as the adds, products and quotients they are: (graph, *args, **kwargs) -> the new node
_DECOMPOSED = {
    # torch's lerp switches formulas at |w| = 0.5 for rounding only: one form for both is exact to rounding
    aten.lerp.Tensor: lambda g, a, b, w: _call(
        g, aten.add.Tensor, a, _call(g, aten.mul.Tensor, w, _call(g, aten.sub.Tensor, b, a))
    ),
    aten.lerp.Scalar: lambda g, a, b, w: _call(
        g, aten.add.Tensor, a, _call(g, aten.mul.Tensor, _call(g, aten.sub.Tensor, b, a), w)
    ),
    aten.addcmul.default: lambda g, a, b, c, value=1: _call(
        g, aten.add.Tensor, a, _scaled(g, _call(g, aten.mul.Tensor, b, c), value)
    ),
    aten.addcdiv.default: lambda g, a, b, c, value=1: _call(
        g, aten.add.Tensor, a, _scaled(g, _call(g, aten.div.Tensor, b, c), value)
    ),
}


class _Blocks:
    """The per-piece rewrite of gate-block-first cells.

    A state-dependent value ``(rows, k H)`` is *blocked* when it is one of the state's linear maps, or a
    pointwise op of blocked values and of values that broadcast per row or per coordinate: its ``k`` column
    blocks ``(rows, H)`` are then the linear map's canonical split ``split_with_sizes(z, [H] * k, -1)``, or the
    pointwise op applied to its operands' blocks (the input part's values and parameters split the same way).
    Every ``(rows, H)`` block taken out of a blocked value (``chunk``, ``split``, slicing ``[:, j H:(j + 1) H]``,
    ``select`` / ``unbind`` of its ``(rows, k, H)`` view; wider aligned ranges recursively) is replaced by that
    block, so the wide pointwise ops become dead and the state reaches the pointwise part only as
    ``(rows, H)`` pieces of its linear maps.
    """

    def __init__(self, gm: fx.GraphModule, origin: dict[fx.Node, int], width: int) -> None:
        self.graph, self.origin, self.h = gm.graph, origin, width
        self._blocks: dict[fx.Node, list[fx.Node] | None] = {}

    def rewrite(self) -> None:
        """Replace every ``(rows, H)`` block taken out of a blocked state-dependent value by the block."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or self.origin.get(node) != _STATE or self._width(node) != self.h:
                continue
            taken = self._taken(node)
            if taken is None or self._width(taken[0]) == self.h:
                continue
            with self.graph.inserting_before(node):
                blocks = self.blocks(taken[0])
            if blocks is not None:
                node.replace_all_uses_with(blocks[taken[1]])

    def blocks(self, node: fx.Node) -> list[fx.Node] | None:
        """``node``'s column blocks ``(rows, H)`` (new nodes at the insertion point), or ``None`` where it is not
        blocked."""
        if node not in self._blocks:
            self._blocks[node] = self._make(node)
        return self._blocks[node]

    def _make(self, node: fx.Node) -> list[fx.Node] | None:
        width = self._width(node)
        if width is None or width % self.h:
            return None
        if width == self.h:
            return [node]
        taken = self._taken(node)
        if taken is not None:
            blocks = self.blocks(taken[0])
            return None if blocks is None else blocks[taken[1] : taken[1] + width // self.h]
        if (
            node.target is aten.cat.default
            and self.origin.get(node) == _STATE
            and _last_dim(_dim(node, 1), node)
        ):
            # a wide state tensor (the blocks it is traced as, concatenated), or state tensors side by side
            parts = [self.blocks(part) for part in node.args[0]]
            return None if any(p is None for p in parts) else [b for p in parts for b in p]
        if self.origin.get(node, _CONST) != _STATE or node.target in _LINEAR:
            sizes = [self.h] * (width // self.h)
            split = _call(self.graph, aten.split_with_sizes.default, node, sizes, -1)
            return [_call(self.graph, operator.getitem, split, j) for j in range(len(sizes))]
        if (
            not _pointwise(node.target)
            or node.meta["val"].dim() != 2
            or any(isinstance(v, fx.Node) for v in node.kwargs.values())
        ):
            return None
        per_arg = []
        for arg in node.args:
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if isinstance(val, Tensor) and val.dim() > 0 and val.shape[-1] == width:
                blocks = self.blocks(arg)
                if blocks is None:
                    return None
                per_arg.append(blocks)
            elif isinstance(arg, fx.Node) and not isinstance(val, Tensor):
                return None
            else:  # a scalar, or a value broadcast over the columns
                per_arg.append([arg] * (width // self.h))
        return [_call(self.graph, node.target, *args, **node.kwargs) for args in zip(*per_arg, strict=True)]

    def _width(self, node: fx.Node) -> int | None:
        """The columns of a 2-D value (the last dimension of any value the blocks may split), else ``None``."""
        val = node.meta.get("val")
        return val.shape[-1] if isinstance(val, Tensor) and val.dim() > 0 else None

    def _taken(self, node: fx.Node) -> tuple[fx.Node, int] | None:
        """``(source, first block)`` where ``node`` is an aligned range of a 2-D source's column blocks."""
        h, target, args = self.h, node.target, node.args
        if target is operator.getitem and isinstance(args[0], fx.Node):
            parent, i = args[0], args[1]
            if parent.target in _SPLITS and _last_dim(parent.args[2] if len(parent.args) > 2 else 0, parent):
                sizes = parent.args[1]
                offset = sum(sizes[:i]) if isinstance(sizes, (list, tuple)) else i * sizes
                return (parent.args[0], offset // h) if offset % h == 0 else None
            if parent.target is aten.unbind.int and self._blocks_view(
                parent.args[0], parent.args[1] if len(parent.args) > 1 else 0
            ):
                return parent.args[0].args[0], i
            return None
        if target is aten.select.int and self._blocks_view(args[0], args[1]):
            return args[0].args[0], args[2] % args[0].meta["val"].shape[1]
        if (
            target is aten.slice.Tensor
            and _last_dim(args[1] if len(args) > 1 else 0, node)
            and (len(args) < 5 or args[4] == 1)
        ):
            size = self._width(args[0])
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            start = max(start + size, 0) if start < 0 else min(start, size)
            return (args[0], start // h) if start % h == 0 else None
        return None

    def _blocks_view(self, view: fx.Node, dim: int) -> bool:
        """Whether ``view`` is a 2-D value ``(rows, k H)`` viewed ``(rows, k, H)``, taken apart along ``dim``."""
        if view.target not in (
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
        ) or dim not in (1, -2):
            return False
        source, val = view.args[0].meta.get("val"), view.meta.get("val")
        return (
            isinstance(source, Tensor)
            and source.dim() == 2
            and isinstance(val, Tensor)
            and val.dim() == 3
            and tuple(val.shape) == (source.shape[0], source.shape[1] // self.h, self.h)
        )


def _signature(gm: fx.GraphModule) -> list[tuple]:
    """The graph's ops and non-tensor arguments (nodes by position): equal iff no shape depends on the rows."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    mapped = lambda a: fx.node.map_arg(a, lambda n: ("node", index[n]))  # noqa: E731
    return [(n.op, str(n.target), repr(mapped(n.args)), repr(mapped(n.kwargs))) for n in gm.graph.nodes]


def _extract(
    gm: fx.GraphModule,
    inputs: list[fx.Node | None],
    outputs: list[fx.Node | None],
    nodes: list[fx.Node] | None = None,
) -> fx.GraphModule:
    """A graph computing ``outputs`` from ``inputs`` with ``gm``'s nodes (``nodes``, or all those needed); a
    ``None`` input is a placeholder nothing reads, a ``None`` output is ``None``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        placeholder = graph.placeholder(f"in_{i}")
        if node is not None:
            env[node] = placeholder
            placeholder.meta = node.meta
    allowed = None if nodes is None else set(nodes)
    for node in gm.graph.nodes:
        if (
            node in env
            or node.op in ("placeholder", "output")
            or (allowed is not None and node not in allowed)
        ):
            continue
        if all(a in env for a in node.all_input_nodes):
            env[node] = graph.node_copy(node, lambda n: env[n])
    missing = [o.name for o in outputs if o is not None and o not in env]
    if missing:
        raise NotTraceable(f"the traced step's parts do not separate ({missing[0]})")
    graph.output([None if o is None else env[o] for o in outputs])
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def _eager(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` calling torch's own functions where they exist instead of the aten overloads: the same kernels
    without the overloads' boxed calls (several µs an op, most of a small step). The traced loop is checked
    against the cell's, so an overload resolved differently is found."""
    for node in gm.graph.nodes:
        if node.target is aten.split.Tensor:
            # torch.split is Python over the overload; split_with_sizes is direct (~2x faster, e.g. gate chunks)
            dim = node.args[2] if len(node.args) > 2 else 0
            node.target = torch.split_with_sizes
            node.args = (node.args[0], [piece.shape[dim] for piece in node.meta["val"]], dim)
        elif isinstance(node.target, torch._ops.OpOverload):
            function = getattr(torch, node.target._schema.name.split("::")[-1], None)
            if isinstance(function, types.BuiltinFunctionType):
                node.target = function
    gm.recompile()
    return gm


def _thin_aware(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` for runs over all ``B T`` rows: its ``mm`` / ``addmm`` through :mod:`lightning_bppsa.gemm`
    (the backward's thin products, e.g. a narrow input's projection, are several times faster transposed; a
    bias of one row is part of the product) and its 2-D splits along the last dimension through
    :class:`_SplitColumns` (whose backward takes the pieces' gradients without a copy where they are adjacent
    columns of one tensor, as the compiled loop's are)."""
    for node in gm.graph.nodes:
        if node.target is aten.mm.default:
            node.target = gemm.mm
        elif node.target is aten.addmm.default:
            node.target = gemm.addmm
        elif node.target in _SPLITS and _last_dim(node.args[2] if len(node.args) > 2 else 0, node):
            node.target = _split_columns
            node.args = (node.args[0], [piece.shape[-1] for piece in node.meta["val"]])
            node.kwargs = {}
    gm.recompile()
    return gm


def _split_columns(a: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
    return _SplitColumns.apply(a, sizes)


class _SplitColumns(torch.autograd.Function):
    """``a.split(sizes, -1)`` of a 2-D ``a``; the backward concatenates the gradients, unless they already are
    adjacent column blocks of one tensor (then it is a view of them)."""

    @staticmethod
    def forward(ctx, a: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.shape, ctx.sizes = a.shape, sizes
        return tuple(a.split(sizes, -1))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor, None]:
        first = grads[0]
        if first is not None and _adjacent(grads):
            return first.as_strided(ctx.shape, first.stride(), first.storage_offset()), None
        like = next(g for g in grads if g is not None)
        parts = [
            g if g is not None else like.new_zeros(ctx.shape[0], n)
            for g, n in zip(grads, ctx.sizes, strict=True)
        ]
        return torch.cat(parts, -1), None


def _adjacent(grads: tuple[Tensor | None, ...]) -> bool:
    """Whether 2-D ``grads`` are the consecutive column blocks of one tensor (rows not overlapping)."""
    first = grads[0]
    total = sum(g.shape[-1] for g in grads if g is not None)
    if first.dim() != 2 or first.stride(-1) != 1 or first.stride(0) < total:
        return False
    at = first.storage_offset()
    for g in grads:
        if (
            g is None
            or g.stride() != first.stride()
            or g.shape[0] != first.shape[0]
            or g.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or g.storage_offset() != at
        ):
            return False
        at += g.shape[-1]
    return True


def _input_terms(
    gm: fx.GraphModule,
    frontier: list[fx.Node],
    states: list[fx.Node],
    linear: list[fx.Node],
    pieces: list[fx.Node],
    width: int,
) -> fx.GraphModule:
    """A graph ``(*frontier) -> [input-only term of each piece, or None]``: the linear part with the states
    dropped. A concatenation keeps its input-only parts and the product the weight rows they meet; a product
    of the states alone is zero (None), or its bias where it has one; splits and slices follow."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node | None] = {}  # None: zero
    for i, node in enumerate(frontier):
        placeholder = graph.placeholder(f"in_{i}")
        if node is not None:  # a frontier value the compiled step computes itself
            env[node] = placeholder
            placeholder.meta = node.meta
    env.update({s: None for s in states})
    # a column block of another frontier value is taken from it here (blocks join: _wide)
    for node in frontier:
        source = None if node is None else _split_source(node)
        if source in env:
            env.setdefault(node.args[0], graph.node_copy(node.args[0], lambda n: env[n]))
            env[node] = graph.node_copy(node, lambda n: env[n])
    kept: dict[fx.Node, list[tuple[int, int]]] = {}  # a concatenation -> the rows of its kept parts
    for node in linear:
        args = node.args
        if node.target is aten.cat.default:
            parts, at, ranges = [], 0, []
            for part in args[0]:
                width = part.meta["val"].shape[-1]
                if part not in states:
                    parts.append(env[part])
                    ranges.append((at, at + width))
                at += width
            kept[node] = ranges
            env[node] = (
                None
                if not parts
                else parts[0]
                if len(parts) == 1
                else _call(graph, aten.cat.default, parts, -1)
            )
        elif node.target in _LINEAR:
            operand, weight = env[args[-2]], env[args[-1]]
            bias = env[args[0]] if node.target is aten.addmm.default else None
            if operand is None:
                env[node] = bias
                continue
            rows = [_call(graph, aten.slice.Tensor, weight, 0, a, b) for a, b in kept[args[-2]]]
            weight = rows[0] if len(rows) == 1 else _call(graph, aten.cat.default, rows, 0)
            call = (bias, operand, weight) if bias is not None else (operand, weight)
            env[node] = _call(graph, aten.addmm.default if bias is not None else aten.mm.default, *call)
        elif node.target in (aten.add.Tensor, aten.sub.Tensor):  # an input-only term taken into a piece
            env[node] = _sum_of_terms(graph, node, env)
        elif env.get(args[0]) is None:  # a split, slice or getitem of zero
            env[node] = None
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    terms = [env[p] for p in pieces]
    vals = [getattr(t, "meta", {}).get("val") for t in terms]
    if len(terms) > 1 and all(
        isinstance(v, Tensor) and v.dim() == 2 and v.shape == vals[0].shape and v.shape[-1] == width
        for v in vals
    ):
        # one tensor whose column blocks are the terms (ih(x) + b_hh rather than a sum per block): the compiled
        # loop reads it as it is, not a concatenation of the blocks
        wide = _wide(graph, terms, width)
        if wide is not None:
            split = _call(graph, aten.split_with_sizes.default, wide, [width] * len(terms), -1)
            terms = [_call(graph, operator.getitem, split, k) for k in range(len(terms))]
    graph.output(terms)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def _wide(graph: fx.Graph, blocks: list[fx.Node], width: int) -> fx.Node | None:
    """A node (made at the graph's insertion point) whose consecutive column blocks of ``width`` are ``blocks``,
    or ``None``: consecutive blocks of one split, or the same pointwise op of such blocks (and of values that
    broadcast over the columns)."""
    first = blocks[0]
    if first.target is operator.getitem:
        split = first.args[0]
        if split.target not in _SPLITS or any(
            b.target is not operator.getitem or b.args[0] is not split for b in blocks
        ):
            return None
        source, dim = split.args[0], split.args[2] if len(split.args) > 2 else 0
        if dim not in (-1, source.meta["val"].dim() - 1):
            return None
        sizes = [v.shape[-1] for v in split.meta["val"]]
        index = [b.args[1] for b in blocks]
        if index != list(range(index[0], index[0] + len(blocks))) or any(sizes[j] != width for j in index):
            return None
        start = sum(sizes[: index[0]])
        end = start + len(blocks) * width
        return (
            source
            if start == 0 and end == sum(sizes)
            else _call(graph, aten.slice.Tensor, source, -1, start, end)
        )
    if not _pointwise(first.target) or any(
        b.target is not first.target or b.kwargs != first.kwargs or len(b.args) != len(first.args)
        for b in blocks
    ):
        return None
    args = []
    for column in zip(*(b.args for b in blocks), strict=True):
        val = column[0].meta.get("val") if isinstance(column[0], fx.Node) else None
        if all(c is column[0] for c in column) and (
            val is None or (isinstance(val, Tensor) and (val.dim() == 0 or val.shape[-1] == 1))
        ):
            args.append(column[0])  # a constant, or a value broadcast over the columns
        elif (
            all(isinstance(c, fx.Node) for c in column)
            and (wide := _wide(graph, list(column), width)) is not None
        ):
            args.append(wide)
        else:
            return None
    return _call(graph, first.target, *args, **first.kwargs)


def _composed(
    gm: fx.GraphModule, first: fx.GraphModule, second: fx.GraphModule, keep: set[int]
) -> fx.GraphModule:
    """One graph: ``first``'s inputs -> its outputs at ``keep`` (``None`` for the others), then ``second``'s outputs
    (``second`` reads ``first``'s outputs)."""
    graph = fx.Graph()

    def copy(part: fx.GraphModule, env: dict[fx.Node, fx.Node]) -> list:
        for node in part.graph.nodes:
            if node.op == "output":
                return list(fx.node.map_arg(node.args[0], lambda n: env[n]))
            if node not in env:
                env[node] = graph.node_copy(node, lambda n: env[n])
        raise AssertionError("a graph without an output")

    values = copy(first, {})
    terms = copy(
        second, dict(zip([n for n in second.graph.nodes if n.op == "placeholder"], values, strict=True))
    )
    graph.output([v if i in keep else None for i, v in enumerate(values)] + terms)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


def _sliced_as_split(gm: fx.GraphModule, width: int) -> fx.GraphModule:
    """``v[:, k H:(k + 1) H]`` of a 2-D value ``v`` as block ``k`` of ``v``'s canonical split into ``H`` columns (as
    :class:`_Blocks` splits it), and a chunk of ``v`` into ``H``-wide blocks as that split: with
    :func:`_deduplicated`, one split of ``v`` whose pieces' gradients autograd joins once (a slice's backward
    fills a zero ``v``-sized gradient, each split's pads its missing pieces with zeros, then the sum of all)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target in _SPLITS and _last_dim(_dim(node, 2), node):
            sizes = [piece.shape[-1] for piece in node.meta["val"]]
            if all(
                size == width for size in sizes
            ):  # a chunk into H-wide blocks: the canonical split's spelling
                node.target, node.args, node.kwargs = (
                    aten.split_with_sizes.default,
                    (node.args[0], sizes, -1),
                    {},
                )
            continue
        if node.target is not aten.slice.Tensor or not _last_dim(_dim(node, 1), node):
            continue
        source, args = node.args[0], node.args
        columns = source.meta["val"].shape[-1]
        start = args[2] if len(args) > 2 and args[2] is not None else 0
        end = args[3] if len(args) > 3 and args[3] is not None else columns
        start, end = (v + columns if v < 0 else min(v, columns) for v in (start, end))
        if (len(args) > 4 and args[4] != 1) or end - start != width or start % width or columns % width:
            continue
        with graph.inserting_after(source):
            split = _call(graph, aten.split_with_sizes.default, source, [width] * (columns // width), -1)
        with graph.inserting_after(split):
            block = _call(graph, operator.getitem, split, start // width)
        node.replace_all_uses_with(block)
        graph.erase_node(node)
    gm.recompile()
    return gm


def _deduplicated(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each op computed once from the same operands (the graph is pure): a split the pieces' terms take
    again from a value the pointwise part reads pieces of is the frontier's own split, so that autograd gets
    all its pieces' gradients at one split (one concatenation, not one per split with zeros, then a sum)."""
    freeze = lambda a: (  # noqa: E731
        tuple(freeze(x) for x in a)
        if isinstance(a, (list, tuple))
        else tuple(sorted((k, freeze(v)) for k, v in a.items()))
        if isinstance(a, dict)
        else a
    )
    seen: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        key = (node.target, freeze(node.args), freeze(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            gm.graph.erase_node(node)
        else:
            seen[key] = node
    gm.recompile()
    return gm


def _folded_biases(gm: fx.GraphModule) -> fx.GraphModule:
    """``mm(a, w) + b`` and ``addmm(c, a, w) + b`` (``b`` a bias, the product read nowhere else) as one
    ``addmm(c + b, a, w)``: one pass over the ``(rows, n)`` product, not two (``ih(x) + b_hh``), and one bias
    gradient, its column sum, for both biases."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not aten.add.Tensor or node.kwargs or len(node.args) != 2:
            continue
        for product, bias in (node.args, node.args[::-1]):
            if not (isinstance(product, fx.Node) and isinstance(bias, fx.Node)) or len(product.users) != 1:
                continue
            if product.target not in _LINEAR or product.kwargs:
                continue
            width = product.meta["val"].shape[-1]
            shapes = [bias.meta["val"].shape] + (
                [product.args[0].meta["val"].shape] if product.target is aten.addmm.default else []
            )
            if (
                any(tuple(s) not in ((width,), (1, width)) for s in shapes)
                or bias.meta["val"].dtype != product.meta["val"].dtype
            ):
                continue
            with graph.inserting_before(node):
                total = (
                    bias
                    if product.target is aten.mm.default
                    else _call(graph, aten.add.Tensor, product.args[0], bias)
                )
                fused = _call(graph, aten.addmm.default, total, *product.args[-2:])
            node.replace_all_uses_with(fused)
            break
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _split_source(node: fx.Node) -> fx.Node | None:
    """The value ``node`` is a piece of, where it is an item of a split of an input-only value along its last
    dimension."""
    parent = node.args[0] if node.op == "call_function" and node.target is operator.getitem else None
    if not isinstance(parent, fx.Node) or parent.target not in _SPLITS:
        return None
    source, dim = parent.args[0], parent.args[2] if len(parent.args) > 2 else 0
    val = source.meta.get("val")
    return source if isinstance(val, Tensor) and dim in (-1, val.dim() - 1) else None


def _sum_of_terms(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, fx.Node | None]) -> fx.Node | None:
    """``a + alpha b`` / ``a - alpha b`` (``node``) in the input-terms graph, either operand maybe zero (``None``)."""
    a, b = (env[x] for x in node.args)
    alpha = node.kwargs.get("alpha", 1)
    if b is None:
        return a
    if a is None:
        scale = alpha if node.target is aten.add.Tensor else -alpha
        return b if scale == 1 else _call(graph, aten.mul.Tensor, b, scale)
    return graph.node_copy(node, lambda n: env[n])


def _kernel_view(
    gm: fx.GraphModule,
    sources: list[fx.Node],
    frontier: list[fx.Node | None],
    states: list[fx.Node],
    linear: list[fx.Node],
    pieces: list[fx.Node],
    pointwise: list[fx.Node],
    outputs: list[fx.Node],
    origin: dict[fx.Node, int],
    width: int,
) -> KernelView:
    """The :class:`KernelView` of the pointwise nodes ``pointwise`` reading ``frontier`` (``None``: a value they
    compute themselves), the states and the pieces; ``sources`` are the cell's tensors' and ``x``'s nodes."""
    graph = _extract(gm, [*frontier, *states, *pieces], outputs, pointwise)
    terms = _input_terms(gm, frontier, states, linear, pieces, width)
    read = [bool(n.users) for n in graph.graph.nodes if n.op == "placeholder"][: len(frontier)]
    weights = {frontier.index(n.args[-1]) for n in linear if n.target in _LINEAR}
    needed = weights | {i for i, r in enumerate(read) if r}
    inputs = _composed(gm, _extract(gm, sources, frontier), terms, needed)
    inputs = _thin_aware(_folded_biases(_deduplicated(_sliced_as_split(inputs, width))))
    is_row = tuple(n is not None and origin[n] == _INPUT for n in frontier)
    return KernelView(graph, is_row, inputs)


def _absorbable(
    gm: fx.GraphModule,
    pointwise: list[fx.Node],
    origin: dict[fx.Node, int],
    rows: int,
    width: int,
    dtype: torch.dtype,
) -> set[fx.Node]:
    """The input part's pointwise values a compiled step may compute itself: ``(rows, H)`` in the state's dtype,
    read only by the pointwise part (or by other such values), of operands the step reads per coordinate
    (``(rows, H)``, ``(rows, 1)``, ``(H,)``, ``(1, H)`` or one element)."""
    fits = {(rows, width), (rows, 1), (width,), (1, width)}

    def operand(node: fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, Tensor) and (tuple(val.shape) in fits or (val.numel() == 1 and val.dim() <= 2))

    part, absorbed = set(pointwise), set()
    for node in reversed(gm.graph.nodes):  # users first
        val = node.meta.get("val")
        if (
            node.op == "call_function"
            and origin.get(node) == _INPUT
            and _pointwise(node.target)
            and isinstance(val, Tensor)
            and tuple(val.shape) == (rows, width)
            and val.dtype == dtype
            and node.users
            and all(u in part or u in absorbed for u in node.users)
            and all(operand(a) for a in node.all_input_nodes)
        ):
            absorbed.add(node)
    return absorbed


def _ancestors(nodes: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    """``nodes`` and the nodes of ``within`` they are computed from (the pieces' cat, mm, split: the linear part)."""
    found: set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node in within and node not in found:
            found.add(node)
            stack += node.all_input_nodes
    return found


def _factor(
    state_part: list[fx.Node],
    outputs: list[fx.Node],
    origin: dict[fx.Node, int],
    states: list[fx.Node],
    frontier: list[fx.Node],
    rows: int,
    width: int,
) -> tuple[str | None, list[tuple[fx.Node, _Piece]]]:
    """``(None, pieces)`` where the Jacobians factor (module docstring), else ``(reason, [])``."""
    full = (rows, width)
    shape = lambda n: tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), Tensor) else None  # noqa: E731
    if any(shape(s) != full for s in states):
        return "the state tensors are not (rows, H)", []
    reads: dict[fx.Node, tuple[tuple[int, int], ...]] = {}  # linear operand -> (state, row offset in Wt)
    linear: dict[fx.Node, fx.Node] = {}  # mm / addmm node -> its weight node
    pieces: list[tuple[fx.Node, _Piece]] = []
    smooth = set(states)  # nodes a pointwise op may read: states, pieces, pointwise results

    def piece(node: fx.Node, mm: fx.Node, offset: int) -> str | None:
        if shape(node) != full:
            return f"a piece of a linear map of the state ({node.name}) is not (rows, H)"
        pieces.append((node, _Piece(frontier.index(linear[mm]), offset, reads[mm.args[-2]])))
        smooth.add(node)
        return None

    for node in state_part:
        target, args = node.target, node.args
        if target is aten.cat.default and _last_dim(args[1] if len(args) > 1 else 0, node):
            offsets, at = [], 0
            for part in args[0]:
                if part in states:
                    offsets.append((states.index(part), at))
                elif origin[part] == _STATE:
                    return (
                        f"a concatenation reads a state-dependent value ({part.name}) that is not a state tensor",
                        [],
                    )
                at += shape(part)[-1]
            reads[node] = tuple(offsets)
        elif target in _LINEAR and not node.kwargs:
            operand, weight = args[-2], args[-1]
            if operand in states:
                reads[operand] = ((states.index(operand), 0),)
            if (
                operand not in reads
                or origin[weight] != _CONST
                or (target is aten.addmm.default and origin[args[0]] == _STATE)
            ):
                return (
                    f"the state reaches a matrix product ({node.name}) other than a state tensor times a parameter",
                    [],
                )
            linear[node] = weight
            if shape(node)[-1] == width and (reason := piece(node, node, 0)):
                return reason, []
        elif target in _SPLITS and args[0] in linear and _last_dim(args[2] if len(args) > 2 else 0, node):
            sizes = args[1] if isinstance(args[1], (list, tuple)) else None
            for user in node.users:
                if user.target is not operator.getitem:
                    return f"a split of a linear map of the state is read by {user.target}", []
                i = user.args[1]
                offset = sum(sizes[:i]) if sizes is not None else i * args[1]
                if reason := piece(user, args[0], offset):
                    return reason, []
        elif target is operator.getitem and args[0].target in _SPLITS and args[0].args[0] in linear:
            continue  # a piece, recorded with its split
        elif (
            target is aten.slice.Tensor
            and args[0] in linear
            and _last_dim(args[1] if len(args) > 1 else 0, node)
            and (len(args) < 5 or args[4] == 1)
        ):
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            if reason := piece(node, args[0], start + shape(args[0])[-1] if start < 0 else start):
                return reason, []
        elif _pointwise(target):
            stateful = [a for a in node.all_input_nodes if origin[a] == _STATE]
            if shape(node) != full or any(a not in smooth or shape(a) != full for a in stateful):
                return f"the state reaches {target} with operands that are not per-coordinate (rows, H)", []
            smooth.add(node)
        else:
            return f"the state reaches {target}, neither pointwise nor a linear map by parameters", []
    if any(origin[o] == _STATE and o not in smooth for o in outputs):
        return "a new state tensor is not the result of a pointwise op", []
    return None, [(_absorbed(node, origin, full), p) for node, p in pieces]


def _absorbed(piece: fx.Node, origin: dict[fx.Node, int], full: tuple[int, int]) -> fx.Node:
    """The piece with the input-only terms added to it taken in (``ih(x) + hh(h)`` per block): its only
    user while that adds a value of the input part that broadcasts per row or per coordinate with coefficient
    1 on the piece (``p + v``, ``v + p``, ``p - v``, ``alpha`` on ``v``). The terms then come with the piece's
    offsets, computed once for all rows, and the pointwise part does not read them: no partials by them are
    kept (they equal the piece's)."""
    while len(piece.users) == 1:
        user = next(iter(piece.users))
        args, alpha = user.args, user.kwargs.get("alpha", 1)
        if (
            user.target not in (aten.add.Tensor, aten.sub.Tensor)
            or set(user.kwargs) - {"alpha"}
            or len(args) != 2
        ):
            break
        other = args[1] if args[0] is piece else args[0]
        first = args[0] is piece and args[1] is not piece
        if not (first or (user.target is aten.add.Tensor and alpha == 1)):
            break
        val, own = getattr(other, "meta", {}).get("val"), user.meta.get("val")
        if (
            not isinstance(other, fx.Node)
            or origin[other] == _STATE
            or not isinstance(val, Tensor)
            or not isinstance(own, Tensor)
            or tuple(own.shape) != full
            or val.dtype != own.dtype
            or val.dim() > 2
            or any(n not in (1, f) for n, f in zip(reversed(val.shape), reversed(full), strict=False))
        ):
            break
        piece = user
    return piece


def _dim(node: fx.Node, index: int) -> int:
    """``node``'s dimension argument at ``index`` (default 0)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)


def _is_column_cat(node: object) -> bool:
    """Whether ``node`` concatenates 2-D values along their last dimension."""
    return isinstance(node, fx.Node) and node.target is aten.cat.default and _last_dim(_dim(node, 1), node)


def _pointwise(target: object) -> bool:
    """Whether ``target`` computes each output coordinate from the same coordinate of its operands."""
    return target in _UNTAGGED_POINTWISE or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    )


def _last_dim(dim: int, node: fx.Node) -> bool:
    """``dim`` is the last dimension of ``node``'s 2-D operands."""
    return dim in (-1, 1) and node.args[0] is not None and _ndim(node) == 2


def _ndim(node: fx.Node) -> int:
    first = node.args[0][0] if isinstance(node.args[0], (list, tuple)) else node.args[0]
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    return val.dim() if isinstance(val, Tensor) else -1
