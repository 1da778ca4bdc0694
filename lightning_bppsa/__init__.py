"""lightning-bppsa: back-propagation as a parallel prefix scan (BPPSA, MLSys 2020) for PyTorch Lightning.

Importing the package registers the ``bppsa`` torch.library ops and the Lightning strategy names
``"bppsa"`` (one device), ``"bppsa_ddp"`` (data parallel) and ``"bppsa_model_parallel"`` (a sequence
split over processes): ``Trainer(strategy="bppsa")``.
"""

from lightning_bppsa import ops  # noqa: F401  (registers the bppsa:: ops)
from lightning_bppsa.jacobians import FactoredJacobians
from lightning_bppsa.model_parallel import BPPSAModelParallelStrategy
from lightning_bppsa.scan import backprop_scan, scan_ref
from lightning_bppsa.strategy import BPPSADDPStrategy, BPPSAStrategy

__all__ = [
    "BPPSADDPStrategy",
    "BPPSAModelParallelStrategy",
    "BPPSAStrategy",
    "FactoredJacobians",
    "backprop_scan",
    "scan_ref",
]
__version__ = "0.1.0"

BPPSAStrategy.register_strategies()
BPPSADDPStrategy.register_strategies()
BPPSAModelParallelStrategy.register_strategies()
