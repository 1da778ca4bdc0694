"""Register the BPPSA strategy names with Lightning once Lightning is imported, without importing it.

``import lightning_bppsa`` (and so ``import lightning_bppsa.nn`` / ``.scan``) must stay free of Lightning
(~6 s of CPU to import), yet ``Trainer(strategy="bppsa")`` must work after it. Lightning's strategy registry
is only consulted once ``lightning.pytorch`` is imported, so the names are registered right then: when
``lightning.pytorch`` is already loaded, at once; otherwise by a one-shot import hook that runs the
registration as soon as ``lightning.pytorch`` has finished executing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["LIGHTNING", "register_strategies", "register_when_lightning_loads"]

LIGHTNING = "lightning.pytorch"


#: the modules whose import registers ``"bppsa"``, ``"bppsa_ddp"`` and ``"bppsa_model_parallel"``
STRATEGY_MODULES = ("lightning_bppsa.strategy", "lightning_bppsa.model_parallel")


def register_strategies() -> None:
    """Register the strategy names (imports Lightning): each strategy module registers its classes at the
    end of its own import. A module being imported right now (its import is what loaded Lightning) is
    left to finish: it registers itself then."""
    for name in STRATEGY_MODULES:
        if name not in sys.modules:
            importlib.import_module(name)


class _RegisterAfter(importlib.abc.Loader):
    """Runs the real loader of ``lightning.pytorch``, then :func:`register_strategies`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module looks as if this wrapper never existed (resources, reloads use the real loader)
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        register_strategies()


class _LightningImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that answers only for ``lightning.pytorch``, once, and then leaves."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != LIGHTNING:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from coming back here
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfter(spec.loader)
        return spec


def register_when_lightning_loads() -> None:
    """Register now if ``lightning.pytorch`` is loaded, else install the import hook (at most one)."""
    if LIGHTNING in sys.modules:
        register_strategies()
    elif not any(isinstance(finder, _LightningImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LightningImportHook())
