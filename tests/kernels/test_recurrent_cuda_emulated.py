"""The recurrent forward CUDA kernels (``kernels/recurrent.cu``) on the CPU through the host emulation.

Same source, same launches (``recurrent_cuda.prepare``) as on a GPU, compared with torch's own layers
(``torch._VF.rnn_tanh / rnn_relu / gru / lstm``) in float64 and with the Jacobian factors recomputed from
torch's states (``jacobians.recurrent``). Float32 within ``assert_derived_close`` of the float64 truth, the
torch float32 run as the baseline. The float32 kernels compiled per H (H <= 32) stage gi through a ring of
``RING_DEPTH`` steps: sequences shorter than, as long as and longer than the ring, and tiny rings; the
emulated asynchronous copies land as late as cp.async allows (``recurrent_emulation.h``), so a read before
its wait reads stale data. Also the compile gate (nvcc, sm_80 and sm_90, no spill) and the loading of the
per-H modules through the CuPy loader (a stand-in CuPy).
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _nvcc, cuda_inspect, recurrent_cuda
from lightning_bppsa.kernels import recurrent_emulated as emulated
from lightning_bppsa.kernels._build import kernel_path

from lightning_bppsa.jacobians.recurrent import gru_jacobians
from lightning_bppsa.testing import assert_derived_close

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")


#: tests/kernels/test_cuda_compile.py, for its ``assert_nvrtc_compiles``
_spec = importlib.util.spec_from_file_location(
    "_compile_tests", Path(__file__).with_name("test_cuda_compile.py")
)
COMPILE_TESTS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(COMPILE_TESTS)

CELLS = ("rnn_tanh", "rnn_relu", "gru", "lstm")
INPUT_SIZE = 5
NAMES = {  # the outputs of each cell's forward, in order
    "rnn_tanh": ("out",),  # no factor: f' is a function of out
    "rnn_relu": ("out",),
    "gru": ("out", "scales", "z", "dn"),
    "lstm": ("out", "cells", "gates"),
}


def make_layer(cell: str, batch: int, steps: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """Random float64 weights, inputs and initial states (scaled so the states neither vanish nor saturate)."""
    gen = torch.Generator().manual_seed(seed)
    gates = recurrent_cuda.CELLS[cell]

    def rand(*shape, scale=1.0):
        return (2 * torch.rand(*shape, dtype=torch.float64, generator=gen) - 1) * scale

    layer = {
        "x": rand(batch, steps, INPUT_SIZE),
        "w_ih": rand(gates * hidden, INPUT_SIZE, scale=0.8),
        "w_hh": rand(gates * hidden, hidden, scale=1.5 / hidden**0.5),
        "b_ih": rand(gates * hidden, scale=0.5),
        "b_hh": rand(gates * hidden, scale=0.5),
        "h0": rand(batch, hidden),
    }
    if cell == "lstm":
        layer["c0"] = rand(batch, hidden)
    return layer


def kernel_inputs(cell: str, layer: dict, dtype: torch.dtype, fold_bias: bool) -> dict:
    """The kernels' arguments: ``gi`` from one GEMM; ``b_hh`` folded into it (an LSTM always, an RNN if
    ``fold_bias``) or passed (a GRU always: ``b_hn`` sits inside ``r ⊙ (.)``)."""
    p = {k: v.to(dtype) for k, v in layer.items()}
    fold = cell == "lstm" or (fold_bias and cell.startswith("rnn"))
    gi = p["x"] @ p["w_ih"].T + p["b_ih"] + (p["b_hh"] if fold else 0)
    args = {"gi": gi, "w_hh": p["w_hh"], "h0": p["h0"]}
    if cell == "lstm":
        args["c0"] = p["c0"]
    else:
        args["b_hh"] = None if fold else p["b_hh"]
    return args


def run_emulated(cell: str, args: dict, **options):
    if cell.startswith("rnn"):
        return emulated.rnn_forward(**args, relu=cell == "rnn_relu", **options)
    return {"gru": emulated.gru_forward, "lstm": emulated.lstm_forward}[cell](**args, **options)


def torch_reference(cell: str, layer: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Torch's layer forward in ``dtype``, and the factors computed from its states with torch ops."""
    p = {k: v.to(dtype) for k, v in layer.items()}
    params = [p["w_ih"], p["w_hh"], p["b_ih"], p["b_hh"]]
    if cell == "lstm":
        hx = (p["h0"][None], p["c0"][None])
        out, _, c_last = torch._VF.lstm(p["x"], hx, params, True, 1, 0.0, False, False, True)
    else:
        fn = {"rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu, "gru": torch._VF.gru}[cell]
        out, _ = fn(p["x"], p["h0"][None], params, True, 1, 0.0, False, False, True)
    h_prev = torch.cat([p["h0"][:, None], out[:, :-1]], 1)
    hidden = out.shape[-1]
    if cell.startswith("rnn"):
        return (out,)
    if cell == "gru":
        chain, local = gru_jacobians(p["x"], h_prev, *params)
        return out, chain.scales, chain.diagonal, local[..., 2 * hidden :]
    pre = p["x"] @ p["w_ih"].T + p["b_ih"] + h_prev @ p["w_hh"].T + p["b_hh"]
    i, f, g, o = pre.split(hidden, -1)
    gates = torch.cat([i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()], -1)
    i, f, g, o = gates.split(hidden, -1)
    cells, c = [], p["c0"]
    for t in range(out.shape[1]):
        c = f[:, t] * c + i[:, t] * g[:, t]
        cells.append(c)
    cells = torch.stack(cells, 1)
    torch.testing.assert_close(cells[:, -1], c_last[0])  # the loop above is torch's cell state
    return out, cells, gates


def check_layer(cell, batch, steps, hidden, dtype, *, fold_bias=False, seed=0, **options):
    layer = make_layer(cell, batch, steps, hidden, seed)
    actual = run_emulated(cell, kernel_inputs(cell, layer, dtype, fold_bias), **options)
    assert actual is not None, "the kernel declined to run"
    reference = torch_reference(cell, layer, torch.float64)
    baseline = torch_reference(cell, layer, dtype) if dtype != torch.float64 else [None] * len(reference)
    assert len(actual) == len(reference) == len(NAMES[cell])
    for name, a, r, base in zip(NAMES[cell], actual, reference, baseline, strict=True):
        assert a.dtype == dtype and a.is_contiguous()
        floor = 1e-12 if dtype == torch.float64 else 1e-6
        assert_derived_close(a, r, base, floor=floor, name=f"{cell} {name}")


@needs_gxx
@pytest.mark.parametrize("steps", [1, 5, 37])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("hidden", [1, 7, 20, 32, 33, 64])
@pytest.mark.parametrize("cell", CELLS)
def test_float64_matches_torch(cell, hidden, batch, steps):
    # the RNN alternates between b_hh passed to the kernel and folded into gi
    check_layer(cell, batch, steps, hidden, torch.float64, fold_bias=steps == 5, seed=hidden * 100 + steps)


@needs_gxx
# H <= 32: the per-H kernels; 33: W_hh in registers too (a module per cell and H)
@pytest.mark.parametrize("hidden", [1, 7, 20, 32, 33])
@pytest.mark.parametrize("cell", CELLS)
def test_float32_within_derived_tolerance(cell, hidden):
    check_layer(cell, 3, 37, hidden, torch.float32, seed=hidden)


#: float32 above a warp, by how the kernel compiled for them holds W_hh (recurrent_cuda.wide_layout): ``(cell, H,
#: lanes a unit, part of it in shared memory)``: several warps of one lane a unit, two lanes (their partial sums
#: meet by shuffles), the widest RNN in registers alone, and wider ones whose lanes hold the rest of their rows
#: in shared memory
FORWARD_LAYOUTS = [("rnn_tanh", 33, 1, False), ("rnn_relu", 100, 1, False), ("rnn_tanh", 192, 2, False),
                   ("rnn_tanh", 256, 1, True), ("gru", 40, 1, False), ("gru", 60, 2, False), ("gru", 110, 2, True),
                   ("lstm", 40, 2, False), ("lstm", 90, 2, True)]  # fmt: skip


@needs_gxx
@pytest.mark.parametrize(("cell", "hidden", "split", "hybrid"), FORWARD_LAYOUTS)
def test_float32_register_kernels_split_over_lanes(cell, hidden, split, hybrid):
    layout = recurrent_cuda.wide_layout(cell, hidden, "forward")
    assert (layout.split, layout.register_packs < layout.lane_packs) == (split, hybrid)
    launch = recurrent_cuda.prepare(
        cell, **{"b_hh": None, "c0": None, **kernel_inputs(cell, make_layer(cell, 2, 9, hidden, 0), torch.float32,
                                                            False)},
        device_type="cpu", shared_limit=1 << 20,
    )[0]  # fmt: skip
    assert (launch.kernel, launch.block) == (f"bppsa_{cell}_forward_f32_h{hidden}", 32 * -(-hidden * split // 32))
    assert launch.options == recurrent_cuda.wide_options(cell, hidden, layout, "forward")
    check_layer(cell, 2, 9, hidden, torch.float32, fold_bias=hidden % 2 == 0, seed=hidden)


#: an H100's / H200's shared memory a block (the opt-in maximum), where the widest layers need clusters
SM90_SHARED_BYTES = 232448
#: float32 layers run as clusters of blocks on an sm_90 device, at small H (a small block budget forces them):
#: ``(cell, H, shared memory a block, blocks a cluster, part of W_hh in shared memory)``: two blocks holding part
#: of each unit's rows in shared memory, four with uneven shares (130 units = 3 x 33 + 31; 150 = 3 x 38 + 36)
#: in registers alone and in part in shared memory, and eight; and an RNN wider than one block's 256 threads
#: at an H100's budget (two blocks of 150 units, part of their rows in shared memory)
CLUSTER_CASES = [("gru", 130, 48 * 1024, 2, True), ("gru", 130, 8 * 1024, 4, False),
                 ("lstm", 150, 48 * 1024, 4, True), ("lstm", 150, 8 * 1024, 8, False),
                 ("rnn_tanh", 300, 232448, 2, True)]  # fmt: skip


@needs_gxx
@pytest.mark.parametrize(("cell", "hidden", "limit", "cluster", "hybrid"), CLUSTER_CASES)
def test_float32_cluster_kernels(cell, hidden, limit, cluster, hybrid):
    """A layer whose W_hh no block holds runs as a cluster of blocks a row (sm_90): each block owns
    ceil(H / cluster) units' rows and writes its units' h_t into every block's state buffer (distributed
    shared memory) before the cluster barrier; without clusters the launch is refused."""
    layout = recurrent_cuda.cluster_layout(cell, hidden, "forward", limit, 8)
    assert (layout.cluster, layout.register_packs < layout.lane_packs) == (cluster, hybrid)
    inputs = {"b_hh": None, "c0": None, **kernel_inputs(cell, make_layer(cell, 2, 9, hidden, 0), torch.float32, False)}
    launch = recurrent_cuda.prepare(cell, **inputs, device_type="cpu", shared_limit=limit, cluster_limit=8)[0]
    name = f"bppsa_{cell}_forward_f32_h{hidden}_c{cluster}"
    assert (launch.kernel, launch.grid, launch.cluster) == (name, 2 * cluster, cluster)
    assert launch.block == 32 * math.ceil(math.ceil(hidden / cluster) * layout.split / 32)
    assert launch.shared_bytes <= limit and launch.options[-1] == f"-DBPPSA_REC_CLUSTER={cluster}"
    assert recurrent_cuda.prepare(cell, **inputs, device_type="cpu", shared_limit=limit) is None
    # a cluster at a time (resident=1) once: the blocks of a cluster are resident together
    check_layer(cell, 2, 9, hidden, torch.float32, fold_bias=cell == "lstm", seed=hidden, shared_limit=limit,
                cluster_limit=8, resident=1 if cluster == 8 else None)  # fmt: skip


#: the widest float32 layer each cell runs on an sm_90 device (clusters of up to 8 blocks)
SM90_WIDEST = {"rnn_tanh": 512, "rnn_relu": 512, "gru": 472, "lstm": 388}


def test_cluster_layouts_on_sm90():
    """On an H100 / H200 every float32 width up to 256 runs both kernels, and beyond it up to
    :data:`SM90_WIDEST`: one block where its layout fits the block's shared memory (and H <= 256 threads), else
    (GRU H > 160, LSTM H > 133, every H > 256) the smallest cluster whose blocks each fit; wider ones are
    refused; a device without clusters (an A100) refuses those as before, saying why."""
    refusals = {"forward": recurrent_cuda.refusal, "backward": recurrent_cuda.backward_refusal}
    clustered = {}
    for cell in CELLS:
        for hidden in range(33, recurrent_cuda.MAX_CLUSTER_HIDDEN + 2):
            whys = [refuse(cell, hidden, torch.float32, SM90_SHARED_BYTES, 8) for refuse in refusals.values()]
            if hidden > SM90_WIDEST[cell]:  # one direction at least refuses, saying how wide the clusters go
                assert any(whys) and all(why is None or "(float32 up to 512 as a cluster" in why for why in whys)
                continue
            assert whys == [None, None], (cell, hidden, whys)
        for direction, refuse in refusals.items():
            rows = recurrent_cuda.CELLS[cell] if direction == "forward" else 1
            for hidden in range(33, SM90_WIDEST[cell] + 1):
                layout = recurrent_cuda.cluster_layout(cell, hidden, direction, SM90_SHARED_BYTES, 8)
                single = recurrent_cuda.wide_layout(cell, hidden, direction)  # None above 256
                if single is not None and recurrent_cuda._wide_bytes(single, hidden, rows) <= SM90_SHARED_BYTES:
                    assert layout is None
                    continue
                clustered.setdefault((cell, direction), hidden)
                assert recurrent_cuda._wide_bytes(layout, hidden, rows) <= SM90_SHARED_BYTES
                for smaller in (q for q in recurrent_cuda.CLUSTER_SIZES if q < layout.cluster):
                    narrower = recurrent_cuda.wide_layout(cell, hidden, direction, smaller)
                    assert recurrent_cuda._wide_bytes(narrower, hidden, rows) > SM90_SHARED_BYTES
                without = refuse(cell, hidden, torch.float32, SM90_SHARED_BYTES, 1) or ""
                assert ("shared memory per block" if hidden <= 256 else "at most 256: H=") in without, (cell, hidden)
    assert clustered == {("gru", "forward"): 161, ("gru", "backward"): 161, ("lstm", "forward"): 134,
                         ("lstm", "backward"): 134, **{(rnn, d): 257 for rnn in ("rnn_tanh", "rnn_relu")
                                                       for d in DIRECTIONS}}  # fmt: skip
    # a batch of at most SPREAD_BATCH rows: a GRU / LSTM of 2 blocks a row spreads over 4 blocks of 4 lanes a unit
    # (GRU 161-240, LSTM 134-200 / 196), holding no fewer packs of a lane's share in registers, and so does a GRU's
    # backward that one block runs with at most 2/3 of a lane's share in registers (H 123-160), all of it in
    # registers there; layers of 4 or 8 blocks, the RNN's, an LSTM's one block, a GRU's one-block forward, a GRU's
    # backward of H 33-122 and larger batches keep the smallest cluster (or one block)
    spread_widths = {}
    for cell in CELLS:
        for direction in DIRECTIONS:
            rows = recurrent_cuda.CELLS[cell] if direction == "forward" else 1
            for hidden in range(33, SM90_WIDEST[cell] + 1):
                smallest = recurrent_cuda.cluster_layout(cell, hidden, direction, SM90_SHARED_BYTES, 8)
                spread = recurrent_cuda.launch_layout(cell, hidden, direction, SM90_SHARED_BYTES, 8, True)
                assert recurrent_cuda.launch_layout(cell, hidden, direction, SM90_SHARED_BYTES, 8, False) == smallest
                single = recurrent_cuda.wide_layout(cell, hidden, direction)
                hybrid_block = (smallest is None and (cell, direction) == ("gru", "backward")
                                and 3 * single.register_packs <= 2 * single.lane_packs)  # fmt: skip
                if not hybrid_block and (smallest is None or smallest.cluster != 2 or cell.startswith("rnn")):
                    assert spread == smallest, (cell, direction, hidden)
                    continue
                spread_widths.setdefault((cell, direction), []).append(hidden)
                assert (spread.cluster, spread.split) == (4, 4)
                if hybrid_block:
                    assert spread.register_packs == spread.lane_packs, hidden
                else:
                    assert spread.register_packs >= smallest.register_packs
                assert recurrent_cuda._wide_bytes(spread, hidden, rows) <= SM90_SHARED_BYTES
    assert {k: (v[0], v[-1], len(v)) for k, v in spread_widths.items()} == {
        ("gru", "forward"): (161, 240, 80), ("gru", "backward"): (123, 240, 118),
        ("lstm", "forward"): (134, 200, 67), ("lstm", "backward"): (134, 196, 63),
    }  # fmt: skip
    # GRU H = 256 forward: 4 blocks of 64 units, 4 lanes a unit, 16 packs of each of a unit's 3 rows a lane, 10 in
    # registers: the two state buffers (64 packs each) and 6 packs x 3 rows x 256 lanes in shared memory
    gru = recurrent_cuda.cluster_layout("gru", 256, "forward", SM90_SHARED_BYTES, 8)
    assert gru == (4, 10, 16, 4) and recurrent_cuda._wide_bytes(gru, 256, 3) == (2 * 64 + 6 * 3 * 256) * 16
    # where no cluster of 8 holds it (1 KiB a block: not even the state buffers), the refusal says so
    assert "nor in a cluster of up to 8 blocks" in recurrent_cuda.refusal("lstm", 256, torch.float32, 1024, 8)


@needs_gxx
@pytest.mark.parametrize("cell", CELLS)
def test_blocks_one_at_a_time_and_multi_warp(cell):
    """One resident block (a GPU with one free SM) and H = 70: three warps meet at __syncthreads."""
    check_layer(cell, 2, 9, 70, torch.float64, seed=70, resident=1)


@needs_gxx
def test_relu_nan_semantics_match_torch():
    """A NaN pre-activation stays NaN (torch's relu)."""
    layer = make_layer("rnn_relu", 2, 6, 5, seed=4)
    layer["x"][0, 2, 1] = float("nan")
    actual = run_emulated("rnn_relu", kernel_inputs("rnn_relu", layer, torch.float64, False))
    reference = torch_reference("rnn_relu", layer, torch.float64)
    assert actual[0][0, 2:].isnan().all() and not actual[0][1].isnan().any()
    for a, r in zip(actual, reference, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, equal_nan=True)


@needs_gxx
def test_non_contiguous_inputs():
    layer = make_layer("gru", 3, 11, 9, seed=9)
    args = kernel_inputs("gru", layer, torch.float64, False)
    strided = {k: v.mT.contiguous().mT if v.dim() >= 2 else v for k, v in args.items() if v is not None}
    assert not strided["gi"].is_contiguous()
    actual = run_emulated("gru", {**strided, "b_hh": args["b_hh"]})
    for a, r in zip(actual, run_emulated("gru", args), strict=True):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


def test_empty_sequence_and_batch_launch_nothing():
    for batch, steps in ((2, 0), (0, 4)):
        layer = make_layer("lstm", batch, steps, 6, seed=1)
        out, cells, gates = run_emulated("lstm", kernel_inputs("lstm", layer, torch.float64, False))
        assert out.shape == cells.shape == (batch, steps, 6) and gates.shape == (batch, steps, 24)


def test_declines_what_it_cannot_run():
    """``None`` (the caller runs torch) for other dtypes, mixed dtypes, another device, a too-wide state."""
    args = kernel_inputs("gru", make_layer("gru", 2, 3, 4, seed=2), torch.float64, False)
    assert emulated.gru_forward(**{k: v.half() for k, v in args.items()}) is None
    assert emulated.gru_forward(**{**args, "w_hh": args["w_hh"].float()}) is None
    assert emulated.gru_forward(**{**args, "gi": args["gi"].to("meta")}) is None
    wide = kernel_inputs("lstm", make_layer("lstm", 1, 2, 64, seed=3), torch.float64, False)
    assert recurrent_cuda.shared_bytes("lstm", 64, 8) > recurrent_cuda.PORTABLE_SHARED_BYTES
    assert emulated.lstm_forward(**wide, shared_limit=recurrent_cuda.PORTABLE_SHARED_BYTES) is None
    too_many_threads = kernel_inputs(
        "rnn_tanh", make_layer("rnn_tanh", 1, 2, 257, seed=3), torch.float32, False
    )
    assert emulated.rnn_forward(**too_many_threads, relu=False, shared_limit=1 << 30) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"w_hh": torch.zeros(4, 4)}, "w_hh must be"),
        ({"gi": torch.zeros(2, 3, 13)}, "gi must be"),
        ({"b_hh": torch.zeros(11)}, "b_hh must be"),
        ({"h0": torch.zeros(3, 4)}, "h0 must be"),
    ],
)
def test_bad_shapes_name_the_argument(change, message):
    args = kernel_inputs("gru", make_layer("gru", 2, 3, 4, seed=2), torch.float32, False)
    with pytest.raises(ValueError, match=message):
        emulated.gru_forward(**{**args, **change})


