"""A factored cell's compiled loop on CUDA: the CPU loop's generated step (:mod:`~lightning_bppsa.nn.cell_kernel`)
run by CUDA kernels (``kernels/cell_loop_cuda.h``).

The step's pointwise part is generated from the traced graph by :mod:`~lightning_bppsa.nn.cell_kernel`'s own
generator (values and forward-mode partials, per coordinate ``j``: the same statements as the CPU loop's) for
this module's :data:`TARGET`: device functions, one thread per coordinate instead of the loop over ``j``,
``kernels/cell_cuda_prologue.h`` instead of ``activations.h``, ``kernels/cell_loop_cuda.h`` instead of
``cell_loop.h``. Three kernels, launched on torch's current stream:

- the forward loop (one block per batch row): the states and, with partials, the Jacobians' factors and the
  partials by the input part's values, in one pass (the input projection is one torch GEMM before it, as on
  the CPU);
- the backward (one block per batch row): the reverse linear sweep of the factored Jacobians fused with the
  products the parameter VJP needs; the weights' GEMMs then run in torch (:meth:`CellKernel.vjp`);
- the products alone, after a scan that ran elsewhere (``"blelloch"`` / ``"chunked"``).

The forward and the backward have two entry points each (:data:`ENTRIES`): the pieces' weights staged in shared
memory, or (``_global``) read from global memory where they do not fit; each compiles its weight reads for where
they are (a runtime flag made them generic loads). Below a warp's width (``H < 32``: :data:`SPREAD_BELOW`) a
step's work is shared over a block of up to :data:`MAX_THREADS` threads: a state of widths (31, 33) is 64 blocks
of width 1, and one thread per coordinate left one thread doing all of a step. The products with the weights go
one thread per piece coordinate / read column; the pointwise part goes as items (:func:`generate`): the generated
step of one coordinate splits into parts that share no computed value, parts whose statements differ only by
offsets affine in their index are one kind, and each (kind, index, coordinate) is one thread's item, each kind
from a warp's start where the block has room (a warp runs one kind's code, not two one after the other); the
backward's products and its new states' gradient likewise. What the items and products read of a step's rows in
global memory (the offsets; the scales, input partials, diagonal and direct gradient) is copied into shared memory
(``cp.async``) a step ahead, off a step's dependent path (not the input values the forward's items read: a cell
with some still waits on those loads).

Modelled effect (a model from nvcc 13.0's sm_90 SASS, float32, ``CoprimeWidths`` at H = 32, B = 16; NOT a
measurement: no GPU timed it). Instructions the busiest thread runs a step: forward with partials ~1800 -> ~240
(thread 0 ran the 64 parts' tanh, partials and stores and the 64 state copies, ~1650, beside its ~150 of the
products with the weights; now one part, one state copy, its share of the next offsets' copies and the same
~150), backward ~1130 -> ~265 (thread 0's 64 products and 64 coordinates of g_{t-1}, ~950; now one product, one
coordinate, its share of the next row's copies and the same ~155 of the columns' sums), for a third barrier a
step. A step was issue-bound on thread 0 (about 1 instruction a cycle: ~1800 and ~1100 cycles); it becomes
bound by the products' 64-long multiply-add chain (~256 cycles at 4 a multiply-add), one part (~100-150 cycles
for the forward's tanh and partials) and two or three barriers: ~3-4x fewer cycles a step in each loop. The rows
copied a step ahead take an L2 round trip (~250 cycles; a (16, 1000) batch's rows fit in L2) off the forward's
step and two off the backward's. The products' chain is then the limit (splitting its sums would change their
order from the CPU loop's).

:class:`CudaCellKernel` is a :class:`~lightning_bppsa.nn.cell_kernel.CellKernel` whose compiled library is
these launches (:class:`_Launches` takes the C functions' arguments): its forward, scan, products and VJP are
the CPU kernel's own code. The kernels are built by a :class:`Backend`: NVRTC through the package's CuPy
loader :mod:`lightning_bppsa.kernels.cupy_loader` (:class:`CupyBackend`, the default), or the host emulation
(:mod:`lightning_bppsa.kernels.cell_cuda_emulated`: the same source text through g++, the same launches, on
CPU tensors). Where the source cannot be made (an op the generator does not compile), ``H > 256`` (one
thread per coordinate), the device has no room for the state buffers, or the kernels do not build or load
(no CuPy, no NVRTC), construction raises :class:`~lightning_bppsa.nn.cell_kernel.Unsupported` or
:class:`RuntimeError` and :class:`~lightning_bppsa.nn.Recurrence` keeps the torch path with the reason.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Protocol

import torch

from lightning_bppsa.kernels._build import kernel_path
from lightning_bppsa.nn import cell_kernel
from lightning_bppsa.nn.cell_kernel import CellKernel, Unsupported
from lightning_bppsa.nn.cell_structure import CellStructure

__all__ = [
    "Backend",
    "CellSource",
    "CudaCellKernel",
    "CupyBackend",
    "ENTRIES",
    "Launch",
    "KERNELS",
    "TARGET",
    "generate",
    "launch_config",
    "weight_products",
]

KERNELS = ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward", "bppsa_cell_cuda_cotangent")
#: the compiled entry points: the forward and the backward once with the weights staged in shared memory (their
#: reads compiled as shared-memory loads) and once (``_global``) reading them from global memory
ENTRIES = (*KERNELS[:2], *(f"{k}_global" for k in KERNELS[:2]), KERNELS[2])
MAX_THREADS = 256  # CELL_MAX_THREADS in cell_loop_cuda.h: one thread per coordinate of a state tensor
#: below this width the forward and the backward spread the products with the weights over the whole block
#: (CELL_SPREAD in cell_loop_cuda.h): a warp of one coordinate per thread would leave most lanes idle
SPREAD_BELOW = 32
#: the cotangent kernel's grid-stride launch: threads per block and at most this many blocks
COTANGENT_BLOCK, COTANGENT_GRID = 256, 4096
_HEADERS = ("cuda_host_emulation.h", "cell_cuda_prologue.h", "cell_loop_cuda.h")


@dataclass(frozen=True)
class CellSource:
    """A cell's generated CUDA source (headers inlined: CuPy's cache key is the text) and what launches need."""

    text: str
    digest: str  # of the text: names the built module
    n_inputs: int  # NI: input-part values, each a (pointer, row stride) pair of kernel parameters
    width: int  # H
    n_states: int  # M
    pieces: int  # NK
    read_columns: int  # CHI - CLO: the state columns the pieces' weights read (the staged rows)
    element_bytes: int
    # CELL_SPREAD (else 0): the range of the items a step's pointwise part is shared out as (forward without and
    # with the partials; the backward's products and its new states' gradient), each kind from a warp's start
    # where they fit a block so (:func:`_dispatch`)
    value_items: int = 0
    partial_items: int = 0
    product_items: int = 0
    gradient_items: int = 0
    backward_row: int = (
        0  # CELL_ROW: a step's row of the backward's inputs, copied into shared memory a step ahead
    )

    @property
    def spread(self) -> bool:
        """The kernels spread the products with the weights over the block (``CELL_SPREAD``)."""
        return self.width < SPREAD_BELOW


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as :func:`launch_config` computed it."""

    kernel: str
    grid: int
    block: int
    shared_bytes: int  # dynamic shared memory per block
    staged: bool = False  # the pieces' weights staged in shared memory (forward, backward)

    @property
    def entry(self) -> str:
        """The compiled entry point that runs it (:data:`ENTRIES`)."""
        return self.kernel if self.staged or self.kernel == KERNELS[2] else f"{self.kernel}_global"


