"""Compile gate (nvcc only, no GPU): every CUDA kernel compiles for sm_80 and sm_90 with no spill and no
stack (the generic module and the warp-sweep modules of shapes at the register rule's edges), its static
shared memory is what launch_config budgets, and the look-back's PTX uses the cache operators and memory
orderings the design needs (which the host emulation, on x86, cannot check)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence

import pytest
from lightning_bppsa.kernels import cuda, cuda_inspect

ARCHS = ("sm_80", "sm_90")
#: warp-sweep modules (d, k) compiled by the gate: the smallest and widest states, the GRU and LSTM at the
#: largest d whose W stays in registers (float32: (k + 2) d <= 160; float64: <= 80) and just past it, a
#: dense d = 26, where the chunked kernel's fully unrolled copies spilled at 128 registers, and the widest
#: k d whose float32 chunk aggregates one warp forms (cuda.warp_aggregates: 26 x 4, 20 x 5) and just past it
WARP_SHAPES = [
    (1, 1), (5, 3), (16, 3), (20, 3), (20, 5), (21, 5), (22, 5), (23, 5), (26, 1), (26, 4), (27, 4), (32, 3),
    (32, 4), (32, 5),
]  # fmt: skip


def chunked_register_cap(shape: tuple[int, int] | None, suffix: str, factored: bool) -> int:
    """A chunked kernel's register cap (__launch_bounds__(kChunkedThreads, kChunkedBlocksPerSm)): a warp's block,
    8 resident, where one warp forms the aggregates; else 256 threads, 2 blocks float32, 1 float64."""
    warp = cuda.warp_shape(factored=factored, d=shape[0], m=shape[0] * shape[1]) if shape else None  # dense: k = 1
    if cuda.warp_aggregates(warp, 4 if suffix == "f32" else 8):
        return 255
    return 128 if suffix == "f32" else 255


@pytest.fixture(scope="module")
def usage() -> dict[tuple[int, int] | None, dict[str, dict[str, cuda_inspect.KernelUsage]]]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile gate needs the CUDA toolkit (no GPU needed)")
    # one nvcc call per module for both archs, with -Xptxas -warn-spills -Werror (a spill fails it)
    return {shape: cuda_inspect.ptxas_usage(ARCHS, warp_shape=shape) for shape in [None, *WARP_SHAPES]}


@pytest.mark.slow  # ~1-2 min of nvcc (10 modules)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills_or_stack(usage, arch):
    for shape, by_arch in usage.items():
        kernels = by_arch[arch]
        assert sorted(kernels) == sorted(cuda.module_kernels(shape)), (
            f"{arch} {shape}: ptxas reported {sorted(kernels)}"
        )
        for name, use in kernels.items():
            where = f"{arch} {shape} {name}: {use}"
            assert (use.stack_bytes, use.spill_store_bytes, use.spill_load_bytes) == (0, 0, 0), where
            cap = chunked_register_cap(shape, name[-3:], "_factored_" in name) if "_chunked_" in name else 255
            assert 0 < use.registers <= cap, where
            family = name.split("_")[1]
            assert use.static_shared_bytes == cuda.STATIC_SHARED_BYTES[family], where
        print(
            f"\n{arch} {shape} registers: "
            + ", ".join(f"{k}={v.registers}" for k, v in sorted(kernels.items()))
        )


def assert_nvrtc_compiles(source: str, name: str, option_sets: Sequence[Sequence[str]] = ((),)) -> None:
    """``source`` compiles through CuPy's NVRTC (no GPU needed) for compute_80 and compute_90, with each of
    ``option_sets``; skips where CuPy or its NVRTC library is missing."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # no CuPy, or CuPy without its NVRTC library
        pytest.skip(f"CuPy's NVRTC is not usable here ({type(err).__name__}: {err})")
    for arch in ("compute_80", "compute_90"):
        for options in option_sets:
            program = nvrtc.createProgram(source, name, [], [])
            try:
                nvrtc.compileProgram(program, [f"-arch={arch}", "-std=c++17", *options])
            except nvrtc.NVRTCError:
                pytest.fail(f"NVRTC ({arch}, {tuple(options)}) failed:\n{nvrtc.getProgramLog(program)}")