def test_launch_config():
    """Float32 with H <= 32: the kernels compiled for that H (module options), one warp, shared memory = two
    state buffers + the gi ring; wider float32 where W_hh fits in registers: compiled per cell and H, 1-4 lanes
    a unit, the state buffers alone; otherwise one thread per unit in whole warps, packed W_hh + state
    buffers."""

    def prepare(cell, layer, dtype, **change):
        args = {"b_hh": None, "c0": None, **kernel_inputs(cell, layer, dtype, False), **change}
        return recurrent_cuda.prepare(cell, **args, device_type="cpu", shared_limit=1 << 20)

    def launch(cell, hidden, dtype):
        return prepare(cell, make_layer(cell, 3, 4, hidden, seed=0), dtype)[0]

    depth = recurrent_cuda.RING_DEPTH
    small = launch("gru", 20, torch.float32)  # a unit's 3 gates in neighbouring lanes, 10 units a warp: 2 warps
    assert (small.kernel, small.grid, small.block) == ("bppsa_gru_forward_f32_h20", 3, 64)
    assert small.options == ("-DBPPSA_REC_HIDDEN=20", f"-DBPPSA_REC_RING={depth}")
    # the state buffers, the ring a word a thread
    assert small.shared_bytes == (2 * 20 + depth * 64) * 4 == recurrent_cuda.shared_bytes("gru", 20, 4)
    odd = launch("lstm", 5, torch.float32)  # state buffers padded to whole float4 vectors; 8 units a warp
    assert (odd.kernel, odd.block) == ("bppsa_lstm_forward_f32_h5", 32)
    assert odd.shared_bytes == (2 * 8 + depth * 32) * 4
    assert [recurrent_cuda.group_threads(c, h) for c in ("gru", "lstm") for h in (10, 11, 32)] == [32, 64, 128, 64, 64, 128]
    one = launch("rnn_tanh", 20, torch.float32)  # one warp, its state buffers a value a lane
    assert (one.block, one.shared_bytes) == (32, (2 * 32 + depth * 20) * 4)
    shared = launch("gru", 20, torch.float64)
    assert (shared.kernel, shared.shared_bytes) == ("bppsa_gru_forward_f64", (3 * 20 + 2) * 20 * 8)
    assert shared.options == () and shared.kernel in recurrent_cuda.KERNELS
    wide = launch("lstm", 33, torch.float32)  # W_hh in registers, a lane a unit: the state buffers alone
    assert recurrent_cuda.wide_layout("lstm", 33, "forward") == (1, 9, 9, 1)
    assert (wide.kernel, wide.block, wide.shared_bytes) == ("bppsa_lstm_forward_f32_h33", 64, 2 * 36 * 4)
    assert wide.options == recurrent_cuda.wide_options("lstm", 33, recurrent_cuda.WideLayout(1, 9, 9), "forward")
    split = launch("gru", 60, torch.float32)  # two lanes a unit: 15 packs a row, 8 each
    assert (split.kernel, split.block, split.shared_bytes) == ("bppsa_gru_forward_f32_h60", 128, 2 * 16 * 4 * 4)
    # 23 packs a row, 12 a lane of which 7 in registers: 5 of each of the 4 rows of 180 lanes in shared memory
    hybrid = launch("lstm", 90, torch.float32)
    assert recurrent_cuda.wide_layout("lstm", 90, "forward") == (2, 7, 12, 1)
    assert (hybrid.kernel, hybrid.block) == ("bppsa_lstm_forward_f32_h90", 192)
    assert hybrid.shared_bytes == 2 * 24 * 16 + 4 * 5 * 180 * 16
    wide = launch("lstm", 33, torch.float64)
    assert (wide.kernel, wide.block) == ("bppsa_lstm_forward_f64", 64)
    assert wide.shared_bytes == (4 * 33 + 2) * 34 * 8  # H padded to whole double2 vectors
    assert len(wide.args) == 12 and wide.args[9:] == (3, 4, 33)
    assert wide.args[2] == 0 and wide.args[4] != 0 and wide.args[8] == 0  # no b_hh, c0 given, 2 factors
    with pytest.raises(ValueError, match="c0 is required"):
        prepare("lstm", make_layer("lstm", 1, 2, 3, seed=0), torch.float64, c0=None)
    # the per-H kernels always fit the portable 48 KiB: refusal() and prepare() agree on every H <= 32
    for cell in CELLS:
        assert recurrent_cuda.shared_bytes(cell, 32, 4) <= recurrent_cuda.PORTABLE_SHARED_BYTES
        assert recurrent_cuda.refusal(cell, 32, torch.float32, recurrent_cuda.PORTABLE_SHARED_BYTES) is None