def generate(structure: CellStructure, dtype: torch.dtype) -> tuple[CellSource, list, cell_kernel._Layout]:
    """The CUDA source of ``structure``'s loop in ``dtype``, the input-part values it reads, in order, and the
    partials it keeps (the C generator's :class:`~lightning_bppsa.nn.cell_kernel._Input` list and ``_Layout``);
    :class:`Unsupported` where the generator does not compile the graph."""
    text, inputs, layout = cell_kernel._generated(structure, dtype, TARGET)
    read = [q for piece in structure.pieces for q, _ in piece.reads]
    h = structure.width
    m, counts, row = structure.n_states, (0, 0, 0, 0), 0
    if h < SPREAD_BELOW:  # the step's pointwise work as items the block shares (CELL_SPREAD)
        lines, counts = _items(text, h, m)
        text = text.replace(_LOOP_INCLUDE, "\n".join([*lines, _LOOP_INCLUDE]))
        row = (_define(text, "NS") + _define(text, "NF")) * h + (m == 1) * h + m * h  # as CELL_ROW
    for header in _HEADERS:
        # inlined once each: their include guards would only warn in the main file
        text = text.replace(
            f'#include "{header}"', kernel_path(header).read_text().replace("#pragma once", "")
        )
    source = CellSource(
        text=text, digest=hashlib.sha256(text.encode()).hexdigest()[:16], n_inputs=len(inputs), width=h,
        n_states=structure.n_states, pieces=len(structure.pieces),
        read_columns=(max(read) - min(read) + 1) * h if read else 0, element_bytes=dtype.itemsize,
        value_items=counts[0], partial_items=counts[1], product_items=counts[2], gradient_items=counts[3],
        backward_row=row,
    )  # fmt: skip
    return source, inputs, layout


