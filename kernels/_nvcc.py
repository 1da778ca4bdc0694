"""The CUDA compile gate: compile a ``.cu`` file of this package with nvcc and read ptxas's resource report.

Needs only the CUDA toolkit (nvcc, ptxas), no GPU or driver. ptxas runs with ``-warn-spills -Werror``, so a
register spill fails the compilation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lightning_bppsa.kernels._build import kernel_path

__all__ = ["ResourceUsage", "compile_cubin", "ptxas_report"]


@dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reports for one kernel on one architecture."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    static_shared_bytes: int


def _nvcc(nvcc: str | None) -> str:
    found = nvcc or shutil.which("nvcc")
    if found is None:
        raise FileNotFoundError("nvcc not found on PATH")
    return found


def _run(cmd: list[str]) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {result.returncode}:\n{result.stderr[-3000:]}")
    return result.stderr


_PTXAS_FLAGS = ["-Xptxas", "-v", "-Xptxas", "-warn-spills", "-Xptxas", "-Werror"]


def ptxas_report(
    source: str, archs: tuple[str, ...] = ("sm_80", "sm_90"), nvcc: str | None = None
) -> dict[str, dict[str, ResourceUsage]]:
    """Compile ``source`` (a file of this package) for ``archs`` in one nvcc call; ptxas's report per arch and kernel.

    Raises ``FileNotFoundError`` without nvcc and ``RuntimeError`` (with the command and its output) when
    the compilation fails, a spill included.
    """
    gencodes = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [_nvcc(nvcc), "-fatbin", "-std=c++17", *gencodes, *_PTXAS_FLAGS, "-o", f"{tmp}/out.fatbin",
               str(kernel_path(source))]  # fmt: skip
        report = _run(cmd)
    usage: dict[str, dict[str, ResourceUsage]] = {arch: {} for arch in archs}
    for entry in re.split(r"Compiling entry function ", report)[1:]:
        name, arch = re.match(r"'(\w+)' for '(\w+)'", entry).groups()
        stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                                                  r"(\d+) bytes spill loads", entry).groups())  # fmt: skip
        registers = int(re.search(r"Used (\d+) registers", entry).group(1))
        shared = re.search(r"(\d+) bytes smem", entry)
        usage[arch][name] = ResourceUsage(registers, stack, stores, loads, int(shared.group(1)) if shared else 0)
    return usage


def compile_cubin(source: str, arch: str, output: Path, nvcc: str | None = None) -> Path:
    """Compile ``source`` for one ``arch`` (e.g. ``"sm_90"``) into the cubin ``output`` (for SASS inspection)."""
    _run([_nvcc(nvcc), "-cubin", "-std=c++17", f"-arch={arch}", *_PTXAS_FLAGS, "-o", str(output),
          str(kernel_path(source))])  # fmt: skip
    return output
