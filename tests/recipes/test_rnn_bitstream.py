"""The generated bitstream dataset (Eq. 8)."""

from __future__ import annotations

import torch
from lightning_bppsa.recipes.rnn_bitstream import BitstreamRNN, generate_bitstreams


def test_generation_is_deterministic_and_follows_eq8() -> None:
    bits, labels = generate_bitstreams(2000, 400, seed=3, chunk=300)
    again, again_labels = generate_bitstreams(2000, 400, seed=3, chunk=700)
    assert bits.dtype == torch.uint8 and bits.shape == (2000, 400) and labels.shape == (2000,)
    assert torch.equal(bits, again) and torch.equal(labels, again_labels)  # the chunk size changes nothing
    for c in range(10):
        rate = bits[labels == c].float().mean().item()
        assert abs(rate - (0.05 + 0.1 * c)) < 0.01, (c, rate)
    assert not torch.equal(generate_bitstreams(50, 10, seed=4)[0], generate_bitstreams(50, 10, seed=3)[0])


def test_model_classifies_the_last_hidden_state() -> None:
    model = BitstreamRNN(hidden_size=5)
    bits = torch.randint(2, (3, 7), dtype=torch.uint8)
    logits = model(bits)
    assert logits.shape == (3, 10)
    _, h_n = model.rnn(bits.float().unsqueeze(-1))
    torch.testing.assert_close(logits, model.head(h_n[-1]))