# --------------------------------------------------------------------------------------------------
# The step as items (narrow blocks, CELL_SPREAD): the generated step of one coordinate j splits into parts that
# share no computed value (CoprimeWidths: one per state block); parts whose statements differ only in the offsets
# they read and write, by an affine function of their index m, are one item kind; an item is (kind, m, j), and
# the block's threads share a step's items (kernels/cell_loop_cuda.h). The backward's products and the new
# states' gradient are items alike, one per product / state block and coordinate.
# --------------------------------------------------------------------------------------------------

_LOOP_INCLUDE = '#include "cell_loop_cuda.h"'
_DEFINE = re.compile(r"const REAL (\w+) = (.*);")
_STORE = re.compile(r"(?:next|scales|diagonal|fpart)\[.*\] = .*;")
_LEAF = re.compile(r"(?:prev|piece)\[\d+ \+ j\]|in\d+(?:\[j\])?")  # a read of the step's inputs
_NAMES = re.compile(r"\b(?:[vd]_\w+|in\d+)\b")
# the offsets an item's index moves: ``[o + j]``, ``[row * W + o + j]`` (columns of a row), ``= o + j``, and the
# input values it reads (``in[o]``, ``stride[o]``)
_OFFSET = re.compile(r"(\[(?:row \* \d+ \+ )?|= |\b(?:in|stride)\[)(\d+)( \+ j\b|\])")
_NAMED = re.compile(r"const REAL(?:\* restrict)? (\w+) = ")
_SUM = re.compile(r"(S|F)\((\d+)\) \* G\((\d+)\)")


@dataclass(frozen=True)
class _Kind:
    """Items of one statement template (``@`` where an offset goes): item m's offsets are ``base + m step``."""

    template: str
    base: tuple[int, ...]
    step: tuple[int, ...]
    count: int

    def body(self) -> str:
        offsets = iter(
            str(b) if s == 0 or self.count == 1 else f"({b} + {s} * m)"
            for b, s in zip(self.base, self.step, strict=True)
        )
        return re.sub("@", lambda _: next(offsets), self.template)


