"""The scan ops on CUDA tensors (the CUDA kernels: the fixture fails where they cannot run) give the CPU float64 result."""

import pytest
import torch

from lightning_bppsa import FactoredJacobians, backprop_scan
from lightning_bppsa.testing import assert_derived_close

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked", "auto"])
@pytest.mark.parametrize("hidden", [1, 20, 33, 128])
def test_factored_matches_cpu_float64(cuda, algorithm, hidden):
    weight = torch.randn(hidden, hidden, dtype=torch.float64) / hidden**0.5
    scales = torch.rand(3, 301, hidden, dtype=torch.float64)
    grad = torch.randn(3, 302, hidden, dtype=torch.float64)
    reference = backprop_scan(FactoredJacobians(weight, scales), grad, algorithm="linear")
    out = backprop_scan(FactoredJacobians(weight.to(cuda), scales.to(cuda)), grad.to(cuda), algorithm=algorithm)
    assert out.device.type == "cuda"
    assert_derived_close(out.cpu(), reference, floor=1e-12)


def test_non_contiguous_inputs(cuda):
    jt = torch.randn(2, 40, 6, 6, device=cuda, dtype=torch.float64).mT * 0.3
    grad = torch.randn(2, 6, 41, device=cuda, dtype=torch.float64).mT
    reference = backprop_scan(jt.cpu(), grad.cpu(), algorithm="linear")
    assert_derived_close(backprop_scan(jt, grad, algorithm="chunked").cpu(), reference, floor=1e-12)


def test_opcheck_on_cuda(cuda):
    args = (torch.randn(2, 9, 3, 3, device=cuda), torch.randn(2, 3, device=cuda), "blelloch", 4)
    torch.library.opcheck(torch.ops.bppsa.scan_dense.default, args)
