"""Compare BPPSA gradients with plain autograd on the very same graph."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_bppsa.nn import reference_backward
from lightning_bppsa.testing import relative_error

__all__ = ["gradient_difference"]


def gradient_difference(loss: Tensor, parameters: Iterable[torch.nn.Parameter]) -> float:
    """Largest relative difference, over parameters, between BPPSA's and autograd's gradients of ``loss``.

    Runs two extra backward passes (``retain_graph=True``): one as configured (BPPSA modules use the
    scan) and one inside :func:`~lightning_bppsa.nn.reference_backward` (every module uses autograd).
    ``.grad`` is left untouched. Returns ``0.0`` when no parameter needs a gradient. The reference switch is
    process-wide while the second pass runs (autograd's device threads must see it): backward passes other
    threads run meanwhile take the reference path too.

    Example:
        >>> rnn = torch.nn.RNN(1, 4)
        >>> loss = rnn(torch.randn(5, 1))[0].sum()
        >>> gradient_difference(loss, rnn.parameters())
        0.0
    """
    params = [p for p in parameters if p.requires_grad]
    if not params or not loss.requires_grad:
        return 0.0
    scanned = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    with reference_backward():
        reference = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    worst = 0.0
    for ours, ref in zip(scanned, reference, strict=True):
        if ours is None and ref is None:
            continue
        ours = torch.zeros_like(ref) if ours is None else ours
        ref = torch.zeros_like(ours) if ref is None else ref
        worst = max(worst, relative_error(ours, ref))
    return worst
