"""CUDA forward kernels of whole recurrent layers (``kernels/recurrent.cu``): states AND Jacobian factors.

One single-layer, single-direction layer per call, torch's gate order, batch-major contiguous tensors,
float32 or float64. ``gi`` is the input projection the caller computes with one GEMM (``x W_ihᵀ + b_ih``;
for RNN and LSTM the caller may fold ``b_hh`` into it):

- :func:`rnn_forward` ``(gi (B,T,H), w_hh (H,H), b_hh (H,)|None, h0 (B,H), relu) -> (out,)``, ``(B, T, H)``
  (no factor: the backward's ``f'`` is a function of ``out``).
- :func:`gru_forward` ``(gi (B,T,3H), w_hh (3H,H), b_hh (3H,)|None, h0) -> (out, scales (B,T,3H), z, dn)``:
  exactly the factors of ``FactoredJacobians(w_hh, scales, z)`` (``jacobians/recurrent.gru_jacobians``).
- :func:`lstm_forward` ``(gi (B,T,4H), w_hh (4H,H), h0, c0) -> (out, cells (B,T,H), gates (B,T,4H))``, the
  cells ``c_1..c_T`` and the activated gates ``[i, f, g, o]``.
- :func:`rnn_backward`, :func:`gru_backward`, :func:`lstm_backward`: a layer's backward recursion with its gate
  gradients in one launch, with the arguments and results of the CPU kernels'
  (:mod:`lightning_bppsa.kernels.recurrent`; no parameter sums): ``(d_a, gh0)``, ``(d_gi, d_gh, gh0)``,
  ``(d_gates, gh0, gc0)``. :func:`backward_refusal` says where they cannot launch (the layer's backward then
  scans the factored Jacobians).

Float32 layers with ``H <= 32`` run kernels compiled for their ``H`` (``bppsa_<cell>_forward_f32_h<H>`` and
``bppsa_<cell>_backward_f32_h<H>``: one module per ``H``, compiled on the first launch of that ``H`` with
``-DBPPSA_REC_HIDDEN=<H>``; ``W_hh`` in registers, the forward's ``gi`` staged :data:`RING_DEPTH` steps ahead
through shared memory). Wider float32 layers (``32 < H <= 256``) run kernels compiled for their cell, direction
and ``H`` too (:func:`wide_layout`; one module each, :func:`wide_options`): each unit's share of ``W_hh`` split
over one or two lanes, in registers where it fits (RNN ``H <= 192``, GRU ``H <= 104``, LSTM ``H <= 72``
forward / ``70`` backward), else partly in registers and the rest in shared memory. Float64 layers keep
``W_hh`` in shared memory (:data:`KERNELS`, one module compiled by :func:`available`; float32 too inside a
CUDA graph capture, where NVRTC cannot compile). ``recurrent.cu``'s header says why. :func:`refusal` says
where and why a launch cannot be made (the caller plans torch's forward there before anything runs); each
function returns ``None`` where the kernels cannot run: a dtype other than float32 / float64 or mismatched
dtypes, tensors not on one CUDA device, ``H > 256`` (one thread per hidden unit), or a block's shared memory
(state or row buffers, and the part of ``W_hh`` it holds) above the device's per block (opt-in limit:
163 KiB on sm_80, 227 KiB on sm_90), i.e. beyond

    ===========  =====  =====  =====
    max H        RNN    GRU    LSTM
    ===========  =====  =====  =====
    sm_80 f32    256    138    128
    sm_80 f64    142    82     71
    sm_90 f32    256    160    133
    sm_90 f64    168    98     84
    ===========  =====  =====  =====

A malformed shape raises ``ValueError`` naming the argument. :func:`available` says whether CuPy and a
device are usable. The kernels load through the package's one CuPy loader
(:mod:`lightning_bppsa.kernels.cupy_loader`): each module is compiled once per process and device with
NVRTC (CuPy caches the binary on disk), and a launch passes raw data pointers on
``torch.cuda.current_stream()``: no copy (but of non-contiguous inputs), no synchronisation.

:func:`prepare` is the ONE place computing a launch (kernel, grid, block, shared memory, argument words);
the host emulation (:mod:`lightning_bppsa.kernels.recurrent_emulated`) runs the same launches on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from lightning_bppsa.kernels import cuda, cupy_loader
from lightning_bppsa.kernels._build import kernel_path
from torch import Tensor

__all__ = [
    "CELLS",
    "KERNELS",
    "Launch",
    "RING_DEPTH",
    "available",
    "backward_refusal",
    "forward",
    "gru_forward",
    "gru_backward",
    "lstm_backward",
    "lstm_forward",
    "module_options",
    "WideLayout",
    "wide_blocks_per_sm",
    "wide_layout",
    "wide_options",
    "wide_threads",
    "prepare",
    "refusal",
    "rnn_backward",
    "rnn_forward",
    "shared_bytes",
    "source",
]

#: gates per cell kind (the rows of ``W_hh`` are ``G * H``)
CELLS = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
#: factor outputs per cell kind, as multiples of ``H`` in the last dimension
_FACTORS = {"rnn_tanh": (), "rnn_relu": (), "gru": (3, 1, 1), "lstm": (1, 4)}
#: the kernels of the module :func:`available` compiles: W_hh in shared memory, any H that fits
KERNELS = tuple(
    f"bppsa_{cell}_{direction}_{suffix}"
    for direction in ("forward", "backward")
    for cell in CELLS
    for suffix in ("f32", "f64")
)
MAX_THREADS = 256  # kMaxThreads in recurrent.cu: one thread per hidden unit
#: the widest float32 layer the kernels compiled per H take as a cluster of blocks (cluster_layout; sm_90)
MAX_CLUSTER_HIDDEN = 512
FIXED_HIDDEN = 32  # float32 with H <= 32: the kernels compiled for their H (W_hh in registers, one warp; GRU /
# LSTM forward: a unit's gates in neighbouring lanes, group_threads)
#: lanes a unit of the gated cells' backward compiled for H <= 32 (recurrent.cu's kFixedSplit): a half / a
#: quarter of the column's 3 H / 4 H multiply-adds a lane; the RNN cells keep one lane (one warp)
FIXED_SPLIT = {"gru": 2, "lstm": 4}
#: steps of gi the H <= 32 kernels stage ahead in shared memory (BPPSA_REC_RING; a lead of RING_DEPTH - 2
#: steps must cover a global load's latency: ~0.5-1 us on an H100 against ~0.1-0.2 us a step)
RING_DEPTH = 16
PORTABLE_SHARED_BYTES = cupy_loader.PORTABLE_SHARED_BYTES  # shared memory a block gets without the opt-in
SM80_OPTIN_SHARED_BYTES = 163 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an A100
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as :func:`prepare` computed it."""

    kernel: str  # entry point in recurrent.cu
    grid: int  # blocks: one per batch row (a cluster of blocks per row: ``cluster`` per row)
    block: int  # threads: H rounded up to a whole warp
    shared_bytes: int  # dynamic shared memory per block
    args: tuple[int, ...]  # the kernel's argument words (pointers as addresses)
    # the tensors behind the pointers (contiguous copies included): alive until the launch is queued
    buffers: tuple[Tensor, ...] = field(default=(), repr=False, compare=False)
    #: the -D options of the kernel's module (NVRTC's and the host emulation's g++'s): () for :data:`KERNELS`
    options: tuple[str, ...] = ()
    cluster: int = 1  # blocks of a cluster (the kernel's own __cluster_dims__; :func:`cluster_layout`)


