"""The CUDA scan kernels (``kernels/scan.cu``) run on the CPU through the host-emulation header.

Same source, same launches (``cuda.launch_config``) as on a GPU; compared with a float64 plain loop.
One OS thread per CUDA thread: the grids stay tiny. ``resident`` bounds the blocks running at once
(1 = strictly one after another), which checks the chunked kernel's inter-block waits for deadlock.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import cuda, emulated

from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")


#: tests/kernels/test_cuda.py, for its ``config`` (cuda.launch_config with one test shape's defaults)
_spec = importlib.util.spec_from_file_location("_launch_tests", Path(__file__).with_name("test_cuda.py"))
LAUNCH_TESTS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(LAUNCH_TESTS)


def plain_loop(jacobians_t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``g_n`` = last-state gradient, ``g_t = J_{t+1}ᵀ g_{t+1} + δ_t``, in the inputs' dtype."""
    batch, n, d, _ = jacobians_t.shape
    per_step = grad.dim() == 3
    out = grad.new_empty(batch, n + 1, d)
    out[:, n] = grad[:, n] if per_step else grad
    for t in range(n - 1, -1, -1):
        out[:, t] = (jacobians_t[:, t] @ out[:, t + 1].unsqueeze(-1)).squeeze(-1)
        if per_step:
            out[:, t] += grad[:, t]
    return out


def make_factored(batch, n, d, tiles, diagonal, per_step, generator):
    def rand(*shape):
        return torch.rand(*shape, dtype=torch.float64, generator=generator)

    weight = (rand(tiles * d, d) - 0.5) * (2.0 / d**0.5)
    scales = 0.5 + rand(batch, n, tiles * d)
    diag = 0.5 * rand(batch, n, d) if diagonal else None
    grad = rand(batch, n + 1, d) - 0.5 if per_step else rand(batch, d) - 0.5
    return weight, scales, diag, grad


def make_dense(batch, n, d, per_step, generator):
    jt = (torch.rand(batch, n, d, d, dtype=torch.float64, generator=generator) - 0.5) * (2.2 / d**0.5)
    shape = (batch, n + 1, d) if per_step else (batch, d)
    return jt, torch.rand(*shape, dtype=torch.float64, generator=generator) - 0.5


def check(actual, jt64, grad64, dtype):
    """``actual`` (a scan's output in ``dtype``) against the float64 plain loop over ``jt64``, the chain's
    transposed Jacobians, with ``grad64`` its gradient, within the tolerance derived from ``dtype``."""
    if jt64.dim() != 4 or jt64.shape[-1] != jt64.shape[-2]:
        raise ValueError(
            f"check takes the transposed Jacobians (B, n, d, d) as jt64; got {tuple(jt64.shape)}"
        )
    reference = plain_loop(jt64, grad64)
    baseline = plain_loop(jt64.to(dtype), grad64.to(dtype)) if dtype != torch.float64 else None
    assert actual.dtype == dtype and actual.shape == reference.shape
    assert_derived_close(actual, reference, baseline, floor=1e-12 if dtype == torch.float64 else 1e-5)


SWEEP_CASES = [  # (batch, n, d, per_step): d <= 32 runs the warp-resident sweep, wider the block sweep
    (1, 1, 1, True),
    (3, 130, 1, False),
    (2, 41, 20, True),
    (4, 17, 20, False),
    (1, 23, 7, True),
    (2, 13, 7, False),
    (2, 19, 32, True),
    (1, 11, 32, False),
    (2, 23, 33, True),
    (3, 9, 40, False),
]


@pytest.mark.slow  # the emulated grid: CI runs it, the quick loop does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), SWEEP_CASES)
def test_sweep_factored_gru_tiles(batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d)
    weight, scales, diag, grad = make_factored(batch, n, d, 3, True, per_step, gen)
    args = [t.to(dtype) if t is not None else None for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, "linear", 1)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


@pytest.mark.slow  # the emulated grid: CI runs it, the quick loop does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n", "d", "per_step"), SWEEP_CASES)
def test_sweep_dense(batch, n, d, per_step, dtype):
    gen = torch.Generator().manual_seed(n * 100 + d + 1)
    jt, grad = make_dense(batch, n, d, per_step, gen)
    check(emulated.scan_dense(jt.to(dtype), grad.to(dtype), "linear", 1), jt, grad, dtype)


