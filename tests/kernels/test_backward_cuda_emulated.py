"""The CUDA backward kernels (``bppsa_<cell>_backward_*`` in ``kernels/recurrent.cu``) on the CPU through the
host emulation: the same source and launch (``recurrent_cuda.prepare_backward``) as on a GPU.

The gradients are torch autograd's through its own layer (``torch._VF.rnn_tanh / rnn_relu / gru / lstm``) in
float64: the layer's input is the gate pre-activation itself (``W_ih = I``, no bias), so that autograd's
gradient of the input IS the kernel's ``d_gi``; ``d_gh`` is checked through ``W_hh``'s gradient (``d_ghᵀ
h_prev`` summed over the steps), beside the gradients of ``h0`` (and ``c0``). The forward factors come from
the emulated CUDA forward kernels. Float32 within ``assert_derived_close`` of the float64 truth, torch's
float32 autograd as the baseline. The sanitized launches (ASan, TSan: the double-buffered gate gradients) are
in ``recurrent_cuda_sanitize.cpp``; the compile gates in ``test_recurrent_cuda_emulated.py`` cover the kernels.
"""

from __future__ import annotations

import functools
import math
import shutil
import types

import pytest
import torch
from lightning_bppsa.kernels import recurrent_cuda
from lightning_bppsa.kernels import recurrent_emulated as emulated

from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")

CELLS = tuple(recurrent_cuda.CELLS)
NAMES = ("d_gi", "grad_w_hh", "grad_h0", "grad_c0")


def make_inputs(cell: str, batch: int, steps: int, hidden: int, seed: int, given: bool) -> dict:
    """Random float64 pre-activations ``gi``, ``W_hh``, initial states and (``given``) upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    gates = recurrent_cuda.CELLS[cell]

    def rand(*shape, scale=1.0):
        return (2 * torch.rand(*shape, dtype=torch.float64, generator=gen) - 1) * scale

    lstm = cell == "lstm"
    return {
        "gi": rand(batch, steps, gates * hidden, scale=1.5),
        "w_hh": rand(gates * hidden, hidden, scale=1.5 / hidden**0.5),
        "h0": rand(batch, hidden),
        "c0": rand(batch, hidden) if lstm else None,
        "grad_out": rand(batch, steps, hidden) if given else None,
        "grad_h": rand(batch, hidden) if given else None,
        "grad_cn": rand(batch, hidden) if given and lstm else None,
    }


def _given(p: dict, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``p[name]`` in ``dtype``; the gradient of ``h_T`` is ones where none is given (the loss ``sum(h_T)``)."""
    return p[name].to(dtype) if p[name] is not None else torch.ones_like(p["h0"], dtype=dtype)