RING = recurrent_cuda.RING_DEPTH
#: (steps, batch) around the ring: shorter than its lead, as long as the prologue fills, the ring, one
#: more step than the ring (the first reuse of slot 0), a long sequence (many wraps); B alternates 1 / 3
RING_CASES = ((1, 3), (RING - 2, 1), (RING - 1, 3), (RING, 1), (RING + 1, 3), (3 * RING + 5, 1))


@needs_gxx
@pytest.mark.parametrize("hidden", [1, 5, 20, 31, 32])
@pytest.mark.parametrize("cell", CELLS)
def test_float32_per_hidden_kernels_around_the_ring_depth(cell, hidden):
    for steps, batch in RING_CASES:
        check_layer(cell, batch, steps, hidden, torch.float32, fold_bias=steps == RING, seed=hidden + steps)


@needs_gxx
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("cell", CELLS)
def test_float32_tiny_rings(monkeypatch, cell, depth):
    """A ring of 2 slots (wait for everything each step) and of 3, wrapped many times: the invariant of
    recurrent.cu's pipeline at its edge (a module built with -DBPPSA_REC_RING=<depth>)."""
    monkeypatch.setattr(recurrent_cuda, "RING_DEPTH", depth)
    recurrent_cuda._kernel_and_block.cache_clear()
    try:
        for steps, batch in ((1, 2), (depth, 1), (depth + 1, 3), (4 * depth + 3, 2)):
            check_layer(cell, batch, steps, 6, torch.float32, seed=depth * 10 + steps)
        assert recurrent_cuda.prepare(
            cell, **{"b_hh": None, "c0": None, **kernel_inputs(cell, make_layer(cell, 1, 2, 6, 0), torch.float32, True)},
            device_type="cpu", shared_limit=1 << 20,
        )[0].options[-1] == f"-DBPPSA_REC_RING={depth}"  # fmt: skip
    finally:
        recurrent_cuda._kernel_and_block.cache_clear()


