"""The CUDA loop's layout for narrow state blocks (nn/cell_cuda.py, CELL_SPREAD in kernels/cell_loop_cuda.h).

A state of widths (31, 33) factors into 64 blocks of width 1 (their greatest common divisor): with one thread per
coordinate, thread 0 alone did a step's 64 x 64 multiply-adds with the weights in the forward and again in the
backward (CoprimeWidths ran 45 ms a training step on an H200 where HandLSTM ran 4.8). Below a warp's width the
block shares them out, and (since the products were spread) the step's pointwise part too: the generated step
of one coordinate splits into parts that share no computed value, one per state block here, run as items by the
block's threads (thread 0 alone ran all 64 parts' activations and partials). These tests count the busiest
thread's work from the launches and the generated items, and check the results against the CPU loop and
autograd in float64 through the host emulation."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native, cuda_inspect
from lightning_bppsa.kernels.cell_cuda_emulated import H100_SHARED_BYTES, EmulatedBackend
from torch import nn

from lightning_bppsa.nn import Recurrence, cell_cuda, recurrence
from lightning_bppsa.nn.cell_cuda import CudaCellKernel, generate, launch_config, weight_products
from lightning_bppsa.nn.cell_kernel import Unsupported
from lightning_bppsa.nn.cell_structure import trace_cell

F64 = torch.float64
CPU = torch.device("cpu")
FORWARD, BACKWARD = cell_cuda.KERNELS[:2]

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host emulation"),
    pytest.mark.skipif(
        not _native.build_expected(), reason="no C compiler: no CPU compiled loop to compare with"
    ),
]


def _sibling(name: str):
    """A test module of this folder, loaded by path (tests are not a package)."""
    path = Path(__file__).resolve().parent / name
    spec = importlib.util.spec_from_file_location(f"_sibling_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS = _sibling("test_cell_corpus.py")
CUDA_TESTS = _sibling("test_cell_cuda.py")  # its comparison of the emulated kernels with the CPU loop


class ManyWidths(nn.Module):
    """A state of widths ``(2, 3, 5, 1) * scale`` (blocks of ``scale``): pieces of all four from the first two
    states, the second read directly, the third gated by an input value (its partials by the input part), the
    first and the fourth the same formula (one template, offsets 0, 1 then 10: not affine, two item kinds)."""

    def __init__(self, inputs: int, scale: int) -> None:
        super().__init__()
        self.state_size = (2 * scale, 3 * scale, 5 * scale, scale)
        self.ih, self.gx = nn.Linear(inputs, 11 * scale), nn.Linear(inputs, 5 * scale)
        self.hh = nn.Linear(5 * scale, 11 * scale, bias=False)

    def forward(self, x, state):
        a, b, c, d = state
        s = d.shape[-1]
        z = self.ih(x) + self.hh(torch.cat([a, b], -1))
        za, zb, zc, zd = z[:, : 2 * s], z[:, 2 * s : 5 * s], z[:, 5 * s : 10 * s], z[:, 10 * s :]
        gate = torch.sigmoid(self.gx(x))
        leaky = lambda z, v: torch.tanh(z) * 0.5 + v * 0.5  # noqa: E731
        c = gate * c + (1 - gate) * torch.tanh(zc)
        return leaky(za, a), torch.sigmoid(zb) * b + torch.tanh(zb), c, leaky(zd, d)


def _source(cell_type, hidden: int, batch: int = 2, dtype: torch.dtype = F64):
    cell = cell_type(3, hidden).to(dtype)
    states = tuple(torch.randn(batch, s, dtype=dtype) for s in cell.state_size)
    structure = trace_cell(cell, torch.randn(batch, 3, dtype=dtype), states, True)
    return cell, structure, torch.cat(states, -1), generate(structure, dtype)[0]


def _kinds_of(source, function: str) -> list[tuple[int, int, str]]:
    """The item kinds of the generated item function ``function``, in order: (first item, end, body)."""
    text = source.text[source.text.index(f"void {function}(int e") :]
    kinds = re.split(r"    if \(e >= (\d+) && e < (\d+)\) \{", text[: text.index("\n}\n")])[1:]
    return [(int(a), int(b), body) for a, b, body in zip(kinds[::3], kinds[1::3], kinds[2::3], strict=True)]


def test_narrow_blocks_share_the_weight_products_over_the_block():
    """CoprimeWidths at H = 32: 64 states and 64 pieces of width 1 read all 64 state columns. Thread j alone
    would do 64 x 64 = 4096 multiply-adds a step in each kernel; spread over a block of 64 threads, 64. A state
    of warp-wide blocks (HandLSTM, H = 32) keeps one thread per coordinate: the launches it was timed with."""
    *_, source = _source(CORPUS.CoprimeWidths, 32)
    assert (source.width, source.n_states, source.pieces, source.read_columns) == (1, 64, 64, 64)
    assert source.spread and "#define CELL_SPREAD 1" in source.text
    alone = source.pieces * source.read_columns  # thread 0's share with one thread per coordinate
    assert alone == 4096
    # the forward's block: a thread per item of the step with its partials (64 states, 33 constant scales, each
    # kind from a warp's start: 129)
    for name, block in ((FORWARD, 160), (BACKWARD, 64)):
        launch = launch_config(source, name, 16, 1000, H100_SHARED_BYTES)
        assert (launch.grid, launch.block, launch.staged) == (16, block, True)
        assert weight_products(source, launch) == 64, name
    backward = launch_config(source, BACKWARD, 16, 1000, H100_SHARED_BYTES)
    # products, column sums, the states' gradient, two steps' rows (128 kept scales: by the 64 pieces and the 64
    # states read directly; 64 direct gradients), weights
    assert source.backward_row == 128 + 64
    assert backward.shared_bytes == (2 * 64 + 64 + 2 * 64 + 2 * (128 + 64) + 64 * 64) * 8
    forward = launch_config(source, FORWARD, 16, 1000, H100_SHARED_BYTES)
    assert forward.shared_bytes == (2 * 64 + 64 + 2 * 64 + 64 * 64) * 8  # states, pieces, two steps' offsets

    *_, lstm = _source(CORPUS.HandLSTM, 32)
    assert not lstm.spread and "#define CELL_SPREAD 0" in lstm.text
    for name in (FORWARD, BACKWARD):
        launch = launch_config(lstm, name, 16, 1000, H100_SHARED_BYTES)
        assert launch.block == 32 and weight_products(lstm, launch) == 4 * 32, name
    with pytest.raises(ValueError, match="no products"):
        weight_products(source, launch_config(source, cell_cuda.KERNELS[2], 16, 1000, H100_SHARED_BYTES))


def test_the_pointwise_step_of_narrow_blocks_is_one_part_per_thread():
    """CoprimeWidths at H = 32: the step of its one coordinate is 64 parts (one per state block: its piece's tanh,
    its new state, its partials), of two templates (the 31 states of width H - 1, the 33 of width H + 1), plus
    the 33 constant diagonal scales of the second; one thread used to run them all. Now each is an item and the
    forward's block has a thread per item: the busiest thread runs one tanh a step. The backward's products and
    new states' gradient are 64 items each, one per piece / state block."""
    *_, source = _source(CORPUS.CoprimeWidths, 32)
    # items from a warp's start per kind: [0, 31), [32, 65) and (partials) [96, 129)
    assert (source.value_items, source.partial_items, source.product_items) == (65, 129, 64)
    # a device with room for the buffers only: neither kernel's weights fit (both _global entries run)
    limit = CUDA_TESTS.buffers_only(source)
    assert not any(launch_config(source, name, 16, 1000, limit).staged for name in (FORWARD, BACKWARD))
    values, partials = _kinds_of(source, "cell_item_values"), _kinds_of(source, "cell_item_partials")
    assert [kind[:2] for kind in values] == [(0, 31), (32, 65)]  # two kinds of 31 and 33 items, a warp apart
    assert [kind[:2] for kind in partials] == [(0, 31), (32, 65), (96, 129)]
    assert all(body.count("tanh_f64(") == 1 for *_, body in values + partials[:2])
    assert "tanh" not in partials[2][2] and partials[2][2].count("scales[") == 1  # the constant scale
    forward = launch_config(source, FORWARD, 16, 1000, H100_SHARED_BYTES)
    assert forward.block >= source.partial_items  # one item a thread
    backward = launch_config(source, BACKWARD, 16, 1000, H100_SHARED_BYTES)
    assert backward.block >= max(source.product_items, source.gradient_items) == 64
    assert [kind[:2] for kind in _kinds_of(source, "cell_item_products")] == [(0, 64)]
    assert [kind[:2] for kind in _kinds_of(source, "cell_item_gradient")] == [(0, 64)]

    *_, lstm = _source(CORPUS.HandLSTM, 32)  # warp-wide blocks: one thread per coordinate, no items
    assert (lstm.value_items, lstm.partial_items, lstm.product_items) == (0, 0, 0)
    assert "cell_item_values(int e" not in lstm.text


