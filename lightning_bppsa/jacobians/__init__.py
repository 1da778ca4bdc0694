"""Transposed Jacobians of operators, in the structured forms the scan consumes.

- :class:`FactoredJacobians`: recurrent cells (``diag + diag·W`` with a shared ``W``).
- CSR (:class:`BatchedCSR`, :func:`transposed_jacobian`, :func:`linearize`): layer chains (BPPSA Sec. 3.3-3.4,
  Appendix D): one module per operator family (``conv``, ``pointwise``, ``pooling``, ``linear``), each
  registering its modules with :mod:`~lightning_bppsa.jacobians.dispatch`.
"""

from lightning_bppsa.jacobians import conv, linear, pointwise, pooling  # noqa: F401  (register linearizers)
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import (
    is_supported,
    linearize,
    output_dims,
    refusal,
    register_linearizer,
    supported_types,
    transposed_jacobian,
)
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = [
    "BatchedCSR",
    "CSRPattern",
    "FactoredJacobians",
    "is_supported",
    "linearize",
    "output_dims",
    "refusal",
    "register_linearizer",
    "supported_types",
    "transposed_jacobian",
]
