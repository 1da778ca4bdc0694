"""lightning_bppsa.callbacks (lives in the top-level `callbacks/` folder, mapped by setuptools)."""

if __name__ != "lightning_bppsa.callbacks":
    raise ImportError("import lightning_bppsa.callbacks, not the top-level 'callbacks' folder")

__all__: list[str] = []