def test_item_kinds_group_one_template_while_its_offsets_are_affine():
    parts = [("A @ @", (0, 4)), ("A @ @", (1, 6)), ("B @", (7,)), ("A @ @", (2, 8)), ("A @ @", (5, 9))]
    kinds = cell_cuda._kinds(parts)
    assert [(k.template, k.base, k.step, k.count) for k in kinds] == [
        ("A @ @", (0, 4), (1, 2), 3),
        ("A @ @", (5, 9), (0, 0), 1),
        ("B @", (7,), (0,), 1),
    ]
    assert kinds[0].body() == "A (0 + 1 * m) (4 + 2 * m)" and kinds[1].body() == "A 5 9"
    # ManyWidths (H = 1): the first state's two blocks, the fourth's (same template, not affine), the second's
    # three, the gated third's five (each its own input values: in[m], in[5 + m])
    *_, source = _source(ManyWidths, 1)
    values = _kinds_of(source, "cell_item_values")
    assert [kind[:2] for kind in values] == [(0, 2), (32, 33), (64, 67), (96, 101)]
    assert "in[(" in values[3][2]


def test_a_step_spelled_otherwise_than_the_generators_is_refused():
    """The items are made from the generated text: a statement of another form (or no loop head) is Unsupported
    (Recurrence then keeps the torch path with the reason), never split wrongly."""
    *_, source = _source(CORPUS.CoprimeWidths, 4)
    text = source.text
    assert cell_cuda._step_parts(text, "cell_values")  # as generated
    odd = text.replace("        next[0 + j] = ", "        if (row) next[0 + j] = ", 1)
    with pytest.raises(Unsupported, match="do not read"):
        cell_cuda._step_parts(odd, "cell_values")
    headless = text.replace(cell_cuda.TARGET.loop.format(), "{ const int64_t j = 0;")
    with pytest.raises(Unsupported, match="not spelled"):
        cell_cuda._step_parts(headless, "cell_partials")
    with pytest.raises(Unsupported, match="sum the CUDA items do not read"):
        cell_cuda._sums(text.replace("OUT(0, S(0) * G(0))", "OUT(0, S(0) * G(0) * 2)"), "CELL_PRODUCTS")