def _kinds(parts: list[tuple[str, tuple[int, ...]]]) -> list[_Kind]:
    """``parts`` (template, offsets) as item kinds: those of one template, in order, split where their offsets stop
    being affine in their index."""
    by_template: dict[str, list[tuple[int, ...]]] = {}
    for template, offsets in parts:
        by_template.setdefault(template, []).append(offsets)
    kinds = []
    for template, members in by_template.items():
        start = 0
        while start < len(members):
            base, end = members[start], start + 1
            step = (
                tuple(b - a for a, b in zip(base, members[end], strict=True))
                if end < len(members)
                else (0,) * len(base)
            )
            while end < len(members) and all(
                o == b + (end - start) * s for o, b, s in zip(members[end], base, step, strict=True)
            ):
                end += 1
            kinds.append(_Kind(template, base, step, end - start))
            start = end
    return kinds


def _templated(lines: list[str]) -> tuple[str, tuple[int, ...]]:
    """``lines`` with their computed names numbered in order (t0, t1, ...) and their offsets taken out."""
    names: dict[str, str] = {}
    for line in lines:
        if defined := _NAMED.match(line):
            names[defined.group(1)] = f"t{len(names)}"
    text = _NAMES.sub(lambda n: names.get(n.group(), n.group()), "\n".join(lines))
    offsets = tuple(int(o.group(2)) for o in _OFFSET.finditer(text))
    return _OFFSET.sub(lambda o: f"{o.group(1)}@{o.group(3)}", text), offsets


def _step_parts(text: str, function: str) -> list[tuple[str, tuple[int, ...]]]:
    """The generated ``function`` (cell_values or cell_partials) split into parts that share no computed value,
    in the order of their first store, each (template, offsets) with the reads of the step's inputs it
    needs (copied into every part that reads them). Any other spelling than the generator's raises
    :class:`Unsupported`."""
    body = text[text.index(f"void {function}(") :]
    lines = [line.strip() for line in body[: body.index("\n}\n")].splitlines()[2:]]
    head = lines.index(TARGET.loop.format()) if TARGET.loop.format() in lines else -1
    pointers = {_NAMED.match(line).group(1): line for line in lines[: max(head, 0)] if _NAMED.match(line)}
    if head < 0 or len(pointers) != head:  # the loop's head after the input values' pointers
        raise Unsupported(f"the generated {function} is not spelled as the CUDA items read it")
    statements = lines[head + 1 : -1]
    defined, leaves, owner = {}, {}, list(range(len(statements)))

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    for i, line in enumerate(statements):
        match = _DEFINE.fullmatch(line)
        if match is None and not _STORE.fullmatch(line):
            raise Unsupported(f"the generated step has a statement the CUDA items do not read: {line!r}")
        if match and _LEAF.fullmatch(match.group(2)):
            leaves[match.group(1)] = i
            continue
        for name in _NAMES.findall(line.split(" = ", 1)[1] if match else line):
            if name in defined:
                owner[root(i)] = root(defined[name])
        if match:
            defined[match.group(1)] = i
    parts: dict[int, list[int]] = {}
    leaf_lines = set(leaves.values())
    computed = [i for i in range(len(statements)) if i not in leaf_lines]
    for i in computed:
        if _STORE.fullmatch(statements[i]):  # a part is what its stores need
            parts.setdefault(root(i), [])
    for i in computed:
        if root(i) in parts:
            parts[root(i)].append(i)
    result = []
    for members in parts.values():
        names = {n for i in members for n in _NAMES.findall(statements[i])}
        reads = sorted(leaves[n] for n in names if n in leaves)
        needed = names | {n for i in reads for n in _NAMES.findall(statements[i])}
        lines = [line for name, line in pointers.items() if name in needed]
        result.append(_templated(lines + [statements[i] for i in sorted(reads + members)]))
    return result


def _sums(text: str, macro: str) -> dict[int, list[tuple[str, int, int]]]:
    """The generated backward's sums ``macro`` (CELL_PRODUCTS or CELL_DIRECT) per output: [(S or F, column n,
    state p)]."""
    line = next(line for line in text.splitlines() if line.startswith(f"#define {macro}("))
    body = line.split(") ", 1)[1].strip()
    out = {}
    for index, expr in re.findall(r"(?:OUT|ADD)\((\d+), (.*?)\)(?= OUT\(| ADD\(|$)", body):
        terms = _SUM.findall(expr)
        if " + ".join(f"{k}({n}) * G({p})" for k, n, p in terms) != expr and expr != "(REAL)0":
            raise Unsupported(f"the generated backward has a sum the CUDA items do not read: {expr!r}")
        out[int(index)] = [(k, int(n), int(p)) for k, n, p in terms]
    return out


