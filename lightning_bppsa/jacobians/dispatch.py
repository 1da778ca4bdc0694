"""Which modules have an analytic transposed Jacobian, and the two entry points that use them.

Every operator family (``conv``, ``pointwise``, ``pooling``, ``linear``) registers a *linearizer* per
module type: ``linearizer(module, x) -> (y, jac)`` runs the forward on a batch ``x`` of shape
``(B, *sample_shape)`` and returns ``y = module(x)`` together with the :class:`BatchedCSR` ``jac`` of the
transposed Jacobians ``(∂y_b/∂x_b)ᵀ``, shape ``(x_b.numel(), y_b.numel())`` per sample ``b``. Running the
forward inside the linearizer is what keeps input-dependent values (ReLU masks, pooling indices,
dropout masks) consistent with the ``y`` that the rest of the network sees.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from lightning_bppsa.jacobians.csr import BatchedCSR

__all__ = ["is_supported", "linearize", "register_linearizer", "supported_types", "transposed_jacobian"]

Linearizer = Callable[[nn.Module, Tensor], "tuple[Tensor, BatchedCSR]"]
_LINEARIZERS: dict[type, Linearizer] = {}


def register_linearizer(*types: type) -> Callable[[Linearizer], Linearizer]:
    """Decorator registering ``linearizer`` for the exact module ``types`` (subclasses may change forward)."""

    def register(linearizer: Linearizer) -> Linearizer:
        for t in types:
            _LINEARIZERS[t] = linearizer
        return linearizer

    return register


def supported_types() -> tuple[type, ...]:
    """The module types with an analytic transposed Jacobian."""
    return tuple(_LINEARIZERS)


def is_supported(module: nn.Module) -> bool:
    """True when ``type(module)`` has an analytic transposed Jacobian (its current mode may still refuse)."""
    return type(module) in _LINEARIZERS


def linearize(module: nn.Module, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    """Forward ``y = module(x)`` on a batch and the transposed Jacobian of every sample.

    Args:
        module: a supported module (see :func:`supported_types`).
        x: ``(B, *sample_shape)``.

    Returns:
        ``(y, jac)``: ``y`` of shape ``(B, *out_shape)`` and a :class:`BatchedCSR` of shape
        ``(prod(sample_shape), prod(out_shape))`` with values ``(B, nnz)`` or ``(1, nnz)`` when the
        Jacobian is the same for every sample. The pattern is cached per layer configuration and shape.
    """
    linearizer = _LINEARIZERS.get(type(module))
    if linearizer is None:
        names = ", ".join(sorted(t.__name__ for t in _LINEARIZERS))
        raise NotImplementedError(
            f"module {type(module).__name__} has no analytic transposed Jacobian; supported: {names}"
        )
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a batched Tensor (B, *sample_shape); got {getattr(x, 'shape', type(x))}")
    y, jac = linearizer(module, x)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"{type(module).__name__} changed the batch size ({x.shape[0]} -> {y.shape[0]})")
    return y, jac


def transposed_jacobian(module: nn.Module, x: Tensor) -> Tensor:
    """``(∂y/∂x)ᵀ`` of ``y = module(x)`` for a single sample ``x`` (no batch dim), generated analytically.

    Args:
        module: a supported module (see :func:`supported_types`); ``nn.BatchNorm2d`` must be in eval mode.
            For ``nn.Dropout`` in training mode the mask is drawn from the global RNG exactly as the
            CPU forward draws it, so ``torch.manual_seed(s); module(x)`` and ``torch.manual_seed(s);
            transposed_jacobian(module, x)`` agree on CPU.
        x: one sample, e.g. ``(C, H, W)`` for ``nn.Conv2d``, ``(in_features,)`` for ``nn.Linear``.

    Returns:
        ``torch.sparse_csr_tensor`` of shape ``(x.numel(), y.numel())``; its pattern holds every entry that
        is not a guaranteed zero (BPPSA Table 1), so input-dependent zeros are stored explicitly.

    Example:
        >>> import torch
        >>> transposed_jacobian(torch.nn.ReLU(), torch.tensor([-1.0, 2.0])).to_dense()
        tensor([[0., 0.],
                [0., 1.]])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor (one sample, no batch dim); got {type(x).__name__}")
    _, jac = linearize(module, x.unsqueeze(0))
    return jac.to_sparse_csr(0)
