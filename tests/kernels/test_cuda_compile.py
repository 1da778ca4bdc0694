"""Compile gate (nvcc only, no GPU): every CUDA kernel compiles for sm_80 and sm_90 with no spill and no
stack, its static shared memory is what launch_config budgets, and the look-back's PTX uses the cache
operators and memory orderings the design needs (which the host emulation, on x86, cannot check)."""

from __future__ import annotations

import re
import shutil

import pytest
from lightning_bppsa.kernels import cuda, cuda_inspect

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def usage() -> dict[str, dict[str, cuda_inspect.KernelUsage]]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile gate needs the CUDA toolkit (no GPU needed)")
    return cuda_inspect.ptxas_usage(ARCHS)  # one nvcc call for both archs, with -Xptxas -warn-spills -Werror


@pytest.mark.slow  # ~10-20 s of nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills_or_stack(usage, arch):
    kernels = usage[arch]
    assert sorted(kernels) == sorted(cuda.KERNELS), f"{arch}: ptxas reported {sorted(kernels)}"
    for name, use in kernels.items():
        assert (use.stack_bytes, use.spill_store_bytes, use.spill_load_bytes) == (0, 0, 0), f"{arch} {name}: {use}"
        # __launch_bounds__(256) leaves up to 255 registers per thread: reported, not capped
        assert 0 < use.registers <= 255, f"{arch} {name}: {use.registers} registers"
        family = name.split("_")[1]
        assert use.static_shared_bytes == cuda.STATIC_SHARED_BYTES[family], f"{arch} {name}: {use}"
    print(f"\n{arch} registers: " + ", ".join(f"{k}={v.registers}" for k, v in sorted(kernels.items())))


def test_nvrtc_compiles_what_cupy_loads():
    """The exact source CuPy compiles (header inlined) through NVRTC, which needs no GPU either."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as err:  # no CuPy, or CuPy without its NVRTC library
        pytest.skip(f"CuPy's NVRTC is not usable here ({type(err).__name__}: {err})")
    for arch in ("compute_80", "compute_90"):
        program = nvrtc.createProgram(cuda.source(), "scan.cu", [], [])
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", "-std=c++17"])
        except nvrtc.NVRTCError:
            pytest.fail(f"NVRTC ({arch}) failed:\n{nvrtc.getProgramLog(program)}")


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


@pytest.mark.slow  # ~2 s of nvcc
def test_look_back_ptx_uses_l2_loads_relaxed_polls_and_one_fence():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the PTX check needs the CUDA toolkit (no GPU needed)")
    bodies = cuda_inspect.ptx("compute_90")
    chunked = [k for k in cuda.KERNELS if "_chunked_" in k]
    assert sorted(k for k in bodies if "_chunked_" in k) == sorted(chunked)
    for name in chunked:
        for pattern, expected in LOOK_BACK_PTX.items():
            found = len(re.findall(pattern, bodies[name], flags=re.M))
            if expected is not None:
                assert found == expected, f"{name}: {found} x /{pattern}/, expected {expected}"
    for name in cuda.KERNELS:  # the sweeps publish nothing: no flags, no fences
        if "sweep_" in name:
            assert not re.search(r"fence|\.release|\.acquire|\.relaxed", bodies[name]), name


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump
def test_cost_model_instruction_counts_are_the_sass():
    """The cost model's per-iteration instruction counts are those of the current SASS (sm_90)."""
    from lightning_bppsa.cuda_cost_model import SASS_COUNTS

    try:
        loops = cuda_inspect.sass_loops("sm_90")
    except FileNotFoundError as err:
        pytest.skip(f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}")

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
    assert SASS_COUNTS.tile_aggregate in sizes("bppsa_chunked_dense_f32", has=("LDG", "STS"), lacks=("STG", "FMUL"))
    for chain in ("factored", "dense"):
        kernel = f"bppsa_warpsweep_{chain}_f32"
        steps = cuda_inspect.warp_step_counts(max(loops[kernel], key=lambda loop: loop.instructions), 4)
        assert (steps.group, steps.overhead) == (
            getattr(SASS_COUNTS, f"warp_group_{chain}"), getattr(SASS_COUNTS, f"warp_overhead_{chain}")
        ), kernel
        print(f"\n{kernel}: {steps}")


@pytest.mark.slow  # ~5 s of nvcc + cuobjdump
def test_warp_sweep_step_is_register_resident():
    """What makes the warp sweep fast, read from its SASS (sm_90): per step, no barrier and no integer
    division; shuffles read immediate source lanes; the factored W is read with immediate offsets."""
    try:
        loops = cuda_inspect.sass_loops("sm_90")
    except FileNotFoundError as err:
        pytest.skip(f"needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): {err}")
    for name in (k for k in cuda.KERNELS if "_warpsweep_" in k):
        step = max(loops[name], key=lambda loop: loop.instructions)  # two steps, every group unrolled
        assert step.kinds.get("SHFL", 0) >= 2 * 32, name  # two steps of up to 32 operand rows
        assert not {"BAR", "IDIV", "MUFU", "I2F", "F2I"} & set(step.kinds), f"{name}: {step.kinds}"
        assert step.kinds.get("LDS", 0) == (2 * 5 * 32 if "factored" in name else 0), name  # no W reload
