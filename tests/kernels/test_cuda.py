"""The CUDA loader's launch configuration and availability (no GPU needed: nothing is launched here)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from lightning_bppsa.kernels import cuda


def config(**overrides):
    """``cuda.launch_config`` for a float32 factored chunked scan (n=1000, B=16, d=m=20), with ``overrides``."""
    args = dict(
        factored=True,
        element_bytes=4,
        n=1000,
        batch=16,
        d=20,
        m=20,
        affine=False,
        algorithm="chunked",
        chunk_size=32,
    )
    return cuda.launch_config(**{**args, **overrides})


def test_chunked_launch_covers_every_chunk_once():
    launch = config(n=1000, chunk_size=32, batch=16)
    assert launch.kernel == "bppsa_chunked_factored_f32"
    assert launch.grid == 16 * 32  # ceil(1000 / 32) chunks per row
    assert launch.sync_words == 1 + launch.grid  # ticket counter + one flag per block (64-bit words)
    assert launch.work_elements == launch.grid * (20 * 20 + 20)  # aggregate C and carry per block
    assert launch.block % 32 == 0 and launch.block <= cuda.MAX_THREADS
    assert launch.shared_bytes <= cuda.SHARED_BYTES and launch.tile_rows >= 1


@pytest.mark.parametrize("algorithm", ["chunked", "blelloch"])
def test_parallel_algorithms_use_the_one_launch_kernel(algorithm):
    assert config(algorithm=algorithm).kernel.startswith("bppsa_chunked_")


def test_linear_uses_one_block_per_row():
    launch = config(algorithm="linear", element_bytes=8, affine=True, factored=False, d=40)
    assert (launch.kernel, launch.grid, launch.chunk, launch.sync_words) == (
        "bppsa_sweep_dense_f64",
        16,
        1000,
        0,
    )


@pytest.mark.parametrize("element_bytes", [4, 8])
@pytest.mark.parametrize(("d", "tiles"), [(1, 1), (7, 3), (20, 1), (20, 3), (32, 5)])
def test_linear_with_d_up_to_32_uses_one_warp_per_row(d, tiles, element_bytes):
    """The warp-resident sweep: a block is one warp, from the module compiled for (d, k); its shared memory is
    the operand ring (and W where W is not in registers), ``tile_rows`` the ring's depth."""
    launch = config(algorithm="linear", d=d, m=tiles * d, element_bytes=element_bytes)
    suffix = {4: "f32", 8: "f64"}[element_bytes]
    assert (launch.kernel, launch.grid, launch.block) == (f"bppsa_warpsweep_factored_{suffix}", 16, 32)
    assert launch.warp_shape == (d, tiles)
    layout = cuda.warp_layout(factored=True, d=d, k=tiles, element_bytes=element_bytes)
    assert (launch.shared_bytes, launch.tile_rows) == (layout.shared_bytes, layout.depth)
    assert (launch.work_elements, launch.sync_words, launch.static_bytes) == (0, 0, 0)
    dense = config(algorithm="linear", d=d, m=d, factored=False, element_bytes=element_bytes)
    assert (dense.kernel, dense.block, dense.warp_shape) == (f"bppsa_warpsweep_dense_{suffix}", 32, (d, 1))
    dense_layout = cuda.warp_layout(factored=False, d=d, k=1, element_bytes=element_bytes)
    assert dense.shared_bytes == dense_layout.shared_bytes and not dense_layout.weight_in_registers


@pytest.mark.parametrize("element_bytes", [4, 8])
def test_warp_layout_depth_and_weight_placement(element_bytes):
    """The ring is a power of two of at most 32 slots within 47 KiB with a shared W; W in registers where it and
    two columns take at most 160 words (the GRU at d = 20 float32: yes; the LSTM at d = 32: no); a factored
    float32 ring is at least 16 deep (32 with W in registers); the chunked kernel's (lean) sweeps keep W in
    shared memory."""
    for d in range(1, 33):
        for k in range(1, 6):
            for factored in (True, False):
                layout = cuda.warp_layout(factored=factored, d=d, k=k, element_bytes=element_bytes)
                assert layout.depth in (2, 4, 8, 16, 32) and layout.shared_bytes <= cuda.WARP_SHARED_BYTES
                words = (k + 2) * d * element_bytes // 4
                assert layout.weight_in_registers == (factored and words <= cuda.REGISTER_WORDS)
                if factored and element_bytes == 4:  # 32 deep, at least 16 where a shared W takes room
                    assert layout.depth == 32 or (layout.depth == 16 and not layout.weight_in_registers), (
                        d,
                        k,
                    )
                lean = cuda.warp_layout(factored=factored, d=d, k=k, element_bytes=element_bytes, lean=True)
                assert not lean.weight_in_registers and lean.slot == layout.slot
    gru = cuda.warp_layout(factored=True, d=20, k=3, element_bytes=4)
    assert gru.weight_in_registers and gru.shared_bytes == 32 * (3 * 20 + 2 * 20) * 4
    assert not cuda.warp_layout(factored=True, d=32, k=5, element_bytes=4).weight_in_registers


