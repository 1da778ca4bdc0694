"""Mutation list of the CUDA scan: each one-line bug below must make the suite fail.

Each case copies ``scan.cu`` and its header to a temporary folder, applies one mutation there (the
worktree is never edited), points ``$BPPSA_CUDA_SOURCE_DIR`` at the copy (read by the emulated build,
the nvcc compile gate and the PTX check) and runs the tests named beside the mutation in a fresh
pytest process, which must FAIL. Slow (a fresh g++ build of the emulated kernels per mutation):

    pytest -m slow tests/kernels/test_cuda_mutations.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from lightning_bppsa.kernels import cuda

HERE = Path(__file__).resolve().parent
EMULATED = str(HERE / "test_cuda_emulated.py")
COMPILE = str(HERE / "test_cuda_compile.py")


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # scan.cu or cuda_host_emulation.h
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail on the mutant


MUTATIONS = [
    Mutation(
        "ticket = blockIdx.x (blocks assumed to start in index order)",
        "scan.cu",
        "const bppsa::u64 ticket = bppsa::take_ticket(sync);",
        "const bppsa::u64 ticket = blockIdx.x;",
        (EMULATED, "-k", "dispatched_in_any_order"),
    ),
    Mutation(
        "fallback waits for AGGREGATE only, then reads an unpublished INCLUSIVE",
        "scan.cu",
        "while (bppsa::load_relaxed(&flags[(q - 1 - hops) * p.batch + b]) != inclusive_flag)",
        "while ((bppsa::load_relaxed(&flags[(q - 1 - hops) * p.batch + b]) >> 2) != (bppsa::u64)epoch)",
        (EMULATED, "-k", "look_back_over"),
    ),
    Mutation(
        "flag polls ignore the epoch (an earlier launch's flags taken as this one's)",
        "scan.cu",
        "while (((flag = bppsa::load_relaxed(&flags[k * p.batch + b])) >> 2) != (bppsa::u64)epoch)",
        "while ((flag = bppsa::load_relaxed(&flags[k * p.batch + b])) == 0)",
        (EMULATED, "-k", "old_epochs or reuse_one_flag"),
    ),
    Mutation(
        "the ticket counter not set back to 0 by a launch's last ticket",
        "scan.cu",
        "if (ticket + 1 == gridDim.x) bppsa::reset_ticket(sync);",
        "",
        (EMULATED, "-k", "old_epochs or reuse_one_flag"),
    ),
    Mutation(
        "__ballot_sync with a partial mask",
        "scan.cu",
        "__ballot_sync(0xffffffffu, flag == inclusive_flag)",
        "__ballot_sync(0x0000ffffu, flag == inclusive_flag)",
        (EMULATED, "-k", "look_back_over"),
    ),
    Mutation(
        "published data read through L1 (a weak load)",
        "cuda_host_emulation.h",
        "T load_shared_global(const T* p) { return __ldcg(p); }",
        "T load_shared_global(const T* p) { return *p; }",
        (COMPILE, "-m", "slow", "-k", "look_back_ptx"),
    ),
    Mutation(
        "one published aggregate tile read through L1",
        "scan.cu",
        "tile[e] = bppsa::load_shared_global(c_matrix + (i64)j0 * d + e);",
        "tile[e] = c_matrix[(i64)j0 * d + e];",
        (COMPILE, "-m", "slow", "-k", "look_back_ptx"),
    ),
    Mutation(
        "an acquire load per poll (invalidates L1 on every poll)",
        "cuda_host_emulation.h",
        'asm volatile("ld.relaxed.gpu.u64 %0, [%1];"',
        'asm volatile("ld.acquire.gpu.u64 %0, [%1];"',
        (COMPILE, "-m", "slow", "-k", "look_back_ptx"),
    ),
    Mutation(
        "no fence after the polls",
        "scan.cu",
        "bppsa::fence_acq_rel();  // what the polls saw",
        "// what the polls saw",
        (COMPILE, "-m", "slow", "-k", "look_back_ptx"),
    ),
    Mutation(
        "a chunk announced before its aggregate is stored (the closing barrier of a product dropped)",
        "scan.cu",
        "                if (store) bppsa::store_shared_global(store + o, v);\n            }\n    }\n    __syncthreads();",
        "                if (store) bppsa::store_shared_global(store + o, v);\n            }\n    }",
        (EMULATED, "-k", "look_back_over or chunked_factored"),
    ),
    Mutation(
        "warp sweep: a wrong shuffle source lane",
        "scan.cu",
        "acc[l % kChains] += __shfl_sync(kFullMask, g, l) * col.j[l];",
        "acc[l % kChains] += __shfl_sync(kFullMask, g, (l + 1) % kWarp) * col.j[l];",
        (EMULATED, "-k", "ring_quick"),
    ),
    Mutation(
        "warp sweep, dense: J_t staged untransposed (lane c reads row c of J_t, not its column)",
        "scan.cu",
        "if (e < D * D) bppsa::copy_async(to + e / D * L::kRow + e % D, jt + e);",
        "if (e < D * D) bppsa::copy_async(to + e % D * L::kRow + e / D, jt + e);",
        (EMULATED, "-k", "ring_quick and dense"),
    ),
    Mutation(
        "warp sweep, factored: every tile multiplies the first tile's W (registers)",
        "scan.cu",
        "for (int v = 0; v < V; ++v) wv[v] = l0 + v < D ? w[i * D + l0 + v] : T(0);",
        "for (int v = 0; v < V; ++v) wv[v] = l0 + v < D ? w[l0 + v] : T(0);",
        (EMULATED, "-k", "ring_quick and k3"),
    ),
    Mutation(
        "warp sweep, factored: every tile multiplies the first tile's W (shared memory)",
        "scan.cu",
        "bppsa::load_shared_vector(w_shared + i * L::kPart + l0, wv);",
        "bppsa::load_shared_vector(w_shared + l0, wv);",
        (EMULATED, "-k", "ring_in_chunk and d5k3"),
    ),
    Mutation(
        "warp sweep: a dead lane writes its output (over the next step's row)",
        "scan.cu",
        "if (live) p.out_row(b, t)[lane] = g;",
        "p.out_row(b, t)[lane] = g;",
        (
            EMULATED,
            "-k",
            "ring_quick and 20",
        ),  # d = 20: the stray writes stay inside the output (d = 5: a crash)
    ),
    Mutation(
        "warp sweep ring index: a step's copies go into the slot being formed",
        "scan.cu",
        "if (formed + 1 - S >= lo) stage(formed + 1 - S, slot(formed + 1));",
        "if (formed + 1 - S >= lo) stage(formed + 1 - S, slot(formed));",
        (EMULATED, "-k", "ring_quick or ring_in_chunk"),
    ),
    Mutation(
        "warp sweep ring: a step formed before its copies' group is waited for",
        "scan.cu",
        "bppsa::copy_async_wait<S - 2>();  // 1.",
        "bppsa::copy_async_wait<S - 1>();  // 1.",
        (EMULATED, "-k", "ring_quick or ring_in_chunk"),
    ),
    Mutation(
        "warp sweep: shuffles with a mask that leaves out lane 31",
        "scan.cu",
        "constexpr unsigned kFullMask = 0xffffffffu;",
        "constexpr unsigned kFullMask = 0x7fffffffu;",
        (EMULATED, "-k", "warp_sweep"),
    ),
    Mutation(
        "no barrier before reloading the tile on a second output pass",
        "scan.cu",
        "if (j0 > 0 || base > 0) __syncthreads();",
        "if (j0 > 0) __syncthreads();",
        (EMULATED, "-k", "wide_dense_sweep"),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_the_suite_catches_the_mutation(mutation, tmp_path):
    for name in ("scan.cu", "cuda_host_emulation.h"):
        shutil.copy(cuda.source_path(name), tmp_path / name)
    target = tmp_path / mutation.file
    text = target.read_text()
    assert text.count(mutation.old) == 1, f"the mutation no longer applies: {mutation.old!r} not found once"
    target.write_text(text.replace(mutation.old, mutation.new))
    env = {**os.environ, "BPPSA_CUDA_SOURCE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    # exit status 1: tests ran and some failed (5 would be "no test ran", 2 a collection error)
    assert result.returncode == 1, f"the suite did not catch {mutation.name!r}:\n{result.stdout[-3000:]}"
