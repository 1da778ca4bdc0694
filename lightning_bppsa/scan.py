"""Back-propagation as an exclusive scan (BPPSA, Wang, Bai, Pekhimenko, MLSys 2020, Sec. 3): the entry point.

For a chain ``x_i = f_i(x_{i-1})``, ``i = 1..n``, with Jacobians ``J_i = ∂x_i/∂x_{i-1}``, back-propagation is

    g_n = ∇_{x_n} l,        g_{i-1} = J_iᵀ g_i + δ_{i-1}                                   (Eq. 1, affine form)

where ``δ_i`` is the *direct* gradient of the loss w.r.t. ``x_i`` (zero except at ``x_n`` when the loss
only reads the last state). Every ``g_i`` is a suffix product of affine maps, so it is an exclusive scan
(Eq. 3-4) and can run in Θ(log n) steps (Algorithm 1) instead of Θ(n).

:func:`backprop_scan` validates its inputs and calls the ``bppsa::`` op (:mod:`lightning_bppsa.ops`), which
decides the plan at run time (:mod:`lightning_bppsa.plan`) and runs one of the algorithms of
:mod:`lightning_bppsa.algorithms` (``"linear"``, ``"blelloch"``, ``"chunked"``; ``"auto"``: whichever
:mod:`lightning_bppsa.cost_model` predicts fastest). Chains of sparse layer Jacobians of different widths
have their own entry point, :func:`lightning_bppsa.sparse_scan.sparse_backprop_scan`.

:func:`scan_ref` is the float64 reference beside it: the plain loop, sharing no code with the algorithms.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from lightning_bppsa import ops  # noqa: F401  (registers the bppsa:: ops this module calls)
from lightning_bppsa.jacobians.factored import FactoredJacobians
from lightning_bppsa.plan import ALGORITHMS, check_algorithm

__all__ = ["ALGORITHMS", "backprop_scan", "scan_ref"]

Jacobians = Union[Tensor, FactoredJacobians]

def _check_grad(grad: Tensor, batch: int, n: int, d: int, like: Tensor, jac_name: str) -> None:
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a Tensor of shape (B, d) or (B, n + 1, d); got {type(grad).__name__}")
    if grad.dtype != like.dtype:
        raise TypeError(f"grad has dtype {grad.dtype} but {jac_name} has {like.dtype}; they must match")
    if grad.device != like.device:
        raise ValueError(f"grad is on {grad.device} but {jac_name} is on {like.device}; they must match")
    if tuple(grad.shape) not in ((batch, d), (batch, n + 1, d)):
        raise ValueError(
            f"grad must have shape (B, d) = {(batch, d)} or (B, n + 1, d) = {(batch, n + 1, d)} "
            f"to match {jac_name}; got {tuple(grad.shape)}"
        )


def _check_floating(t: Tensor, name: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype; got {t.dtype}")


def _validate_dense(jacobians_t: Tensor, grad: Tensor) -> tuple[int, int, int]:
    if jacobians_t.dim() != 4 or jacobians_t.shape[-1] != jacobians_t.shape[-2]:
        raise ValueError(f"jacobians_t must have shape (B, n, d, d); got {tuple(jacobians_t.shape)}")
    _check_floating(jacobians_t, "jacobians_t")
    batch, n, d, _ = jacobians_t.shape
    _check_grad(grad, batch, n, d, jacobians_t, "jacobians_t")
    return batch, n, d


def _validate_factored(jac: FactoredJacobians, grad: Tensor) -> tuple[int, int, int, int]:
    weight, scales, diagonal = jac.weight, jac.scales, jac.diagonal
    if weight.dim() != 2 or weight.shape[1] == 0 or weight.shape[0] % weight.shape[1]:
        raise ValueError(f"FactoredJacobians.weight must have shape (k * d, d); got {tuple(weight.shape)}")
    _check_floating(weight, "FactoredJacobians.weight")
    m, d = weight.shape
    if scales.dim() != 3 or scales.shape[2] != m:
        raise ValueError(f"FactoredJacobians.scales must have shape (B, n, {m}); got {tuple(scales.shape)}")
    batch, n, _ = scales.shape
    parts = [("scales", scales)] + ([("diagonal", diagonal)] if diagonal is not None else [])
    if diagonal is not None and tuple(diagonal.shape) != (batch, n, d):
        raise ValueError(f"FactoredJacobians.diagonal must have shape {(batch, n, d)}; got {tuple(diagonal.shape)}")
    for name, t in parts:
        if t.dtype != weight.dtype or t.device != weight.device:
            raise TypeError(f"FactoredJacobians.{name} must match weight's dtype and device ({weight.dtype}, {weight.device})")
    _check_grad(grad, batch, n, d, weight, "FactoredJacobians")
    return batch, n, d, m


def _promote_factored(jac: FactoredJacobians, grad: Tensor) -> FactoredJacobians:
    """Under autocast the factors may come in mixed floating dtypes: compute in ``grad``'s dtype."""
    parts = [jac.weight, jac.scales] + ([jac.diagonal] if jac.diagonal is not None else [])
    if not isinstance(grad, Tensor) or not all(t.is_floating_point() for t in [*parts, grad]):
        return jac
    return jac.to(grad.dtype)


