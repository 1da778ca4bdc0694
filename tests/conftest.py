import pytest
import torch

from lightning_bppsa import layer_plan


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
def _model_decisions():
    """``algorithm="auto"`` decides by the model in tests: a measured decision would make the path depend on
    the machine's speed (tests/test_layer_plan.py measures with an injected timer)."""
    layer_plan.forget()
    with layer_plan.measurements(False):
        yield
    layer_plan.forget()