@pytest.mark.parametrize(
    ("tiles", "diagonal", "d"), [(1, False, 20), (1, True, 7), (2, False, 13), (5, True, 32)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_warp_sweep_any_number_of_weight_tiles(tiles, diagonal, d, dtype):
    """The warp sweep keeps k <= 5 weight tiles (RNN 1, GRU 3, LSTM 5) resident; with or without u_t."""
    gen = torch.Generator().manual_seed(tiles * 100 + d)
    weight, scales, diag, grad = make_factored(2, 15, d, tiles, diagonal, True, gen)
    launch = LAUNCH_TESTS.config(
        element_bytes=dtype.itemsize, n=15, batch=2, d=d, m=tiles * d, affine=True,
        algorithm="linear", chunk_size=1,
    )  # fmt: skip
    assert launch.kernel.startswith("bppsa_warpsweep_factored_") and launch.block == 32
    args = [None if t is None else t.to(dtype) for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, "linear", 1)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


# --------------------------------------------------------------------------------------------------
# The warp sweep compiled per (d, k), its operands staged through a ring of `depth` slots (cp.async)
# --------------------------------------------------------------------------------------------------

RING_SHAPES = [(d, k) for d in (1, 5, 8, 20, 31, 32) for k in (1, 3, 5)]  # + dense (its module is (d, 1))


def ring_depth(d: int, k: int | None, dtype: torch.dtype, lean: bool = False) -> int:
    return cuda.warp_layout(
        factored=k is not None, d=d, k=k or 1, element_bytes=dtype.itemsize, lean=lean
    ).depth


def check_chain(d, k, n, dtype, algorithm="linear", chunk=1, batch=1, seed=1, resident=None):
    """One factored (k tiles, u_t, per-step delta) or dense (k None, last-state gradient) chain of n steps
    through the emulated kernels, against the float64 loop; returns the output."""
    gen = torch.Generator().manual_seed(1000 * d + 10 * (k or 0) + n)
    if k is None:
        jt, grad = make_dense(batch, n, d, False, gen)
        out = emulated.scan_dense(
            jt.to(dtype), grad.to(dtype), algorithm, chunk, seed=seed, resident=resident
        )
        check(out, jt, grad, dtype)
        return out
    weight, scales, diag, grad = make_factored(batch, n, d, k, True, True, gen)
    args = [t.to(dtype) for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, algorithm, chunk, seed=seed, resident=resident)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, dtype)
    return out


@pytest.mark.parametrize("k", [1, 3, 5, None], ids=["k1", "k3", "k5", "dense"])
@pytest.mark.parametrize("d", [5, 20])
def test_warp_sweep_ring_quick(d, k):
    """n = depth - 1, depth, depth + 1 (the ring's boundaries: fewer steps than slots, exactly full, one
    reuse of a slot) and 2 depth + 3 (every slot reused twice), float32, against the float64 loop."""
    depth = ring_depth(d, k, torch.float32)
    for n in (depth - 1, depth, depth + 1, 2 * depth + 3):
        check_chain(d, k, n, torch.float32)


@pytest.mark.slow  # ~1-2 min: 18 modules built once, then ~100 emulated launches
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 5, None], ids=["k1", "k3", "k5", "dense"])
@pytest.mark.parametrize("d", [1, 8, 31, 32])
def test_warp_sweep_ring_boundaries_every_shape(d, k, dtype):
    """The same boundaries for d = 1 (31 dead lanes), 8, 31 (one dead lane), 32 (none), both dtypes (W in
    registers or in shared memory, rings of 2 to 32 slots)."""
    depth = ring_depth(d, k, dtype)
    for n in sorted({1, depth - 1, depth, depth + 1, 2 * depth + 3} - {0}):
        check_chain(d, k, n, dtype, batch=2 if n < 8 else 1)


@pytest.mark.parametrize(("d", "k"), [(5, 3), (20, 1), (8, None)], ids=["d5k3", "d20k1", "d8dense"])
def test_warp_sweep_ring_in_chunk_sweeps(d, k):
    """The chunked kernel's lean chunk sweeps: chunks of depth - 1, depth and depth + 1 steps (a last partial
    chunk each), a few blocks resident."""
    depth = ring_depth(d, k, torch.float32, lean=True)
    for chunk in (depth - 1, depth, depth + 1):
        check_chain(d, k, 2 * chunk + 3, torch.float32, "chunked", chunk, resident=2)


def test_warp_sweep_bit_identical_whatever_the_copies_timing():
    """Copies landing at other times (another seed: each copy lands at once or only at its wait) and another
    block order give the same bits, linear and chunked."""
    for algorithm, chunk in (("linear", 1), ("chunked", 9)):
        runs = [check_chain(20, 3, 40, torch.float32, algorithm, chunk, batch=2, seed=s) for s in (1, 2, 3)]
        assert all(torch.equal(runs[0], other) for other in runs[1:])


