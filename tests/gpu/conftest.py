"""tests/gpu: the CUDA kernels and GPU paths, each test body run through the ``backend`` fixture.

On a CUDA machine ``backend`` is the GPU, and the tests FAIL (never skip) where the BPPSA CUDA kernels
cannot run, with the reason (CuPy missing or too old, NVRTC missing, a compile or load error): a GPU run
that silently fell back to the torch implementation would launch no kernel.

Without CUDA the same bodies, with the same ``check`` calls, run on the host emulation of the same
kernels (``kernels/emulated.py``, ``kernels/recurrent_emulated.py``; skipped without g++) at sizes the
emulation affords (:meth:`Backend.size`), and the Lightning tests on ``accelerator="cpu"``: a mistake in
a test shows on CPU, not first on a GPU. What only a GPU has (a side stream, a CUDA graph) is a stand-in
there that runs the body eagerly on the current thread.
"""

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels
from lightning_bppsa.kernels import emulated, recurrent_cuda, recurrent_emulated
from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES
from torch import Tensor


def require_kernels() -> torch.device:
    """The CUDA device, after checking that the kernels load on it: skip without CUDA, fail without kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the lent GPU machine)")
    ok, reason = kernels.available()
    if not ok:
        pytest.fail(f"this machine has CUDA but the BPPSA CUDA kernels cannot run: {reason}")
    return torch.device("cuda")


@dataclass(frozen=True)
class Backend:
    """Where a tests/gpu body runs: ``"cuda"`` (the GPU through CuPy) or ``"emulated"`` (the host emulation)."""

    name: str
    device: torch.device
    #: ``rnn_forward`` / ``gru_forward`` / ``lstm_forward`` with the CUDA signatures
    recurrent: ModuleType
    #: the per-block shared memory a launch may use (the device's opt-in limit; an A100's when emulated)
    shared_limit: int

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def accelerator(self) -> str:
        """``Trainer(accelerator=...)`` for this backend."""
        return "gpu" if self.is_cuda else "cpu"

    @property
    def mixed_precision(self) -> str:
        """The 16-bit mixed precision Lightning offers here (on CPU only bfloat16)."""
        return "16-mixed" if self.is_cuda else "bf16-mixed"

    def size(self, cuda: int, emulated: int) -> int:
        """``cuda`` on the GPU (sizes that stress real concurrency), ``emulated`` on the emulation (one OS
        thread per CUDA thread: a grid of a few dozen blocks takes seconds)."""
        return cuda if self.is_cuda else emulated

    def to(self, *tensors: Tensor | None, dtype: torch.dtype | None = None) -> list[Tensor | None]:
        """The tensors on this backend's device (in ``dtype`` if given); ``None`` stays ``None``."""
        return [None if t is None else t.to(self.device, dtype) for t in tensors]

    def scan_dense(self, jacobians_t: Tensor, grad: Tensor, algorithm: str, chunk_size: int) -> Tensor:
        """:func:`lightning_bppsa.kernels.cuda.scan_dense` on this backend."""
        if self.is_cuda:
            return kernels.scan_dense(jacobians_t, grad, algorithm, chunk_size)
        return emulated.scan_dense(
            jacobians_t, grad, algorithm, chunk_size, shared_limit=self.shared_limit, timeout=EMULATED_TIMEOUT_S
        )

    def scan_factored(
        self, weight: Tensor, scales: Tensor, diagonal: Tensor | None, grad: Tensor, algorithm: str, chunk: int
    ) -> Tensor:
        """:func:`lightning_bppsa.kernels.cuda.scan_factored` on this backend."""
        if self.is_cuda:
            return kernels.scan_factored(weight, scales, diagonal, grad, algorithm, chunk)
        return emulated.scan_factored(
            weight, scales, diagonal, grad, algorithm, chunk, shared_limit=self.shared_limit,
            timeout=EMULATED_TIMEOUT_S,
        )  # fmt: skip

    def side_stream(self) -> AbstractContextManager:
        """A CUDA side stream made current (``torch.cuda.stream``); the current thread when emulated."""
        return torch.cuda.stream(torch.cuda.Stream()) if self.is_cuda else nullcontext()

    @contextmanager
    def graph_capture(self) -> Iterator[Callable[[], None]]:
        """Capture the body into a CUDA graph and give its replay; emulated: the body runs eagerly and the
        replay does nothing (its outputs are already there)."""
        if not self.is_cuda:
            yield lambda: None
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yield graph.replay


def make_backend(name: str) -> Backend:
    """The backend ``name`` ("cuda" or "emulated"); see the module docstring for when each fails or skips."""
    if name == "cuda":
        device = require_kernels()
        ok, reason = recurrent_cuda.available()
        if not ok:
            pytest.fail(f"this machine has CUDA but the recurrent CUDA kernels cannot run: {reason}")
        limit = kernels.device_shared_limit(torch.cuda.current_device())
        return Backend("cuda", device, recurrent_cuda, limit)
    if shutil.which("g++") is None:
        pytest.skip("no CUDA device, and no g++ to build the host emulation of the kernels")
    return Backend("emulated", torch.device("cpu"), recurrent_emulated, SM80_OPTIN_SHARED_BYTES)


#: an emulated launch is aborted as deadlocked after this long: generous, since a loaded machine (thousands of
#: OS threads on two cores) must not fail a test that checks values, not the deadlock guard
EMULATED_TIMEOUT_S = 600.0

#: decided once per session: a CUDA machine runs the GPU, any other the emulation (the id says which)
BACKEND = "cuda" if torch.cuda.is_available() else "emulated"


@pytest.fixture(params=[BACKEND])
def backend(request: pytest.FixtureRequest) -> Backend:
    return make_backend(request.param)


#: where each finished test's phase, outcome and seconds are appended (``benchmarks/gpu.py``'s tests stage sets
#: it): a run stopped at its time limit still says what passed, what failed and what took the time
TEST_LOG = "BPPSA_TEST_LOG"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(TEST_LOG)
    if path and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as log:  # one short append per line: xdist's workers write beside each other
            log.write(f"{report.when}\t{report.outcome}\t{report.duration:.3f}\t{report.nodeid}\n")