def autograd(cell: str, p: dict, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Torch's ``[d_gi, grad W_hh, grad h0, grad c0 (LSTM) or None]`` in ``dtype``."""
    hidden = p["w_hh"].shape[1]
    leaves = [p[k].to(dtype).requires_grad_() for k in ("gi", "w_hh", "h0")]
    gi, w_hh, h0 = leaves
    eye = torch.eye(gi.shape[-1], dtype=dtype, device=gi.device)
    # train=True (no dropout: 0.0): cuDNN refuses the backward of a layer run in eval mode
    if cell == "lstm":
        c0 = p["c0"].to(dtype).requires_grad_()
        leaves.append(c0)
        out, h_n, c_n = torch._VF.lstm(gi, (h0[None], c0[None]), [eye, w_hh], False, 1, 0.0, True, False, True)
    else:
        fn = {"rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu, "gru": torch._VF.gru}[cell]
        out, h_n = fn(gi, h0[None], [eye, w_hh], False, 1, 0.0, True, False, True)
    assert out.shape[-1] == hidden
    loss = (h_n[0] * _given(p, "grad_h", dtype)).sum()
    if p["grad_out"] is not None:
        loss = loss + (out * p["grad_out"].to(dtype)).sum()
    if p["grad_cn"] is not None:
        loss = loss + (c_n[0] * p["grad_cn"].to(dtype)).sum()
    grads = list(torch.autograd.grad(loss, leaves))
    return grads if cell == "lstm" else [*grads, None]


def kernel(cell: str, p: dict, dtype: torch.dtype, kernels=emulated, to=lambda t: t) -> list[torch.Tensor | None]:
    """The forward kernel's factors, then the backward kernel of ``kernels``, on the tensors ``to`` places:
    ``[d_gi, grad W_hh, grad h0, grad c0 or None]`` on the CPU (``grad W_hh = Σ d_ghᵀ h_prev``)."""
    t = {k: None if v is None else to(v.to(dtype)) for k, v in p.items()}
    grad_h = to(_given(p, "grad_h", dtype))
    if cell == "lstm":
        out, cells, gates = kernels.lstm_forward(t["gi"], t["w_hh"], t["h0"], t["c0"])
        result = kernels.lstm_backward(gates, cells, t["c0"], t["w_hh"], t["grad_out"], t["grad_cn"],
                                       grad_h=grad_h)  # fmt: skip
        d_gi, d_gh, states = result[0], result[0], result[1:]
    elif cell == "gru":
        out, scales, z, dn = kernels.gru_forward(t["gi"], t["w_hh"], None, t["h0"])
        result = kernels.gru_backward(scales, z, dn, t["w_hh"], t["grad_out"], grad_h=grad_h)
        d_gi, d_gh, states = result[0], result[1], result[2:]
    else:
        (out,) = kernels.rnn_forward(t["gi"], t["w_hh"], None, t["h0"], cell == "rnn_relu")
        result = kernels.rnn_backward(out, t["w_hh"], t["grad_out"], cell == "rnn_relu", grad_h=grad_h)
        d_gi, d_gh, states = result[0], result[0], result[1:]
    h_prev = torch.cat([t["h0"][:, None], out[:, :-1]], 1)
    grad_w_hh = d_gh.reshape(-1, d_gh.shape[-1]).T @ h_prev.reshape(-1, h_prev.shape[-1])
    found = [d_gi, grad_w_hh, *states, *([None] if cell != "lstm" else [])]
    return [None if g is None else g.cpu() for g in found]


def check(cell: str, p: dict, dtype: torch.dtype, **kernel_args) -> None:
    actual = kernel(cell, p, dtype, **kernel_args)
    reference = autograd(cell, p, torch.float64)
    baseline = autograd(cell, p, dtype) if dtype != torch.float64 else [None] * 4
    floor = 1e-12 if dtype == torch.float64 else 1e-6
    for name, a, r, b in zip(NAMES, actual, reference, baseline, strict=True):
        if r is None:
            assert a is None
            continue
        assert a.dtype == dtype
        assert_derived_close(a, r, None if b is None else b.cpu(), floor=floor, name=f"{cell} {name}")


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize(("batch", "steps"), [(1, 1), (3, 6)])
@pytest.mark.parametrize("hidden", [1, 7, 20, 33, 70])  # one warp; several (H = 70: three, __syncthreads)
@pytest.mark.parametrize("cell", CELLS)
def test_float64_matches_autograd(cell, hidden, batch, steps, given):
    p = make_inputs(cell, batch, steps, hidden, seed=hidden * 10 + steps, given=given)
    check(cell, p, torch.float64, kernels=emulated)


@pytest.mark.parametrize("hidden", [5, 32, 40])
@pytest.mark.parametrize("cell", CELLS)
def test_float32_within_derived_tolerance(cell, hidden):
    check(cell, make_inputs(cell, 2, 37, hidden, seed=hidden, given=True), torch.float32)


#: float32 widths above a warp, by how the kernel compiled for them holds W_hh (recurrent_cuda.wide_layout):
#: ``(cell, H, lanes a unit, part of it in shared memory)``: several warps of one lane a unit, two lanes a unit
#: (their partial products meet by shuffles), the widest RNN in registers alone, and wider ones whose lanes
#: hold the rest of their share in shared memory
LAYOUTS = [("rnn_tanh", 33, 1, False), ("rnn_relu", 100, 1, False), ("rnn_tanh", 192, 2, False),
           ("rnn_tanh", 256, 1, True), ("gru", 40, 1, False), ("gru", 60, 2, False), ("gru", 110, 2, True),
           ("lstm", 40, 2, False), ("lstm", 96, 2, True)]  # fmt: skip


@pytest.fixture
def launched(monkeypatch) -> list:
    """The launches ``recurrent_cuda.prepare_backward`` computes in the test, in order."""
    launches = []
    real = recurrent_cuda.prepare_backward

    def prepare_backward(*args, **kwargs):
        prepared = real(*args, **kwargs)
        launches.append(prepared[0])
        return prepared

    monkeypatch.setattr(recurrent_cuda, "prepare_backward", prepare_backward)
    return launches


@pytest.mark.parametrize(("cell", "hidden", "split", "hybrid"), LAYOUTS)
def test_float32_register_kernels_split_over_lanes(launched, cell, hidden, split, hybrid):
    layout = recurrent_cuda.wide_layout(cell, hidden)
    assert (layout.split, layout.register_packs < layout.lane_packs) == (split, hybrid)
    check(cell, make_inputs(cell, 2, 9, hidden, seed=hidden, given=True), torch.float32)
    (launch,) = launched
    assert (launch.kernel, launch.block) == (f"bppsa_{cell}_backward_f32_h{hidden}", 32 * -(-hidden * split // 32))
    assert launch.options == recurrent_cuda.wide_options(cell, hidden, layout)


#: ``(cell, H, shared memory a block, blocks a cluster, part of W_hh in shared memory)``: backward kernels run as a
#: cluster of blocks a row (sm_90) at small H (a small block budget forces them): two blocks holding part of
#: each unit's column in shared memory, four with uneven shares (130 units = 3 x 33 + 31; 150 = 3 x 38 + 36)
#: in registers alone and in part in shared memory, and eight; and an RNN wider than one block's 256 threads at
#: an H100's budget (two blocks of 150 units, part of their columns in shared memory)
CLUSTER_CASES = [("gru", 130, 48 * 1024, 2, True), ("gru", 130, 8 * 1024, 4, False),
                 ("lstm", 150, 48 * 1024, 4, True), ("lstm", 150, 8 * 1024, 8, False),
                 ("rnn_tanh", 300, 232448, 2, True)]  # fmt: skip


@pytest.mark.parametrize(("cell", "hidden", "limit", "cluster", "hybrid"), CLUSTER_CASES)
def test_float32_cluster_kernels(launched, cell, hidden, limit, cluster, hybrid):
    """Each block of a row's cluster owns ceil(H / cluster) units' columns of W_hh and writes its units' entries
    of the row r_t into every block's row buffer (distributed shared memory) before the cluster barrier, the
    gate gradients after its arrival; the forward's factors come from its cluster kernel too."""
    layout = recurrent_cuda.cluster_layout(cell, hidden, "backward", limit, 8)
    assert (layout.cluster, layout.register_packs < layout.lane_packs) == (cluster, hybrid)
    on_sm90 = {name: functools.partial(getattr(emulated, name), shared_limit=limit, cluster_limit=8)
               for name in ("rnn_forward", "rnn_backward", "gru_forward", "gru_backward", "lstm_forward",
                            "lstm_backward")}  # fmt: skip
    check(cell, make_inputs(cell, 2, 9, hidden, seed=hidden, given=True), torch.float32,
          kernels=types.SimpleNamespace(**on_sm90))  # fmt: skip
    (launch,) = launched
    assert (launch.kernel, launch.grid, launch.cluster) == (f"bppsa_{cell}_backward_f32_h{hidden}_c{cluster}", 2 * cluster,
                                                            cluster)  # fmt: skip
    assert launch.block == 32 * math.ceil(math.ceil(hidden / cluster) * layout.split / 32)
    assert launch.shared_bytes <= limit and launch.options[-1] == f"-DBPPSA_REC_CLUSTER={cluster}"


def test_relu_passes_the_gradient_through_a_nan_state_as_torch():
    """Torch's ReLU backward selects (``threshold_backward``): where ``h`` is NaN the gradient passes, where
    ``h <= 0`` it is 0 even for a NaN gradient; a product with a mask would give NaN both times."""
    out = torch.tensor([[[float("nan")], [-1.0], [2.0]]], dtype=torch.float64)
    grad_out = torch.tensor([[[3.0], [float("nan")], [5.0]]], dtype=torch.float64)
    d_a, _ = emulated.rnn_backward(out, torch.zeros(1, 1, dtype=torch.float64), grad_out, True)
    assert d_a.flatten().tolist() == [3.0, 0.0, 5.0]


@pytest.mark.parametrize("cell", CELLS)
def test_no_step_passes_the_given_gradients_through(cell):
    p = make_inputs(cell, 2, 0, 3, seed=1, given=True)
    grad_h, grad_cn = p["grad_h"], p["grad_cn"]
    gates = recurrent_cuda.CELLS[cell]
    empty = torch.zeros(2, 0, 3, dtype=torch.float64)
    factors = {"rnn_tanh": (empty,), "rnn_relu": (empty,), "gru": (empty.repeat(1, 1, 3), empty, empty),
               "lstm": (empty.repeat(1, 1, 4), empty, p["c0"])}[cell]  # fmt: skip
    outputs = recurrent_cuda.backward(cell, factors, p["w_hh"], p["grad_out"], grad_h, grad_cn,
                                      launcher=pytest.fail, device_type="cpu", shared_limit=1 << 20)  # fmt: skip
    assert outputs[0].shape == (2, 0, gates * 3)
    assert torch.equal(outputs[-2 if cell == "lstm" else -1], grad_h)
    if cell == "lstm":
        assert torch.equal(outputs[-1], grad_cn)


def test_declines_what_it_cannot_run():
    """``None`` (the layer's backward scans instead) for other dtypes, mixed dtypes, another device, a block
    beyond the shared memory or the threads; :func:`recurrent_cuda.backward_refusal` says why, in one line."""
    p = make_inputs("lstm", 2, 3, 4, seed=2, given=True)
    gates, cells = torch.rand(2, 3, 16, dtype=torch.float64), torch.rand(2, 3, 4, dtype=torch.float64)
    args = (gates, cells, p["c0"], p["w_hh"], p["grad_out"], p["grad_cn"])
    assert emulated.lstm_backward(*args) is not None
    assert emulated.lstm_backward(*(a.half() for a in args)) is None
    assert emulated.lstm_backward(gates.float(), *args[1:]) is None
    assert emulated.lstm_backward(gates.to("meta"), *args[1:]) is None
    needed = recurrent_cuda.backward_shared_bytes("lstm", 4, 8)
    assert emulated.lstm_backward(*args, shared_limit=needed - 1) is None
    assert emulated.lstm_backward(*args, shared_limit=needed) is not None
    assert "shared memory" in recurrent_cuda.backward_refusal("gru", 4, torch.float64, 100)
    assert "float32 / float64" in recurrent_cuda.backward_refusal("rnn_tanh", 4, torch.float16, 1 << 20)
    assert "at most 256" in recurrent_cuda.backward_refusal("rnn_relu", 257, torch.float32, 1 << 30)
    assert recurrent_cuda.backward_refusal("lstm", 4, torch.float32, 1 << 20) is None
    with pytest.raises(ValueError, match="cell must be one of"):
        recurrent_cuda.backward_refusal("elman", 4, torch.float32, 1 << 20)


@pytest.mark.parametrize(
    ("index", "bad", "message"),
    [
        (0, torch.zeros(2, 3, 15), "gates must be"),
        (1, torch.zeros(2, 3, 5), "cells must be"),
        (2, torch.zeros(3, 4), "c0 must be"),
        (3, torch.zeros(4, 4), "w_hh must be"),
        (4, torch.zeros(2, 4, 4), "grad_out must be"),
        (5, torch.zeros(2, 5), "grad_cn must be"),
    ],
)
def test_bad_shapes_name_the_argument(index, bad, message):
    args = [torch.zeros(2, 3, 16), torch.zeros(2, 3, 4), torch.zeros(2, 4), torch.zeros(16, 4),
            torch.zeros(2, 3, 4), torch.zeros(2, 4)]  # fmt: skip
    args[index] = bad
    with pytest.raises(ValueError, match=message):
        emulated.lstm_backward(*args)
    with pytest.raises(ValueError, match="dn must be"):
        emulated.gru_backward(torch.zeros(2, 3, 12), torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.zeros(12, 4),
                              None)  # fmt: skip


def test_sums_are_refused():
    with pytest.raises(ValueError, match="sums=None"):
        emulated.rnn_backward(torch.zeros(2, 3, 4), torch.zeros(4, 4), None, False, sums=object())


def test_launch_config():
    """Float32 with H <= 32: the kernel compiled for that H (module options, shared memory = the two row buffers:
    W_hh in registers; the RNN cells one warp, the GRU's column over 2 lanes a unit, the LSTM's over 4); above: per
    H, W_hh over a unit's lanes in registers and maybe shared memory; otherwise a thread per unit in whole
    warps, W_hh in shared memory."""

    def launch(cell: str, hidden: int, dtype: torch.dtype) -> recurrent_cuda.Launch:
        gates = recurrent_cuda.CELLS[cell]
        factors = {"rnn_tanh": ((2, 3, hidden),), "gru": ((2, 3, 3 * hidden), (2, 3, hidden), (2, 3, hidden)),
                   "lstm": ((2, 3, 4 * hidden), (2, 3, hidden), (2, hidden))}[cell]  # fmt: skip
        tensors = tuple(torch.zeros(shape, dtype=dtype) for shape in factors)
        w_hh = torch.zeros(gates * hidden, hidden, dtype=dtype)
        return recurrent_cuda.prepare_backward(cell, tensors, w_hh, None, None, None, device_type="cpu",
                                               shared_limit=1 << 20)[0]  # fmt: skip

    lstm20 = launch("lstm", 20, torch.float32)  # 80 rows: 20 packs, 5 for each of a unit's 4 lanes (80 threads)
    assert (lstm20.kernel, lstm20.block, lstm20.shared_bytes) == ("bppsa_lstm_backward_f32_h20", 96, 2 * 80 * 4)
    assert lstm20.options == recurrent_cuda.module_options(20)
    gru5 = launch("gru", 5, torch.float32)  # 15 rows: 4 packs, two a lane (10 threads: one warp)
    assert (gru5.kernel, gru5.block, gru5.shared_bytes) == ("bppsa_gru_backward_f32_h5", 32, 2 * 16 * 4)
    gru20 = launch("gru", 20, torch.float32)  # 60 rows: 15 packs, 8 a lane (the second lane's 8th: padding)
    assert (gru20.block, gru20.shared_bytes) == (64, 2 * 64 * 4)
    rnn20 = launch("rnn_tanh", 20, torch.float32)  # one warp, a lane a unit
    assert (rnn20.block, rnn20.shared_bytes) == (32, 2 * 20 * 4)
    wide = launch("rnn_tanh", 33, torch.float32)  # 33 rows padded to 36 (9 packs), W_hh in registers
    assert recurrent_cuda.wide_layout("rnn_tanh", 33) == (1, 9, 9, 1)
    assert (wide.kernel, wide.block, wide.shared_bytes) == ("bppsa_rnn_tanh_backward_f32_h33", 64, 2 * 36 * 4)
    split = launch("gru", 60, torch.float32)  # 180 rows: 45 packs, two lanes a unit: 23 packs each
    assert recurrent_cuda.wide_layout("gru", 60) == (2, 23, 23, 1)
    assert (split.kernel, split.block, split.shared_bytes) == ("bppsa_gru_backward_f32_h60", 128, 2 * 46 * 16)
    # 360 rows: 90 packs, 45 a lane of which 31 in registers; the other 14 of each of 240 lanes in shared memory
    hybrid = launch("gru", 120, torch.float32)
    assert recurrent_cuda.wide_layout("gru", 120) == (2, 31, 45, 1)
    assert (hybrid.kernel, hybrid.block, hybrid.shared_bytes) == (
        "bppsa_gru_backward_f32_h120", 256, 2 * 90 * 16 + 14 * 240 * 16)
    assert hybrid.options[-1] == "-DBPPSA_REC_REGISTER_PACKS=31"
    double = launch("lstm", 20, torch.float64)
    assert (double.kernel, double.block, double.shared_bytes) == ("bppsa_lstm_backward_f64", 32, 22 * 80 * 8)