def test_warp_sweep_limits_fall_back_to_the_block_sweep():
    assert config(algorithm="linear", d=33, m=33).kernel == "bppsa_sweep_factored_f32"  # wider than a warp
    assert config(algorithm="linear", d=20, m=120).kernel == "bppsa_sweep_factored_f32"  # 6 > MAX_TILES tiles
    assert config(algorithm="linear", d=20, m=30).kernel == "bppsa_sweep_factored_f32"  # m not k d


def test_single_chunk_and_wide_states_fall_back_to_the_sweep():
    assert config(chunk_size=5000).kernel.startswith("bppsa_warpsweep_")  # one chunk: nothing to look back on
    assert config(chunk_size=5000, d=40, m=40).kernel.startswith("bppsa_sweep_")
    assert config(d=200, m=600).kernel.startswith("bppsa_sweep_")  # two (d+1) x d matrices exceed 48 KiB
    wide = config(d=1000, m=3000, element_bytes=8)
    assert wide.kernel == "bppsa_sweep_factored_f64" and wide.tile_rows < 3000  # W streamed in tiles


def test_too_wide_state_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="too wide"):
        config(d=5000, m=5000, element_bytes=8)
    with pytest.raises(ValueError, match="n, batch, d >= 1"):
        config(n=0)


def test_kernel_args_follow_the_kernel_signature():
    launch = config()
    args = cuda.kernel_args(
        launch,
        mat=1,
        scales=2,
        diagonal=0,
        grad=3,
        out=4,
        work=5,
        sync=6,
        n=1000,
        batch=16,
        d=20,
        m=20,
        affine=False,
        epoch=7,
    )
    assert args == [1, 2, 0, 3, 4, 5, 6, 1000, 16, 20, 20, launch.chunk, 0, launch.tile_rows, 7]


def test_availability_says_why_not():
    ok, reason = cuda.available()
    assert isinstance(ok, bool)
    assert ok or reason  # never "unavailable" without a reason


@pytest.mark.slow  # a fresh interpreter importing torch
def test_importing_the_loader_imports_no_cupy():
    code = "import sys, lightning_bppsa.kernels.cuda; print('cupy' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_cost_model_rule_for_the_cuda_kernels():
    from lightning_bppsa import cuda_cost_model, cuda_step_model

    assert cuda_cost_model.cuda_choose("linear", n=1000, d=20, batch=16, width=20)[0] == "linear"
    algorithm, chunk = cuda_cost_model.cuda_choose("auto", n=1000, d=20, batch=16, width=20)
    assert algorithm in ("linear", "chunked")
    sweep = cuda_step_model.kernel_seconds("linear", n=1000, d=20, m=20, batch=16, chunk=1)
    best_chunk = cuda_cost_model.cuda_choose("chunked", n=1000, d=20, batch=16, width=20)[1]
    assert 2 <= best_chunk < 1000
    chunked = cuda_step_model.kernel_seconds("chunked", n=1000, d=20, m=20, batch=16, chunk=best_chunk)
    assert (algorithm == "chunked") == (chunked < sweep)
    # the sweep is n dependent steps: 30x the steps costs about 30x the time
    long = cuda_step_model.kernel_seconds("linear", n=30000, d=20, m=20, batch=16, chunk=1)
    launch = cuda_step_model.KERNELS.launch
    assert 25 < (long - launch) / (sweep - launch) < 35
    assert cuda_cost_model.cuda_choose("auto", n=1, d=4, batch=2, width=None) == ("linear", 1)


