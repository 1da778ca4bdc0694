import logging

import pytest
import torch

from lightning_bppsa import backends, layer_plan, testing


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _lightning_logs_reach_caplog(monkeypatch):
    """Lightning stops its logger propagating where the root logger had no handler when it was first imported,
    which the collection order decides (``pytest tests/callbacks tests/strategy`` lost the strategy's table
    from ``caplog``): every test sees Lightning's messages whatever ran first."""
    monkeypatch.setattr(logging.getLogger("lightning.pytorch"), "propagate", True)


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
    """The recurrent layers' CUDA path on CPU tensors, every kernel run by its host emulation (needs g++), as
    :func:`lightning_bppsa.testing.cuda_path_on_cpu` sets it up, through ``monkeypatch`` (so that a test's own
    patches of the same attributes undo in order); yields the CUDA backend registered for ``"cpu"``."""
    emulated_cuda, patches = testing._cuda_path_patches()
    for target, name, value in patches:
        if isinstance(target, dict):
            monkeypatch.setitem(target, name, value)
        else:
            monkeypatch.setattr(target, name, value)
    testing._clear_plans()  # plans cached for "cpu" must not answer, nor these leak
    yield emulated_cuda
    testing._clear_plans()
