"""lightning_bppsa.kernels (lives in the top-level `kernels/` folder, mapped by setuptools)."""

if __name__ != "lightning_bppsa.kernels":
    raise ImportError("import lightning_bppsa.kernels, not the top-level 'kernels' folder")

__all__: list[str] = []