def _sum(terms: list[tuple[str, int, int]], h: int) -> str:
    """A sum of the backward's terms as the CPU loop adds them, ``s``/``f`` the row's columns, ``g`` the state."""
    return (
        " + ".join(f"{'s' if k == 'S' else 'f'}[{n * h} + j] * g[{p * h} + j]" for k, n, p in terms)
        or "(REAL)0"
    )


def _dispatch(name: str, params: str, kinds: list[_Kind], h: int) -> tuple[list[str], int]:
    """A device function running item e of ``kinds`` (in order, H items per index m), and the items' range. Each
    kind starts a warp where they all fit in a block that way: the lanes of a warp then run one kind's code, not
    several one after the other (CoprimeWidths: 31 states of one kind, 33 of another)."""
    warp = lambda n: 32 * math.ceil(n / 32)  # noqa: E731
    aligned = sum(warp(kind.count * h) for kind in kinds) <= MAX_THREADS
    lines = [f"__device__ __forceinline__ void {name}(int e, {params}) {{"]
    start = 0
    for kind in kinds:
        start = warp(start) if aligned else start
        end = start + kind.count * h
        lines += [
            f"    if (e >= {start} && e < {end}) {{",
            f"        const int m = (e - {start}) / H; const int64_t j = (e - {start}) % H; (void)m;",
            *("        " + line for line in kind.body().splitlines()),
            "        return;",
            "    }",
        ]
        start = end
    return [*lines, "}"], start


def _define(text: str, name: str) -> int:
    """The value of the generated ``#define name``."""
    return int(re.search(rf"^#define {name} (\d+)$", text, re.M).group(1))


def _items(text: str, h: int, m: int) -> tuple[list[str], tuple[int, int, int, int]]:
    """The item functions of the generated ``text`` (kernels/cell_loop_cuda.h's CELL_SPREAD step) and the ranges
    of items (values, partials, products, the new states' gradient)."""
    step = "int64_t row, const REAL* restrict prev, const REAL* restrict piece, const REAL* const* in, const int64_t* stride, REAL* restrict next"
    lines: list[str] = []
    counts = []
    for function, params in (
        ("values", step),
        ("partials", f"{step}, REAL* restrict scales, REAL* restrict diagonal, REAL* restrict fpart"),
    ):
        code, count = _dispatch(
            f"cell_item_{function}", params, _kinds(_step_parts(text, f"cell_{function}")), h
        )
        lines += code
        counts.append(count)
    products, direct = _sums(text, "CELL_PRODUCTS"), _sums(text, "CELL_DIRECT")
    npieces = _define(text, "NK")
    parts = []
    for k, terms in products.items():
        shared = f" shared[{k * h} + j] = v;" if k < npieces else ""
        parts.append(_templated([f"const REAL v = {_sum(terms, h)};", f"out[{k * h} + j] = v;{shared}"]))
    code, count = _dispatch(
        "cell_item_products",
        "const REAL* restrict g, const REAL* restrict s, const REAL* restrict f, REAL* restrict out, REAL* restrict shared",
        _kinds(parts), h,
    )  # fmt: skip
    lines += code
    counts.append(count)
    # the new states' gradient at state q: the read columns' sum, the diagonal (one state), the direct terms
    parts = []
    clo, chi = _define(text, "CLO"), _define(text, "CHI")
    for q in range(m):
        body = [f"const int64_t c = {q * h} + j;"]
        body.append(f"REAL v = column[{q * h - clo} + j];" if clo <= q * h < chi else "REAL v = REAL(0);")
        if m == 1:
            body.append("if (diag != nullptr) v += g[j] * diag[j];")
        if q in direct:
            body.append(f"v += ({_sum(direct[q], h)});")
        body.append("gn[c] = (d != nullptr && c < direct_width ? d[c] : REAL(0)) + v;")
        parts.append(_templated(body))
    code, count = _dispatch(
        "cell_item_gradient",
        "const REAL* restrict g, const REAL* restrict s, const REAL* restrict column, const REAL* restrict diag, const REAL* restrict d, int64_t direct_width, REAL* restrict gn",
        _kinds(parts), h,
    )  # fmt: skip
    counts.append(count)
    names = ("CELL_VALUE_ITEMS", "CELL_PARTIAL_ITEMS", "CELL_PRODUCT_ITEMS", "CELL_GRADIENT_ITEMS")
    return [*lines, *code, *(f"#define {n} {c}" for n, c in zip(names, counts, strict=True))], tuple(counts)


