"""Transposed Jacobians of operators, in the structured forms the scan consumes.

- :class:`FactoredJacobians`: recurrent cells (``diag + diag·W`` with a shared ``W``).
- CSR (:class:`BatchedCSR`, :func:`transposed_jacobian`, :func:`linearize`): layer chains (BPPSA Sec. 3.3-3.4,
  Appendix D): one module per operator family (``conv``, ``pointwise``, ``pooling``, ``linear``), each
  registering its modules with :mod:`~lightning_bppsa.jacobians.dispatch`.
"""

from lightning_bppsa.jacobians import conv, dispatch, linear, pointwise, pooling  # noqa: F401  (registers)
from lightning_bppsa.jacobians.csr import BatchedCSR, CSRPattern
from lightning_bppsa.jacobians.dispatch import *  # noqa: F403  (the registry's entry points)
from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["BatchedCSR", "CSRPattern", "FactoredJacobians", *dispatch.__all__]
