"""Shared benchmark plumbing for the scripts in this folder: it lives in :mod:`lightning_bppsa.bench.measure`."""

from lightning_bppsa.bench.measure import machine_description, median_seconds, peak_memory_bytes

__all__ = ["machine_description", "median_seconds", "peak_memory_bytes"]