NARROW = [(CORPUS.CoprimeWidths, 32), (ManyWidths, 1), (ManyWidths, 2)]  # H = 1, 1, 2


@pytest.mark.parametrize("max_threads", [256, 32])  # 32: threads take several items, pieces and columns
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("cell_type, hidden", NARROW, ids=lambda c: getattr(c, "__name__", str(c)))
def test_narrow_blocks_equal_the_cpu_compiled_loop(monkeypatch, cell_type, hidden, staged, max_threads):
    """The spread kernels' states, factors, fused sweeps (each gradient form) and products after a scan equal the
    CPU loop's to float64 rounding for three batch rows, with the weights staged or in global memory (each its
    entry point) and a block smaller than the work (the strided loops' further trips)."""
    monkeypatch.setattr(cell_cuda, "MAX_THREADS", max_threads)
    torch.manual_seed(5)
    cell, structure, s0, source = _source(cell_type, hidden, batch=3)
    backend = CUDA_TESTS.assert_cuda_loop_equals_cpu_loop(
        cell, structure, s0, source, staged, batch=3, steps=3
    )
    launches = [launch_config(source, name, 3, 3, backend.shared_limit(CPU)) for name in (FORWARD, BACKWARD)]
    assert launches[1].staged == staged  # (the forward's weights may fit beside its smaller buffers)
    expected = {(launch.entry, launch.block) for launch in launches}
    assert {
        (kernel, block) for kernel, _, block, _ in backend.launches if "cotangent" not in kernel
    } == expected
    assert max(block for _, block in expected) <= max_threads


