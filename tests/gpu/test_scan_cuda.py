"""The scan ops on the CUDA path (the CUDA kernels: the fixture fails where they cannot run) give the CPU
float64 result. Emulated (no CUDA), the ops take CPU tensors through the same CUDA plan into the host
emulation of the kernels."""

from collections.abc import Iterator

import pytest
import torch
from lightning_bppsa.kernels import cuda as kernels

from lightning_bppsa import FactoredJacobians, backprop_scan, plan, scan_ref
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda


@pytest.fixture
def device(backend, monkeypatch) -> Iterator[torch.device]:
    """Where the ops run: the GPU; or, emulated, CPU tensors planned as on CUDA and scanned by the emulation
    (which must then have run: a scan that went to the CPU code instead would prove nothing here)."""
    if backend.is_cuda:
        yield backend.device
        return
    launches = []

    def counted(scan):
        def run(*args):
            launches.append(scan.__name__)
            return scan(*args)

        return run

    real_choose = plan.choose

    def choose(algorithm, *, device, **shape):  # the plan a CUDA tensor of this shape gets
        return real_choose(algorithm, device="cuda", **shape)

    monkeypatch.setattr(plan, "choose", choose)
    monkeypatch.setattr(kernels, "available", lambda: (True, ""))
    monkeypatch.setattr(kernels, "current_shared_limit", lambda: backend.shared_limit)
    monkeypatch.setattr(kernels, "scan_dense", counted(backend.scan_dense))  # the emulation's
    monkeypatch.setattr(kernels, "scan_factored", counted(backend.scan_factored))
    plan._choose.cache_clear()  # plans cached for "cuda" without kernels (or with the stand-in) must not leak
    yield backend.device
    plan._choose.cache_clear()
    assert launches, "the emulated CUDA kernels never ran: the ops took another path"


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked", "auto"])
@pytest.mark.parametrize("hidden", [1, 20, 33, 128])
def test_factored_matches_cpu_float64(backend, device, algorithm, hidden):
    rows, steps = backend.size(cuda=3, emulated=1), backend.size(cuda=301, emulated=11)
    weight = torch.randn(hidden, hidden, dtype=torch.float64) / hidden**0.5
    scales = torch.rand(rows, steps, hidden, dtype=torch.float64)
    grad = torch.randn(rows, steps + 1, hidden, dtype=torch.float64)
    reference = scan_ref(FactoredJacobians(weight, scales), grad)  # plain torch: no plan, no kernel
    jacobians = FactoredJacobians(weight.to(device), scales.to(device))
    out = backprop_scan(jacobians, grad.to(device), algorithm=algorithm)
    assert out.device.type == device.type
    assert_derived_close(out.cpu(), reference, floor=1e-12)


def test_non_contiguous_inputs(device):
    jt = torch.randn(2, 40, 6, 6, device=device, dtype=torch.float64).mT * 0.3
    grad = torch.randn(2, 6, 41, device=device, dtype=torch.float64).mT
    reference = scan_ref(jt.cpu(), grad.cpu())
    assert_derived_close(backprop_scan(jt, grad, algorithm="chunked").cpu(), reference, floor=1e-12)


def test_opcheck(device):
    args = (torch.randn(2, 9, 3, 3, device=device), torch.randn(2, 3, device=device), "blelloch", 4)
    torch.library.opcheck(torch.ops.bppsa.scan_dense.default, args)
