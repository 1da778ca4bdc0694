"""The default random generators a computation on a device draws from (the CPU's, and that CUDA device's):
their states read, set, and kept across a block (a measurement, a check or a capture that must not draw the
caller's random numbers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["generator_states", "kept_generators", "set_generator_states"]


def generator_states(device: torch.device) -> list[Tensor]:
    """The states of the generators ops on ``device`` may draw from: the CPU's, and ``device``'s if CUDA."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_generator_states(device: torch.device, states: list[Tensor]) -> None:
    """:func:`generator_states`' inverse."""
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


@contextmanager
def kept_generators(device: torch.device, states: list[Tensor] | None = None) -> Iterator[None]:
    """What runs inside draws from ``states`` (``None``: the current ones) and leaves the generators of
    ``device`` (and the CPU's) as it found them."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if states is not None:
            set_generator_states(device, states)
        yield
