"""BPPSA versions of torch modules and ``convert(model)``.

Importing this package registers the converters of every module family with ``convert``.
"""

from lightning_bppsa.nn import chain, recurrent, traced  # noqa: F401  (traced registers its converters)
from lightning_bppsa.nn._reference_backward import reference_backward
from lightning_bppsa.nn._replay import no_cuda_graphs
from lightning_bppsa.nn.chain import *  # noqa: F403
from lightning_bppsa.nn.convert import Conversion, ConversionRecord, convert, register_converter
from lightning_bppsa.nn.recurrence import Recurrence
from lightning_bppsa.nn.recurrent import *  # noqa: F403

__all__ = [
    "Conversion",
    "ConversionRecord",
    "Recurrence",
    "convert",
    "no_cuda_graphs",
    "reference_backward",
    "register_converter",
    *recurrent.__all__, *chain.__all__]
