"""BPPSA version of nn.Sequential chains of supported layers (filled in by the layer-chains work)."""

__all__: list[str] = []