@pytest.mark.parametrize(("d", "k"), [(5, 3), (20, 1), (20, 3), (32, 5)])
def test_warp_layout_is_the_kernels(d, k):
    """cuda.warp_layout (which sizes the launches' shared memory) is what scan.cu compiled for (d, k)."""
    lib = emulated.library((d, k))
    for element_bytes in (4, 8):
        for factored in (True, False):
            for lean in (False, True):
                layout = cuda.warp_layout(
                    factored=factored, d=d, k=k if factored else 1, element_bytes=element_bytes, lean=lean
                )
                if not factored and k != 1:
                    continue  # a dense chain runs from the module of (d, 1)
                compiled = [lib.bppsa_warp_layout(factored, element_bytes, lean, depth) for depth in (0, 1)]
                assert compiled == [layout.shared_bytes, layout.depth], (factored, element_bytes, lean)


def test_a_module_refuses_a_chain_of_another_shape():
    """A launch of the (20, 3) module with a chain of d = 5 traps (bppsa::fail) instead of reading out of bounds."""
    launch = LAUNCH_TESTS.config(n=4, batch=1, d=5, m=15, affine=True, algorithm="linear", chunk_size=1)
    wrong = dataclasses.replace(launch, warp_shape=(20, 3))
    weight, scales, diag, grad = make_factored(1, 4, 5, 3, True, True, torch.Generator().manual_seed(0))
    launcher = emulated._launcher(None, 20.0, 1, 0.0)
    with pytest.raises(RuntimeError, match="an emulated thread failed"):
        cuda.run(
            weight.float(), scales.float(), diag.float(), grad.float(), algorithm="linear", chunk_size=1,
            launcher=lambda config, args, device: launcher(wrong, args, device),
        )  # fmt: skip


CHUNKED_CASES = [  # (batch, n, d, chunk, resident, per_step); chunk counts odd where possible
    (3, 130, 1, 10, None, True),  # 13 chunks, all resident: the look-back sees aggregates
    (2, 61, 20, 12, None, False),  # 6 chunks, one of them partial
    (2, 45, 20, 3, None, True),  # 15 chunks of 3 steps
    (1, 37, 33, 5, 2, True),  # 8 chunks, 2 blocks resident
    (4, 19, 20, 4, 1, False),  # one block at a time: waits only on finished blocks
]


@pytest.mark.slow  # the emulated grid: CI runs it, the quick loop does not
@pytest.mark.parametrize(("batch", "n", "d", "chunk", "resident", "per_step"), CHUNKED_CASES)
def test_chunked_factored(batch, n, d, chunk, resident, per_step):
    gen = torch.Generator().manual_seed(n + d)
    tiles, diagonal = (3, True) if d > 1 else (1, False)
    weight, scales, diag, grad = make_factored(batch, n, d, tiles, diagonal, per_step, gen)
    out = emulated.scan_factored(weight, scales, diag, grad, "chunked", chunk, resident=resident)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


@pytest.mark.slow  # the emulated grid: CI runs it, the quick loop does not
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_warp_sweeps_with_five_tiles(dtype):
    """d = 32, 5 weight tiles: the staged W (163 padded rows) is larger than the chunk matrices it reuses."""
    gen = torch.Generator().manual_seed(32)
    weight, scales, diag, grad = make_factored(2, 23, 32, 5, True, True, gen)
    args = [t.to(dtype) for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, "chunked", 5, resident=3)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, dtype)


WARP_AGGREGATE_CASES = [  # (batch, n, d, tiles, chunk, resident, per_step): float32, k d <= 104
    (2, 61, 20, 3, 12, None, True),  # a GRU's chain, per-step gradients
    (2, 45, 32, 3, 5, 3, True),  # d = 32: the affine row is a 33rd, beyond the warp's lanes
    (3, 40, 26, 4, 7, None, False),  # the widest k d whose aggregates one warp forms
    (2, 23, 1, 1, 4, 1, True),  # d = 1, one block at a time
]


@pytest.mark.slow  # the emulated grid: CI runs it, the quick loop does not
@pytest.mark.parametrize(("batch", "n", "d", "tiles", "chunk", "resident", "per_step"), WARP_AGGREGATE_CASES)
def test_chunked_float32_aggregates_formed_in_one_warp(batch, n, d, tiles, chunk, resident, per_step):
    """The specialised module's float32 chunked kernel: each chunk's aggregate [C; b] formed by the block's one
    warp (a row of C per lane, b as a sweep's state), then the look-back and the chunk's sweep."""
    assert cuda.warp_aggregates(cuda.warp_shape(factored=True, d=d, m=tiles * d), 4)
    gen = torch.Generator().manual_seed(n + d + tiles)
    weight, scales, diag, grad = make_factored(batch, n, d, tiles, d > 1, per_step, gen)
    args = [None if t is None else t.float() for t in (weight, scales, diag, grad)]
    out = emulated.scan_factored(*args, "chunked", chunk, resident=resident)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