def test_per_hidden_modules_load_once_and_fall_back_inside_a_capture(fake_device, monkeypatch):
    """A per-H kernel's module is compiled on its first launch (with its -D options) and fetched once; the
    shared-memory kernels load as before. Inside a CUDA graph capture, where NVRTC cannot run, the first
    launch of an H runs the shared-memory kernel of the same cell and direction with its own shared memory,
    and warns."""
    fake, _ = fake_device
    device = torch.device("cuda", 0)
    launch = recurrent_cuda.Launch("bppsa_gru_forward_f32_h20", 2, 32, 4000, (1,) * 11 + (20,),
                                   options=recurrent_cuda.module_options(20))  # fmt: skip
    code = recurrent_cuda.source()
    reads = []
    monkeypatch.setattr(recurrent_cuda, "source", lambda: reads.append(1) or code)
    for _ in range(3):
        recurrent_cuda._launch_cuda(launch, device)
    assert len(reads) == 2  # the shared-memory module and the per-H one, once each: later launches look up
    options = (*recurrent_cuda.cupy_loader.NVRTC_OPTIONS, *launch.options)
    assert fake.compiled[(0, code, options)] == 1 and fake.lookups[(0, launch.kernel)] == 1
    assert len(fake.kernels[(0, launch.kernel)].calls) == 3
    assert all(fake.lookups[(0, name)] == 1 for name in recurrent_cuda.KERNELS)

    captured = recurrent_cuda.Launch("bppsa_lstm_forward_f32_h7", 1, 32, 2000, (2,) * 11 + (7,),
                                     options=recurrent_cuda.module_options(7))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning, match="inside a CUDA graph capture"):
        recurrent_cuda._launch_cuda(captured, device)
    generic = fake.kernels[(0, "bppsa_lstm_forward_f32")]
    assert generic.calls == [
        ((1,), (32,), captured.args, recurrent_cuda._shared_bytes("lstm", 7, 4, fixed=False), 0x1000)
    ]
    assert (0, captured.kernel) not in fake.lookups  # nothing compiled inside the capture
    backward = recurrent_cuda.Launch("bppsa_rnn_relu_backward_f32_h9", 1, 32, 96, (3,) * 13 + (9,),
                                     options=recurrent_cuda.module_options(9))  # fmt: skip
    with pytest.warns(UserWarning, match="runs bppsa_rnn_relu_backward_f32 "):
        recurrent_cuda._launch_cuda(backward, device)
    generic = fake.kernels[(0, "bppsa_rnn_relu_backward_f32")]
    assert generic.calls == [
        ((1,), (32,), backward.args, recurrent_cuda._backward_shared_bytes("rnn_relu", 9, 4, layout=None), 0x1000)
    ]
    # two lanes a unit (128 threads for H = 60): the shared-memory kernel runs one a unit
    split = recurrent_cuda.Launch("bppsa_gru_backward_f32_h60", 1, 128, 1472, (3,) * 13 + (60,),
                                  options=recurrent_cuda.wide_options("gru", 60, recurrent_cuda.WideLayout(2, 23, 23)))  # fmt: skip
    with pytest.warns(UserWarning, match="runs bppsa_gru_backward_f32 "):
        recurrent_cuda._launch_cuda(split, device)
    assert fake.kernels[(0, "bppsa_gru_backward_f32")].calls == [
        ((1,), (64,), split.args, recurrent_cuda._backward_shared_bytes("gru", 60, 4, layout=None), 0x1000)
    ]
    # H = 256: W_hh in shared memory alone would not fit the device: said, not launched
    wide = recurrent_cuda.Launch("bppsa_rnn_tanh_backward_f32_h256", 1, 256, 104448, (3,) * 13 + (256,),
                                 options=recurrent_cuda.wide_options("rnn_tanh", 256,
                                                                     recurrent_cuda.wide_layout("rnn_tanh", 256)))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"needs 264192 B .*run the layer once before capturing"):
        recurrent_cuda._launch_cuda(wide, device)
    assert (0, "bppsa_rnn_tanh_backward_f32") not in fake.kernels or not fake.kernels[
        (0, "bppsa_rnn_tanh_backward_f32")
    ].calls
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fake.compile_error = RuntimeError("NVRTC: error")
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="NVRTC"):  # outside a capture: raised
        warnings.simplefilter("error")
        recurrent_cuda._launch_cuda(captured, device)