def group_threads(cell: str, hidden: int) -> int:
    """Threads of the gated cells' forward compiled for ``hidden <= FIXED_HIDDEN`` (``recurrent.cu``'s
    ``unit_group_forward``): a unit's gates in neighbouring lanes, ``32 // G`` units a warp, whole warps."""
    return 32 * math.ceil(hidden / (32 // CELLS[cell]))


def _fixed(hidden: int, element_bytes: int) -> bool:
    return element_bytes == 4 and hidden <= FIXED_HIDDEN


#: registers a lane holds beside its share of ``W_hh``, by direction and cell (ptxas on sm_80 / sm_90 measured
#: up to: backward RNN 64, GRU 88, LSTM 112; forward RNN 70, GRU 90, LSTM 86, at the H of the compile gate)
_OTHER_REGISTERS = {
    "forward": {"rnn_tanh": 72, "rnn_relu": 72, "gru": 96, "lstm": 96},
    "backward": {"rnn_tanh": 64, "rnn_relu": 64, "gru": 96, "lstm": 112},
}
#: and beside a share read partly from shared memory (its loads in flight: ptxas spilled 8-24 bytes with 16)
_SHARED_PART_REGISTERS = 32
#: and more in a cluster's kernel, by direction and cell: the RNN's backward keeps its gate gradients past the
#: barrier's arrival (ptxas spilled 36-80 bytes with 39 packs in registers at H = 257 / 424 in 2 blocks, none
#: with 36); the others' fit as counted
_CLUSTER_REGISTERS = {"backward": {"rnn_tanh": 12, "rnn_relu": 12}}
_REGISTERS_PER_SM = 65536  # every sm_80 / sm_90 multiprocessor: a block's threads share them
_MAX_THREADS_PER_BLOCK = 1024


class WideLayout(NamedTuple):
    """How a float32 kernel compiled per ``H > 32`` holds ``W_hh`` (``recurrent.cu``'s ``cell_backward`` /
    ``shared_forward``): ``split`` lanes a unit, each with ``lane_packs`` 16-byte packs of the unit's share (the
    backward's: of its column; the forward's: of each of its ``G`` rows), the first ``register_packs`` in
    registers, the others in shared memory; a row's units over a ``cluster`` of blocks (sm_90+), each owning
    ``ceil(H / cluster)`` of them (:func:`cluster_layout`)."""

    split: int
    register_packs: int
    lane_packs: int
    cluster: int = 1


def _other_registers(cell: str, direction: str, cluster: int) -> int:
    """A lane's registers beside its share of ``W_hh`` (a cluster's kernels keep a few more)."""
    extra = _CLUSTER_REGISTERS.get(direction, {}).get(cell, 0) if cluster > 1 else 0
    return _OTHER_REGISTERS[direction][cell] + extra


#: the lanes a unit a :class:`WideLayout` may take
SPLITS = (1, 2, 4, 8)


@functools.lru_cache(maxsize=512)
def wide_layout(
    cell: str, hidden: int, direction: str = "backward", cluster: int = 1, splits: tuple[int, ...] = SPLITS
) -> WideLayout | None:
    """The :class:`WideLayout` of the float32 ``direction`` kernel of ``FIXED_HIDDEN < hidden <= MAX_THREADS``
    (its units over ``cluster`` blocks: up to :data:`MAX_CLUSTER_HIDDEN`): the fewest lanes a unit (a power of
    two of ``splits``) whose share fits in registers beside a lane's other registers, the block within
    ptxas's bound (a quarter of the register file for the warps of each scheduler); where none does, the split
    holding the most of it in registers, the rest in shared memory (one block: RNN ``H > 192``, GRU ``H > 104``,
    LSTM ``H > 72`` forward, ``H > 70`` backward). ``None`` outside that range. The compile gates
    (``tests/kernels/test_recurrent_cuda_emulated.py``) build the widest ``H`` of each layout without a spill."""
    if not FIXED_HIDDEN < hidden <= (MAX_THREADS if cluster == 1 else MAX_CLUSTER_HIDDEN):
        return None
    gates, backward = CELLS[cell], direction == "backward"
    packs = math.ceil((gates if backward else 1) * hidden / 4)  # of the column / of each row, in 16-byte packs
    registers_a_pack = 4 if backward else 4 * gates  # a forward lane holds a pack of each gate's row
    best = None
    for split in splits:
        threads = wide_threads(math.ceil(hidden / cluster), split)
        if threads > _MAX_THREADS_PER_BLOCK:
            break
        limit = _register_limit(threads)
        lane, other = math.ceil(packs / split), _other_registers(cell, direction, cluster)
        if lane * registers_a_pack + other <= limit:
            return WideLayout(split, lane, lane, cluster)
        fit = max(0, (limit - other - _SHARED_PART_REGISTERS) // registers_a_pack)
        if best is None or split * fit > best.split * best.register_packs:
            best = WideLayout(split, fit, lane, cluster)
    return best


#: the cluster sizes a layout may take (portable on every sm_90 device: at most 8 blocks)
CLUSTER_SIZES = (2, 4, 8)


@functools.lru_cache(maxsize=512)
def cluster_layout(cell: str, hidden: int, direction: str, shared_limit: int, cluster_limit: int) -> WideLayout | None:
    """The layout of a float32 ``direction`` kernel whose ``W_hh`` no single block holds within ``shared_limit``
    bytes (:func:`wide_layout`; none above :data:`MAX_THREADS`): the smallest cluster of :data:`CLUSTER_SIZES`,
    up to ``cluster_limit`` (the device's: 1 before sm_90), whose blocks each hold their units' share; ``None``
    where the single block fits, or where no cluster does (on an H100 above RNN H = 512, GRU H = 472, LSTM H =
    392 forward / 388 backward)."""
    single = wide_layout(cell, hidden, direction)
    rows = CELLS[cell] if direction == "forward" else 1
    if not FIXED_HIDDEN < hidden <= MAX_CLUSTER_HIDDEN or (
        single is not None and _wide_bytes(single, hidden, rows) <= shared_limit
    ):
        return None
    for cluster in CLUSTER_SIZES:
        if cluster > cluster_limit or (cluster - 1) * math.ceil(hidden / cluster) >= hidden:
            break  # beyond the device's clusters, or a block of the cluster would own no unit
        layout = wide_layout(cell, hidden, direction, cluster)
        if _wide_bytes(layout, hidden, rows) <= shared_limit:
            return layout
    return None


#: a batch of at most this many rows spreads a gated layer that takes 2 blocks a row over 4 blocks of 4 lanes a
#: unit (at most 64 blocks: one wave on any sm_90 GPU, 78-132 SMs): more of a lane's share of ``W_hh`` in
#: registers, half of it a lane; on an H200 at B = 16 T = 1000 the GRU H = 192 kernels 1.51x (forward) / 1.67x
#: (backward) faster, LSTM H = 160 1.52x / 1.39x (``benchmarks/results/cluster-layouts-h200-f9d52e5.md``;
#: layers already on 4 or 8 blocks gained nothing from other layouts there, the RNN's were not measured). So
#: does a GRU's backward that one block runs with at most :data:`SPREAD_REGISTER_SHARE` of a lane's share in
#: registers (H 123-160 on an H100): there GRU H = 128's backward (31 of 48 packs) 1.26x faster on 4 blocks of
#: 4 lanes (all of a lane's share in registers), its forward 0.93x (the forward stays; an LSTM's one-block
#: backward was not measured). Above that share the step model prices the spread slower (H = 120: 0.97x)
SPREAD_BATCH = 16
SPREAD_CLUSTER = SPREAD_SPLIT = 4
SPREAD_REGISTER_SHARE = 2 / 3


@functools.lru_cache(maxsize=512)
def launch_layout(
    cell: str, hidden: int, direction: str, shared_limit: int, cluster_limit: int, spread: bool
) -> WideLayout | None:
    """The cluster layout a launch of the ``direction`` kernel takes: :func:`cluster_layout`'s, or, for a
    ``spread`` batch (at most :data:`SPREAD_BATCH` rows), :data:`SPREAD_CLUSTER` blocks of :data:`SPREAD_SPLIT`
    lanes a unit where those fit: for a GRU / LSTM that takes 2 blocks a row where they hold at least as many packs
    of a lane's share in registers, for a GRU's backward that one block runs with at most
    :data:`SPREAD_REGISTER_SHARE` of a lane's share in registers where they hold all of it there; ``None`` where
    one block runs it, or nothing does."""
    layout = cluster_layout(cell, hidden, direction, shared_limit, cluster_limit)
    if not spread or cell not in ("gru", "lstm") or cluster_limit < SPREAD_CLUSTER:
        return layout
    wider = wide_layout(cell, hidden, direction, SPREAD_CLUSTER, splits=(SPREAD_SPLIT,))
    rows = CELLS[cell] if direction == "forward" else 1
    if wider is None or _wide_bytes(wider, hidden, rows) > shared_limit:
        return layout
    if layout is None:  # one block runs it, or nothing does
        single = wide_layout(cell, hidden, direction)
        hybrid = single is not None and single.register_packs <= SPREAD_REGISTER_SHARE * single.lane_packs
        one_block = single is not None and _wide_bytes(single, hidden, rows) <= shared_limit
        wanted = cell == "gru" and direction == "backward" and hybrid and one_block
        return wider if wanted and wider.register_packs == wider.lane_packs else None
    if layout.cluster != 2 or wider.register_packs < layout.register_packs:
        return layout
    return wider


def wide_threads(hidden: int, split: int) -> int:
    """Threads of a block of a :class:`WideLayout` kernel: ``split`` lanes a unit, in whole warps."""
    return 32 * math.ceil(hidden * split / 32)


def _register_limit(threads: int) -> int:
    """A thread's registers under ``__launch_bounds__(threads)``: a quarter of the file serves each of the SM's
    four schedulers, whose warps share it (ptxas's bound; in whole 8-register units)."""
    warps_a_quarter = math.ceil(threads / 32 / 4)
    return min(255, _REGISTERS_PER_SM // 4 // warps_a_quarter // 32 // 8 * 8)


def wide_blocks_per_sm(cell: str, hidden: int, direction: str, cluster: int = 1) -> int:
    """Blocks of the float32 ``direction`` kernel of ``hidden`` (:func:`wide_layout`, its units over ``cluster``
    blocks) one multiprocessor holds at once by registers: a thread's estimated from its layout (the share in
    registers and the lane's others, as :func:`wide_layout` reckons them, up to ptxas's bound); 1 where there
    is no such kernel."""
    layout = wide_layout(cell, hidden, direction, cluster)
    if layout is None:
        return 1
    threads = wide_threads(math.ceil(hidden / cluster), layout.split)
    a_pack = 4 if direction == "backward" else 4 * CELLS[cell]
    hybrid = _SHARED_PART_REGISTERS if layout.register_packs < layout.lane_packs else 0
    wanted = layout.register_packs * a_pack + _other_registers(cell, direction, cluster) + hybrid
    registers = min(_register_limit(threads), math.ceil(wanted / 8) * 8)
    return max(1, _REGISTERS_PER_SM // (threads * registers))


def _register_layout(cell: str, hidden: int, element_bytes: int, direction: str) -> WideLayout | None:
    """The layout of ``W_hh`` of the ``direction`` kernel compiled per ``H``: for ``H <= 32`` the backward's
    column over :data:`FIXED_SPLIT` lanes a unit (the RNN cells' one lane: one warp; the forward's
    :data:`FIXED_HIDDEN` kernels, a lane a gate of a unit, are not described by it), or :func:`wide_layout`; ``None`` for
    the kernels of :data:`KERNELS` (float64)."""
    if element_bytes != 4:
        return None
    if hidden <= FIXED_HIDDEN:
        split = FIXED_SPLIT.get(cell, 1) if direction == "backward" else 1
        lane = math.ceil(math.ceil(CELLS[cell] * hidden / 4) / split)
        return WideLayout(split, lane, lane)
    return wide_layout(cell, hidden, direction)


def wide_options(cell: str, hidden: int, layout: WideLayout, direction: str = "backward") -> tuple[str, ...]:
    """The -D options of the module of ``cell``'s float32 ``direction`` kernel compiled for ``hidden`` > 32 with
    ``W_hh`` held as ``layout`` says (:func:`wide_layout`)."""
    forward = ("-DBPPSA_REC_FORWARD=1",) if direction == "forward" else ()
    return (f"-DBPPSA_REC_HIDDEN={hidden}", f"-DBPPSA_REC_SPLIT={layout.split}", f"-DBPPSA_REC_CELL={cell}",
            f"-DBPPSA_REC_REGISTER_PACKS={layout.register_packs}", *forward)  # fmt: skip


def module_options(hidden: int) -> tuple[str, ...]:
    """The -D options of the module of the float32 kernels compiled for ``hidden`` (<= :data:`FIXED_HIDDEN`)."""
    return (f"-DBPPSA_REC_HIDDEN={hidden}", f"-DBPPSA_REC_RING={RING_DEPTH}")


def shared_bytes(cell: str, hidden: int, element_bytes: int) -> int:
    """Dynamic shared memory of a block: two state buffers (padded to 16-byte vectors; the RNN's per-``H``
    kernels: a value a lane), plus ``W_hh`` packed
    in 16-byte vectors, or, in the kernels compiled per ``H`` (float32, ``H <= 32``: ``W_hh`` in registers),
    the ring of :data:`RING_DEPTH` steps of ``gi`` (GRU / LSTM: a word a thread); in the
    float32 kernels compiled per ``H`` above that (:func:`wide_layout`) the state buffers, padded to whole
    vectors for each of a unit's lanes, and the part of ``W_hh`` not in registers."""
    fixed = _fixed(hidden, element_bytes)
    layout = None if fixed else _register_layout(cell, hidden, element_bytes, "forward")
    return _shared_bytes(cell, hidden, element_bytes, fixed=fixed, layout=layout)


def _shared_bytes(
    cell: str, hidden: int, element_bytes: int, *, fixed: bool, layout: WideLayout | None = None
) -> int:
    width = 16 // element_bytes
    vectors = math.ceil(hidden / width)
    if fixed:  # the RNN's state buffers hold a value a lane, its ring gi's rows; the gated cells' ring a word a thread
        if CELLS[cell] == 1:
            return (2 * 32 + RING_DEPTH * hidden) * element_bytes
        return (2 * vectors * width + RING_DEPTH * group_threads(cell, hidden)) * element_bytes
    if layout is not None:
        return _wide_bytes(layout, hidden, CELLS[cell])
    return (CELLS[cell] * hidden + 2) * vectors * width * element_bytes


def _wide_bytes(layout: WideLayout, hidden: int, rows: int) -> int:
    """A :class:`WideLayout` block's shared memory (float32): two row or state buffers of a unit's lanes' packs,
    and the packs not in registers of ``rows`` rows (the forward's gates; the backward's column: 1) per unit of
    the block."""
    lanes, units = layout.split * layout.lane_packs, math.ceil(hidden / layout.cluster)
    return 2 * lanes * 16 + rows * (layout.lane_packs - layout.register_packs) * units * layout.split * 16


@functools.lru_cache(maxsize=256)
def refusal(cell: str, hidden: int, dtype: torch.dtype, shared_limit: int, cluster_limit: int = 1) -> str | None:
    """Why the forward kernel of a ``cell`` layer of hidden size ``hidden`` in ``dtype`` cannot launch on a
    device giving a block ``shared_limit`` bytes of shared memory and running clusters of up to
    ``cluster_limit`` blocks (:func:`cluster_layout`) (one line), ``None`` where it can.

    The ONE statement of the kernels' limits: :func:`prepare` declines exactly where this refuses, and the
    layer's plan (:meth:`lightning_bppsa.backends.CudaBackend.refuses`) asks it before anything runs.
    Cached: a training loop asks with one shape every step.
    """
    return _limits("forward", cell, hidden, dtype, shared_limit, cluster_limit)


@functools.lru_cache(maxsize=256)
def backward_refusal(
    cell: str, hidden: int, dtype: torch.dtype, shared_limit: int, cluster_limit: int = 1
) -> str | None:
    """As :func:`refusal`, for the backward kernel of ``cell`` (its block stages two rows of gate gradients and,
    but where compiled per ``H``, ``W_hh``: :func:`backward_shared_bytes`)."""
    return _limits("backward", cell, hidden, dtype, shared_limit, cluster_limit)


def _limits(
    direction: str, cell: str, hidden: int, dtype: torch.dtype, shared_limit: int, cluster_limit: int
) -> str | None:
    """Why the CUDA ``direction`` kernel of a ``cell`` layer (one thread per hidden unit, the shared memory of
    :func:`shared_bytes` / :func:`backward_shared_bytes`; or as a cluster of blocks, :func:`cluster_layout`)
    cannot launch; ``None`` where it can."""
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {sorted(CELLS)}; got {cell!r}")
    if dtype not in _SUFFIX:
        return f"dtype {dtype} (the CUDA {direction} kernels take float32 / float64)"
    clustered = dtype == torch.float32 and cluster_layout(cell, hidden, direction, shared_limit, cluster_limit)
    if hidden > MAX_THREADS and not clustered:
        wider = f" (float32 up to {MAX_CLUSTER_HIDDEN} as a cluster of blocks where it fits)" if cluster_limit > 1 else ""
        return f"the CUDA {direction} kernel runs one thread per hidden unit, at most {MAX_THREADS}{wider}: H={hidden}"
    size = shared_bytes if direction == "forward" else backward_shared_bytes
    needed = size(cell, hidden, torch.finfo(dtype).bits // 8)
    if needed > shared_limit and not clustered:
        clusters = f", nor in a cluster of up to {cluster_limit} blocks" if cluster_limit > 1 else ""
        return (
            f"the CUDA {direction} kernel of H={hidden} needs {needed} B of shared memory per block, "
            f"the device has {shared_limit} B{clusters}"
        )
    return None


def backward_shared_bytes(cell: str, hidden: int, element_bytes: int) -> int:
    """Dynamic shared memory of a backward block: two rows of the ``G H`` gate gradients, padded to whole
    16-byte vectors, and ``W_hh`` (but in the float32 kernels compiled per ``H``, :func:`wide_layout`: the rows
    padded to whole vectors for each of a unit's lanes, and only the part of ``W_hh`` not in registers)."""
    layout = _register_layout(cell, hidden, element_bytes, "backward")
    return _backward_shared_bytes(cell, hidden, element_bytes, layout=layout)


def _backward_shared_bytes(cell: str, hidden: int, element_bytes: int, *, layout: WideLayout | None) -> int:
    if layout is not None:
        return _wide_bytes(layout, hidden, 1)
    width = 16 // element_bytes
    vectors = math.ceil(CELLS[cell] * hidden / width)
    return (2 + hidden) * vectors * width * element_bytes


def _check_shapes(
    cell: str, gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, c0: Tensor | None
) -> None:
    gates = CELLS[cell]
    if w_hh.dim() != 2 or w_hh.shape[0] != gates * w_hh.shape[1]:
        raise ValueError(f"w_hh must be ({gates} H, H) for a {cell} cell; got {tuple(w_hh.shape)}")
    hidden = w_hh.shape[1]
    if gi.dim() != 3 or gi.shape[2] != gates * hidden:
        raise ValueError(
            f"gi must be (B, T, {gates * hidden}) for hidden size {hidden}; got {tuple(gi.shape)}"
        )
    batch = gi.shape[0]
    if b_hh is not None and tuple(b_hh.shape) != (gates * hidden,):
        raise ValueError(f"b_hh must be ({gates * hidden},) or None; got {tuple(b_hh.shape)}")
    for name, state in (("h0", h0), ("c0", c0)):
        if state is not None and tuple(state.shape) != (batch, hidden):
            raise ValueError(f"{name} must be (B, H) = ({batch}, {hidden}); got {tuple(state.shape)}")


def prepare(
    cell: str,
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    c0: Tensor | None,
    *,
    device_type: str,
    shared_limit: int,
    cluster_limit: int = 1,
) -> tuple[Launch | None, tuple[Tensor, ...]] | None:
    """Check the inputs, allocate the outputs and compute the launch of one layer forward (``cluster_limit``: the
    largest cluster of blocks the device runs, 1 before sm_90).

    Returns ``None`` where the kernel cannot run (tensors of mixed dtypes or not all on one ``device_type``
    device, or what :func:`refusal` refuses); else ``(launch, outputs)``
    with ``outputs = (out, *factors)`` (empty tensors, filled by the launch) and ``launch = None`` when
    there is nothing to compute (``B``, ``T`` or ``H`` is 0). Raises ``ValueError`` on a malformed shape.
    """
    if cell not in CELLS:
        raise ValueError(f"cell must be one of {sorted(CELLS)}; got {cell!r}")
    if (c0 is not None) != (cell == "lstm"):
        raise ValueError(f"c0 is {'required' if cell == 'lstm' else 'only for an LSTM'} ({cell} cell)")
    _check_shapes(cell, gi, w_hh, b_hh, h0, c0)
    if not _one_kind(gi, (w_hh, b_hh, h0, c0), device_type):
        return None
    batch, steps, hidden = gi.shape[0], gi.shape[1], w_hh.shape[1]
    if refusal(cell, hidden, gi.dtype, shared_limit, cluster_limit) is not None:
        return None
    outputs = tuple(gi.new_empty(batch, steps, k * hidden) for k in (1, *_FACTORS[cell]))
    if batch == 0 or steps == 0 or hidden == 0:
        return None, outputs

    # no detach: a pointer is all a launch takes, and detach() is one more torch call per tensor
    inputs = [None if t is None else t.contiguous() for t in (gi, w_hh, b_hh, h0, c0)]
    pointers = [0 if t is None else t.data_ptr() for t in inputs]
    factors = [t.data_ptr() for t in outputs[1:]] + [0] * (4 - len(outputs))
    kernel, block, nbytes, options, cluster = _kernel_and_block(
        cell, gi.dtype, hidden, "forward", shared_limit, cluster_limit, batch <= SPREAD_BATCH
    )
    launch = Launch(
        kernel=kernel,
        grid=batch * cluster,
        block=block,
        shared_bytes=nbytes,
        args=(*pointers, outputs[0].data_ptr(), *factors, batch, steps, hidden),
        buffers=(*[t for t in inputs if t is not None], *outputs),
        options=options,
        cluster=cluster,
    )
    # After the launch is queued the copies may be freed: torch's caching allocator hands a freed block
    # only to work queued later on the same stream, so the kernel still reads valid memory.
    return launch, outputs


@functools.lru_cache(maxsize=128)
def _kernel_and_block(
    cell: str, dtype: torch.dtype, hidden: int, direction: str, shared_limit: int, cluster_limit: int,
    spread: bool = False,
) -> tuple[str, int, int, tuple[str, ...], int]:  # fmt: skip
    """The entry point, threads per block, dynamic shared memory, module options and blocks a cluster of a
    layer's ``direction`` kernel on a device of ``shared_limit`` / ``cluster_limit`` (:func:`refusal`'s), for a
    ``spread`` batch or not (:func:`launch_layout`) (once per shape: a training loop asks every step)."""
    element_bytes = torch.finfo(dtype).bits // 8
    size = shared_bytes if direction == "forward" else backward_shared_bytes
    nbytes = size(cell, hidden, element_bytes)
    if _fixed(hidden, element_bytes):  # forward: one warp (RNN), a unit's gates in neighbouring lanes (GRU / LSTM);
        # backward: FIXED_SPLIT lanes a unit
        if direction == "forward":
            threads = 32 if CELLS[cell] == 1 else group_threads(cell, hidden)
        else:
            threads = wide_threads(hidden, _register_layout(cell, hidden, 4, direction).split)
        return f"bppsa_{cell}_{direction}_f32_h{hidden}", threads, nbytes, module_options(hidden), 1
    clustered = (
        launch_layout(cell, hidden, direction, shared_limit, cluster_limit, spread) if element_bytes == 4 else None
    )
    if clustered is not None:
        q, rows = clustered.cluster, CELLS[cell] if direction == "forward" else 1
        return (
            f"bppsa_{cell}_{direction}_f32_h{hidden}_c{q}", wide_threads(math.ceil(hidden / q), clustered.split),
            _wide_bytes(clustered, hidden, rows),
            (*wide_options(cell, hidden, clustered, direction), f"-DBPPSA_REC_CLUSTER={q}"), q,
        )  # fmt: skip
    layout = _register_layout(cell, hidden, element_bytes, direction)
    if layout is not None:
        threads = wide_threads(hidden, layout.split)
        options = wide_options(cell, hidden, layout, direction)
        return f"bppsa_{cell}_{direction}_f32_h{hidden}", threads, nbytes, options, 1
    return f"bppsa_{cell}_{direction}_{_SUFFIX[dtype]}", 32 * math.ceil(hidden / 32), nbytes, (), 1


Launcher = Callable[[Launch, torch.device], None]


def forward(
    cell: str,
    gi: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    h0: Tensor,
    c0: Tensor | None,
    *,
    launcher: Launcher,
    device_type: str,
    shared_limit: int,
    cluster_limit: int = 1,
) -> tuple[Tensor, ...] | None:
    """:func:`prepare`, then ``launcher(launch, device)``; shared by the CUDA path and the host emulation."""
    prepared = prepare(cell, gi, w_hh, b_hh, h0, c0, device_type=device_type, shared_limit=shared_limit,
                       cluster_limit=cluster_limit)  # fmt: skip
    if prepared is None:
        return None
    launch, outputs = prepared
    if launch is not None:
        launcher(launch, gi.device)
    return outputs


#: the factor tensors a backward kernel reads (f0, f1, f2), by cell: their names and last dimensions in H
_BACKWARD_FACTORS = {
    "rnn_tanh": (("out", 1),),
    "rnn_relu": (("out", 1),),
    "gru": (("scales", 3), ("z", 1), ("dn", 1)),
    "lstm": (("gates", 4), ("cells", 1), ("c0", None)),
}


def prepare_backward(
    cell: str, factors: tuple[Tensor, ...], w_hh: Tensor, grad_out: Tensor | None, grad_h: Tensor | None,
    grad_cn: Tensor | None, *, device_type: str, shared_limit: int, cluster_limit: int = 1,
) -> tuple[Launch | None, tuple[Tensor, ...]] | None:  # fmt: skip
    """As :func:`prepare`, for the backward of ``cell`` over its ``factors`` (:data:`_BACKWARD_FACTORS`: the RNN's
    ``out``; the GRU's ``scales, z, dn``; the LSTM's ``gates, cells, c0``): ``(launch, outputs)`` with the
    outputs ``(d_gi, [d_gh (GRU),] gh0, [gc0 (LSTM)])`` empty, filled by the launch (``launch = None`` where
    ``B``, ``T`` or ``H`` is 0); ``None`` where the kernel cannot run. Raises ``ValueError`` on a malformed
    shape, naming the argument."""
    gates = CELLS[cell]
    first_name = _BACKWARD_FACTORS[cell][0][0]
    first = factors[0]
    if first.dim() != 3 or first.shape[2] % gates:
        raise ValueError(f"{first_name} must be (B, T, {gates} H); got {tuple(first.shape)}")
    batch, steps, hidden = first.shape[0], first.shape[1], first.shape[2] // gates
    given = (*factors, w_hh, grad_out, grad_h, grad_cn)
    for (name, shape), tensor in zip(_backward_shapes(cell, batch, steps, hidden), given, strict=True):
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} must be {tuple(shape)}; got {tuple(tensor.shape)}")
    if not _one_kind(first, given, device_type):
        return None
    if backward_refusal(cell, hidden, first.dtype, shared_limit, cluster_limit) is not None:
        return None
    grads = [first.new_empty(batch, steps, gates * hidden) for _ in range(2 if cell == "gru" else 1)]
    states = [first.new_empty(batch, hidden) for _ in range(2 if cell == "lstm" else 1)]
    outputs = (*grads, *states)
    if batch == 0 or steps == 0 or hidden == 0:
        # no step: the initial state is the last one, its gradients the ones given for that
        for given_grad, result in zip((grad_h, grad_cn), states, strict=False):
            if given_grad is None:
                result.zero_()
            else:
                result.copy_(given_grad)
        return None, outputs
    # the kernel's words: f0, f1, f2 (0 where the cell has fewer factors), w_hh, grad_out, grad_h, grad_cn,
    # d_gi, d_gh (GRU), gh0, gc0 (LSTM), batch, steps, hidden
    padded = (*factors, *(None,) * (3 - len(factors)), w_hh, grad_out, grad_h, grad_cn)
    inputs = [None if t is None else t.contiguous() for t in padded]
    outs = [grads[0], grads[1] if cell == "gru" else None, states[0], states[1] if cell == "lstm" else None]
    kernel, block, nbytes, options, cluster = _kernel_and_block(
        cell, first.dtype, hidden, "backward", shared_limit, cluster_limit, batch <= SPREAD_BATCH
    )
    launch = Launch(
        kernel=kernel,
        grid=batch * cluster,
        block=block,
        shared_bytes=nbytes,
        args=(*[0 if t is None else t.data_ptr() for t in (*inputs, *outs)], batch, steps, hidden),
        buffers=(*[t for t in inputs if t is not None], *outputs),
        options=options,
        cluster=cluster,
    )
    return launch, outputs


@functools.lru_cache(maxsize=64)
def _backward_shapes(cell: str, batch: int, steps: int, hidden: int) -> tuple[tuple[str, torch.Size], ...]:
    """``(name, shape)`` of each tensor :func:`prepare_backward` takes, in its order (once per shape: a training
    loop asks every step)."""
    factors = [(name, (batch, steps, k * hidden) if k else (batch, hidden)) for name, k in _BACKWARD_FACTORS[cell]]
    rest = [("w_hh", (CELLS[cell] * hidden, hidden)), ("grad_out", (batch, steps, hidden)),
            ("grad_h", (batch, hidden)), ("grad_cn", (batch, hidden))]  # fmt: skip
    return tuple((name, torch.Size(shape)) for name, shape in factors + rest)


def _one_kind(first: Tensor, others: Sequence[Tensor | None], device_type: str) -> bool:
    """Whether ``first`` (float32 / float64, on a ``device_type`` device) and ``others`` (``None`` skipped) share
    its dtype and device: what the kernels take."""
    dtype, device = first.dtype, first.device
    if dtype not in _SUFFIX or device.type != device_type:
        return False
    for t in others:  # a plain loop: asked twice a training step
        if t is not None and (t.dtype != dtype or t.device != device):
            return False
    return True


def backward(
    cell: str, factors: tuple[Tensor, ...], w_hh: Tensor, grad_out: Tensor | None, grad_h: Tensor | None,
    grad_cn: Tensor | None, *, launcher: Launcher, device_type: str, shared_limit: int, sums: object = None,
    cluster_limit: int = 1,
) -> tuple[Tensor, ...] | None:  # fmt: skip
    """:func:`prepare_backward`, then ``launcher(launch, device)``; shared by the CUDA path and the host
    emulation. ``sums`` (the CPU kernels' parameter sums) must be ``None``: the parameter gradients are the
    caller's GEMMs."""
    if sums is not None:
        raise ValueError("the CUDA backward kernels do not sum the parameter gradients: pass sums=None")
    prepared = prepare_backward(cell, factors, w_hh, grad_out, grad_h, grad_cn, device_type=device_type,
                                shared_limit=shared_limit, cluster_limit=cluster_limit)  # fmt: skip
    if prepared is None:
        return None
    launch, outputs = prepared
    if launch is not None:
        launcher(launch, factors[0].device)
    return outputs


# --------------------------------------------------------------------------------------------------
# CuPy (through the package's one loader, :mod:`.cupy_loader`): availability, the kernels, the launch.
# --------------------------------------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """``(True, "")`` when CuPy and a CUDA device are usable and the kernels load, else ``(False, why)``.

    The first eager call compiles the module (once; CuPy caches the binary on disk). While ``torch.compile``
    traces it only reports what an earlier eager call found: tracing never imports CuPy or compiles.
    """
    ok, reason = cuda.available()  # the scan's kernels: a layer's backward runs them
    return cupy_loader.family_available("the recurrent CUDA kernels", _functions) if ok else (ok, reason)


def source() -> str:
    """``recurrent.cu`` with its headers inlined (CuPy's cache key is the source text: a header edit counts)."""
    text = kernel_path("recurrent.cu").read_text()
    for header in ("cuda_host_emulation.h", "recurrent_emulation.h"):
        text = text.replace(f'#include "{header}"', kernel_path(header).read_text())
    return text


_KERNELS_ON: dict[int, dict] = {}  # device index -> {kernel name: loaded cupy Function}


def _functions(device_index: int) -> dict:
    """The :data:`KERNELS` of ``recurrent.cu``, compiled and loaded on a device once, in the dict that also
    takes the kernels compiled per ``H`` (each launch opts its kernel in beyond 48 KiB of shared memory the
    first time it needs more: :func:`cupy_loader.launch`)."""
    functions = _KERNELS_ON.get(device_index)
    if functions is None:
        code = source()
        functions = {name: cupy_loader.load_function(device_index, code, name) for name in KERNELS}
        _KERNELS_ON[device_index] = functions
    return functions


def _load(device_index: int, launch: Launch) -> tuple[object, Launch]:
    """The function of ``launch`` (compiling its module on first use), and the launch to make with it.

    NVRTC cannot compile inside a CUDA graph capture: a kernel compiled per ``H`` whose first launch is
    captured runs as the shared-memory kernel of the same cell (same arguments, same results), with a
    warning; a warm-up launch before capturing avoids it."""
    functions = _functions(device_index)
    if not launch.options:
        return functions[launch.kernel], launch
    try:
        function = cupy_loader.load_function(device_index, source(), launch.kernel, launch.options)
    except RuntimeError:
        if not torch.cuda.is_current_stream_capturing():
            raise
        generic = launch.kernel.rsplit("_h", 1)[0]  # bppsa_<cell>_<direction>_f32
        cell, direction = generic[len("bppsa_") : -len("_f32")].rsplit("_", 1)
        hidden = launch.args[-1]
        nbytes = (
            _shared_bytes(cell, hidden, 4, fixed=False)
            if direction == "forward"
            else _backward_shared_bytes(cell, hidden, 4, layout=None)
        )
        limit = cupy_loader.shared_limit(device_index)
        if nbytes > limit:  # float32 H beyond what W_hh in shared memory allows (its own layout held part of it)
            raise RuntimeError(
                f"{launch.kernel} is first launched inside a CUDA graph capture, where it cannot be compiled, and "
                f"the shared-memory kernel of H={hidden} needs {nbytes} B of shared memory (the device has "
                f"{limit} B): run the layer once before capturing"
            ) from None
        fallback = dataclasses.replace(
            launch, kernel=generic, grid=launch.grid // launch.cluster, block=32 * math.ceil(hidden / 32),
            shared_bytes=nbytes, options=(), cluster=1,
        )
        warnings.warn(
            f"{launch.kernel} is first launched inside a CUDA graph capture, where it cannot be compiled: "
            f"the capture runs {fallback.kernel} (slower); run the layer once before capturing",
            stacklevel=3,
        )
        return functions[fallback.kernel], fallback
    functions[launch.kernel] = function
    return function, launch


def _launch_cuda(launch: Launch, device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _KERNELS_ON.get(index, _NO_FUNCTIONS).get(launch.kernel)
    if function is None:
        function, launch = _load(index, launch)
    cupy_loader.launch(function, index, launch.grid, launch.block, launch.shared_bytes, launch.args)


_NO_FUNCTIONS: dict = {}


def _forward_cuda(cell: str, gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, c0: Tensor | None):
    if gi.device.type != "cuda" or not available()[0]:
        return None
    index = gi.device.index if gi.device.index is not None else torch.cuda.current_device()
    return forward(cell, gi, w_hh, b_hh, h0, c0, launcher=_launch_cuda, device_type="cuda",
                   shared_limit=cupy_loader.shared_limit(index), cluster_limit=cupy_loader.cluster_limit(index))  # fmt: skip


def rnn_forward(
    gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, relu: bool
) -> tuple[Tensor] | None:
    """Elman RNN layer on CUDA: ``(out,)``, ``(B, T, H)``; ``None`` where the kernel cannot run."""
    return _forward_cuda("rnn_relu" if relu else "rnn_tanh", gi, w_hh, b_hh, h0, None)


def gru_forward(
    gi: Tensor, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """GRU layer on CUDA: ``(out, scales (B,T,3H), z, dn)``; ``None`` where the kernel cannot run."""
    return _forward_cuda("gru", gi, w_hh, b_hh, h0, None)


def lstm_forward(gi: Tensor, w_hh: Tensor, h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """LSTM layer on CUDA: ``(out, cells (B,T,H), gates (B,T,4H))``; ``None`` where the kernel cannot run."""
    return _forward_cuda("lstm", gi, w_hh, None, h0, c0)



def _backward_cuda(cell: str, factors: tuple, w_hh, grad_out, grad_h, grad_cn, sums) -> tuple[Tensor, ...] | None:
    first = factors[0]
    if first.device.type != "cuda" or not available()[0]:
        return None
    index = first.device.index if first.device.index is not None else torch.cuda.current_device()
    return backward(cell, factors, w_hh, grad_out, grad_h, grad_cn, launcher=_launch_cuda, device_type="cuda",
                    shared_limit=cupy_loader.shared_limit(index), sums=sums,
                    cluster_limit=cupy_loader.cluster_limit(index))  # fmt: skip


def rnn_backward(
    out: Tensor, w_hh: Tensor, grad_out: Tensor | None, relu: bool, sums: object = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:  # fmt: skip
    """Elman RNN backward on CUDA: ``(d_a (B,T,H), gh0 (B,H))``, the arguments of the CPU kernels'
    :func:`lightning_bppsa.kernels.recurrent.rnn_backward` (``sums`` must be ``None``: the parameter gradients
    are the caller's GEMMs; ``keep_gate_grads`` is moot: the gate gradients are always returned); ``None``
    where the kernel cannot run."""
    return _backward_cuda("rnn_relu" if relu else "rnn_tanh", (out,), w_hh, grad_out, grad_h, None, sums)


def gru_backward(
    scales: Tensor, z: Tensor, dn: Tensor, w_hh: Tensor, grad_out: Tensor | None, sums: object = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """GRU backward on CUDA: ``(d_gi, d_gh (B,T,3H), gh0 (B,H))``, as :func:`rnn_backward` for the CPU kernels'
    :func:`lightning_bppsa.kernels.recurrent.gru_backward`."""
    return _backward_cuda("gru", (scales, z, dn), w_hh, grad_out, grad_h, None, sums)


def lstm_backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_cn: Tensor | None,
    sums: object = None, keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """LSTM backward on CUDA: ``(d_gates (B,T,4H), gh0 (B,H), gc0 (B,H))``, as :func:`rnn_backward` for the CPU
    kernels' :func:`lightning_bppsa.kernels.recurrent.lstm_backward`."""
    return _backward_cuda("lstm", (gates, cells, c0), w_hh, grad_out, grad_h, grad_cn, sums)