@pytest.mark.parametrize(
    ("batch", "n", "d", "chunk", "resident", "per_step"), CHUNKED_CASES[:2] + CHUNKED_CASES[3:]
)
def test_chunked_dense_float32(batch, n, d, chunk, resident, per_step):
    gen = torch.Generator().manual_seed(n + d + 7)
    jt, grad = make_dense(batch, n, d, per_step, gen)
    out = emulated.scan_dense(jt.float(), grad.float(), "blelloch", chunk, resident=resident)
    check(out, jt, grad, torch.float32)


def exact_dense(batch, n, d, generator):
    """Signed permutation Jacobians and small integer per-step gradients: every partial product and
    sum is an integer below 2^24, so any association order (sweep, chunks, look-back) gives the same
    bits, and a wrong carry, a stale or an unpublished (NaN-poisoned) read cannot hide in a tolerance."""
    perms = torch.stack([torch.randperm(d, generator=generator) for _ in range(batch * n)])
    signs = torch.randint(0, 2, (batch * n, d), generator=generator) * 2 - 1
    jt = torch.zeros(batch * n, d, d, dtype=torch.float64)
    jt.scatter_(2, perms.unsqueeze(-1), signs.unsqueeze(-1).double())
    grad = torch.randint(-4, 5, (batch, n + 1, d), generator=generator).double()
    return jt.view(batch, n, d, d), grad


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_blocks_dispatched_in_any_order_take_tickets(seed):
    """Blocks start in a random order with one resident at a time: the kernel must order chunks by the
    ticket it takes, not by blockIdx (a chunk waiting on a block that has not started never finishes)."""
    gen = torch.Generator().manual_seed(seed)
    jt, grad = exact_dense(2, 31, 3, gen)
    out = emulated.scan_dense(jt, grad, "chunked", 3, resident=1, seed=seed, timeout=20)
    assert torch.equal(out, plain_loop(jt, grad))


@pytest.mark.parametrize(
    ("resident", "jitter_us", "dtype"),
    [
        (1, 2000, torch.float64),
        (2, 2000, torch.float32),
        (40, 20000, torch.float64),
        (40, 20000, torch.float32),
    ],
)
def test_look_back_over_about_100_chunks_with_delayed_announcements(resident, jitter_us, dtype):
    """~100 chunks per row (more than the 32-chunk window), 1-2 or 40 blocks resident, each block stalled
    after every announcement: with 40 resident, blocks often find nothing but AGGREGATE in their whole
    window and must wait for the farthest one's INCLUSIVE (the fallback) before reading it; the scratch
    is NaN-poisoned, so reading it before it is published shows."""
    gen = torch.Generator().manual_seed(100 + resident)
    jt, grad = exact_dense(1, 101, 3, gen)
    out = emulated.scan_dense(
        jt.to(dtype), grad.to(dtype), "chunked", 1, resident=resident, jitter_us=jitter_us, seed=7
    )
    assert out.dtype == dtype and torch.equal(out.double(), plain_loop(jt, grad))


def test_same_bits_whatever_the_schedule():
    """Deterministic (torch.use_deterministic_algorithms needs no other path): however far each look-back
    goes under different dispatch orders, residency and delays, the carries are the same instructions
    on the same values, so the results are bit-identical."""
    gen = torch.Generator().manual_seed(21)
    weight, scales, diag, grad = make_factored(1, 61, 5, 3, True, True, gen)
    runs = [
        emulated.scan_factored(
            weight, scales, diag, grad, "chunked", 2, resident=res, seed=seed, jitter_us=500
        )
        for seed, res in ((0, 31), (1, 6), (2, 2), (3, 31))
    ]
    check(runs[0], FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)
    assert all(torch.equal(runs[0], other) for other in runs[1:])


def test_half_precision_runs_in_float32():
    gen = torch.Generator().manual_seed(3)
    jt, grad = make_dense(2, 9, 5, True, gen)
    out = emulated.scan_dense(jt.bfloat16(), grad.bfloat16(), "chunked", 3)
    assert out.dtype == torch.bfloat16
    expected = plain_loop(jt.bfloat16().float(), grad.bfloat16().float())
    torch.testing.assert_close(out, expected.bfloat16())


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(5)
    jt, grad = make_dense(2, 12, 4, True, gen)
    out = emulated.scan_dense(jt.mT.contiguous().mT, grad.mT.contiguous().mT, "chunked", 5)
    check(out, jt, grad, torch.float64)


