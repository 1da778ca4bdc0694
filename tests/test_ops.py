"""The bppsa:: ops: opcheck, torch.compile(fullgraph=True), TorchScript."""

import pytest
import torch

import lightning_bppsa  # noqa: F401  (registers the ops)
from lightning_bppsa import FactoredJacobians, backprop_scan


def dense_args(algorithm, per_step):
    jt = torch.randn(2, 9, 3, 3, dtype=torch.float64) * 0.3
    grad = torch.randn(2, 10, 3, dtype=torch.float64) if per_step else torch.randn(2, 3, dtype=torch.float64)
    return (jt, grad, algorithm, 4)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("per_step", [False, True])
def test_opcheck_dense(algorithm, per_step):
    torch.library.opcheck(torch.ops.bppsa.scan_dense.default, dense_args(algorithm, per_step))


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked"])
@pytest.mark.parametrize("with_diagonal", [False, True])
def test_opcheck_factored(algorithm, with_diagonal):
    diagonal = torch.rand(2, 9, 3, dtype=torch.float64) if with_diagonal else None
    args = (
        torch.randn(6, 3, dtype=torch.float64),
        torch.rand(2, 9, 6, dtype=torch.float64),
        diagonal,
        torch.randn(2, 3, dtype=torch.float64),
        algorithm,
        4,
    )
    torch.library.opcheck(torch.ops.bppsa.scan_factored.default, args)


@pytest.mark.slow
def test_compile_fullgraph_dense_and_factored():
    def step(jt, w, s, grad):
        dense = backprop_scan(jt * 0.5, grad)
        factored = backprop_scan(FactoredJacobians(w, s.sigmoid()), grad, algorithm="chunked")
        return dense.sum(1) + factored.sum(1)

    jt, w, s, grad = torch.randn(2, 11, 4, 4), torch.randn(4, 4), torch.randn(2, 11, 4), torch.randn(2, 4)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(jt, w, s, grad), step(jt, w, s, grad))


@pytest.mark.filterwarnings("ignore:`torch.jit")
def test_torchscript_calls_the_ops():
    @torch.jit.script
    def scripted(jt: torch.Tensor, grad: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a = torch.ops.bppsa.scan_dense(jt, grad, "blelloch", 4)
        b = torch.ops.bppsa.scan_factored(w, s, None, grad, "chunked", 4)
        return a + b

    jt, grad, w, s = torch.randn(2, 9, 3, 3), torch.randn(2, 3), torch.randn(3, 3), torch.rand(2, 9, 3)
    expected = backprop_scan(jt, grad, algorithm="linear") + backprop_scan(
        FactoredJacobians(w, s), grad, algorithm="linear"
    )
    torch.testing.assert_close(scripted(jt, grad, w, s), expected)


@pytest.mark.parametrize("cell", ["rnn_tanh", "rnn_relu", "gru", "lstm"])
def test_opcheck_recurrent_layer_ops(cell):
    """The layer's forward and backward ops: schema, fake kernels and AOT dispatch agree with the kernels."""
    from lightning_bppsa.cells import CELLS

    kind = CELLS[cell]
    batch, steps, inputs, hidden = 3, 5, 2, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, steps, inputs, dtype=torch.float64, generator=gen)
    h0 = torch.randn(batch, hidden, dtype=torch.float64, generator=gen)
    c0 = torch.randn(batch, hidden, dtype=torch.float64, generator=gen) if kind.has_cell_state else None
    gates = kind.gates * hidden
    weights = [torch.randn(*shape, dtype=torch.float64, generator=gen) * 0.4
               for shape in ((gates, inputs), (gates, hidden), (gates,), (gates,))]  # fmt: skip
    forward = torch.ops.bppsa.recurrent_forward.default
    torch.library.opcheck(forward, (cell, x, h0, c0, weights))
    results = forward(cell, x, h0, c0, weights)
    out, factors = results[0], results[2 if kind.has_cell_state else 1 :]
    grad_cn = torch.randn(batch, hidden, dtype=torch.float64) if kind.has_cell_state else None
    args = (
        cell,
        "auto",
        x,
        h0,
        c0,
        weights,
        out,
        factors,
        torch.randn_like(out),
        torch.randn_like(h0),
        grad_cn,
        True,
    )
    torch.library.opcheck(torch.ops.bppsa.recurrent_backward.default, args)
