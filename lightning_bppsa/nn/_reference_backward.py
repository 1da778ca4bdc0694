"""Global switches read by every BPPSA module's backward (shared by recurrent layers and chains)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["reference_backward", "reference_backward_enabled"]

# Process-wide, not thread-local: autograd runs the backward of CUDA (and other accelerator) tensors on its
# own device threads, which never see a thread-local flag set by the caller (the "reference" then ran the
# scan again and was compared with itself). A count, so nested and concurrent blocks compose.
_lock = threading.Lock()
_depth = 0


def reference_backward_enabled() -> bool:
    """True while any thread is inside :func:`reference_backward`."""
    return _depth > 0  # one int read: atomic, no lock needed


@contextmanager
def reference_backward() -> Iterator[None]:
    """Make BPPSA modules compute their backward with plain autograd (recomputing their forward).

    Used to check BPPSA gradients against autograd on the very same graph, e.g.
    ``torch.autograd.grad(loss, params, retain_graph=True)`` once normally and once inside this context.

    The switch is process-wide for the duration of the block: every BPPSA backward that runs meanwhile
    takes the reference path, whatever thread runs it (autograd's device threads included, which is why it
    is not thread-local), so backward passes of other threads during the block are slower but exact.
    """
    global _depth
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