def test_cost_model_plan_is_dtype_aware():
    from lightning_bppsa import cuda_cost_model, cuda_step_model

    for element_bytes in (4, 8):
        algorithm, chunk = cuda_cost_model.cuda_choose(
            "chunked", n=1000, d=100, batch=4, width=100, element_bytes=element_bytes
        )
        best = min(
            (cuda_step_model.kernel_seconds(
                "chunked", n=1000, d=100, m=100, batch=4, chunk=c, element_bytes=element_bytes
            ), c)
            for c in (chunk, max(2, chunk // 2), min(999, chunk * 2))
            if cuda_step_model.runs_chunked(n=1000, d=100, m=100, chunk=c, element_bytes=element_bytes)
        )  # fmt: skip
        assert best[1] == chunk
    with pytest.raises(ValueError, match="element_bytes must be 4 or 8"):
        cuda_cost_model.cuda_choose("auto", n=10, d=4, batch=2, width=None, element_bytes=2)


def test_chunked_that_cannot_fit_becomes_the_sweep_in_the_plan_not_in_the_launch():
    from lightning_bppsa.kernels import cuda

    from lightning_bppsa import plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda, "available", lambda *a, **k: (True, ""))
        mp.setattr(cuda, "current_shared_limit", lambda: H100_OPTIN)
        plan._choose.cache_clear()
        wide = plan.choose("chunked", n=1000, d=256, batch=16, width=256, device="cuda", dtype=torch.float32)
        narrow = plan.choose("chunked", n=1000, d=20, batch=16, width=20, device="cuda", dtype=torch.float32)
        plan._choose.cache_clear()
    assert (wide.algorithm, wide.chunk) == (
        "linear",
        1,
    ) and "the chunked scan kernel of d=256 needs" in wide.reason
    assert wide.instead.startswith("chunked asked: the chunked scan kernel of d=256")
    assert narrow.algorithm == "chunked" and narrow.chunk > 1


H100_OPTIN = 232448  # an H100's shared_memory_per_block_optin (227 KiB)


@pytest.mark.parametrize(
    ("element_bytes", "limit", "widest"),
    [(4, cuda.SHARED_BYTES, 77), (8, cuda.SHARED_BYTES, 54), (4, H100_OPTIN, 169), (8, H100_OPTIN, 119)],
)
def test_widest_state_of_the_chunked_kernel_is_as_documented(element_bytes, limit, widest):
    def kernel(d):
        return config(element_bytes=element_bytes, d=d, m=d, affine=True, shared_limit=limit).kernel

    assert kernel(widest).startswith("bppsa_chunked_") and kernel(widest + 1).startswith("bppsa_sweep_")


def every_launch(static_bytes: dict[str, int] | None = None):
    """Every launch launch_config makes for d in 1..128, both dtypes, both chain kinds (m = d .. 4d),
    either gradient, both kernels, under 48 KiB and an H100's opt-in limit: (launch, limit)."""
    for d in range(1, 129):
        for element_bytes in (4, 8):
            for m in (None, d, 2 * d, 3 * d, 4 * d):
                for affine in (False, True):
                    for algorithm in ("linear", "chunked"):
                        for limit in (cuda.SHARED_BYTES, H100_OPTIN):
                            launch = config(
                                factored=m is not None, m=m or d, d=d, element_bytes=element_bytes, affine=affine,
                                algorithm=algorithm, chunk_size=8, n=100, shared_limit=limit,
                            )  # fmt: skip
                            yield launch, limit


def test_static_plus_dynamic_shared_memory_within_the_limit_of_every_launch():
    """The chunked kernels also declare static shared memory (STATIC_SHARED_BYTES, checked against ptxas
    by the compile gate): static + dynamic must fit the limit, for every launch launch_config makes."""
    count = 0
    for launch, limit in every_launch():
        family = launch.kernel.split("_")[1]
        assert launch.static_bytes == cuda.STATIC_SHARED_BYTES[family]
        assert launch.static_bytes + launch.shared_bytes <= limit, (launch, limit)
        count += 1
    assert count == 128 * 2 * 5 * 2 * 2 * 2


def test_shared_limit_below_48_kib_is_refused():
    with pytest.raises(ValueError, match="shared_limit=1024"):
        config(shared_limit=1024)


@pytest.mark.parametrize("element_bytes", [4, 8])
@pytest.mark.parametrize(("d", "tiles"), [(1, 1), (20, 3), (32, 5)])
def test_chunked_launch_holds_the_warp_step_ring(d, tiles, element_bytes):
    """For d <= 32 the chunk sweeps put their ring and W over the chunk matrices: the launch gives the larger,
    from the module of (d, k)."""
    launch = config(d=d, m=tiles * d, element_bytes=element_bytes, affine=True)
    assert launch.kernel.startswith("bppsa_chunked_") and cuda.warp_resident(factored=True, d=d, m=tiles * d)
    lean = cuda.warp_layout(factored=True, d=d, k=tiles, element_bytes=element_bytes, lean=True)
    assert launch.shared_bytes >= lean.shared_bytes and launch.warp_shape == (d, tiles)
    assert not cuda.warp_resident(factored=True, d=33, m=33) and not cuda.warp_resident(
        factored=True, d=20, m=120
    )


def test_the_scan_kernels_limits_are_stated_once_by_refusal(monkeypatch):
    """The launch (``launch_config``) and the plan both decide by ``cuda.refusal``: a stand-in refusing the
    chunked kernel at d=20 only changes both, and the plan reports the stand-in's reason."""
    from lightning_bppsa import plan

    def stand_in(algorithm, *, d, element_bytes, shared_limit, affine=True):
        return "a stand-in limit: d=20" if algorithm != "linear" and d == 20 else None

    monkeypatch.setattr(cuda, "refusal", stand_in)
    monkeypatch.setattr(cuda, "available", lambda: (True, ""))
    monkeypatch.setattr(cuda, "current_shared_limit", lambda: H100_OPTIN)
    for cached in (cuda.launch_config, plan._choose):
        cached.cache_clear()
    try:
        assert config(d=20, m=20).kernel == "bppsa_warpsweep_factored_f32"
        assert config(d=24, m=24).kernel == "bppsa_chunked_factored_f32"
        chosen = plan.choose("chunked", n=1000, d=20, batch=16, width=20, device="cuda", dtype=torch.float32)
        assert (chosen.algorithm, chosen.instead) == ("linear", "chunked asked: a stand-in limit: d=20")
        assert (
            plan.choose("chunked", n=1000, d=24, batch=16, width=24, device="cuda", dtype=torch.float32).chunk
            > 1
        )
    finally:
        for cached in (cuda.launch_config, plan._choose):
            cached.cache_clear()