def test_empty_chain_returns_the_last_gradient():
    grad = torch.randn(3, 1, 4, dtype=torch.float64)
    out = emulated.scan_dense(torch.empty(3, 0, 4, 4, dtype=torch.float64), grad, "chunked", 4)
    torch.testing.assert_close(out, grad)


#: Runs in a process preloaded with libtsan and WITHOUT torch (importing torch under ThreadSanitizer
#: takes ~20 s): builds the sanitized library from emulated.build_arguments and makes the launch that
#: cuda.run computed, on buffers passed as files.
_TSAN_CHILD = """
import ctypes, importlib.util, json, sys
spec = json.load(open(sys.argv[1]))
loader = importlib.util.spec_from_file_location("_build", spec["builder"])
build = importlib.util.module_from_spec(loader)
loader.loader.exec_module(build)
lib = build.load_library(**spec["library"])
data = [open(path, "rb").read() for path in spec["buffers"]]
buffers = [(ctypes.c_char * len(b)).from_buffer_copy(b) for b in data]
words = [ctypes.addressof(buffers[a["buffer"]]) if isinstance(a, dict) else a for a in spec["args"]]
lib.bppsa_emu_launch.restype = ctypes.c_int
entry = ctypes.cast(getattr(lib, spec["kernel"] + "_host"), ctypes.c_void_p)
status = lib.bppsa_emu_launch(entry, (ctypes.c_uint64 * len(words))(*words), ctypes.c_uint(spec["grid"]),
                              ctypes.c_uint(spec["block"]), ctypes.c_size_t(spec["shared"]),
                              ctypes.c_uint(spec["grid"]), ctypes.c_double(120.0),
                              ctypes.c_ulonglong(1), ctypes.c_double(0.0))
open(spec["buffers"][spec["out"]], "wb").write(bytes(buffers[spec["out"]]))
sys.exit(status)
"""


