import pytest

from lightning_bppsa import cost_model


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_choose_returns_concrete_algorithm_and_valid_chunk(device):
    for n in [0, 1, 2, 10, 1000, 30000]:
        for batch in [1, 16, 256]:
            algorithm, chunk = cost_model.choose("auto", n=n, d=20, batch=batch, width=20, device=device)
            assert algorithm in ("linear", "blelloch", "chunked")
            assert 1 <= chunk <= max(n, 1)


def test_explicit_algorithm_is_kept():
    assert cost_model.choose("blelloch", n=100, d=4, batch=1, width=None, device="cpu")[0] == "blelloch"


@pytest.fixture
def without_cpu_kernel(monkeypatch):
    monkeypatch.setattr(cost_model.cpu_kernel, "available", lambda: False)
    cost_model._choose.cache_clear()
    yield
    cost_model._choose.cache_clear()


def test_scan_pays_on_long_small_batch_chains_and_not_on_large_batches(without_cpu_kernel):
    # op-bound torch loops: the parallel scan pays at B = 1 (CPU and GPU), not at B = 256 on CPU
    assert cost_model.choose("auto", n=1000, d=20, batch=1, width=20, device="cpu")[0] != "linear"
    assert cost_model.choose("auto", n=1000, d=20, batch=1, width=20, device="cuda")[0] != "linear"
    assert cost_model.choose("auto", n=1000, d=20, batch=256, width=None, device="cpu")[0] == "linear"


def test_compiled_linear_kernel_wins_on_cpu():
    if not cost_model.cpu_kernel.available():
        pytest.skip("no C compiler on this machine: the compiled linear kernel is not built")
    cost_model._choose.cache_clear()
    for batch in (1, 16, 256):
        assert cost_model.choose("auto", n=1000, d=20, batch=batch, width=20, device="cpu")[0] == "linear"


def test_predictions_grow_with_work():
    kwargs = dict(d=20, batch=16, width=20, device="cpu")
    for algorithm in ["linear", "blelloch", "chunked"]:
        small = cost_model.predict_seconds(algorithm, n=100, chunk_size=8, **kwargs)
        large = cost_model.predict_seconds(algorithm, n=10000, chunk_size=8, **kwargs)
        assert large > small > 0
