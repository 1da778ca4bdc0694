"""The autocast state a BPPSA backward runs under: the forward's, never the caller's of ``backward()``.

Lightning's ``bf16-mixed`` / ``16-mixed`` with manual optimization calls ``manual_backward`` inside the
autocast region, a plain loop may call ``loss.backward()`` outside it: the gradients must not depend on
which. So a BPPSA backward records the autocast state at forward time, replays it where it recomputes the
forward (as ``torch.amp.custom_bwd`` does), and runs its scan with autocast off, in the dtypes the forward
chose (autocast would otherwise recast the scan's products, or fail on its mixed-dtype operands).
Keyed on the tensors' device type, so CPU and CUDA (and any device with autocast) take the same code.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

__all__ = ["AutocastState", "autocast_state", "replay_autocast", "without_autocast"]


class AutocastState(NamedTuple):
    """Autocast on one device type: whether it is on, and its dtype."""

    device_type: str
    enabled: bool
    dtype: torch.dtype


def autocast_state(device_type: str) -> AutocastState | None:
    """The autocast state now on ``device_type``, or ``None`` for a device type without autocast (meta)."""
    if not _has_autocast(device_type):
        return None
    if not torch.is_autocast_enabled(device_type):  # every call of a step without autocast: one object per type
        return _off(device_type)
    return AutocastState(device_type, True, torch.get_autocast_dtype(device_type))


_has_autocast = functools.cache(torch.amp.is_autocast_available)


@functools.cache
def _off(device_type: str) -> AutocastState:
    """Autocast off on ``device_type`` (the dtype is moot)."""
    return AutocastState(device_type, False, torch.get_autocast_dtype(device_type))


#: the context that changes nothing: what the two below return where autocast is already as asked (off then
#: and off now, the common case: a training step without autocast enters ~4 of them, ~4 µs each otherwise)
_UNCHANGED = contextlib.nullcontext()


def replay_autocast(state: AutocastState | None) -> contextlib.AbstractContextManager:
    """A context with autocast as in ``state`` (on or off); a no-op for ``None`` and where autocast is off
    both in ``state`` and now."""
    if state is None or not (state.enabled or torch.is_autocast_enabled(state.device_type)):
        return _UNCHANGED
    return torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled)


def without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off on ``device_type`` (a no-op where it is off, or the device type has none)."""
    if not (_has_autocast(device_type) and torch.is_autocast_enabled(device_type)):
        return _UNCHANGED
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), enabled=False)
