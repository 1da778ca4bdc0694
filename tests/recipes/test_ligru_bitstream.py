"""The LiGRU recipe: the Recurrence's scan gives the plain loop's logits and gradients."""

from __future__ import annotations

import torch
from lightning_bppsa.recipes.ligru_bitstream import BitstreamLiGRU


def test_scan_and_plain_loop_give_the_same_logits_and_gradients() -> None:
    scanned = BitstreamLiGRU(hidden_size=6, algorithm="linear").double()
    looped = BitstreamLiGRU(hidden_size=6, scan=False).double()
    looped.load_state_dict(scanned.state_dict())
    bits = torch.randint(2, (3, 17), dtype=torch.uint8)
    labels = torch.tensor([1, 7, 3])
    results = []
    for model in (scanned, looped):
        logits = model(bits)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        results.append((logits, torch.autograd.grad(loss, list(model.parameters()))))
    assert results[0][0].shape == (3, 10)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    for name, a, b in zip([n for n, _ in scanned.named_parameters()], results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert scanned.rnn.last_stats["path"] == "scan"
