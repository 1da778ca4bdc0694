"""The cells' torch forward (the reference backward recomputes through it) runs torch's op in training mode:
cuDNN refuses a backward through an op run with ``train=False`` ("cudnn RNN backward can only be called in
training mode", seen on an H100 in GradientCheck's reference backward)."""

import pytest
import torch

from lightning_bppsa import cells


@pytest.mark.parametrize("name", ["RNN_TANH", "GRU", "LSTM"])
def test_torch_forward_asks_for_training_mode(monkeypatch, name):
    seen = []

    def spy(op):
        def call(*args):
            seen.append(args[6])  # (input, hx, params, has_biases, num_layers, dropout, train, ...)
            return op(*args)

        return call

    cell = cells.cell_of(name)
    if name == "LSTM":
        monkeypatch.setattr(torch._VF, "lstm", spy(torch._VF.lstm))
    else:
        monkeypatch.setitem(cells._VF_FORWARD, cell.name, spy(cells._VF_FORWARD[cell.name]))
    torch_module = getattr(torch.nn, name.split("_")[0])(3, 4, batch_first=True)
    weights = [getattr(torch_module, n) for n in torch_module._flat_weights_names]
    h0 = torch.zeros(2, 4)
    cell.torch_forward(torch.randn(2, 5, 3), h0, h0 if name == "LSTM" else None, weights)
    assert seen == [True]
