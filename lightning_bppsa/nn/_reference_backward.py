"""Process-wide switches read by BPPSA modules (shared by recurrent layers and chains): the reference backward."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ProcessSwitch", "reference_backward", "reference_backward_enabled"]


class ProcessSwitch:
    """A switch on while any thread is inside one of its :meth:`blocks <block>`. Process-wide, not
    thread-local: autograd runs the backward of CUDA (and other accelerator) tensors on its own device threads,
    which never see a thread-local flag set by the caller (a "reference" backward then ran the scan again and
    was compared with itself). A count, so nested and concurrent blocks compose."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0

    def on(self) -> bool:
        """Whether any thread is inside a block."""
        return self._depth > 0  # one int read: atomic, no lock needed

    @contextmanager
    def block(self) -> Iterator[None]:
        """The switch on for the block's duration (and while any other block lasts)."""
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1


_REFERENCE = ProcessSwitch()


def reference_backward_enabled() -> bool:
    """True while any thread is inside :func:`reference_backward`."""
    return _REFERENCE.on()


@contextmanager
def reference_backward() -> Iterator[None]:
    """Make BPPSA modules compute their backward with plain autograd (recomputing their forward).

    Used to check BPPSA gradients against autograd on the very same graph, e.g.
    ``torch.autograd.grad(loss, params, retain_graph=True)`` once normally and once inside this context.

    The switch is process-wide for the duration of the block: every BPPSA backward that runs meanwhile
    takes the reference path, whatever thread runs it (autograd's device threads included, which is why it
    is not thread-local), so backward passes of other threads during the block are slower but exact.
    """
    with _REFERENCE.block():
        yield
