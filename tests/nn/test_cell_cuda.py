"""The compiled cell loop's CUDA twin (nn/cell_cuda.py) on this machine: its kernels through the host emulation
(the generated CUDA source built with g++, the GPU's launches) against the CPU compiled loop, the falls back to
the torch path with their reasons, and the generated source through nvcc (compile only)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native
from lightning_bppsa.kernels.cell_cuda_emulated import H100_SHARED_BYTES, EmulatedBackend
from torch import nn

from lightning_bppsa.nn import Recurrence, cell_cuda, cell_kernel, recurrence
from lightning_bppsa.nn.cell_cuda import CudaCellKernel, Launch, generate, launch_config
from lightning_bppsa.nn.cell_kernel import CellKernel, Unsupported
from lightning_bppsa.nn.cell_structure import cell_tensors, trace_cell

F64 = torch.float64
CPU = torch.device("cpu")

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the host emulation"),
    pytest.mark.skipif(
        not _native.build_expected(), reason="no C compiler: no CPU compiled loop to compare with"
    ),
]


def _cases(name: str):
    """The cells of a test module next to this one (tests/nn/test_cell_kernel.py: every op the generator emits,
    one to three states; tests/nn/test_cell_corpus.py: cells written the ways people write them)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_{name}_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES, CORPUS = _cases("test_cell_kernel"), _cases("test_cell_corpus")


