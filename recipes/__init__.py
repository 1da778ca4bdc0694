"""lightning_bppsa.recipes (lives in the top-level `recipes/` folder, mapped by setuptools)."""

if __name__ != "lightning_bppsa.recipes":
    raise ImportError("import lightning_bppsa.recipes, not the top-level 'recipes' folder")

__all__: list[str] = []