def test_available_is_false_without_cuda_here():
    ok, reason = recurrent_cuda.available()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu/test_recurrent_cuda.py checks the real kernels")
    assert not ok and reason
    assert (
        recurrent_cuda.gru_forward(torch.zeros(1, 2, 3), torch.zeros(3, 1), None, torch.zeros(1, 1)) is None
    )


#: the H of the per-H kernels the compile gate builds: every one (ptxas's spills come and go with H: a change
#: spilled at GRU H = 7 and 18 alone)
GATE_HIDDEN = tuple(range(1, recurrent_cuda.FIXED_HIDDEN + 1))
#: the per-H modules NVRTC compiles in its test (each a compile of its own)
NVRTC_HIDDEN = (1, 5, 20, 31, 32)
DIRECTIONS = ("forward", "backward")


def wide_gate(direction: str) -> list[tuple[str, int, int, int]]:
    """``(cell, H, lanes a unit, register packs)`` of the ``direction`` kernels compiled per ``H > 32`` that hold
    the most registers (``recurrent_cuda.wide_layout``): per cell the first ``H``, the widest ``H`` of each split
    holding ``W_hh`` in registers alone, and of each layout holding part of it in shared memory (their
    registers are the same whatever ``H``), and the widest ``H``."""
    chosen = []
    for cell in recurrent_cuda.CELLS:
        layouts = {h: recurrent_cuda.wide_layout(cell, h, direction) for h in range(33, recurrent_cuda.MAX_THREADS + 1)}

        def kind(layout):
            return layout.split, layout.register_packs if layout.register_packs < layout.lane_packs else "all"

        chosen += [(cell, h, *layout[:2]) for h, layout in layouts.items()
                   if h in (33, recurrent_cuda.MAX_THREADS) or kind(layouts[h + 1]) != kind(layout)]  # fmt: skip
    return chosen