def test_nvrtc_compiles_what_cupy_loads():
    """The exact source CuPy compiles (header inlined) through NVRTC, which needs no GPU either."""
    assert_nvrtc_compiles(cuda.source(), "scan.cu")


#: per chunked kernel, the PTX instructions of the look-back protocol (pinned: a change must keep every
#: load of published data .cg, i.e. through L2 and never from a possibly stale L1 line; review, then update)
LOOK_BACK_PTX = {
    r"ld\.global\.cg\.f(32|64)": 4,  # published aggregates and inclusives (and the last-state row)
    r"st\.global\.cg\.f(32|64)": 6,  # what a chunk publishes (and its outputs)
    r"ld\.relaxed\.gpu\.u64": 4,  # flag polls: relaxed (no L1 invalidation per poll) ...
    r"fence\.acq_rel\.gpu": 1,  # ... then one fence after the ballot
    r"st\.release\.gpu\.u64": 2,  # AGGREGATE and INCLUSIVE, by thread 0
    r"ld\.acquire": 0,
}


@pytest.mark.slow  # ~4 s of nvcc
@pytest.mark.parametrize("shape", [None, (20, 3)], ids=["generic", "d20k3"])
def test_look_back_ptx_uses_l2_loads_relaxed_polls_and_one_fence(shape):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the PTX check needs the CUDA toolkit (no GPU needed)")
    bodies = cuda_inspect.ptx("compute_90", warp_shape=shape)
    assert sorted(bodies) == sorted(cuda.module_kernels(shape))
    for name in (k for k in bodies if "_chunked_" in k):
        # a warp-sweep module's chunk sweeps store their outputs with plain stores (the block sweep's go through
        # L2); where one warp forms the aggregates (float32 here) each lane stores its row of C, d values, and b
        stores = 6 if shape is None else shape[0] + 2 if name.endswith("f32") else 5
        pinned = {**LOOK_BACK_PTX, r"st\.global\.cg\.f(32|64)": stores}
        for pattern, expected in pinned.items():
            found = len(re.findall(pattern, bodies[name], flags=re.M))
            if expected is not None:
                assert found == expected, f"{name}: {found} x /{pattern}/, expected {expected}"
    for name in bodies:  # the sweeps publish nothing: no flags, no fences
        if "sweep_" in name:
            assert not re.search(r"fence|\.release|\.acquire|\.relaxed", bodies[name]), name
        if shape is not None:  # the warp sweeps' ring: asynchronous copies, one commit group per step, waits
            for op in ("cp.async.ca.shared.global", "cp.async.commit_group", "cp.async.wait_group"):
                assert op in bodies[name], f"{name}: no {op}"


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump
def test_cost_model_instruction_counts_are_the_sass():
    """The cost model's per-iteration instruction counts are those of the current SASS (sm_90)."""
    from lightning_bppsa.cuda_cost_model import SASS_COUNTS

    try:
        loops = cuda_inspect.sass_loops("sm_90")
    except FileNotFoundError as err:
        pytest.skip(
            f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}"
        )

    def sizes(kernel, *, has=(), lacks=(), ffma=None):
        return {
            loop.instructions for loop in loops[kernel]
            if all(k in loop.kinds for k in has) and not any(k in loop.kinds for k in lacks)
            and (ffma is None or loop.kinds.get("FFMA") == ffma)
        }  # fmt: skip

    assert SASS_COUNTS.tile_factored in sizes("bppsa_sweep_factored_f32", has=("LDG", "FMUL", "STS"))
    assert SASS_COUNTS.tile_dense in sizes("bppsa_sweep_dense_f32", has=("LDG", "STS"), lacks=("STG", "FMUL"))
    assert SASS_COUNTS.fma_vector in sizes("bppsa_sweep_factored_f32", ffma=2)
    assert SASS_COUNTS.fma_matrix in sizes("bppsa_chunked_factored_f32", ffma=8)
    assert SASS_COUNTS.tile_aggregate in sizes(
        "bppsa_chunked_dense_f32", has=("LDG", "STS"), lacks=("STG", "FMUL")
    )
    # SASS_COUNTS.warp_* (the reworked warp sweep, compiled per (d, k)) are pinned by
    # tests/kernels/test_cuda_cost_model.py; test_warp_sweep_step_is_register_resident pins its SASS shape


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump
@pytest.mark.parametrize(("d", "k"), [(20, 3), (32, 5)])
def test_warp_sweep_step_is_register_resident(d, k):
    """What makes the warp sweep fast, read from its SASS (sm_90, the module of (d, k)): one step's main loop
    holds every shuffle and FMA of the step (everything over d unrolled), stages a later step with
    asynchronous copies (LDGSTS) and waits for them (DEPBAR), and has no barrier, division or conversion."""
    try:
        loops = cuda_inspect.sass_loops("sm_90", warp_shape=(d, k))
    except FileNotFoundError as err:
        pytest.skip(
            f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}"
        )
    for name in (n for n in cuda.module_kernels((d, k)) if "_warpsweep_" in n):
        main = max(loops[name], key=lambda loop: loop.instructions)  # two steps
        step = cuda_inspect.warp_step_counts(main)
        words = 2 if name.endswith("f64") else 1
        assert step.shuffles == d * words, f"{name}: {step}"
        factored = "_factored_" in name
        assert step.fmas == (k * d if factored else 0) + d + int(factored), (
            f"{name}: {step}"
        )  # column, chain, u g
        assert step.copies >= 1 and "DEPBAR" in main.kinds, f"{name}: {main.kinds}"
        assert not {"BAR", "IDIV", "MUFU", "I2F", "F2I"} & set(main.kinds), f"{name}: {main.kinds}"
        print(f"\n{name} (d={d}, k={k}): {step}")


