"""lightning_bppsa.callbacks (lives in the top-level `callbacks/` folder, mapped by setuptools).

Small Lightning callbacks, each an observer with one job:

- :class:`BackwardTimer`: forward / backward / Jacobian-overhead time of every step.
- :class:`GradientCheck`: every N steps, the relative error of BPPSA's gradients against autograd's.
- :class:`ShadowCostMonitor`: backward time and memory per batch and epoch; warns when they grow.
- :class:`ScanProfiler`: FLOPs and sparsity of every scan step (paper Fig. 10).
"""

if __name__ != "lightning_bppsa.callbacks":
    raise ImportError("import lightning_bppsa.callbacks, not the top-level 'callbacks' folder")

from lightning_bppsa.callbacks.backward_timer import BackwardTimer
from lightning_bppsa.callbacks.gradient_check import GradientCheck
from lightning_bppsa.callbacks.scan_profiler import ScanProfiler
from lightning_bppsa.callbacks.shadow_cost import ShadowCostMonitor

__all__ = ["BackwardTimer", "GradientCheck", "ScanProfiler", "ShadowCostMonitor"]