def gate_source(directory: Path) -> Path:
    """A file compiling recurrent.cu with the per-H kernels of :data:`GATE_HIDDEN` and :func:`wide_gate` beside
    the others."""
    wrapper = directory / "recurrent_gate.cu"
    hidden = " ".join(f"X({h})" for h in GATE_HIDDEN)
    wide = {d: " ".join(f"X({cell}, {h}, {split}, {packs})" for cell, h, split, packs in wide_gate(d))
            for d in DIRECTIONS}
    wrapper.write_text(
        f"#define BPPSA_REC_RING {recurrent_cuda.RING_DEPTH}\n#define BPPSA_REC_HIDDEN_LIST(X) {hidden}\n"
        f"#define BPPSA_REC_WIDE_LIST(X) {wide['backward']}\n#define BPPSA_REC_WIDE_FORWARD_LIST(X) {wide['forward']}\n"
        f'#include "{kernel_path("recurrent.cu")}"\n'
    )
    return wrapper


@pytest.mark.slow
def test_compile_gate_sm80_sm90_no_spill(tmp_path):  # ~80 s of nvcc
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile gate needs the CUDA toolkit (no GPU needed)")
    usage = _nvcc.ptxas_report(str(gate_source(tmp_path)), ("sm_80", "sm_90"))  # -warn-spills -Werror
    fixed = [f"bppsa_{cell}_{direction}_f32_h{h}" for cell in CELLS for h in GATE_HIDDEN
             for direction in ("forward", "backward")]  # fmt: skip
    fixed += [f"bppsa_{cell}_{d}_f32_h{h}" for d in DIRECTIONS for cell, h, _, _ in wide_gate(d)]
    for arch, kernels in usage.items():
        assert sorted(kernels) == sorted([*recurrent_cuda.KERNELS, *fixed]), (
            f"{arch}: ptxas reported {sorted(kernels)}"
        )
        for name, use in kernels.items():
            assert (use.stack_bytes, use.spill_store_bytes, use.spill_load_bytes) == (0, 0, 0), (
                f"{arch} {name}"
            )
            assert 0 < use.registers <= 255 and use.static_shared_bytes == 0, f"{arch} {name}: {use}"
        print(f"\n{arch} registers: " + ", ".join(f"{k}={v.registers}" for k, v in sorted(kernels.items())))


def cluster_gate(direction: str) -> list[tuple[str, int, int, int, int]]:
    """``(cell, H, lanes a unit, register packs, blocks a cluster)`` of the ``direction`` kernels an sm_90 device
    runs as clusters (:func:`recurrent_cuda.launch_layout` at its block budget, for any batch): per cell the
    first and the widest ``H`` of each layout."""
    chosen = []
    for cell in CELLS:
        kinds: dict[tuple, list[int]] = {}
        for hidden in range(33, recurrent_cuda.MAX_CLUSTER_HIDDEN + 1):
            layouts = {recurrent_cuda.launch_layout(cell, hidden, direction, SM90_SHARED_BYTES, 8, spread)
                       for spread in (False, True)}  # fmt: skip
            for layout in layouts - {None}:
                kinds.setdefault((layout.split, layout.register_packs, layout.cluster), []).append(hidden)
        chosen += [(cell, h, *kind) for kind, widths in kinds.items() for h in sorted({widths[0], widths[-1]})]
    return chosen


