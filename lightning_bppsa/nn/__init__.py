"""BPPSA versions of torch modules and ``convert(model)``."""

from lightning_bppsa.nn.convert import Conversion, ConversionRecord, convert, register_converter

__all__ = ["Conversion", "ConversionRecord", "convert", "register_converter"]