class MemoryFirst(nn.Module):
    """A leaky memory before the hidden state, ``(m, h)``: the linear map reads only the second state tensor (the
    kernels' staged weight rows start at ``H``), the memory is read directly."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.ih, self.hh = nn.Linear(inputs, 2 * hidden), nn.Linear(hidden, 2 * hidden, bias=False)

    def forward(self, x, state):
        m, h = state
        a, b = (self.ih(x) + self.hh(h)).chunk(2, -1)
        keep = torch.sigmoid(a)
        return keep * m + (1 - keep) * h, torch.tanh(b + m)


CELLS = [CASES.SmoothOps, CASES.PiecewiseOps, CASES.ThreeStates, MemoryFirst]


def _structure(cell, batch, dtype=F64):
    sizes = cell.state_size if isinstance(cell.state_size, tuple) else (cell.state_size,)
    states = tuple(torch.randn(batch, s, dtype=dtype) for s in sizes)
    return trace_cell(
        cell, torch.randn(batch, 3, dtype=dtype), states, isinstance(cell.state_size, tuple)
    ), torch.cat(states, -1)


def buffers_only(source) -> int:
    """The shared memory of a device with room for the kernels' buffers and not the backward's weights."""
    return max(launch_config(source, name, 1, 1, 0).shared_bytes for name in cell_cuda.KERNELS)


def assert_cuda_loop_equals_cpu_loop(cell, structure, s0, source, staged: bool, batch: int, steps: int):
    """The emulated CUDA kernels of ``source`` against the CPU compiled loop, to float64 rounding: forward
    (states, scales, diagonal, input partials; and without factors), the fused sweep for each gradient form
    and the products after a scan, with the weights staged in shared memory or (a device with room for the
    buffers only) read from global memory. Returns the emulated backend (its launches)."""
    backend = EmulatedBackend(shared_limit=H100_SHARED_BYTES if staged else buffers_only(source))
    ours, theirs = CudaCellKernel(structure, F64, CPU, backend), CellKernel(structure, F64)
    x_flat = torch.randn(batch * steps, 3, dtype=F64)
    states, factors = ours.forward(cell_tensors(cell), x_flat, s0, batch, True)
    states_c, factors_c = theirs.forward(cell_tensors(cell), x_flat, s0, batch, True)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    close(states, states_c)
    close(factors.scales, factors_c.scales)
    close(factors.input_partials, factors_c.input_partials)
    assert (factors.diagonal is None) == (factors_c.diagonal is None)
    if factors.diagonal is not None:
        close(factors.diagonal, factors_c.diagonal)
    d = s0.shape[-1]
    per_step, final = torch.randn(batch, steps, d, dtype=F64), torch.randn(batch, d, dtype=F64)
    for grads in ((per_step, final), (None, final), (per_step, None)):
        g0, products = (t.clone() for t in ours.scan(factors, *grads))
        g0_c, products_c = theirs.scan(factors_c, *grads)
        close(g0, g0_c)
        close(products, products_c)
    grad = torch.randn(batch, steps + 1, d, dtype=F64)
    close(ours.products(factors, grad), theirs.products(factors_c, grad))
    without, none = ours.forward(cell_tensors(cell), x_flat, s0, batch, False)
    assert none is None
    close(without, states_c)
    return backend


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("hidden", [5, 33])  # one warp, two warps per block
@pytest.mark.parametrize("cell_type", CELLS)
def test_emulated_kernels_equal_the_cpu_compiled_loop(cell_type, hidden, staged):
    """Forward (states, scales, diagonal, input partials), the fused sweep for each gradient form, and the
    products after a scan: the CUDA kernels' results are the CPU loop's to float64 rounding, with the pieces'
    weights staged in shared memory or (a device with room for the buffers only) read from global memory."""
    torch.manual_seed(hidden)
    cell = cell_type(3, hidden).to(F64)
    batch, steps = 2, 4
    structure, s0 = _structure(cell, batch)
    source, *_ = generate(structure, F64)
    backend = assert_cuda_loop_equals_cpu_loop(cell, structure, s0, source, staged, batch, steps)
    expected = [
        launch_config(source, name, batch, steps, backend.shared_limit(CPU)) for name in cell_cuda.KERNELS[:2]
    ]
    forward, backward = expected
    if source.spread:  # a thread per item (each kind from a warp's start), piece coordinate or read column
        assert forward.block >= max(source.partial_items, source.pieces * hidden) and forward.block % 32 == 0
        assert backward.block >= max(source.product_items, source.gradient_items, source.read_columns)
    else:  # a thread per coordinate
        assert (forward.block, backward.block) == (64, 64)
    assert (forward.grid, backward.grid) == (batch, batch)
    # without room for the weights beside the backward's buffers the forward's may still fit beside its own
    weights = source.read_columns * source.pieces * source.width * 8
    fits = launch_config(source, "bppsa_cell_cuda_forward", 1, 1, 0).shared_bytes + weights <= buffers_only(
        source
    )
    assert [launch.staged for launch in expected] == [staged or fits, staged]
    assert backend.launches[:2] == [  # the weights' reads compiled for where they are (staged: shared memory)
        (launch.entry, launch.grid, launch.block, launch.shared_bytes) for launch in expected
    ]
    assert backend.launches[1][0] == (
        "bppsa_cell_cuda_backward" if staged else "bppsa_cell_cuda_backward_global"
    )


def test_launches_stage_the_read_weight_rows_and_the_products_grid_covers_every_row():
    # pieces f, g of [x, h] and kk(k): they read states 0 and 2, so state columns [0, 3 H) are staged
    structure, _ = _structure(CASES.ThreeStates(3, 40).to(F64), 2)
    source, *_ = generate(structure, F64)
    assert (source.width, source.n_states, source.pieces, source.read_columns) == (40, 3, 3, 120)
    weights, limit = 120 * 120 * 8, H100_SHARED_BYTES
    forward = launch_config(source, "bppsa_cell_cuda_forward", 7, 9, limit)
    assert forward == Launch("bppsa_cell_cuda_forward", 7, 64, (2 * 120 + 120) * 8 + weights, staged=True)
    backward = launch_config(source, "bppsa_cell_cuda_backward", 7, 9, limit)
    assert backward == Launch("bppsa_cell_cuda_backward", 7, 64, 2 * 120 * 8 + weights, staged=True)
    # a device without the room: the weights stay in global memory, the buffers alone in shared memory
    small = launch_config(source, "bppsa_cell_cuda_forward", 7, 9, weights)
    assert small == Launch("bppsa_cell_cuda_forward", 7, 64, (2 * 120 + 120) * 8, staged=False)
    products = launch_config(source, "bppsa_cell_cuda_cotangent", 7, 9, limit)
    assert products.grid * products.block >= 7 * 9 * 40 and products.block % 32 == 0
    with pytest.raises(ValueError, match="no such kernel"):
        launch_config(source, "bppsa_cell_forward", 1, 1, limit)


def _recurrence_with(monkeypatch, backend) -> None:
    """Recurrence's compiled loop on CPU tensors made the CUDA one, run through ``backend``."""
    monkeypatch.setattr(
        recurrence,
        "_compiled_loop",
        lambda structure, dtype, device: CudaCellKernel(structure, dtype, device, backend),
    )


