"""A stand-in ``cupy`` and CUDA device for the CuPy loader's tests (no GPU, no CuPy needed)."""

from __future__ import annotations

import sys
import types
from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from lightning_bppsa.kernels import cuda, cupy_loader, recurrent_cuda

#: an H100's shared_memory_per_block_optin (227 KiB)
H100_OPTIN = 232448


class FakeKernel:
    """A loaded CuPy ``Function``: records its launches and its shared-memory opt-ins (driver calls)."""

    def __init__(self, name: str, static_bytes: int = 0) -> None:
        self.name = name
        self.shared_size_bytes = static_bytes
        self.calls: list[tuple] = []
        self.max_dynamic_shared_size_bytes = 0
        self.opt_ins = 0

    def __setattr__(self, name, value):
        if name == "max_dynamic_shared_size_bytes" and hasattr(self, "opt_ins"):
            self.opt_ins += 1
        super().__setattr__(name, value)

    def __call__(self, grid, block, args, *, shared_mem, stream=None):
        self.calls.append((grid, block, args, shared_mem, None if stream is None else stream.ptr))


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.ptr = handle


class FakeCupy(types.ModuleType):
    """What the loader uses of ``cupy``: counts compilations (per device and source), function lookups,
    stream wrappers and device switches. ``compile_error`` / ``nvrtc_error``: raised by a compile / by
    ``nvrtc.getVersion``; ``static_bytes``: a kernel's static shared memory, by name."""

    def __init__(self) -> None:
        super().__init__("cupy")
        self.__version__ = "14.0.0"
        self.compiled: Counter[tuple[int, str, tuple[str, ...]]] = Counter()  # (device, source, options)
        self.lookups: Counter[tuple[int, str]] = Counter()  # (device, name)
        self.kernels: dict[tuple[int, str], FakeKernel] = {}
        self.streams_made = 0
        self.devices_entered: list[int] = []
        self.compile_error: Exception | None = None
        self.nvrtc_error: Exception | None = None
        self.static_bytes: dict[str, int] = {}
        self.current = [0]
        fake = self

        class Stream:
            @staticmethod
            def from_external(obj):
                fake.streams_made += 1
                return FakeStream(obj.__cuda_stream__()[1])

        @contextmanager
        def device(index):
            fake.devices_entered.append(index)
            fake.current.append(index)
            try:
                yield
            finally:
                fake.current.pop()

        def nvrtc_version():
            if fake.nvrtc_error is not None:
                raise fake.nvrtc_error
            return (13, 0)

        class RawModule:
            def __init__(self, *, code: str, options: tuple[str, ...]) -> None:
                self.device, self.code, self.options = fake.current[-1], code, options

            def compile(self) -> None:
                if fake.compile_error is not None:
                    raise fake.compile_error
                fake.compiled[(self.device, self.code, self.options)] += 1

            def get_function(self, name: str) -> FakeKernel:
                device = fake.current[-1]
                assert device == self.device, "a function is loaded in its module's device context"
                fake.lookups[(device, name)] += 1
                return fake.kernels.setdefault(
                    (device, name), FakeKernel(name, fake.static_bytes.get(name, 0))
                )

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(
            Stream=Stream, Device=device, nvrtc=types.SimpleNamespace(getVersion=nvrtc_version)
        )


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader and both kernel families with empty caches (restored after the test)."""
    for name in ("_ANSWERS", "_MODULES", "_FUNCTIONS", "_RESERVED", "_STREAMS", "_LIMITS"):
        monkeypatch.setattr(cupy_loader, name, {})
    monkeypatch.setattr(cuda, "_KERNELS_ON", {})
    monkeypatch.setattr(recurrent_cuda, "_KERNELS_ON", {})


@pytest.fixture
def fake_device(monkeypatch, fresh_loader):
    """A stand-in ``cupy`` and CUDA devices 0 and 1 (an H100's shared memory), device 0 current; the test
    sets the current torch stream's handle in ``current["stream"]``. Returns ``(fake cupy, current)``."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    current = {"stream": 0x1000}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current["stream"], raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    props = types.SimpleNamespace(shared_memory_per_block_optin=H100_OPTIN)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    return fake, current