@pytest.mark.parametrize("algorithm", ["linear", "blelloch"])
@pytest.mark.parametrize("cell_type, hidden", NARROW[:2], ids=lambda c: getattr(c, "__name__", str(c)))
def test_narrow_cells_on_the_spread_loop_equal_autograd_in_float64(monkeypatch, cell_type, hidden, algorithm):
    """Recurrence(cell) with blocks of width 1 on the CUDA loop (emulated): outputs and every gradient equal
    autograd through the Python loop of the cell to 1e-10."""
    backend = EmulatedBackend()
    monkeypatch.setattr(
        recurrence,
        "_compiled_loop",
        lambda structure, dtype, device: CudaCellKernel(structure, dtype, device, backend),
    )
    torch.manual_seed(6)
    cell = cell_type(3, hidden).to(F64)
    cell.output_fn = lambda state: torch.cat(state, -1)  # the loss reads both state tensors
    x = torch.randn(4, 2, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm=algorithm)
    ours = CORPUS._grads(lambda: module(x)[0], leaves)
    stats = module.last_stats
    assert stats["jacobians"] == "factored" and stats["cell_kernel"] == "cuda (emulated)", stats
    assert FORWARD in [launch[0] for launch in backend.launches]
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _cubin(tmp_path, cell_type, hidden: int) -> tuple[Path, str]:
    """The text NVRTC gets for ``cell_type`` (float32, the benchmark's) through nvcc for sm_90: the cubin and
    ptxas's report (skips without nvcc)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit (no GPU needed)")
    *_, source = _source(cell_type, hidden, dtype=torch.float32)
    path = tmp_path / f"{cell_type.__name__}_{hidden}.cu"
    path.write_text(source.text)
    cmd = [nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-Xptxas", "-warn-spills"]
    result = subprocess.run(
        [*cmd, "-o", str(path.with_suffix(".cubin")), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return path.with_suffix(".cubin"), result.stderr


@pytest.mark.slow  # ~2 s of nvcc a cell
@pytest.mark.parametrize("cell_type, hidden", NARROW, ids=lambda c: getattr(c, "__name__", str(c)))
def test_nvcc_compiles_the_spread_kernels_without_spills(tmp_path, cell_type, hidden):
    """The spread kernels (every entry point) build without warnings and without spilling registers."""
    _, report = _cubin(tmp_path, cell_type, hidden)
    assert "warning" not in report, report[-3000:]
    assert report.count(" 0 bytes spill stores") == len(cell_cuda.ENTRIES), report[-3000:]


@pytest.mark.slow  # ~2 s of nvcc
@pytest.mark.parametrize("cell_type, hidden", [(CORPUS.CoprimeWidths, 32), (CORPUS.HandLSTM, 32)])
def test_the_weights_reads_compile_for_where_they_are(tmp_path, cell_type, hidden):
    """Each entry point knows at compile time where the weights are: the staged kernels read them with shared-memory
    loads, the _global ones with global loads, and no kernel of these cells (no input values) has a generic
    load (a runtime flag made every weight read one: 128 in CoprimeWidths' forward)."""
    cuobjdump = shutil.which("cuobjdump") or cuda_inspect._wheel_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("needs cuobjdump (the [dev] extra's NVIDIA wheel)")
    cubin, _ = _cubin(tmp_path, cell_type, hidden)
    env = {**os.environ, "NVDISASM_PATH": str(Path(cuobjdump).parent)}
    loads = {}
    for entry in cell_cuda.ENTRIES[:4]:
        sass = subprocess.run(
            [cuobjdump, "-sass", "-fun", entry, str(cubin)], capture_output=True, text=True, env=env
        )
        assert sass.returncode == 0 and "Function :" in sass.stdout, sass.stderr[-300:]
        opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass.stdout)
        loads[entry] = {op: opcodes.count(op) for op in ("LD", "LDS", "LDG")}
    assert all(count["LD"] == 0 for count in loads.values()), loads
    for name in (FORWARD, BACKWARD):  # the weights' reads moved from shared to global loads
        assert loads[name]["LDS"] > loads[f"{name}_global"]["LDS"], loads
        assert loads[name]["LDG"] < loads[f"{name}_global"]["LDG"], loads