def _torch_path(cell, reason: str) -> None:
    """``Recurrence(cell)`` keeps the torch path saying ``reason`` and equals autograd through the loop."""
    torch.manual_seed(3)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    if isinstance(cell.state_size, tuple):  # the loss reads every state tensor
        cell.output_fn = lambda state: torch.cat(state, -1)
    module = Recurrence(cell, algorithm="linear")
    ours = CORPUS._grads(lambda: module(x)[0], leaves)
    stats = module.last_stats
    assert stats["jacobians"] == "factored" and stats["cell_kernel"] is None, stats
    assert reason in stats["cell_kernel_reason"], stats["cell_kernel_reason"]
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), leaves), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "cell_type", [CORPUS.TorchLSTMCell, CORPUS.TorchGRUCell, CORPUS.WideMemory], ids=lambda c: c.__name__
)
def test_torchs_cells_and_mixed_widths_run_the_cuda_loop_exactly(monkeypatch, cell_type):
    """torch's own cells (in-place ops in their traces) and a state of widths (H, 2H) on the CUDA loop (emulated):
    factored, compiled, and equal to autograd through the Python loop."""
    _recurrence_with(monkeypatch, EmulatedBackend())
    torch.manual_seed(4)
    cell = cell_type(3, 5).to(F64)
    x = torch.randn(5, 2, 3, dtype=F64, requires_grad=True)
    module, ours = CORPUS._recurrence(cell, x)
    stats = module.last_stats
    assert stats["jacobians"] == "factored" and stats["cell_kernel"] == "cuda (emulated)", stats
    for a, b in zip(ours, CORPUS._grads(lambda: CORPUS._loop(cell, x), [x, *cell.parameters()]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_device_without_room_for_the_buffers_keeps_the_torch_path(monkeypatch):
    _recurrence_with(
        monkeypatch, EmulatedBackend(shared_limit=64)
    )  # two 5-wide float64 state buffers: 80 bytes
    _torch_path(CASES.SmoothOps(3, 5).to(F64), "bytes of shared memory")


def test_kernels_that_do_not_load_keep_the_torch_path(monkeypatch):
    class NoDevice(EmulatedBackend):
        def load(self, source, device):
            raise RuntimeError("the CUDA cell loop cannot run here: torch sees no CUDA device")

    _recurrence_with(monkeypatch, NoDevice())
    _torch_path(CASES.PiecewiseOps(3, 5).to(F64), "torch sees no CUDA device")


def test_a_first_run_that_fails_keeps_the_torch_path(monkeypatch):
    class Refused(EmulatedBackend):
        def launch(self, source, launch, args, device):
            raise OSError(
                "too many resources requested for launch"
            )  # CuPy's CUDADriverError is no RuntimeError

    _recurrence_with(monkeypatch, Refused())
    _torch_path(CASES.ThreeStates(3, 4).to(F64), "first run failed")


def test_a_state_wider_than_a_block_is_not_compiled():
    structure, _ = _structure(CASES.PiecewiseOps(3, cell_cuda.MAX_THREADS + 1).to(F64), 2)
    with pytest.raises(Unsupported, match="at most 256"):
        CudaCellKernel(structure, F64, CPU, EmulatedBackend())


def test_the_cuda_source_has_the_c_loops_step_statements():
    """One generator for both targets: the CUDA source's step functions are the C loop's statements, only the
    target's spelling around them (qualifiers, the loop over j, includes, the loop's own header) differs."""
    structure, _ = _structure(CASES.ThreeStates(3, 4).to(F64), 2)
    c_text, c_inputs, _ = cell_kernel._generate(structure, F64)
    source, cuda_inputs, _ = generate(structure, F64)
    assert c_inputs == cuda_inputs

    def step(text: str, target: cell_kernel.Target) -> str:
        body = text[text.index(f"{target.qualifier} void cell_values(") :]
        body = body[: body.index(target.epilogue(structure, len(c_inputs))[0])]
        return body.replace(target.qualifier, "QUALIFIER").replace(
            target.loop.format(h=structure.width), "LOOP"
        )

    assert step(c_text, cell_kernel.C) == step(source.text, cell_cuda.TARGET)
    assert step(c_text, cell_kernel.C).count("LOOP") == 2
    assert "const int64_t j = threadIdx.x;" in source.text and '#include "cell_loop.h"' not in source.text
    # the backward's sums over the kept partials: the same macros, spelled by each loop's accessors
    sums = [
        line
        for line in c_text.splitlines()
        if line.startswith(("#define CELL_PRODUCTS", "#define CELL_DIRECT"))
    ]
    assert len(sums) == 2 and all(line in source.text.splitlines() for line in sums)
    assert "ADD(" in sums[1]  # ThreeStates reads a state directly


def test_the_cupy_backend_loads_every_kernel_and_launches_through_the_packages_loader(monkeypatch):
    """With a stand-in for kernels/cupy_loader: each kernel of the generated text loaded once, a launch queued
    with launch_config's grid, block and shared memory; a CPU device or an unusable CuPy is a RuntimeError."""
    calls = []

    class Loader:
        answer = (True, "")

        def available(self):
            return self.answer

        def load_function(self, index, text, name):
            calls.append(("load", index, name, text))
            return f"function {name}"

        def launch(self, function, index, grid, block, shared, args):
            calls.append(("launch", function, index, grid, block, shared, tuple(args)))

    loader = Loader()
    monkeypatch.setattr(cell_cuda, "_loader", lambda: loader)
    structure, _ = _structure(CASES.SmoothOps(3, 4).to(F64), 2)
    source, *_ = generate(structure, F64)
    backend = cell_cuda.CupyBackend()
    backend.load(source, torch.device("cuda", 1))
    assert [(c[1], c[2]) for c in calls] == [(1, name) for name in cell_cuda.ENTRIES]
    assert all(c[3] is source.text for c in calls)
    launch = launch_config(source, "bppsa_cell_cuda_backward", 3, 8, H100_SHARED_BYTES)
    backend.launch(source, launch, [1, 2, 3], torch.device("cuda", 1))
    assert calls[-1] == (
        "launch",
        "function bppsa_cell_cuda_backward",
        1,
        3,
        launch.block,
        launch.shared_bytes,
        (1, 2, 3),
    )
    with pytest.raises(RuntimeError, match="takes CUDA tensors"):
        backend.load(source, CPU)
    loader.answer = (False, "CuPy is not installed")
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        backend.load(source, torch.device("cuda", 1))


@pytest.mark.slow  # ~1-2 s of nvcc per source
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_nvcc_compiles_the_generated_source(tmp_path, dtype):
    """The text NVRTC gets on a GPU, through nvcc for sm_90 (no GPU needed): every cell of the op corpus, and one
    whose pieces read no state (MinGRU: no weight columns to stage, once a division by zero)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit (no GPU needed)")
    for cell_type in [*CELLS, CORPUS.MinGRU]:
        structure, _ = _structure(cell_type(3, 5).to(dtype), 2, dtype)
        source, *_ = generate(structure, dtype)
        path = tmp_path / f"{cell_type.__name__}.cu"
        path.write_text(source.text)
        cmd = [nvcc, "-cubin", "-arch=sm_90", "-std=c++17", "-o", str(path.with_suffix(".cubin")), str(path)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"{cell_type.__name__} {dtype}:\n{result.stderr[-3000:]}"
        assert "warning" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump
def test_a_steps_products_read_their_weights_from_registers(tmp_path):
    """sm_90 SASS of torch's GRU cell at H = 32, float32 (one thread per coordinate): a step of the forward loads
    the state alone from shared memory (8 broadcast vectors and a few scalars), not a weight per multiply-add
    (105 loads a step, 407 instructions, when it did), and a step of the backward the pieces' products alone (24
    vectors; it loaded 96 weights more, 308 instructions); neither spills (ptxas)."""
    from lightning_bppsa.kernels import cuda_inspect

    structure, _ = _structure(CORPUS.TorchGRUCell(3, 32).float(), 2, torch.float32)
    source, *_ = generate(structure, torch.float32)
    path = tmp_path / "gru32.cu"
    path.write_text(source.text)
    try:
        loops = cuda_inspect.sass_loops("sm_90", source=str(path), options=())
    except FileNotFoundError as err:
        pytest.skip(f"needs nvcc, cuobjdump and nvdisasm (the [dev] extra's NVIDIA wheels): {err}")
    forward = max(loops["bppsa_cell_cuda_forward"], key=lambda loop: loop.instructions)
    backward = max(loops["bppsa_cell_cuda_backward"], key=lambda loop: loop.instructions)
    assert forward.kinds.get("LDS", 0) <= 12 and forward.instructions <= 340, forward.kinds
    assert backward.kinds.get("LDS", 0) <= 26 and backward.instructions <= 250, backward.kinds
    ptxas = subprocess.run(
        [shutil.which("nvcc"), "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-warn-spills", "-o",
         str(tmp_path / "gru32.cubin"), str(path)], capture_output=True, text=True,
    )  # fmt: skip
    assert ptxas.returncode == 0 and "spill" not in ptxas.stderr, ptxas.stderr[-2000:]
