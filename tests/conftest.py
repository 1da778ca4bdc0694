import pytest
import torch
from lightning_bppsa.kernels import cuda, emulated, recurrent_emulated
from lightning_bppsa.kernels.recurrent_cuda import SM80_OPTIN_SHARED_BYTES

from lightning_bppsa import backends, layer_plan, plan


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """torch's thread count as each test found it (``compare`` measures and sets it, for instance)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _model_decisions(monkeypatch):
    """``algorithm="auto"`` decides by the model in tests: a measured decision would make the path depend on
    the machine's speed (tests/test_layer_plan.py and tests/nn/test_recurrence*.py measure with an injected
    timer). The on-disk plan cache is off whatever the environment says, so that no test writes one to the
    user's cache directory; a test of the cache turns it on in a directory of its own."""
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    layer_plan.forget()
    with layer_plan.measurements(False):
        yield
    layer_plan.forget()


@pytest.fixture
def cuda_on_cpu(monkeypatch) -> backends.CudaBackend:
    """The recurrent layers' CUDA path on CPU tensors, every kernel run by its host emulation (needs g++): the
    CUDA backend over the emulated recurrent kernels registered for ``"cpu"`` (returned), ``plan.choose``
    answering as for a CUDA tensor, the scan's kernels launched through their emulation, on a device with an
    SM 8.0 block's shared memory; the plan caches cleared before and after."""
    emulated_cuda = backends.CudaBackend(
        recurrent_emulated, "cpu", lambda device: SM80_OPTIN_SHARED_BYTES, lambda: (True, "")
    )
    monkeypatch.setitem(backends.DEVICE_BACKENDS, "cpu", emulated_cuda)
    real_choose = plan.choose
    monkeypatch.setattr(
        plan, "choose", lambda algorithm, *, device, **shape: real_choose(algorithm, device="cuda", **shape)
    )
    monkeypatch.setattr(cuda, "available", lambda: (True, ""))
    monkeypatch.setattr(cuda, "current_shared_limit", lambda: SM80_OPTIN_SHARED_BYTES)
    monkeypatch.setattr(cuda, "_launch_cuda", emulated._launcher(None, 600.0, 1, 0.0))
    monkeypatch.setattr(cuda, "_device_limit", lambda t: SM80_OPTIN_SHARED_BYTES)
    plan._choose.cache_clear()  # plans cached for "cpu" must not answer, nor these leak
    yield emulated_cuda
    plan._choose.cache_clear()
