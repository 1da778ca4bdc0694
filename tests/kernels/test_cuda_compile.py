"""Compile gate: every CUDA kernel compiles for sm_80 and sm_90 with no spill and no stack (nvcc only, no GPU)."""

from __future__ import annotations

import shutil

import pytest
from lightning_bppsa.kernels import cuda

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def usage() -> dict[str, dict[str, cuda.KernelUsage]]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA compile gate needs the CUDA toolkit (no GPU needed)")
    return cuda.ptxas_usage(ARCHS)  # one nvcc call for both archs, with -Xptxas -warn-spills -Werror


@pytest.mark.slow  # ~10-20 s of nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills_or_stack(usage, arch):
    kernels = usage[arch]
    assert sorted(kernels) == sorted(cuda.KERNELS), f"{arch}: ptxas reported {sorted(kernels)}"
    for name, use in kernels.items():
        assert (use.stack_bytes, use.spill_store_bytes, use.spill_load_bytes) == (0, 0, 0), f"{arch} {name}: {use}"
        # __launch_bounds__(256) leaves up to 255 registers per thread: reported, not capped
        assert 0 < use.registers <= 255, f"{arch} {name}: {use.registers} registers"
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
