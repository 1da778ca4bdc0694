"""``benchmarks/cluster_layouts.py`` (the wide kernels' layouts timed on a GPU) without one: the layouts it
would time, its forcing of one onto the launch, and that a forced layout computes what the default does (the
kernels' host emulation, needs g++)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import recurrent_cuda, recurrent_emulated

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cluster_layouts.py"
H100 = 232448


def _script():
    sys.path.insert(0, str(SCRIPT.parent))  # its device_runner import
    spec = importlib.util.spec_from_file_location("cluster_layouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep = _script()


def test_the_candidates_are_every_cluster_of_a_unit_a_block_that_fits():
    """GRU H = 256's backward on an H100: clusters of 4 and 8 blocks with 2, 4 or 8 lanes a unit (2 blocks of 128
    units' columns do not fit a block's 227 KiB); the package's own choice (4 blocks x 4 lanes) among them; a
    GRU of H = 128 (one block by default) may take 2 blocks too; none where a second block would own no unit."""
    found = {(x.cluster, x.split) for x in sweep.candidates("gru", 256, "backward", H100)}
    chosen = recurrent_cuda.cluster_layout("gru", 256, "backward", H100, 8)
    assert found == {(q, s) for q in (4, 8) for s in (2, 4, 8)} and (chosen.cluster, chosen.split) == (4, 4)
    assert (2, 2) in {(x.cluster, x.split) for x in sweep.candidates("gru", 128, "forward", H100)}
    assert not sweep.candidates("gru", 33, "backward", 256)  # a block's two row buffers alone take more


def test_a_forced_layout_is_launched_and_then_forgotten():
    """Inside :func:`forced` the launch of that direction takes the layout (its cluster and its split's
    module options), the other direction its own; after it the package's choice again."""
    layout = recurrent_cuda.wide_layout("gru", 256, "forward", 8, splits=(8,))
    default = recurrent_cuda._kernel_and_block("gru", torch.float32, 256, "forward", H100, 8)
    backward = recurrent_cuda._kernel_and_block("gru", torch.float32, 256, "backward", H100, 8)
    with sweep.forced("gru", 256, "forward", layout):
        kernel, threads, _, options, q = recurrent_cuda._kernel_and_block("gru", torch.float32, 256, "forward", H100, 8)
        assert (kernel, threads, q) == ("bppsa_gru_forward_f32_h256_c8", 256, 8)
        assert options == (*recurrent_cuda.wide_options("gru", 256, layout, "forward"), "-DBPPSA_REC_CLUSTER=8")
        assert recurrent_cuda._kernel_and_block("gru", torch.float32, 256, "backward", H100, 8) == backward
    assert recurrent_cuda._kernel_and_block("gru", torch.float32, 256, "forward", H100, 8) == default


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the emulated kernels")
@pytest.mark.parametrize(("cluster", "split"), [(2, 4), (4, 8)])
def test_a_forced_layout_computes_what_the_default_does(monkeypatch, cluster, split):
    """A GRU of H = 40 (one block by default) forced onto clusters of 2 and 4 blocks with 4 and 8 lanes a unit
    (launched so: its cluster and threads): its forward's outputs and its backward's gradients equal the
    default launch's (the same sums, in another order: float32 rounding apart)."""
    launched = []
    real = recurrent_emulated._launcher
    monkeypatch.setattr(
        recurrent_emulated, "_launcher", lambda *a: lambda config, device: launched.append(config) or real(*a)(config, device)
    )
    options = {"shared_limit": H100, "cluster_limit": 8}
    torch.manual_seed(0)
    x = sweep.inputs("gru", 40, 2, 7, torch.device("cpu"))
    factors = sweep.forward("gru", x, recurrent_emulated, **options)
    grads = sweep.backward("gru", x, factors, recurrent_emulated, **options)
    for direction in ("forward", "backward"):
        layout = recurrent_cuda.wide_layout("gru", 40, direction, cluster, splits=(split,))
        assert layout.cluster == cluster
        launched.clear()
        with sweep.forced("gru", 40, direction, layout):
            got = (
                sweep.forward("gru", x, recurrent_emulated, **options)
                if direction == "forward"
                else sweep.backward("gru", x, factors, recurrent_emulated, **options)
            )
        threads = recurrent_cuda.wide_threads(-(-40 // cluster), split)
        assert [(c.cluster, c.block) for c in launched] == [(cluster, threads)]
        for a, b in zip(got, factors if direction == "forward" else grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