def _check_not_differentiated(*tensors: Tensor | None) -> None:
    """The ops have no autograd formula: refuse now rather than fail (or give ``None``) in backward."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "backprop_scan is not differentiable with respect to jacobians_t or grad, and one of them "
            "requires grad: call it on .detach()ed tensors or under torch.no_grad(), or, to differentiate "
            "through the scan, use autograd on plain torch ops (e.g. lightning_bppsa.scan_ref)"
        )


def backprop_scan(jacobians_t: Jacobians, grad: Tensor, *, algorithm: str = "auto") -> Tensor:
    """Gradients w.r.t. every state of a chain, computed as a (parallel) scan. BPPSA Eq. 3-5.

    Args:
        jacobians_t: ``(B, n, d, d)`` tensor with ``jacobians_t[:, i-1] = (∂x_i/∂x_{i-1})ᵀ`` for
            ``i = 1..n`` (natural order), or a :class:`~lightning_bppsa.jacobians.FactoredJacobians`.
            (Sparse layer Jacobians of different widths have their own entry point,
            :func:`~lightning_bppsa.sparse_scan.sparse_backprop_scan`; a list here raises a TypeError
            that names it.)
        grad: ``(B, d)``, the gradient of the loss w.r.t. the last state ``x_n``; or ``(B, n + 1, d)``,
            the direct gradient ``δ_i`` w.r.t. every state ``x_0..x_n`` (per-step losses:
            ``g_i = δ_i + J_{i+1}ᵀ g_{i+1}``).
        algorithm: ``"linear"``, ``"blelloch"``, ``"chunked"`` or ``"auto"`` (see the module docstring).

    Returns:
        ``(B, n + 1, d)`` tensor with ``out[:, i] = ∇_{x_i} l`` for ``i = 0..n``.

    Raises:
        RuntimeError: an input requires grad while grad mode is on: the scan has no autograd formula
            (detach the inputs, or differentiate through :func:`scan_ref`).

    Example:
        >>> jt = 0.5 * torch.eye(3).expand(2, 4, 3, 3)       # B=2, n=4, d=3
        >>> backprop_scan(jt, torch.ones(2, 3))[0, :, 0]     # g_i = 0.5^(4-i)
        tensor([0.0625, 0.1250, 0.2500, 0.5000, 1.0000])
    """
    check_algorithm(algorithm)
    if isinstance(jacobians_t, FactoredJacobians):
        jac = _promote_factored(jacobians_t, grad)
        _validate_factored(jac, grad)
        _check_not_differentiated(jac.weight, jac.scales, jac.diagonal, grad)
        return torch.ops.bppsa.scan_factored(jac.weight, jac.scales, jac.diagonal, grad, algorithm, 0)
    if not isinstance(jacobians_t, Tensor):
        raise TypeError(
            "jacobians_t must be a (B, n, d, d) Tensor or a FactoredJacobians (a list of sparse layer "
            f"Jacobians: use lightning_bppsa.sparse_scan.sparse_backprop_scan); got {type(jacobians_t).__name__}"
        )
    _validate_dense(jacobians_t, grad)
    _check_not_differentiated(jacobians_t, grad)
    return torch.ops.bppsa.scan_dense(jacobians_t, grad, algorithm, 0)


def scan_ref(jacobians_t: Jacobians, grad: Tensor, *, algorithm: str = "auto") -> Tensor:
    """The float64 reference of :func:`backprop_scan`: the plain loop ``g_{i-1} = J_iᵀ g_i + δ_{i-1}``.

    Takes the same arguments and raises the same errors as :func:`backprop_scan` for dense
    ``(B, n, d, d)`` and factored Jacobians, so that the two can be swapped; ``algorithm`` is checked
    and otherwise ignored: the reference always runs the ``n`` sequential steps, in float64 and in plain
    torch ops (differentiable by autograd), sharing no code with the scan algorithms.

    Returns:
        ``(B, n + 1, d)`` **float64** on ``grad``'s device, whatever the inputs' dtype: the truth a fast
        path in any dtype is compared with (e.g. by :func:`lightning_bppsa.testing.assert_derived_close`).

    Example:
        >>> jt = 0.5 * torch.eye(3).expand(2, 4, 3, 3)
        >>> scan_ref(jt, torch.ones(2, 3))[0, :, 0]
        tensor([0.0625, 0.1250, 0.2500, 0.5000, 1.0000], dtype=torch.float64)
    """
    check_algorithm(algorithm)
    if isinstance(jacobians_t, FactoredJacobians):
        jac = _promote_factored(jacobians_t, grad)
        _validate_factored(jac, grad)
        jt = jac.to(torch.float64).dense()
    elif isinstance(jacobians_t, Tensor):
        _validate_dense(jacobians_t, grad)
        jt = jacobians_t.double()
    else:
        raise TypeError(
            "jacobians_t must be a (B, n, d, d) Tensor or a FactoredJacobians (scan_ref has no sparse "
            f"layer-chain form); got {type(jacobians_t).__name__}"
        )
    grad, n = grad.double(), jt.shape[1]
    per_step = grad.dim() == 3
    states = [grad[:, n] if per_step else grad]  # g_n, g_{n-1}, ..., g_0
    for i in range(n, 0, -1):
        g = (jt[:, i - 1] @ states[-1].unsqueeze(-1)).squeeze(-1)
        states.append(g + grad[:, i - 1] if per_step else g)
    return torch.stack(states[::-1], 1)
