"""Compiled CPU kernels for whole recurrent layers (one layer, one direction): ``recurrent.c``.

A forward emits the states **and** the Jacobian factors of every step in one pass; a backward runs the
gradient recurrence (the BPPSA linear scan over the factored step Jacobians, paper Sec. 4.1 / App. E)
with the gate pre-activation gradients in the same pass. For small layers the backward also sums the
parameter gradients of Eq. 2 in that pass (:class:`ParameterSums`, :func:`sums_parameters`); otherwise
the caller runs the GEMMs over all steps with the returned ``d_*``.

All tensors are batch-major ``(B, T, ·)``, float32 or float64, on the CPU; weights as torch stores them
(``w_hh`` ``(G H, H)``, gate order ``GRU: r, z, n``; ``LSTM: i, f, g, o``). ``gi`` is the input projection
``x W_ihᵀ + b_ih`` (for RNN and LSTM with ``b_hh`` added in too; the GRU's ``b_hh`` sits inside
``r ⊙ (·)`` and is passed on its own): a tensor the caller computed with one GEMM, or for narrow inputs a
:class:`Projection` the forward computes row by row (:func:`projects_inputs`). Rows are split over the
threads in whole pairs and every row takes the same code path, so results are bitwise the same for any
thread count.

Every function returns ``None`` when the kernel cannot run (no compiler or ``BPPSA_NATIVE=0``, a dtype
other than float32 / float64, a tensor not on the CPU, mixed dtypes): the caller then runs its torch code.
A shape that does not fit raises :class:`ValueError` naming the argument.

Accuracy: float64 uses libm (matches torch to ~1e-15 relative per step). float32 uses vectorised
``tanh`` / ``sigmoid`` approximations (:func:`fast_tanh`, :func:`fast_sigmoid`; a few ulp, measured in
``tests/kernels/test_recurrent.py``) instead of libm's scalar ones. Denormals are flushed to zero
inside the kernels. Built with the shared CPU build (:mod:`lightning_bppsa.kernels._native`) plus
``-ffp-contract=fast`` (FMA) and ``-fno-trapping-math`` (lets gcc vectorise the branch-free selects);
no ``-ffast-math``, so NaN propagates as in torch.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
from lightning_bppsa.kernels import _native
from torch import Tensor

__all__ = [
    "ParameterSums",
    "Projection",
    "available",
    "fast_sigmoid",
    "fast_tanh",
    "gru_backward",
    "gru_forward",
    "lstm_backward",
    "lstm_forward",
    "rnn_backward",
    "projects_inputs",
    "rnn_forward",
    "sums_parameters",
]

log = logging.getLogger(__name__)

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
#: a backward's parameter-gradient tail: inputs, x, out, h0, grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh
_SUMS = [_I64] + [_PTR] * 7
#: a forward's input-projection tail: inputs, x, w_ih, b_in
_PROJECTION = [_I64] + [_PTR] * 3
# (batch, steps, hidden) then pointers (with the relu flag where it applies), then the thread count
_ARGTYPES = {
    "rnn_forward": [_I64] * 3 + [_PTR] * 4 + [_INT] + [_PTR] + _PROJECTION + [_INT],
    "rnn_backward": [_I64] * 3 + [_PTR] * 4 + [_INT] + [_PTR] * 2 + _SUMS + [_INT],
    "gru_forward": [_I64] * 3 + [_PTR] * 8 + _PROJECTION + [_INT],
    "gru_backward": [_I64] * 3 + [_PTR] * 9 + _SUMS + [_INT],
    "lstm_forward": [_I64] * 3 + [_PTR] * 7 + _PROJECTION + [_INT],
    "lstm_backward": [_I64] * 3 + [_PTR] * 10 + _SUMS + [_INT],
}
_SIGNATURES = {
    **{f"bppsa_{name}_{s}": args for name, args in _ARGTYPES.items() for s in _SUFFIX.values()},
    **{f"bppsa_{name}_f32": [_I64, _PTR, _PTR] for name in ("tanh", "sigmoid")},
}

def _load() -> ctypes.CDLL | None:
    return _native.load(
        "bppsa_recurrent",
        "recurrent.c",
        _SIGNATURES,
        logger=log,
        fallback="The recurrent layers run their torch code",
        extra_flags=("-ffp-contract=fast", "-fno-trapping-math"),
        depends=("recurrent_impl.h", "activations.h"),
    )


_LIBRARY = _native.LazyLibrary(_load)
_library = _LIBRARY.get


def available() -> bool:
    """Whether the compiled kernels can be used (compiles them on the first call).

    While ``torch.compile`` traces it only reports what an earlier eager call found.
    """
    return _LIBRARY.available()


class ParameterSums(NamedTuple):
    """What a backward needs to also sum the parameter gradients over all steps in its sweep (Eq. 2):
    ``x`` ``(B, T, I)``, the forward's ``out`` ``(B, T, H)`` (``h_1..h_T``), ``h0`` ``(B, H)``, and
    whether the layer has biases. The backward then returns, last, ``[grad_W_ih, grad_W_hh(, grad_b_ih,
    grad_b_hh)]`` in torch's layouts, and its gate gradients only where asked (``keep_gate_grads``)."""

    x: Tensor
    out: Tensor
    h0: Tensor
    bias: bool


