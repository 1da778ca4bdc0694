"""Transposed Jacobians of operators, in the structured forms the scan consumes."""

from lightning_bppsa.jacobians.factored import FactoredJacobians

__all__ = ["FactoredJacobians"]
