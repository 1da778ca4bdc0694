"""lightning-bppsa: back-propagation as a parallel prefix scan (BPPSA, MLSys 2020) for PyTorch Lightning.

Importing the package registers the ``bppsa`` torch.library ops and the Lightning strategy name
``"bppsa"`` (``Trainer(strategy="bppsa")``).
"""

from lightning_bppsa import ops  # noqa: F401  (registers the bppsa:: ops)
from lightning_bppsa.jacobians import FactoredJacobians
from lightning_bppsa.scan import backprop_scan, scan_ref
from lightning_bppsa.strategy import BPPSAStrategy

__all__ = ["BPPSAStrategy", "FactoredJacobians", "backprop_scan", "scan_ref"]
__version__ = "0.1.0"

BPPSAStrategy.register_strategies()
from lightning_bppsa._distributed_strategy import ModelParallelStrategy  # noqa: E402,F401  (registers "bppsa_model_parallel")