#: elements of one 256-bit vector: the padding unit of the kernels' rows
_LANES = {torch.float32: 8, torch.float64: 4}

#: the partial sums' elements per pair of rows up to which the backward sums the parameter gradients itself.
#: Measured (backward op summing vs the gate gradients written out and two GEMMs, B=16 T=1000, one thread,
#: float32, AMD EPYC, 2026-11-24): RNN H=20: 1.7 vs 4.7 ms, H=64 (4288 elements): 8.6 vs 12.6, H=80 (6640):
#: 11.2 vs 12.0; RNN H=64 input 38 (6656): 10.9 vs 11.3; GRU H=20 input 12: 6.5 vs 9.0, input 38: 8.4 vs 13.1;
#: LSTM H=16: 5.6 vs 6.6, H=32 input 12 (5888): 11.9 vs 12.6. The sums are small products per pair of rows,
#: where a GEMM over all steps at once runs near the FMA rate once the layer is wide.
_SUMS_ELEMENTS = 7000


def sums_parameters(hidden: int, inputs: int, gates: int, dtype: torch.dtype) -> bool:
    """Whether a backward should sum the parameter gradients in its sweep (:class:`ParameterSums`) rather
    than leave them to GEMMs over all steps: small layers, whose GEMMs over ``B T`` rows this thin run far
    below the core's FMA rate and need the gate gradients written out and read back first."""
    padded = -(-gates * hidden // _LANES[dtype]) * _LANES[dtype]
    return (hidden + inputs + 2) * padded <= _SUMS_ELEMENTS


def _sums_args(sums: ParameterSums | None, gates: int, hidden: int, like: Tensor) -> tuple[list, list[Tensor]]:
    """The kernel's parameter-gradient tail of arguments and the gradients it fills (none without ``sums``)."""
    if sums is None:
        return [0] + [None] * 7, []
    batch, steps, inputs = sums.x.shape
    _check("out", sums.out, (batch, steps, hidden))
    _check("h0", sums.h0, (batch, hidden))
    grads = [like.new_empty(gates * hidden, inputs), like.new_empty(gates * hidden, hidden)]
    grads += [like.new_empty(gates * hidden), like.new_empty(gates * hidden)] if sums.bias else [None, None]
    args = [inputs, _dense(sums.x), _dense(sums.out), _dense(sums.h0), *grads]
    return args, [g for g in grads if g is not None]


class Projection(NamedTuple):
    """In place of a forward's ``gi``: the input projection ``x W_ihᵀ + bias`` for the kernel to compute
    row by row (``x`` ``(B, T, I)``, ``w_ih`` ``(G H, I)``, ``bias`` ``(G H,)`` or ``None``), see
    :func:`projects_inputs`."""

    x: Tensor
    w_ih: Tensor
    bias: Tensor | None


#: the widest input the forward kernels project themselves. Measured (forward op with the projection vs an
#: addmm for gi, B=16 T=1034 H=20, one thread, float32, AMD EPYC, 2026-11-24): GRU input 12: 3.5 vs 3.8 ms,
#: 24: 3.8 vs 4.2, 38: 4.7 vs 4.7; LSTM 12: 4.6 vs 9.9, 38: 6.5 vs 10.8. A wide input's projection is a
#: GEMM that runs near the FMA rate; a narrow one's is a thin one that does not.
_PROJECTION_INPUTS = 40


def projects_inputs(inputs: int) -> bool:
    """Whether a forward kernel should compute the input projection itself (a :class:`Projection`): for
    narrow inputs a few FMAs per gate beat writing ``gi`` ``(B, T, G H)`` out and reading it back."""
    return inputs <= _PROJECTION_INPUTS


def _input(gi: Tensor | Projection, gates: int) -> tuple[tuple[int, int, int], Tensor, Tensor | None, list]:
    """``((B, T, H), a tensor to allocate like, gi or None, the projection's tail of kernel arguments)``."""
    if isinstance(gi, Projection):
        x, w_ih, bias = gi
        if x.dim() != 3 or w_ih.dim() != 2 or w_ih.shape[0] % gates or w_ih.shape[0] == 0:
            raise ValueError(f"projection: x must be (B, T, I) and w_ih ({gates} H, I); got {tuple(x.shape)}, "
                             f"{tuple(w_ih.shape)}")  # fmt: skip
        batch, steps, inputs = x.shape
        _check("w_ih", w_ih, (w_ih.shape[0], inputs))
        _check("bias", bias, (w_ih.shape[0],))
        return (batch, steps, w_ih.shape[0] // gates), x, None, [inputs, _dense(x), _dense(w_ih), _dense(bias)]
    return _sizes("gi", gi, gates), gi, _dense(gi), [0, None, None, None]


def _check(name: str, tensor: Tensor | None, shape: Sequence[int]) -> None:
    if tensor is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")


def _kernel(name: str, *tensors: Tensor | None):
    """The compiled function for the tensors' common dtype, or ``None`` if the kernel cannot run on them."""
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX:
        return None
    for t in tensors:  # a plain loop: this runs on every call of a layer (a generator costs ~3 µs more)
        if t is not None and (t.dtype != dtype or not t.is_cpu or t.layout != torch.strided):
            return None
    lib = _library()
    return None if lib is None else getattr(lib, f"bppsa_{name}_{_SUFFIX[dtype]}")


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _dense(t: Tensor | None) -> Tensor | None:
    """``t`` with its elements dense in memory (the kernels read raw pointers); ``t`` itself when they are."""
    return t if t is None or t.is_contiguous() else t.detach().contiguous()


def _run(fn, batch: int, steps: int, hidden: int, *args) -> None:
    """Call a kernel: tensors as pointers, the thread count last; raise if it ran out of memory."""
    pointers = [a if a is None or isinstance(a, int) else _ptr(a) for a in args]
    if fn(batch, steps, hidden, *pointers, _native.threads(batch)):
        raise MemoryError("lightning_bppsa: the recurrent kernel could not allocate its buffers")


def _sizes(name: str, tensor: Tensor, width_per_hidden: int) -> tuple[int, int, int]:
    """``(B, T, H)`` of a ``(B, T, G H)`` tensor."""
    if tensor.dim() != 3 or tensor.shape[2] % width_per_hidden or tensor.shape[2] == 0:
        raise ValueError(
            f"{name} must have shape (B, T, {width_per_hidden} H) with H >= 1, got {tuple(tensor.shape)}"
        )
    batch, steps, width = tensor.shape
    return batch, steps, width // width_per_hidden


def rnn_forward(
    gi: Tensor | Projection, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor, relu: bool
) -> tuple[Tensor] | None:
    """Elman RNN forward ``h_t = f(gi_t + h_{t-1} W_hhᵀ [+ b_hh])``, ``f = relu if relu else tanh``.

    Args: ``gi`` ``(B, T, H)`` (or a :class:`Projection` of the inputs), ``w_hh`` ``(H, H)``, ``b_hh``
    ``(H,)`` or ``None``, ``h0`` ``(B, H)``.

    Returns ``(out,)``, ``(B, T, H)``: ``out[:, t] = h_{t+1}``. No factor: the backward's ``f'`` is a
    function of ``out`` (:func:`rnn_backward`).
    """
    (batch, steps, hidden), like, gi, tail = _input(gi, 1)
    _check("w_hh", w_hh, (hidden, hidden))
    _check("b_hh", b_hh, (hidden,))
    _check("h0", h0, (batch, hidden))
    fn = _kernel("rnn_forward", like, gi, w_hh, b_hh, h0, *tail[2:])
    if fn is None:
        return None
    out = like.new_empty(batch, steps, hidden)
    _run(fn, batch, steps, hidden, gi, _dense(w_hh), _dense(b_hh), _dense(h0), int(relu), out, *tail)
    return (out,)


def rnn_backward(
    out: Tensor, w_hh: Tensor, grad_out: Tensor | None, relu: bool, sums: ParameterSums | None = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple | None:
    """Elman RNN backward: ``g_T = grad_out[:, T-1] + grad_h``, ``d_a_t = g_t ⊙ f'_t``,
    ``g_{t-1} = d_a_t W_hh + grad_out[:, t-2]`` (none for ``h_0``), with ``f'`` from the states ``out``:
    ``1 - h²`` for tanh; for relu ``d_a`` selects like torch's ``threshold_backward`` (0 where ``h <= 0``,
    even for a NaN ``g``; a NaN ``h`` passes the gradient).

    Args: ``out`` (the forward's states), ``grad_out`` ``(B, T, H)`` or ``None`` (zero); ``w_hh``
    ``(H, H)``; ``sums``: see :class:`ParameterSums`; ``grad_h`` ``(B, H)`` or ``None``: a gradient of the
    last state besides ``grad_out``'s (e.g. of a separate ``h_n`` output).
    Returns ``(d_a (B, T, H), g0 (B, H) = ∇h_0)`` (``d_a`` ``None`` unless ``keep_gate_grads``), then with
    ``sums`` the parameter gradients.
    """
    batch, steps, hidden = _sizes("out", out, 1)
    _check("w_hh", w_hh, (hidden, hidden))
    _check("grad_out", grad_out, (batch, steps, hidden))
    _check("grad_h", grad_h, (batch, hidden))
    fn = _kernel("rnn_backward", out, w_hh, grad_out, grad_h, *(sums[:3] if sums else ()))
    if fn is None:
        return None
    tail, grads = _sums_args(sums, 1, hidden, out)
    d_a = out.new_empty(batch, steps, hidden) if keep_gate_grads or sums is None else None
    g0 = out.new_empty(batch, hidden)
    dense = map(_dense, (out, w_hh, grad_out, grad_h))
    _run(fn, batch, steps, hidden, *dense, int(relu), d_a, g0, *tail)
    return (d_a, g0, grads) if sums else (d_a, g0)


def gru_forward(
    gi: Tensor | Projection, w_hh: Tensor, b_hh: Tensor | None, h0: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """GRU forward (torch's gate order ``r, z, n``)::

        gh = h W_hhᵀ + b_hh,  r = σ(gi_r + gh_r),  z = σ(gi_z + gh_z),  n = tanh(gi_n + r ⊙ gh_n)
        h = (1 - z) ⊙ n + z ⊙ h_prev,  dn = (1 - z)(1 - n²)

    Args: ``gi`` ``(B, T, 3H)`` (or a :class:`Projection`), ``w_hh`` ``(3H, H)``, ``b_hh`` ``(3H,)`` or ``None``, ``h0`` ``(B, H)``.

    Returns ``(out (B, T, H), scales (B, T, 3H), z (B, T, H), dn (B, T, H))`` with
    ``scales = [dn gh_n r(1-r), (h_prev - n) z(1-z), dn r]``: ``FactoredJacobians(w_hh, scales, z)`` is the
    chain of :func:`lightning_bppsa.jacobians.recurrent.gru_jacobians`.
    """
    (batch, steps, hidden), like, gi, tail = _input(gi, 3)
    _check("w_hh", w_hh, (3 * hidden, hidden))
    _check("b_hh", b_hh, (3 * hidden,))
    _check("h0", h0, (batch, hidden))
    fn = _kernel("gru_forward", like, gi, w_hh, b_hh, h0, *tail[2:])
    if fn is None:
        return None
    out, z, dn = (like.new_empty(batch, steps, hidden) for _ in range(3))
    scales = like.new_empty(batch, steps, 3 * hidden)
    _run(fn, batch, steps, hidden, gi, _dense(w_hh), _dense(b_hh), _dense(h0), out, scales, z, dn, *tail)
    return out, scales, z, dn


def gru_backward(
    scales: Tensor, z: Tensor, dn: Tensor, w_hh: Tensor, grad_out: Tensor | None, sums: ParameterSums | None = None,
    keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple | None:
    """GRU backward: ``g_{t-1} = g_t ⊙ z_t + (tile(g_t, 3) ⊙ scales_t) W_hh + grad_out[:, t-2]``.

    Args: :func:`gru_forward`'s ``scales``, ``z``, ``dn``; ``w_hh`` ``(3H, H)``; ``grad_out`` ``(B, T, H)``.

    Returns ``(d_gi, d_gh, g0)``: ``d_gh_t = tile(g_t, 3) ⊙ scales_t`` ``(B, T, 3H)`` (the gradient of
    ``h W_hhᵀ + b_hh``), ``d_gi`` the same except the n block, ``g_t ⊙ dn_t`` (the gradient of ``gi``),
    and ``g0 = ∇h_0`` ``(B, H)``. With ``sums`` (:class:`ParameterSums`): ``d_gh`` is ``None`` and ``d_gi``
    too unless ``keep_gate_grads``, then the parameter gradients last. ``grad_out`` / ``grad_h``: as
    :func:`rnn_backward`'s.
    """
    batch, steps, hidden = _sizes("scales", scales, 3)
    for name, tensor in (("z", z), ("dn", dn), ("grad_out", grad_out)):
        _check(name, tensor, (batch, steps, hidden))
    _check("w_hh", w_hh, (3 * hidden, hidden))
    _check("grad_h", grad_h, (batch, hidden))
    fn = _kernel("gru_backward", scales, z, dn, w_hh, grad_out, grad_h, *(sums[:3] if sums else ()))
    if fn is None:
        return None
    tail, grads = _sums_args(sums, 3, hidden, scales)
    d_gh = scales.new_empty(batch, steps, 3 * hidden) if sums is None else None
    d_gi = scales.new_empty(batch, steps, 3 * hidden) if keep_gate_grads or sums is None else None
    g0 = scales.new_empty(batch, hidden)
    _run(fn, batch, steps, hidden, *map(_dense, (scales, z, dn, w_hh, grad_out, grad_h)), d_gh, d_gi, g0, *tail)
    return (d_gi, d_gh, g0, grads) if sums else (d_gi, d_gh, g0)


def lstm_forward(gi: Tensor | Projection, w_hh: Tensor, h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """LSTM forward (gate order ``i, f, g, o``; ``gi`` holds both biases)::

        [i, f, g, o] = [σ, σ, tanh, σ](gi + h W_hhᵀ),  c = f ⊙ c_prev + i ⊙ g,  h = o ⊙ tanh(c)

    Args: ``gi`` ``(B, T, 4H)`` (or a :class:`Projection`), ``w_hh`` ``(4H, H)``, ``h0`` and ``c0`` ``(B, H)``.
    Returns ``(out (B, T, H), cells (B, T, H) = c_1..c_T, gates (B, T, 4H) = activated i, f, g, o)``.
    """
    (batch, steps, hidden), like, gi, tail = _input(gi, 4)
    _check("w_hh", w_hh, (4 * hidden, hidden))
    _check("h0", h0, (batch, hidden))
    _check("c0", c0, (batch, hidden))
    fn = _kernel("lstm_forward", like, gi, w_hh, h0, c0, *tail[2:])
    if fn is None:
        return None
    out, cells = like.new_empty(batch, steps, hidden), like.new_empty(batch, steps, hidden)
    gates = like.new_empty(batch, steps, 4 * hidden)
    _run(fn, batch, steps, hidden, gi, *map(_dense, (w_hh, h0, c0)), out, cells, gates, *tail)
    return out, cells, gates


def lstm_backward(
    gates: Tensor, cells: Tensor, c0: Tensor, w_hh: Tensor, grad_out: Tensor | None, grad_cn: Tensor | None,
    sums: ParameterSums | None = None, keep_gate_grads: bool = True, grad_h: Tensor | None = None,
) -> tuple | None:
    """LSTM backward: the structured recursion over ``(h, c)``, from ``gh_T = grad_out[:, T-1]``,
    ``gc_T = grad_cn``::

        gc_tot = gc + gh ⊙ o ⊙ (1 - tanh² c)
        d_gates = [gc_tot g i(1-i), gc_tot c_prev f(1-f), gc_tot i (1-g²), gh tanh(c) o(1-o)]
        gh_prev = d_gates W_hh + grad_out[:, t-2],  gc_prev = gc_tot ⊙ f

    Args: :func:`lstm_forward`'s ``gates`` ``(B, T, 4H)`` and ``cells`` ``(B, T, H)``; ``c0`` ``(B, H)``;
    ``w_hh`` ``(4H, H)``; ``grad_out`` ``(B, T, H)`` or ``None`` (no gradient on the outputs);
    ``grad_cn`` ``(B, H)`` or ``None`` (none on ``c_T``).
    Returns ``(d_gates (B, T, 4H), gh0 (B, H), gc0 (B, H))``; with ``sums`` (:class:`ParameterSums`)
    ``d_gates`` is ``None`` unless ``keep_gate_grads``, and the parameter gradients come last; ``grad_h``:
    as :func:`rnn_backward`'s.
    """
    batch, steps, hidden = _sizes("gates", gates, 4)
    _check("cells", cells, (batch, steps, hidden))
    _check("c0", c0, (batch, hidden))
    _check("w_hh", w_hh, (4 * hidden, hidden))
    _check("grad_out", grad_out, (batch, steps, hidden))
    _check("grad_cn", grad_cn, (batch, hidden))
    _check("grad_h", grad_h, (batch, hidden))
    fn = _kernel("lstm_backward", gates, cells, c0, w_hh, grad_out, grad_h, grad_cn, *(sums[:3] if sums else ()))
    if fn is None:
        return None
    tail, grads = _sums_args(sums, 4, hidden, gates)
    d_gates = gates.new_empty(batch, steps, 4 * hidden) if keep_gate_grads or sums is None else None
    gh0, gc0 = gates.new_empty(batch, hidden), gates.new_empty(batch, hidden)
    _run(
        fn, batch, steps, hidden, *map(_dense, (gates, cells, c0, w_hh, grad_out, grad_h, grad_cn)), d_gates, gh0, gc0,
        *tail,
    )
    return (d_gates, gh0, gc0, grads) if sums else (d_gates, gh0, gc0)


def _activation(name: str, x: Tensor) -> Tensor | None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or _library() is None:
        return None
    x = x.detach().contiguous()
    y = torch.empty_like(x)
    getattr(_library(), f"bppsa_{name}_f32")(x.numel(), x.data_ptr(), y.data_ptr())
    return y


def fast_tanh(x: Tensor) -> Tensor | None:
    """The kernels' float32 ``tanh`` over a float32 CPU tensor (``None`` otherwise, or without the kernel).

    ``|x| < 0.625``: ``x + x³ P(x²)`` (P fitted for relative error); else ``1 - 2 / (exp(2|x|) + 1)`` with
    a Cody-Waite ``exp``. NaN gives NaN.
    """
    return _activation("tanh", x)


def fast_sigmoid(x: Tensor) -> Tensor | None:
    """The kernels' float32 ``sigmoid = 1 / (1 + exp(-x))`` (as :func:`fast_tanh`); below ``x = -88`` the
    result would be a denormal and is flushed to zero, as inside the kernels."""
    return _activation("sigmoid", x)
