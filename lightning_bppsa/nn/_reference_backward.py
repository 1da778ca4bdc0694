"""Global switches read by every BPPSA module's backward (shared by recurrent layers and chains)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["reference_backward", "reference_backward_enabled"]

_state = threading.local()


def reference_backward_enabled() -> bool:
    """True inside :func:`reference_backward`."""
    return getattr(_state, "reference", False)


@contextmanager
def reference_backward() -> Iterator[None]:
    """Make BPPSA modules compute their backward with plain autograd (recomputing their forward).

    Used to check BPPSA gradients against autograd on the very same graph, e.g.
    ``torch.autograd.grad(loss, params, retain_graph=True)`` once normally and once inside this context.
    """
    previous = reference_backward_enabled()
    _state.reference = True
    try:
        yield
    finally:
        _state.reference = previous