@pytest.mark.slow  # ~30 s of nvcc
def test_cluster_compile_gate_sm90_no_spill(tmp_path):
    """Every cluster layout an H100 / H200 runs compiles for sm_90 (clusters need it) without a spill or a stack
    frame, within 255 registers."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile gate needs the CUDA toolkit (no GPU needed)")
    lists = {d: " ".join(f"X({cell}, {h}, {split}, {packs}, {q})" for cell, h, split, packs, q in cluster_gate(d))
             for d in DIRECTIONS}  # fmt: skip
    wrapper = tmp_path / "recurrent_cluster_gate.cu"
    wrapper.write_text(
        f"#define BPPSA_REC_CLUSTER_LIST(X) {lists['backward']}\n"
        f"#define BPPSA_REC_CLUSTER_FORWARD_LIST(X) {lists['forward']}\n#include \"{kernel_path('recurrent.cu')}\"\n"
    )
    usage = _nvcc.ptxas_report(str(wrapper), ("sm_90",))["sm_90"]
    clustered = [f"bppsa_{cell}_{d}_f32_h{h}_c{q}" for d in DIRECTIONS for cell, h, _, _, q in cluster_gate(d)]
    assert len(clustered) >= 16 and sorted(usage) == sorted([*recurrent_cuda.KERNELS, *clustered])
    for name in clustered:
        use = usage[name]
        assert (use.stack_bytes, use.spill_store_bytes, use.spill_load_bytes) == (0, 0, 0), f"{name}: {use}"
        assert 0 < use.registers <= 255 and use.static_shared_bytes == 0, f"{name}: {use}"


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump per kernel
@pytest.mark.parametrize(("cell", "direction"), [("gru", "forward"), ("gru", "backward"), ("lstm", "backward")])
def test_cluster_step_stores_after_its_arrival(cell, direction):
    """A step of a cluster kernel (sm_90 SASS, H = 256, four blocks): its share of the state / row stored into
    each block of the cluster (distributed shared memory: generic STs), the barrier's arrival (ptxas's release
    is a GPU-scope MEMBAR, which waits for the thread's stores), then the step's outputs (STG) before the wait,
    so that the MEMBAR does not wait for them; one arrival and one wait a step (in each copy of the time loop: the
    LSTM's backward has an unchecked one and the checked tail)."""
    kernel, _, _, options, cluster = recurrent_cuda._kernel_and_block(
        cell, torch.float32, 256, direction, SM90_SHARED_BYTES, 8
    )
    assert cluster == 4
    try:
        loops = cuda_inspect.sass_loops("sm_90", source="recurrent.cu", options=options)
    except FileNotFoundError as err:
        pytest.skip(f"needs nvcc, cuobjdump and nvdisasm (the [dev] extra's NVIDIA wheels): {err}")
    mains = [loop for loop in loops[kernel] if loop.kinds.get("UCGABAR_ARV", 0) >= 2]
    assert mains, [loop.kinds for loop in loops[kernel]]
    shares = cluster * (1 if direction == "forward" else recurrent_cuda.CELLS[cell])  # a unit's values, to every block
    for main in mains:
        steps = main.kinds["UCGABAR_ARV"]
        assert main.kinds["UCGABAR_WAIT"] == main.kinds["MEMBAR"] == steps and "BAR" not in main.kinds
        assert main.kinds["ST"] == shares * steps, main.kinds
        order = [op for op in main.opcodes if op in ("ST", "STG", "MEMBAR", "UCGABAR_ARV", "UCGABAR_WAIT")]
        step = ["ST"] * shares + ["MEMBAR", "UCGABAR_ARV"] + ["STG"] * (main.kinds["STG"] // steps) + ["UCGABAR_WAIT"]
        assert order == step * steps, order


#: the most instructions one step of the per-H RNN kernels' time loops may issue (sm_90 SASS, per warp), by
#: direction and H: a step's own work (the forward: ceil(H / 4) broadcast LDS.128 of h_{t-1}, H multiply-adds
#: and their sum, gi's load, tanh, two stores, the asynchronous copy of a later step; the backward: the same
#: product with r_t, the slope, two stores, two loads of a later step) and a little bookkeeping. Steps checking
#: their ring offsets, operands and bounds one by one, and branching around the lanes beyond H, issued forward
#: 67 / 78 / 98 / 107 and backward 39.5 / 44 / 61.25 / 79.5 at H = 1 / 5 / 20 / 32; the groups of 4 with
#: compile-time offsets, forward 37 / 47 / 65 / 78 and backward 23 / 28 / 43 / 58.
RNN_STEP_CAP = {"forward": {1: 40, 5: 50, 20: 68, 32: 80}, "backward": {1: 26, 5: 31, 20: 46, 32: 61}}
#: the same for a step of the gated cells' forward (a unit's gates in neighbouring lanes, one block barrier a
#: step), by cell and H: a warp a gate (two barriers a step, its gates through shared memory), single steps issued
#: LSTM 145 / 155 / 179 / 181 and GRU 150 / 161 / 184 / 191 (a CALL of the division's slow path in each sigmoid);
#: the LSTM's groups of 2 127 / 133 / 160 / 171; without the call, the LSTM's groups of 4 102 / 115 / 135 / 143
#: and the GRU's of 2 121 / 129 / 144 / 156. A unit's gates in neighbouring lanes: LSTM 89.5 / 94.5 / 117.75 /
#: 134.5, GRU 94 / 100 / 121.5 / 140.
GATED_FORWARD = {"lstm": (4, {1: 92, 5: 97, 20: 120, 32: 137}), "gru": (2, {1: 96, 5: 102, 20: 124, 32: 142})}
#: the same for a step of the gated cells' backward, whose loop runs groups of kBackwardAhead = 4 steps: the GRU's
#: checked its bounds every step (its registers spilled with the unchecked copy of the loop: ptxas kept 96 and
#: spilled at H = 18 until the kernels asked for one block an SM), 61.5 / 75.5 / 110.5 / 123.25 instructions a
#: step; unchecked 48.75 / 50.5 / 80 / 102.25. The LSTM's 78.25 / 88 / 116.5 / 133.25, with the launch bounds
#: 78.25 / 88 / 113.75 / 128.25.
GATED_BACKWARD = {"gru": {1: 51, 5: 53, 20: 83, 32: 105}, "lstm": {1: 80, 5: 90, 20: 116, 32: 131}}


@pytest.mark.slow  # ~2 s of nvcc + cuobjdump per H
@pytest.mark.parametrize("hidden", sorted(RNN_STEP_CAP["forward"]))
def test_rnn_time_loops_are_branch_free_groups(hidden):
    """The per-H RNN kernels' main loops (sm_90 SASS): a group of 4 steps (forward: a copy group committed a
    step; backward: a row stored a step) with no branch but the loop's own (ring slots, state or row buffers and
    output offsets at compile-time offsets; every lane computes, the lanes beyond H store into padding or
    nothing), within :data:`RNN_STEP_CAP` a step (the groups near the sequence's ends run a guarded copy); the
    gated cells' forward in groups (:data:`GATED_FORWARD`: LSTM 4 steps, GRU 2) within its caps a step, one block
    barrier a step, no call in them (sigmoid_of's reciprocal inline), and their backward's unchecked groups within
    :data:`GATED_BACKWARD`."""
    try:
        loops = cuda_inspect.sass_loops("sm_90", source="recurrent.cu", options=recurrent_cuda.module_options(hidden))
    except FileNotFoundError as err:
        pytest.skip(f"needs nvcc, cuobjdump and nvdisasm (the [dev] extra's NVIDIA wheels): {err}")
    for direction, step_op in (("forward", "LDGDEPBAR"), ("backward", "STS")):
        for cell in ("rnn_tanh", "rnn_relu"):
            name = f"bppsa_{cell}_{direction}_f32_h{hidden}"
            groups = [loop for loop in loops[name] if loop.kinds.get("BRA") == 1 and loop.kinds.get(step_op, 0) >= 4]
            assert len(groups) == 1, f"{name}: {[loop.kinds for loop in loops[name]]}"
            main = groups[0]
            steps = main.kinds[step_op]
            assert steps == 4 and "BSSY" not in main.kinds, f"{name}: {main.kinds}"
            assert main.instructions / steps <= RNN_STEP_CAP[direction][hidden], (
                f"{name}: {main.instructions / steps} instructions a step: {main.kinds}"
            )
    for cell, (unroll, caps) in GATED_FORWARD.items():
        name = f"bppsa_{cell}_forward_f32_h{hidden}"
        groups = [loop for loop in loops[name] if loop.kinds.get("LDGDEPBAR") == unroll]  # the main loop, the tail's
        assert groups, f"{name}: {[loop.kinds for loop in loops[name]]}"
        assert not any("CALL" in kind for loop in groups for kind in loop.kinds), f"{name}: {groups[0].kinds}"
        step = min(loop.instructions for loop in groups) / unroll
        assert step <= caps[hidden], f"{name}: {step} instructions a step"
        assert all(loop.kinds.get("BAR") == unroll for loop in groups), f"{name}: {[loop.kinds for loop in groups]}"
    for cell, caps in GATED_BACKWARD.items():
        name = f"bppsa_{cell}_backward_f32_h{hidden}"
        groups = [loop for loop in loops[name] if loop.kinds.get("STS", 0) >= 4]  # the main loop, the tail's
        step = min(loop.instructions for loop in groups) / 4  # kBackwardAhead steps a group
        assert step <= caps[hidden], f"{name}: {step} instructions a step: {[loop.kinds for loop in groups]}"


#: the most instructions a step of the GRU's backward compiled for an H > 32 with W_hh in registers alone may
#: issue in its unchecked groups (sm_90 SASS, per warp): checking its bounds every step it issued 193 / 286.5 at
#: H = 64 / 104, unchecked 176.75 / 254.75
WIDE_GRU_BACKWARD_STEP_CAP = {64: 180, 104: 258}


@pytest.mark.slow  # ~10 s of nvcc + cuobjdump per H
@pytest.mark.parametrize("hidden", sorted(WIDE_GRU_BACKWARD_STEP_CAP))
def test_wide_gru_backward_runs_unchecked_groups(hidden):
    """The GRU's backward above H = 32, where its layout holds W_hh in registers alone: a main loop of
    kBackwardAhead = 4 steps without a check a step, beside the checked tail (the layouts reading part of W_hh
    from shared memory keep the checked loop alone: ptxas spilled)."""
    layout = recurrent_cuda.wide_layout("gru", hidden)
    assert layout.register_packs == layout.lane_packs
    try:
        loops = cuda_inspect.sass_loops("sm_90", source="recurrent.cu",
                                        options=recurrent_cuda.wide_options("gru", hidden, layout))  # fmt: skip
    except FileNotFoundError as err:
        pytest.skip(f"needs nvcc, cuobjdump and nvdisasm (the [dev] extra's NVIDIA wheels): {err}")
    name = f"bppsa_gru_backward_f32_h{hidden}"
    groups = [loop for loop in loops[name] if loop.kinds.get("STS", 0) >= 4]
    assert len(groups) == 2, f"{name}: {[loop.kinds for loop in loops[name]]}"
    step = min(loop.instructions for loop in groups) / 4
    assert step <= WIDE_GRU_BACKWARD_STEP_CAP[hidden], f"{name}: {step} instructions a step"


def test_nvrtc_compiles_what_cupy_loads():
    """The exact source CuPy compiles (headers inlined) through NVRTC, which needs no GPU either: the generic
    module and each per-H module."""
    option_sets = (
        (),
        *(recurrent_cuda.module_options(h) for h in NVRTC_HIDDEN),
        *(recurrent_cuda.wide_options(cell, h, recurrent_cuda.wide_layout(cell, h, d), d)
          for d in DIRECTIONS for cell, h, _, _ in wide_gate(d)[:2]),
        *(recurrent_cuda._kernel_and_block("gru", torch.float32, 256, d, SM90_SHARED_BYTES, 8)[3] for d in DIRECTIONS),
    )
    COMPILE_TESTS.assert_nvrtc_compiles(recurrent_cuda.source(), "recurrent.cu", option_sets)


@pytest.mark.slow  # ~5 s per sanitizer build
@pytest.mark.parametrize("sanitizers", ["address,undefined", "thread"])
def test_sanitized_launches(tmp_path, sanitizers, monkeypatch):
    """Every cell and dtype, one warp and several, and clusters of blocks, under ASan + UBSan (exact-size global
    buffers) and TSan (the one barrier per step orders the state buffers' writes, a peer block's included, before
    the next step's reads). The driver's launches state their threads and shared memory: the cluster ones and
    the per-H gated cells' (several warps at H = 32, a ring of 3) checked here against recurrent_cuda's."""
    monkeypatch.setattr(recurrent_cuda, "RING_DEPTH", 3)  # the driver's ring
    recurrent_cuda._kernel_and_block.cache_clear()
    for cell, hidden, threads, shared in (("gru", 7, 32, (2 * 8 + 3 * 32) * 4), ("gru", 32, 128, (2 * 32 + 3 * 128) * 4),
                                          ("lstm", 7, 32, (2 * 8 + 3 * 32) * 4), ("lstm", 32, 128, (2 * 32 + 3 * 128) * 4),
                                          ("rnn_relu", 7, 32, (2 * 32 + 3 * 7) * 4)):  # fmt: skip
        assert recurrent_cuda._kernel_and_block(cell, torch.float32, hidden, "forward", 48 * 1024, 1)[1:3] == (threads, shared)
    monkeypatch.undo()
    recurrent_cuda._kernel_and_block.cache_clear()
    for cell, hidden, limit, threads, shared in (("gru", 130, 8 * 1024, 160, 2 * 36 * 16),
                                                 ("lstm", 150, 48 * 1024, 160, 2 * 40 * 16 + 4 * 3 * 38 * 4 * 16)):
        assert recurrent_cuda._kernel_and_block(cell, torch.float32, hidden, "forward", limit, 8)[1:3] == (threads, shared)
    for cell, hidden, limit, threads, shared in (("gru", 130, 8 * 1024, 160, 2 * 100 * 16),
                                                 ("lstm", 150, 48 * 1024, 160, 2 * 152 * 16 + 11 * 38 * 4 * 16)):
        assert recurrent_cuda._kernel_and_block(cell, torch.float32, hidden, "backward", limit, 8)[1:3] == (threads, shared)
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the emulated kernels")
    for name in (
        sanitizers.replace("address", "asan")
        .replace("undefined", "ubsan")
        .replace("thread", "tsan")
        .split(",")
    ):
        runtime = subprocess.run(
            ["g++", f"-print-file-name=lib{name}.so"], capture_output=True, text=True
        ).stdout
        if not os.path.isabs(runtime.strip()):
            pytest.skip(f"g++ has no lib{name} (the sanitizer runtime is not installed)")
    driver = Path(__file__).with_name("recurrent_cuda_sanitize.cpp")
    binary = tmp_path / "driver"
    build = subprocess.run(
        ["g++", "-std=c++20", "-pthread", "-O1", "-g", f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all",
         "-I", str(kernel_path(".")), "-x", "c++", str(driver), "-o", str(binary)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, f"the sanitized driver does not build:\n{build.stderr[-3000:]}"
    env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0", "TSAN_OPTIONS": "halt_on_error=1"}
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "Sanitizer" not in run.stderr, run.stderr[-3000:]
    assert "launch status 0" in run.stdout
