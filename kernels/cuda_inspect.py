"""Dev-only inspection of the CUDA scan kernels without a GPU: ptxas's resource report, the PTX, and the SASS
innermost loops with their per-step instruction counts (nvcc / cuobjdump needed).

Used by the compile-gate tests (``tests/kernels/test_cuda_compile.py``), ``benchmarks/gpu.py`` and to pin the
counts behind :mod:`lightning_bppsa.cuda_cost_model`; the runtime path (:mod:`lightning_bppsa.kernels.cuda`)
never imports it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lightning_bppsa.kernels.cuda import module_options, source_path

__all__ = ["KernelUsage", "SassLoop", "WarpStep", "ptx", "ptxas_usage", "sass_loops", "warp_step_counts"]


@dataclass(frozen=True)
class KernelUsage:
    """What ptxas reports for one kernel."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_shared_bytes: int


def ptxas_usage(
    archs: tuple[str, ...] = ("sm_80", "sm_90"),
    nvcc: str | None = None,
    warp_shape: tuple[int, int] | None = None,
) -> dict[str, dict[str, KernelUsage]]:
    """Compile ``scan.cu`` with nvcc for ``archs`` (one front-end pass) and return ptxas's report per arch and kernel:
    the generic module, or the one specialised for ``warp_shape`` (``(d, k)``: ``cuda.module_options``).

    ptxas runs with ``-warn-spills -Werror``: a spill fails the compilation (``RuntimeError`` with the
    command and its output). Needs only nvcc, no GPU or driver. Raises ``FileNotFoundError`` without nvcc.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH")
    gencodes = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            nvcc, "-fatbin", "-std=c++17", *gencodes, "-Xptxas", "-v", "-Xptxas", "-warn-spills",
            "-Xptxas", "-Werror", *module_options(warp_shape), "-o", f"{tmp}/scan.fatbin", str(source_path("scan.cu")),
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {result.returncode}:\n{result.stderr[-3000:]}")
    usage: dict[str, dict[str, KernelUsage]] = {arch: {} for arch in archs}
    for entry in re.split(r"Compiling entry function ", result.stderr)[1:]:
        name, arch = re.match(r"'(\w+)' for '(\w+)'", entry).groups()
        stack, stores, loads = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", entry
        ).groups()
        registers = re.search(r"Used (\d+) registers", entry).group(1)
        smem = re.search(r"(\d+) bytes smem", entry)
        usage[arch][name] = KernelUsage(
            int(registers), int(stack), int(stores), int(loads), int(smem.group(1)) if smem else 0
        )
    return usage


def ptx(
    arch: str = "compute_90", nvcc: str | None = None, warp_shape: tuple[int, int] | None = None
) -> dict[str, str]:
    """``scan.cu`` (the module of ``warp_shape``, see :func:`ptxas_usage`) compiled to PTX by nvcc (no GPU
    needed): ``{kernel name: its PTX body}``.

    For static checks of what the emulator cannot see, e.g. the cache operators of the look-back's loads.
    Raises ``FileNotFoundError`` without nvcc, ``RuntimeError`` (with nvcc's output) if it fails.
    """
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc not found on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-ptx", "-std=c++17", f"-arch={arch}", *module_options(warp_shape), "-o", f"{tmp}/scan.ptx",
               str(source_path("scan.cu"))]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {result.returncode}:\n{result.stderr[-3000:]}")
        text = Path(f"{tmp}/scan.ptx").read_text()
    bodies = re.split(r"^\.visible \.entry ", text, flags=re.M)[1:]
    return {body[: body.index("(")]: body for body in bodies}


@dataclass(frozen=True)
class SassLoop:
    """One innermost loop of a kernel's SASS (a backward branch with no other loop inside)."""

    instructions: int  # issued per iteration, per warp
    kinds: dict[str, int]  # opcode (before the first dot) -> count per iteration
    opcodes: tuple[str, ...] = ()  # the iteration's opcodes (before the first dot), in code order


def _wheel_tool(name: str) -> str | None:
    """``name`` from NVIDIA's pip wheels (``nvidia/cu*/bin``), or ``None``."""
    try:
        import nvidia
    except ImportError:
        return None
    found = sorted(p for root in nvidia.__path__ for p in Path(root).glob(f"cu*/bin/{name}"))
    return str(found[-1]) if found else None


def sass_loops(
    arch: str = "sm_90",
    cuobjdump: str | None = None,
    warp_shape: tuple[int, int] | None = None,
    *,
    source: str = "scan.cu",
    options: tuple[str, ...] | None = None,
) -> dict[str, list[SassLoop]]:
    """The innermost loops of every kernel's SASS (nvcc -cubin, then ``cuobjdump -sass``; no GPU needed) of the
    module of ``warp_shape`` (see :func:`ptxas_usage`), in code order: what the cost model's per-step
    instruction counts come from. ``source`` another kernel file (e.g. ``"recurrent.cu"``), compiled with
    ``options`` (its -D options; ``None``: the scan module's of ``warp_shape``).

    Needs ``cuobjdump`` and ``nvdisasm`` (the ``[dev]`` extra installs NVIDIA's wheels of them; found on
    ``PATH``, else in those wheels; ``nvdisasm`` beside ``cuobjdump``); raises ``FileNotFoundError``
    without them or without nvcc.
    """
    nvcc = shutil.which("nvcc")
    cuobjdump = cuobjdump or shutil.which("cuobjdump") or _wheel_tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        raise FileNotFoundError("sass_loops needs nvcc and cuobjdump on PATH")
    env = {**os.environ, "NVDISASM_PATH": os.environ.get("NVDISASM_PATH", str(Path(cuobjdump).parent))}
    with tempfile.TemporaryDirectory() as tmp:
        flags = module_options(warp_shape) if options is None else options
        cmd = [nvcc, "-cubin", "-std=c++17", f"-arch={arch}", *flags, "-o", f"{tmp}/module.cubin",
               str(source_path(source))]  # fmt: skip
        subprocess.run(cmd, capture_output=True, text=True, check=True)
        sass = subprocess.run(
            [cuobjdump, "-sass", f"{tmp}/module.cubin"], capture_output=True, text=True, env=env
        )
    if sass.returncode != 0 or "Function :" not in sass.stdout:
        raise FileNotFoundError(f"cuobjdump -sass failed (nvdisasm missing?): {sass.stderr.strip()[-300:]}")
    loops: dict[str, list[SassLoop]] = {}
    for chunk in sass.stdout.split("Function : ")[1:]:
        name = chunk.split()[0]
        code = [
            (int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", chunk)
        ]
        back = []  # (target, branch address) of every backward branch
        for address, text in code:
            target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
            if target and int(target.group(1), 16) <= address:
                back.append((int(target.group(1), 16), address))
        innermost = [
            (lo, hi) for lo, hi in back if not any(lo <= a <= b <= hi and (a, b) != (lo, hi) for a, b in back)
        ]
        found = []
        for lo, hi in sorted(innermost):
            body = [text for address, text in code if lo <= address <= hi]
            opcodes = tuple(
                (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
                for words in map(str.split, body)
            )
            kinds: dict[str, int] = {}
            for op in opcodes:
                kinds[op] = kinds.get(op, 0) + 1
            found.append(SassLoop(len(body), kinds, opcodes))
        loops[name] = found
    return loops


@dataclass(frozen=True)
class WarpStep:
    """What one step of a warp-resident sweep issues, per warp (from its SASS: :func:`warp_step_counts`)."""

    instructions: int  # every instruction of a step (half the main loop, which holds two)
    shuffles: int  # SHFL: d per step (2 d for float64), the broadcast of the state
    fmas: int  # FFMA + FMUL (float32) or DFMA + DMUL (float64): the column's k d (factored) and the chain's d + 1
    copies: int  # LDGSTS: the asynchronous copies staging a later step's operand (this lane's share)


def warp_step_counts(loop: SassLoop) -> WarpStep:
    """One step of the main loop of a ``bppsa_warpsweep_*`` kernel (two steps, every loop over d unrolled:
    the largest innermost loop of the kernel's SASS). Raises ``ValueError`` if the loop's shuffles do not
    split in two equal steps."""
    shuffles = loop.kinds.get("SHFL", 0)
    if not shuffles or shuffles % 2:
        raise ValueError(f"{shuffles} shuffles in the loop: not two steps")
    fmas = sum(loop.kinds.get(op, 0) for op in ("FFMA", "FMUL", "DFMA", "DMUL"))
    return WarpStep(loop.instructions // 2, shuffles // 2, fmas // 2, loop.kinds.get("LDGSTS", 0) // 2)