@pytest.mark.slow  # ~3 s of nvcc + cuobjdump per module
@pytest.mark.parametrize(("d", "k"), [(20, 1), (20, 3), (32, 3)])
def test_chunk_aggregate_step_is_one_warps_unrolled_product(d, k):
    """The float32 factored chunked kernel's aggregate step where one warp forms it (cuda.warp_aggregates), read
    from its SASS (sm_90, the module of (d, k)): one loop iteration holds the step's d^2 FMAs of a row of C
    times J', the column's k d and the affine row's d + 1 (the sweep's step), its d shuffles, d stores of the
    column of J' and d / 4 of the row buffer, J' read back by broadcast 16-byte loads (d^2 / 4 of them, with
    the column's operands' and the row buffer's), and no block barrier, division or conversion. Printed: the
    per-step instruction count (d = 20, k = 3: 880 for the one warp, 461 of them FFMA)."""
    assert cuda.warp_aggregates((d, k), 4)
    try:
        loops = cuda_inspect.sass_loops("sm_90", warp_shape=(d, k))
    except FileNotFoundError as err:
        pytest.skip(
            f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}"
        )
    step = max(loops["bppsa_chunked_factored_f32"], key=lambda loop: loop.instructions)
    kinds = step.kinds
    assert kinds.get("FFMA", 0) + kinds.get("FMUL", 0) == d * d + k * d + d + 1, kinds
    assert kinds.get("SHFL") == d and kinds.get("STS") == d + d // 4, kinds
    vectors = d * d // 4 + 2 * k * d // 4 + d // 4
    assert vectors <= kinds.get("LDS", 0) <= vectors + 16, kinds
    assert not {"BAR", "IDIV", "MUFU", "I2F", "F2I"} & set(kinds), kinds
    print(f"\nbppsa_chunked_factored_f32 (d={d}, k={k}): {step.instructions} instructions a step, {kinds}")
