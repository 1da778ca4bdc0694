"""lightning-bppsa: back-propagation as a parallel prefix scan (BPPSA, MLSys 2020) for PyTorch Lightning.

Importing the package registers the ``bppsa`` torch.library ops, and the Lightning strategy names
``"bppsa"`` (one device), ``"bppsa_ddp"`` (data parallel) and ``"bppsa_model_parallel"`` (a sequence
split over processes) as soon as Lightning is imported: ``Trainer(strategy="bppsa")``. The package itself
never imports Lightning (``import lightning_bppsa.nn`` stays fast); the strategy classes load on first use.
"""

from typing import Any

from lightning_bppsa import ops  # noqa: F401  (registers the bppsa:: ops)
from lightning_bppsa._registration import register_when_lightning_loads
from lightning_bppsa.jacobians import FactoredJacobians
from lightning_bppsa.scan import backprop_scan, scan_ref

__all__ = [
    "BPPSADDPStrategy",
    "BPPSAModelParallelStrategy",
    "BPPSAStrategy",
    "FactoredJacobians",
    "backprop_scan",
    "scan_ref",
]
__version__ = "0.1.0"

#: the public names that need Lightning, and the module each one lives in (imported on first access)
_LIGHTNING_NAMES = {
    "BPPSAStrategy": "lightning_bppsa.strategy",
    "BPPSADDPStrategy": "lightning_bppsa.strategy",
    "BPPSAModelParallelStrategy": "lightning_bppsa.model_parallel",
}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_NAMES:
        import importlib

        return getattr(importlib.import_module(_LIGHTNING_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_bppsa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LIGHTNING_NAMES})


register_when_lightning_loads()
