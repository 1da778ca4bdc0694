"""The one CuPy loader (kernels/cupy_loader.py) of both CUDA kernel families, with a stand-in ``cupy``
(``conftest.py``): compiled once per (device, source, options), shared by the scan's and the recurrent
layers' kernels and by any other family, availability checked once with one reason, the launch."""

from __future__ import annotations

import sys

import pytest
import torch
from lightning_bppsa.kernels import cuda, cupy_loader, recurrent_cuda

SOURCE = 'extern "C" __global__ void cell_a(float *x) {}\nextern "C" __global__ void cell_b(float *x) {}\n'


def test_each_device_source_and_options_compile_once_and_each_function_is_fetched_once(fake_device):
    fake, _ = fake_device
    a = cupy_loader.load_function(0, SOURCE, "cell_a")
    assert cupy_loader.load_function(0, SOURCE, "cell_a") is a
    b = cupy_loader.load_function(0, SOURCE, "cell_b")  # same module: no second compile
    cupy_loader.load_function(1, SOURCE, "cell_a")  # another device: its own module, in its context
    cupy_loader.load_function(0, SOURCE, "cell_a", options=("-DWIDTH=4",))  # other options: another module
    options = cupy_loader.NVRTC_OPTIONS
    assert fake.compiled == {
        (0, SOURCE, options): 1,
        (1, SOURCE, options): 1,
        (0, SOURCE, (*options, "-DWIDTH=4")): 1,
    }
    assert fake.lookups == {(0, "cell_a"): 2, (0, "cell_b"): 1, (1, "cell_a"): 1}  # once per module
    assert a is not b


def test_both_kernel_families_load_through_the_one_loader(fake_device):
    fake, _ = fake_device
    assert cuda.available() == (True, "") and recurrent_cuda.available() == (True, "")
    cuda.prepare(0), recurrent_cuda._functions(0)  # already loaded by available(): nothing compiled again
    options = cupy_loader.NVRTC_OPTIONS
    assert fake.compiled == {(0, cuda.source(), options): 1, (0, recurrent_cuda.source(), options): 1}
    # a third family handing the scan's own source gets the scan's module (and its loaded functions)
    name = cuda.KERNELS[0]
    assert cupy_loader.load_function(0, cuda.source(), name) is cuda.prepare(0)[name]
    assert sum(fake.compiled.values()) == 2 and fake.lookups[(0, name)] == 1


def test_the_scan_kernels_are_opted_in_to_the_devices_shared_memory_when_prepared(fake_device):
    fake, _ = fake_device
    functions = cuda.prepare(0)
    optin = torch.cuda.get_device_properties(0).shared_memory_per_block_optin  # the stand-in H100's
    for name, function in functions.items():
        assert function.max_dynamic_shared_size_bytes == optin - cuda.STATIC_SHARED_BYTES[name.split("_")[1]]
    launch = cuda.launch_config(factored=True, element_bytes=8, n=50, batch=2, d=100, m=100, affine=True,
                                algorithm="chunked", chunk_size=8, shared_limit=optin)  # fmt: skip
    assert launch.shared_bytes > cupy_loader.PORTABLE_SHARED_BYTES
    cuda._launch_cuda(launch, [0] * 14, torch.device("cuda", 0))
    assert functions[launch.kernel].opt_ins == 1  # the prepare's only: the launch makes no driver call


def test_a_kernel_with_more_static_shared_memory_than_budgeted_is_refused(fake_device):
    fake, _ = fake_device
    fake.static_bytes["bppsa_chunked_dense_f32"] = 64
    with pytest.raises(RuntimeError, match="bppsa_chunked_dense_f32 has 64 B of static shared memory"):
        cuda.prepare(0)


def test_launch_opts_in_once_per_new_maximum_and_packs_the_arguments_as_a_tuple(fake_device):
    fake, current = fake_device
    function = cupy_loader.load_function(0, SOURCE, "cell_a")
    for shared in (1024, 60 * 1024, 60 * 1024, 1024, 90 * 1024):
        cupy_loader.launch(function, 0, 3, (64, 2), shared, [7, 8])
    assert function.opt_ins == 2 and function.max_dynamic_shared_size_bytes == 90 * 1024
    assert function.calls[0] == ((3,), (64, 2), (7, 8), 1024, current["stream"])
    assert fake.streams_made == 1


def test_unavailable_cupy_is_checked_once_and_both_families_report_the_same_reason(fresh_loader, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    checks = []
    real = cupy_loader._check
    monkeypatch.setattr(cupy_loader, "_check", lambda: checks.append(1) or real())
    ok, reason = cupy_loader.available()
    assert not ok and "CuPy is not installed" in reason and "cuda12" in reason and "cuda13" in reason
    for _ in range(2):
        assert cuda.available() == (False, reason) and recurrent_cuda.available() == (False, reason)
    assert len(checks) == 1


def test_missing_nvrtc_is_named(fake_device):
    fake, _ = fake_device
    fake.nvrtc_error = RuntimeError("CuPy failed to load libnvrtc.so.13")
    ok, reason = recurrent_cuda.available()
    assert not ok and reason.startswith("CuPy 14.0.0 cannot load NVRTC (RuntimeError: CuPy failed to load")
    assert not fake.compiled


def test_a_family_that_does_not_compile_says_so_once(fake_device):
    fake, _ = fake_device
    fake.compile_error = ValueError("error: identifier 'x' is undefined")
    for _ in range(2):
        ok, reason = cuda.available()
        assert not ok and reason == (
            "the CUDA kernels do not compile or load here (ValueError: error: identifier 'x' is undefined)"
        )
    assert recurrent_cuda.available() == (False, reason)  # it needs the scan's kernels too
    fake.compile_error = None
    assert cuda.available() == (False, reason)  # the first eager answer stands for the process


def test_the_first_load_inside_a_graph_capture_refuses_to_compile_and_a_loaded_one_is_served(
    fake_device, monkeypatch
):
    fake, _ = fake_device
    cupy_loader.load_function(0, SOURCE, "cell_a")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot be inside a CUDA graph capture"):
        cuda.prepare(0)
    assert cupy_loader.load_function(0, SOURCE, "cell_b") is not None  # its module is compiled: a lookup only
    assert sum(fake.compiled.values()) == 1


def test_availability_is_not_probed_while_torch_compile_traces(fresh_loader, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(cupy_loader, "_check", lambda: pytest.fail("CuPy probed while tracing"))
    for family in (cuda, recurrent_cuda, cupy_loader):
        assert family.available() == (False, "not checked yet (first asked while torch.compile traces)")
    assert cupy_loader._ANSWERS == {}  # nothing cached: the first eager call still checks


def test_shared_limit_is_the_devices_opt_in_maximum_read_once(fake_device, monkeypatch):
    asked = []
    small = type("Props", (), {"shared_memory_per_block_optin": 1024})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or small)
    assert cupy_loader.shared_limit(0) == cupy_loader.PORTABLE_SHARED_BYTES  # never below 48 KiB
    assert cuda.device_shared_limit(0) == cupy_loader.PORTABLE_SHARED_BYTES
    assert asked == [0]


def test_cupy_version_is_empty_without_cupy(fresh_loader, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert cupy_loader.cupy_version() == ""


def test_cupy_version_of_a_usable_cupy(fake_device):
    assert cupy_loader.cupy_version() == "14.0.0"