def _epilogue(structure: CellStructure, n_inputs: int) -> list[str]:
    """After the step: the kernels' parameter macros (the input values as (pointer, row stride) pairs), then the
    kernels."""
    pointers = ", ".join(f"in{k}" for k in range(n_inputs))
    strides = ", ".join(f"st{k}" for k in range(n_inputs))
    params = "".join(f", const REAL* __restrict__ in{k}, int64_t st{k}" for k in range(n_inputs))
    host = "".join(
        f", (const REAL*)a[base + {2 * k}], (int64_t)a[base + {2 * k + 1}]" for k in range(n_inputs)
    )
    return [
        f"#define CELL_INPUT_PARAMS {params}",
        f"#define CELL_INPUT_POINTERS {pointers}",
        f"#define CELL_INPUT_STRIDES {strides}",
        f"#define CELL_INPUT_HOST_ARGS(base) {host}",
        f"#define CELL_SPREAD {int(structure.width < SPREAD_BELOW)}",
        '#include "cell_loop_cuda.h"',
    ]


#: the CUDA kernels: the step as device functions, one thread per coordinate j (kernels/cell_loop_cuda.h)
TARGET = cell_kernel.Target(
    generator="lightning_bppsa/nn/cell_cuda.py",
    prologue=('#include "cuda_host_emulation.h"', '#include "cell_cuda_prologue.h"'),
    qualifier="__device__ __forceinline__",
    loop="{{ const int64_t j = threadIdx.x;",
    epilogue=_epilogue,
)


def launch_config(source: CellSource, kernel: str, batch: int, steps: int, shared_limit: int) -> Launch:
    """The launch of ``kernel`` over ``batch`` rows of ``steps`` steps on a device whose blocks may use
    ``shared_limit`` bytes of shared memory: the ONE place that computes it (the GPU and the host emulation
    both launch what it says). The forward and the backward stage the pieces' weights in shared memory where
    they fit, else read them from global memory (``Launch.staged``)."""
    h, m, k, size = source.width, source.n_states, source.pieces, source.element_bytes
    weights = source.read_columns * k * h * size
    block = 32 * math.ceil(h / 32)
    if kernel in ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward"):
        forward = kernel == "bppsa_cell_cuda_forward"
        # forward: two state buffers and the pieces (spread: two steps' offsets); backward: two buffers of the
        # pieces' products (spread: the read columns' sums, two buffers of the states' gradient, two steps' rows)
        if forward:
            buffers = (2 * m * h + k * h + 2 * k * h * source.spread) * size
        else:
            spread = source.read_columns + 2 * m * h + 2 * source.backward_row if source.spread else 0
            buffers = (2 * k * h + spread) * size
        if (
            source.spread
        ):  # a thread per item, piece coordinate (forward) or read column (backward), to the cap
            work = (
                max(k * h, source.value_items, source.partial_items)
                if forward
                else max(source.read_columns, source.product_items, source.gradient_items)
            )
            block = min(MAX_THREADS, max(block, 32 * math.ceil(work / 32)))
        staged = buffers + weights <= shared_limit
        return Launch(kernel, batch, block, buffers + weights * staged, staged)
    if kernel == "bppsa_cell_cuda_cotangent":
        work = batch * steps * h
        block = min(COTANGENT_BLOCK, 32 * max(1, math.ceil(work / 32)))
        return Launch(kernel, max(1, min(COTANGENT_GRID, math.ceil(work / block))), block, 0)
    raise ValueError(f"no such kernel {kernel!r}; one of {KERNELS}")


