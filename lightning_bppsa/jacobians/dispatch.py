"""Which modules have an analytic transposed Jacobian, and the two entry points that use them.

Every operator family (``conv``, ``pointwise``, ``pooling``, ``linear``) registers a *linearizer* per
module type: ``linearizer(module, x) -> (y, jac)`` runs the forward on a batch ``x`` of shape
``(B, *sample_shape)`` and returns ``y = module(x)`` together with the :class:`BatchedCSR` ``jac`` of the
transposed Jacobians ``(∂y_b/∂x_b)ᵀ``, shape ``(x_b.numel(), y_b.numel())`` per sample ``b``. Running the
forward inside the linearizer is what keeps input-dependent values (ReLU masks, pooling indices,
dropout masks) consistent with the ``y`` that the rest of the network sees, and it lets torch's forward
reject bad input first, so a mistake gets torch's own error.

A registration may also say which configurations and modes it cannot take (``refuse``: the reason, e.g.
``padding_mode="reflect"``, ``BatchNorm2d`` in training mode) and which input ranks (``dims``: the rank
of the output for a batched input, or ``None``, e.g. an unbatched ``(C, H, W)`` convolution input):
:func:`refusal` and :func:`output_dims` answer before anything runs, so callers fall back to autograd
instead of failing where torch runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from lightning_bppsa.jacobians.csr import BatchedCSR

__all__ = [
    "exact_dims",
    "is_supported",
    "linearize",
    "output_dims",
    "refusal",
    "register_linearizer",
    "supported_types",
    "transposed_jacobian",
]

Linearizer = Callable[[nn.Module, Tensor], "tuple[Tensor, BatchedCSR]"]
Refusal = Callable[[nn.Module], "str | None"]
DimsRule = Callable[[nn.Module, int], "int | None"]


@dataclass(frozen=True)
class _Entry:
    linearize: Linearizer
    refuse: Refusal | None
    dims: DimsRule | None


_LINEARIZERS: dict[type, _Entry] = {}


def exact_dims(dims: int) -> DimsRule:
    """A :data:`DimsRule` for layers that take batches of exactly ``dims`` dims and keep the rank."""
    return lambda module, ndim: ndim if ndim == dims else None


def register_linearizer(
    *types: type, refuse: Refusal | None = None, dims: DimsRule | None = None
) -> Callable[[Linearizer], Linearizer]:
    """Decorator registering ``linearizer`` for the exact module ``types`` (subclasses may change forward).

    Args:
        types: the module classes.
        refuse: ``refuse(module)``: why this module's configuration or current mode has no analytic
            Jacobian, or ``None``.
        dims: ``dims(module, ndim)``: the rank of the output for a batch of rank ``ndim``, or ``None`` when
            the linearizer cannot take it; default: any rank, kept.
    """

    def register(linearizer: Linearizer) -> Linearizer:
        for t in types:
            _LINEARIZERS[t] = _Entry(linearizer, refuse, dims)
        return linearizer

    return register


def supported_types() -> tuple[type, ...]:
    """The module types with an analytic transposed Jacobian."""
    return tuple(_LINEARIZERS)


def is_supported(module: nn.Module) -> bool:
    """True when ``type(module)`` has an analytic transposed Jacobian (its current mode may still refuse)."""
    return type(module) in _LINEARIZERS


def refusal(module: nn.Module) -> str | None:
    """Why ``module``, in its current configuration and mode, has no analytic Jacobian; ``None`` if it has."""
    entry = _LINEARIZERS.get(type(module))
    if entry is None:
        return f"{type(module).__name__} has no analytic Jacobian"
    return None if entry.refuse is None else entry.refuse(module)


def output_dims(module: nn.Module, ndim: int) -> int | None:
    """The rank of ``module``'s output for a batched input of rank ``ndim``, or ``None`` when its
    linearizer cannot take that rank (torch's forward may still: an unbatched input, or raise its error)."""
    entry = _LINEARIZERS.get(type(module))
    if entry is None or ndim < 1:
        return None
    return ndim if entry.dims is None else entry.dims(module, ndim)


def linearize(module: nn.Module, x: Tensor) -> tuple[Tensor, BatchedCSR]:
    """Forward ``y = module(x)`` on a batch and the transposed Jacobian of every sample.

    Args:
        module: a supported module (see :func:`supported_types`) in a configuration it takes
            (:func:`refusal` is ``None``).
        x: ``(B, *sample_shape)``.

    Returns:
        ``(y, jac)``: ``y`` of shape ``(B, *out_shape)`` and a :class:`BatchedCSR` of shape
        ``(prod(sample_shape), prod(out_shape))`` with values ``(B, nnz)`` or ``(1, nnz)`` when the
        Jacobian is the same for every sample. The pattern is cached per layer configuration and shape.

    Raises:
        NotImplementedError: the module's type or configuration has no analytic Jacobian.
        ValueError: torch's forward takes ``x`` but not as a batch (e.g. an unbatched ``(C, H, W)``);
            input torch rejects gets torch's own error.
    """
    reason = refusal(module)
    if reason is not None:
        names = ", ".join(sorted(t.__name__ for t in _LINEARIZERS))
        raise NotImplementedError(reason if is_supported(module) else f"{reason}; supported: {names}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a batched Tensor (B, *sample_shape); got {type(x).__name__}")
    if output_dims(module, x.dim()) is None:
        module(x)  # torch's own error for input it rejects
        raise ValueError(
            f"{type(module).__name__} takes this input of shape {tuple(x.shape)} but not as a batch "
            "(B, *sample_shape) the Jacobian can be built for"
        )
    y, jac = _LINEARIZERS[type(module)].linearize(module, x)
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
