"""lightning_bppsa.callbacks (lives in the top-level `callbacks/` folder, mapped by setuptools).

Small Lightning callbacks, each an observer with one job:

- :class:`BackwardTimer`: forward / backward / Jacobian-overhead time of every step.
"""

if __name__ != "lightning_bppsa.callbacks":
    raise ImportError("import lightning_bppsa.callbacks, not the top-level 'callbacks' folder")

from lightning_bppsa.callbacks.backward_timer import BackwardTimer

__all__ = ["BackwardTimer"]