def weight_products(source: CellSource, launch: Launch) -> int:
    """The multiply-adds with the pieces' weights that the busiest thread of ``launch`` (forward or backward) does
    in one step: the pieces from the read state columns (forward), the read columns' sums over the pieces'
    products (backward). The serial part of a step that the layout decides (cell_loop_cuda.h)."""
    h, pieces, columns = source.width, source.pieces * source.width, source.read_columns
    if launch.kernel not in ("bppsa_cell_cuda_forward", "bppsa_cell_cuda_backward"):
        raise ValueError(f"{launch.kernel} does no products with the weights")
    forward = launch.kernel == "bppsa_cell_cuda_forward"
    if source.spread:  # the block shares the piece coordinates (forward) or the read columns (backward)
        return math.ceil((pieces if forward else columns) / launch.block) * (columns if forward else pieces)
    # thread j: its coordinate of every piece (forward), of every read state (backward)
    return source.pieces * columns if forward else (columns // h) * pieces


class Backend(Protocol):
    """What builds and launches a cell's kernels: ``platform`` names it in ``last_stats["cell_kernel"]``."""

    platform: str

    def shared_limit(self, device: torch.device) -> int:
        """The dynamic shared memory a block may use on ``device``."""
        ...

    def load(self, source: CellSource, device: torch.device) -> None:
        """Build and load ``source`` for ``device`` (once); ``RuntimeError`` saying why where it cannot."""
        ...

    def launch(self, source: CellSource, launch: Launch, args: list[int], device: torch.device) -> None:
        """Queue ``launch`` with the 64-bit argument words ``args`` (pointers as addresses)."""
        ...


class CudaCellKernel(CellKernel):
    """The compiled loop of one factored :class:`CellStructure` in one dtype on one CUDA device (or, with the
    emulated backend, on CPU tensors through the host emulation).

    Raises :class:`Unsupported` where the graph cannot be compiled or the state does not fit the kernels, and
    :class:`RuntimeError` where the kernels do not build or load (the backend says why).
    """

    def __init__(
        self,
        structure: CellStructure,
        dtype: torch.dtype,
        device: torch.device,
        backend: Backend | None = None,
    ) -> None:
        cell_kernel._check(structure, dtype)  # CellKernel's own conditions, without its C build
        if structure.width > MAX_THREADS:
            raise Unsupported(
                f"the state tensors are {structure.width} wide; the CUDA loop takes at most {MAX_THREADS}"
            )
        backend = CupyBackend() if backend is None else backend
        source, self._inputs, self._layout = generate(structure, dtype)
        limit = backend.shared_limit(device)
        for name in KERNELS:
            need = launch_config(source, name, 1, 1, limit).shared_bytes
            if need > limit:  # the buffers alone: weights that do not fit stay in global memory
                raise Unsupported(f"{name} needs {need} bytes of shared memory; the device gives {limit}")
        backend.load(source, device)
        self.structure, self.dtype, self.source, self.platform = structure, dtype, source, backend.platform
        self._library = _Launches(source, backend, device)
        self._start()


def _address(value: int | None) -> int:
    return 0 if value is None else int(value)


class _Launches:
    """The compiled loop's "library" as :class:`CellKernel` calls it (the C functions' arguments, pointers as
    ints or ``None``; OpenMP's ``threads`` unused), each call one kernel launch of :func:`launch_config`
    through the backend, its argument words in the kernel's order."""

    def __init__(self, source: CellSource, backend: Backend, device: torch.device) -> None:
        self._source, self._backend, self._device = source, backend, device
        self._shared_limit = backend.shared_limit(device)

    def _launch(self, kernel: str, batch: int, steps: int, words: list) -> None:
        """``words``: pointers as ints or None."""
        if batch == 0 or steps == 0:
            return
        launch = launch_config(self._source, kernel, batch, steps, self._shared_limit)
        self._backend.launch(self._source, launch, [_address(w) for w in words], self._device)

    def bppsa_cell_forward(self, batch, steps, threads, wc, offsets, pointers, strides, states, partials, scales,
                           diagonal, fpart) -> int:  # fmt: skip
        inputs = []
        for k in range(self._source.n_inputs):  # the ctypes arrays CellKernel.forward filled
            inputs += [_address(pointers[k]), int(strides[k])]
        words = [batch, steps, wc, offsets, states, int(partials), scales, diagonal, fpart, *inputs]
        self._launch("bppsa_cell_cuda_forward", batch, steps, words)
        return 0

    def bppsa_cell_backward(self, batch, steps, threads, wt, scales, scale_width, diagonal, fpart, direct,
                            direct_width, batch_stride, step_stride, final, out, products) -> int:  # fmt: skip
        words = [
            batch,
            steps,
            wt,
            scales,
            scale_width,
            diagonal,
            fpart,
            direct,
            int(direct_width),
            int(batch_stride),
            int(step_stride),
            final,
            out,
            products,
        ]
        self._launch("bppsa_cell_cuda_backward", batch, steps, words)
        return 0

    def bppsa_cell_cotangent(self, batch, steps, threads, grad, scales, scale_width, fpart, out) -> int:
        self._launch(
            "bppsa_cell_cuda_cotangent", batch, steps, [batch, steps, grad, scales, scale_width, fpart, out]
        )
        return 0


# --------------------------------------------------------------------------------------------------
# NVRTC through CuPy: the package's one loader (lightning_bppsa.kernels.cupy_loader), imported when a kernel is
# built on a GPU (a machine without it keeps the torch path with the reason).
# --------------------------------------------------------------------------------------------------


class CupyBackend:
    """The kernels compiled with NVRTC by CuPy (once per source and device; CuPy caches the binary on disk) and
    launched on torch's current stream (no sync), through :mod:`lightning_bppsa.kernels.cupy_loader`."""

    platform = "cuda"

    def __init__(self) -> None:
        self._functions: dict[tuple[int, str, str], object] = {}  # (device, digest, kernel) -> CuPy Function

    def shared_limit(self, device: torch.device) -> int:
        return _loader().shared_limit(_index(device))

    def load(self, source: CellSource, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"the CUDA cell loop takes CUDA tensors, not {device.type}")
        loader = _loader()
        ok, reason = loader.available()  # CuPy >= 14, NVRTC, a device: what every CUDA kernel here needs
        if not ok:
            raise RuntimeError(f"the CUDA cell loop cannot run here: {reason}")
        index = _index(device)
        try:
            for name in ENTRIES:
                self._functions[(index, source.digest, name)] = loader.load_function(index, source.text, name)
        except Exception as err:  # noqa: BLE001 - CuPy raises unrelated types (CompileException, CUDADriverError, ...)
            raise RuntimeError(
                f"the CUDA cell loop does not compile or load here ({type(err).__name__}: {err})"
            ) from err

    def launch(self, source: CellSource, launch: Launch, args: list[int], device: torch.device) -> None:
        index = _index(device)
        function = self._functions[(index, source.digest, launch.entry)]
        _loader().launch(function, index, launch.grid, launch.block, launch.shared_bytes, args)


def _loader():
    """The package's CuPy loader; ``RuntimeError`` where this installation has none."""
    try:
        from lightning_bppsa.kernels import cupy_loader
    except ImportError as err:
        raise RuntimeError(f"the CUDA cell loop needs lightning_bppsa.kernels.cupy_loader ({err})") from err
    return cupy_loader


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