@pytest.mark.slow  # the first run builds the sanitized library (~20-40 s); then ~3 s
def test_thread_sanitizer_finds_no_race(tmp_path):
    """A ThreadSanitizer build of the chunked kernel, every block resident (look-back and flags race if wrong)."""
    libtsan = subprocess.run(
        ["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(libtsan):
        pytest.skip("g++ has no ThreadSanitizer runtime (libtsan.so)")
    gen = torch.Generator().manual_seed(11)
    weight, scales, diag, grad = make_factored(2, 14, 3, 2, True, True, gen)

    def write_spec(config, args, device):  # called by cuda.run while its buffers are alive
        sizes = {
            args[0]: weight.nbytes, args[1]: scales.nbytes, args[2]: diag.nbytes, args[3]: grad.nbytes,
            args[4]: 2 * 15 * 3 * 8, args[5]: config.work_elements * 8, args[6]: config.sync_words * 8,
        }  # fmt: skip
        paths = []
        for i, address in enumerate(args[:7]):
            paths.append(str(tmp_path / f"buffer{i}"))
            with open(paths[-1], "wb") as f:
                f.write(ctypes.string_at(address, sizes[address]))
        spec = {
            "builder": str(Path(emulated.__file__).with_name("_build.py")),
            "library": emulated.build_arguments("thread"),
            "kernel": config.kernel, "grid": config.grid, "block": config.block, "shared": config.shared_bytes,
            "buffers": paths, "out": 4, "args": [{"buffer": i} for i in range(7)] + args[7:],
        }  # fmt: skip
        (tmp_path / "spec.json").write_text(json.dumps(spec))

    cuda.run(weight, scales, diag, grad, algorithm="chunked", chunk_size=3, launcher=write_spec)
    env = {**os.environ, "LD_PRELOAD": libtsan, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    result = subprocess.run(
        [sys.executable, "-c", _TSAN_CHILD, str(tmp_path / "spec.json")], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    out = torch.frombuffer(bytearray((tmp_path / "buffer4").read_bytes()), dtype=torch.float64).view(2, 15, 3)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, torch.float64)


def test_launch_config_is_what_cuda_uses():
    """The emulated launch goes through cuda.launch_config: a chunked call makes B * ceil(n / c) blocks."""
    launch = LAUNCH_TESTS.config(element_bytes=8, n=130, batch=3, d=20, m=60, affine=True, chunk_size=10)
    assert (launch.kernel, launch.grid, launch.chunk) == ("bppsa_chunked_factored_f64", 39, 10)
    assert launch.block % 32 == 0 and launch.shared_bytes <= cuda.SHARED_BYTES


def test_a_launch_that_does_not_finish_is_aborted():
    """The emulator's deadlock guard: every wait checks the abort flag, so a stuck launch raises. Stuck
    whatever the machine's speed (no race against the timeout): the ticket counter starts at 1, so the
    one resident block takes chunk 1 and waits for chunk 0, which no block ever takes."""
    gen = torch.Generator().manual_seed(9)
    jt, grad = make_dense(1, 40, 8, True, gen)
    launch = emulated._launcher(resident=1, timeout=0.5, seed=0, jitter_us=0.0)

    def without_chunk_0(config, args, device):
        ctypes.c_uint32.from_address(args[6]).value = 1  # sync word 0: the ticket counter
        launch(config, args, device)

    with pytest.raises(emulated.LaunchTimeout, match="1 resident\\) did not finish in 0.5 s"):
        cuda.run(jt, None, None, grad, algorithm="chunked", chunk_size=4, launcher=without_chunk_0)


def test_wide_dense_sweep_takes_several_passes_and_tiles():
    """d = 260 > 256 threads: two output passes; J_t (260 x 260 float64) streamed in 13 tiles per step."""
    gen = torch.Generator().manual_seed(260)
    jt, grad = make_dense(1, 2, 260, True, gen)
    launch = LAUNCH_TESTS.config(
        factored=False, element_bytes=8, n=2, batch=1, d=260, m=260, affine=True,
        algorithm="linear", chunk_size=2,
    )  # fmt: skip
    assert launch.block < 260 and launch.tile_rows < 260  # the multi-pass, multi-tile path
    check(emulated.scan_dense(jt, grad, "linear", 2), jt, grad, torch.float64)


def test_wide_factored_chunks_take_several_passes_and_tiles():
    """d = 50 (float32): 3 passes of 2 x 2 outputs per thread, the 150 scaled weight rows in 2 tiles."""
    gen = torch.Generator().manual_seed(50)
    weight, scales, diag, grad = make_factored(1, 6, 50, 3, True, True, gen)
    launch = LAUNCH_TESTS.config(n=6, batch=1, d=50, m=150, affine=True, chunk_size=3)
    assert launch.kernel == "bppsa_chunked_factored_f32" and launch.tile_rows < 150
    out = emulated.scan_factored(*(t.float() for t in (weight, scales, diag, grad)), "chunked", 3)
    check(out, FactoredJacobians(weight, scales, diag).dense(), grad, torch.float32)


def test_empty_batch_and_empty_state():
    out = emulated.scan_dense(torch.empty(0, 5, 3, 3), torch.empty(0, 3), "chunked", 2)
    assert out.shape == (0, 6, 3)
    grad = torch.empty(2, 6, 0)
    assert emulated.scan_factored(torch.empty(0, 0), torch.empty(2, 5, 0), None, grad, "linear", 1).shape == (
        2,
        6,
        0,
    )


#: Warp collectives of the emulator, on their own: lane l reads lane (l + shift) mod 32; or a shuffle /
#: warp barrier called with a partial mask (which the emulator refuses instead of guessing lock step).
_WARP_PROBE = r"""
#include "cuda_host_emulation.h"
extern "C" __global__ void probe(const double* in, double* out, float* out32, long long mode) {
    const int lane = threadIdx.x;
    if (mode == 0) {  // full mask: values of both widths cross lanes (srcLane taken mod 32)
        out[lane] = __shfl_sync(0xffffffffu, in[lane], lane + 3);
        out32[lane] = __shfl_sync(0xffffffffu, float(in[lane]), 31 - lane);
        __syncwarp(0xffffffffu);
    } else if (mode == 1) {  // every lane calls, the mask names lanes 0-15 only: lanes 16-31 are outside
        out[lane] = __shfl_sync(0x0000ffffu, in[lane], 0);
    } else if (mode == 2) {  // lanes 0-15 call with their own mask but read lane 20, outside it
        if (lane < 16) out[lane] = __shfl_sync(0x0000ffffu, in[lane], 20);
    } else if (mode == 3) {
        __syncwarp(0x0000ffffu);
    } else {  // asynchronous copies into shared memory, then read back by the next lane (vector loads)
        BPPSA_DYNAMIC_SHARED(smem);
        double* ring = reinterpret_cast<double*>(smem);
        bppsa::copy_async(ring + lane, in + lane);
        bppsa::copy_async_commit();
        bppsa::copy_async(ring + 32 + lane, in + lane);  // a second group
        bppsa::copy_async_commit();
        if (mode == 4) bppsa::copy_async_wait<1>();  // the first group landed; the second may not have
        if (mode == 5) bppsa::copy_async_wait<0>();
        __syncwarp(0xffffffffu);
        double v[2];
        bppsa::load_shared_vector(ring + (mode == 6 ? 1 : 2 * (lane / 2)), v);  // mode 6: misaligned
        out[lane] = v[lane % 2];
        out32[lane] = float(ring[32 + lane]);
        if (mode == 4) bppsa::copy_async_wait<0>();  // mode 7 leaves the second group pending at the end
    }
}
extern "C" void probe_host(const uint64_t* a) {
    probe((const double*)a[0], (double*)a[1], (float*)a[2], (long long)a[3]);
}
"""


@pytest.fixture(scope="module")
def warp_probe(tmp_path_factory):
    from lightning_bppsa.kernels._build import load_library

    folder = tmp_path_factory.mktemp("warp_probe")
    (folder / "probe.cu").write_text(_WARP_PROBE)
    shutil.copy(cuda.source_path("cuda_host_emulation.h"), folder / "cuda_host_emulation.h")
    lib = load_library(
        "bppsa_warp_probe", [str(folder / "probe.cu")], ["g++", "-std=c++20", "-pthread", "-x", "c++"],
        flag_sets=[["-O1"]], depends=[str(folder / "cuda_host_emulation.h")], symbols=["probe_host", "bppsa_emu_launch"],
    )  # fmt: skip
    lib.bppsa_emu_launch.restype = ctypes.c_int
    lib.bppsa_emu_launch.argtypes = emulated.LAUNCH_ARGTYPES

    def launch(mode: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        values = torch.arange(32, dtype=torch.float64) * 1.5 + 0.25
        out, out32 = torch.full((32,), float("nan"), dtype=torch.float64), torch.full((32,), float("nan"))
        words = (ctypes.c_uint64 * 4)(values.data_ptr(), out.data_ptr(), out32.data_ptr(), mode)
        entry = ctypes.cast(lib.probe_host, ctypes.c_void_p)
        return lib.bppsa_emu_launch(entry, words, 1, 32, 1024, 1, 20.0, 0, 0.0), values, (out, out32)

    return launch


def test_emulated_shuffle_moves_values_between_lanes(warp_probe):
    status, values, (out, out32) = warp_probe(0)
    lanes = torch.arange(32)
    assert status == 0
    assert torch.equal(out, values[(lanes + 3) % 32])
    assert torch.equal(out32, values[31 - lanes].float())


@pytest.mark.parametrize(
    "mode",
    [1, 2, 3, 6, 7],
    ids=[
        "caller-outside-mask",
        "source-outside-mask",
        "syncwarp-partial",
        "misaligned-vector",
        "copies-pending",
    ],
)
def test_emulated_warp_collectives_refuse_a_bad_mask(warp_probe, mode):
    """Also refused: a 16-byte vector load from an address that is not 16-byte aligned, and asynchronous
    copies still pending when a block ends (they would land in the next block's shared memory)."""
    status, _, _ = warp_probe(mode)
    assert status == 2  # BPPSA_EMU_ERROR: the kernel's thread threw


@pytest.mark.parametrize("mode", [4, 5], ids=["wait-for-one-group", "wait-for-all"])
def test_emulated_async_copies_land_by_their_wait(warp_probe, mode):
    """After copy_async_wait<N> the groups older than the N newest have landed (and a warp barrier shares
    them); the newer ones may not have: in mode 4 the second group (waited only after the reads) is, by the
    seeded coin of each copy, partly still the shared memory's old zeros when read."""
    status, values, (out, out32) = warp_probe(mode)
    assert status == 0
    assert torch.equal(out, values)  # the first group: landed, read back by vector loads
    landed = out32 == values.float()
    if mode == 5:
        assert landed.all()
    else:
        assert (landed | (out32 == 0)).all() and not landed.all() and landed.any()


# --------------------------------------------------------------------------------------------------
# The chunked kernel's flags: one buffer per device and stream, never cleared per launch (epochs)
# --------------------------------------------------------------------------------------------------

_AGGREGATE, _INCLUSIVE = 1, 2  # kAggregate / kInclusive in scan.cu: a flag is epoch * 4 + state


@pytest.fixture
def fresh_flags(monkeypatch) -> dict:
    """The flag buffers of this test only (``cuda._FLAGS``, keyed by device and stream; ``(cpu, 0)`` here)."""
    flags: dict = {}
    monkeypatch.setattr(cuda, "_FLAGS", flags)
    return flags


def _flag_buffer(flags: dict) -> torch.Tensor:
    ((buffer, _),) = flags.values()
    return buffer


def test_repeated_launches_reuse_one_flag_buffer_never_cleared(fresh_flags):
    """Launches of several shapes on one buffer (grown once, when a grid needs more), each in a random block
    order with jitter and a few blocks resident, each against the float64 loop: after every launch the
    ticket counter is back to 0, its flags carry its own epoch, and what a larger grid left beyond a
    smaller one is still there (nothing cleared the buffer)."""
    gen = torch.Generator().manual_seed(31)
    shapes = [(2, 31, 3, 3, 4), (2, 31, 3, 3, 40), (1, 61, 3, 2, 3), (1, 9, 3, 3, 2), (3, 20, 3, 4, 30)]
    previous, epoch = None, 0  # (buffer, epoch) of the previous launch
    for i, (batch, n, d, chunk, resident) in enumerate(shapes):
        jt, grad = exact_dense(batch, n, d, gen)
        out = emulated.scan_dense(jt, grad, "chunked", chunk, resident=resident, seed=i + 1, jitter_us=300)
        assert torch.equal(out, plain_loop(jt, grad)), shapes[i]
        buffer, grid = _flag_buffer(fresh_flags), batch * -(-n // chunk)
        flags = buffer[1 : 1 + grid]
        epoch = epoch + 1 if previous is not None and buffer is previous[0] else 1
        assert buffer[0].item() == 0, "the last ticket sets the counter back to 0"
        assert torch.equal(flags >> 2, torch.full_like(flags, epoch)), (shapes[i], flags.tolist())
        last_chunks = flags.view(-1, batch)[-1]  # the first steps of each row: nobody waits on them
        assert set((flags & 3).tolist()) <= {_AGGREGATE, _INCLUSIVE} and set((last_chunks & 3).tolist()) == {
            _AGGREGATE
        }
        if previous is not None and buffer is previous[0] and grid < previous[1]:
            assert (buffer[1 + grid : 1 + previous[1]] >> 2 == epoch - 1).all(), (
                "an older launch's flags are left"
            )
        previous = (buffer, grid)
    assert buffer.numel() == 2 * (1 + 2 * 11)  # grown once: 23 words, then 32 needed: twice the old size


@pytest.mark.parametrize(("resident", "seed"), [(1, 3), (44, 4)])
def test_old_epochs_never_satisfy_a_new_wait(fresh_flags, resident, seed):
    """Every flag left as the previous launch's INCLUSIVE (the strongest announcement there is): a kernel
    that took any of them for its own launch's would read carries nobody published in this launch (the
    scratch is NaN-poisoned) or finish without waiting; the results are the float64 loop's bits."""
    gen = torch.Generator().manual_seed(seed)
    jt, grad = exact_dense(1, 43, 3, gen)
    assert torch.equal(emulated.scan_dense(jt, grad, "chunked", 1), plain_loop(jt, grad))  # epoch 1
    buffer = _flag_buffer(fresh_flags)
    # whether a wrong kernel reads a carry before its owner publishes it depends on the threads' timing: several
    # launches, each on flags all left as the launch before's INCLUSIVE (one launch alone missed it once in CI)
    for epoch in range(2, 18):
        buffer[1:] = (epoch - 1) * 4 + _INCLUSIVE
        jt, grad = exact_dense(1, 43, 3, gen)
        out = emulated.scan_dense(jt, grad, "chunked", 1, resident=resident, seed=seed + epoch, jitter_us=2000)
        assert torch.equal(out, plain_loop(jt, grad)), epoch
        assert (buffer[1:44] >> 2 == epoch).all()  # this launch's epoch, on the same buffer


def test_a_failed_launch_drops_its_flag_buffer(fresh_flags):
    """A launch that raised may have stopped half way (tickets taken, the counter not back to 0): the next
    launch on that stream gets a fresh buffer; a ticket beyond the grid would stop the kernel, not run it."""
    jt, grad = exact_dense(1, 9, 3, torch.Generator().manual_seed(1))
    emulated.scan_dense(jt, grad, "chunked", 3)
    assert fresh_flags

    def failing(launch, args, device):
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError, match="launch failed"):
        cuda.run(jt, None, None, grad, algorithm="chunked", chunk_size=3, launcher=failing)
    assert not fresh_flags
    emulated.scan_dense(jt, grad, "chunked", 3)
    _flag_buffer(fresh_flags)[0] = 5  # a counter left at 5 by a launch that never finished
    with pytest.raises(RuntimeError, match="an emulated thread failed"):
        emulated.scan_dense(jt, grad, "chunked", 3, timeout=20)
