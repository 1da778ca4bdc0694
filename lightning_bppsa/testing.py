"""Test utilities shared by the test suite and by users checking their own models.

Tolerances are derived, not guessed: a fast path in some dtype may be as far from the float64 truth
as ``factor`` times the plain baseline (autograd, or the linear scan) in the same dtype, plus a floor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bppsa.algorithms import compute_dtype

__all__ = ["assert_derived_close", "relative_error"]


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """Norm-wise relative error ``‖actual - reference‖ / ‖reference‖`` computed in float64."""
    actual, reference = actual.detach().double(), reference.detach().double()
    scale = reference.norm().item()
    diff = (actual - reference).norm().item()
    return diff / scale if scale > 0 else diff


#: flushed denormal terms an element may have lost (see :func:`assert_derived_close`)
FLUSHED_TERMS = 4


def assert_derived_close(
    actual: Tensor,
    reference: Tensor,
    baseline: Tensor | None = None,
    *,
    factor: float = 2.0,
    floor: float | None = None,
    name: str = "value",
) -> None:
    """Assert ``actual`` is as close to the float64 ``reference`` as ``baseline`` is, up to ``factor``.

    Args:
        actual: the fast path's result, any dtype.
        reference: the float64 ground truth.
        baseline: the plain implementation's result in ``actual``'s dtype; ``None`` uses only ``floor``.
        factor: allowed ratio of errors.
        floor: absolute floor on the relative error (default: 1e-12 for float64, 1e-5 otherwise).

    A difference whose norm is below ``FLUSHED_TERMS * finfo(actual.dtype).tiny * sqrt(numel)`` also passes:
    the scan flushes denormals to zero on CPU (they are ~10-100x slower on x86), which moves each term of an
    element by less than the smallest normal number, so a result that lies in or next to the denormal range
    may legitimately differ by a few of those (an LSTM gradient sums terms through both of its states).
    """
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    if floor is None:
        floor = 1e-12 if actual.dtype == torch.float64 else 1e-5
    allowed = floor + (factor * relative_error(baseline, reference) if baseline is not None else 0.0)
    error = relative_error(actual, reference)
    # half precision is computed (and flushed) in float32
    compute = compute_dtype(actual.dtype)
    flushed = (
        FLUSHED_TERMS * torch.finfo(compute).tiny * actual.numel() ** 0.5
        if actual.is_floating_point()
        else 0.0
    )
    if (
        not error <= allowed and not (actual.double() - reference.double()).norm().item() <= flushed
    ):  # NaN fails
        raise AssertionError(f"{name}: relative error {error:.3e} exceeds allowed {allowed:.3e}")
