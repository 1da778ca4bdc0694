"""Packaging and import hygiene."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=300)


@pytest.mark.slow
def test_import_does_not_load_cupy_or_initialise_cuda():
    code = (
        "import sys, lightning_bppsa, lightning_bppsa.kernels, lightning_bppsa.nn\n"
        "import torch\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_the_core_and_the_cli_help_never_import_lightning_yet_the_strategy_names_work():
    code = (
        "import sys, lightning_bppsa, lightning_bppsa.nn, lightning_bppsa.scan\n"
        "from lightning_bppsa.cli import main\n"
        "main(['--help']); main(['--version']); main(['recipes'])\n"
        "assert not [m for m in sys.modules if m.startswith(('lightning.', 'pytorch_lightning'))], 'Lightning imported'\n"
        "import lightning.pytorch as pl\n"
        "for name in ('bppsa', 'bppsa_ddp'):\n"
        "    trainer = pl.Trainer(strategy=name, accelerator='cpu', devices=1, logger=False)\n"
        "    assert type(trainer.strategy).__name__ in ('BPPSAStrategy', 'BPPSADDPStrategy'), name\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'bppsa_model_parallel' in StrategyRegistry\n"
        "assert lightning_bppsa.BPPSAStrategy is StrategyRegistry.get('bppsa').__class__\n"
        "assert type(pl.__spec__.loader).__name__ == 'SourceFileLoader'  # the hook left no trace\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "lightning-bppsa 0.1.0" in result.stdout and "rnn_bitstream_paper" in result.stdout


@pytest.mark.slow
def test_lightning_imported_first_then_the_package_registers_at_once():
    code = (
        "import lightning.pytorch as pl, lightning_bppsa\n"
        "assert type(pl.Trainer(strategy='bppsa', logger=False).strategy).__name__ == 'BPPSAStrategy'\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "first",
    ["import lightning_bppsa.strategy", "from lightning_bppsa import BPPSAStrategy",
     "import lightning_bppsa.model_parallel", "import lightning_bppsa.callbacks"],
)
def test_a_strategy_module_imported_first_registers_every_name(first):
    """Importing a strategy module first loads Lightning from inside that module's own import: the import
    hook must not import it again half-initialised."""
    code = (
        f"{first}\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert {'bppsa', 'bppsa_ddp', 'bppsa_model_parallel'} <= set(StrategyRegistry), list(StrategyRegistry)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_strategy_registered_and_reimport_never_raises():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_bppsa

    assert "bppsa" in StrategyRegistry
    importlib.reload(importlib.import_module("lightning_bppsa.strategy"))
    importlib.reload(lightning_bppsa)
    assert StrategyRegistry.get("bppsa").__class__.__name__ == "BPPSAStrategy"


@pytest.mark.parametrize("name", ["callbacks", "kernels", "recipes"])
def test_mapped_packages_import_only_under_their_namespace(name):
    module = importlib.import_module(f"lightning_bppsa.{name}")
    assert Path(module.__file__).resolve().parent == ROOT / name
    result = subprocess.run(
        [sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0 and f"import lightning_bppsa.{name}" in result.stderr


def test_every_source_folder_is_shipped():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(config["packages"])
    mapped = config["package-dir"]
    folders = {p.parent for p in ROOT.glob("lightning_bppsa/**/__init__.py")}
    folders |= {p.parent for name in mapped.values() for p in (ROOT / name).glob("**/__init__.py")}
    for folder in folders:
        rel = folder.relative_to(ROOT)
        top = rel.parts[0]
        dotted = (
            ".".join(rel.parts) if top == "lightning_bppsa" else ".".join(("lightning_bppsa", *rel.parts))
        )
        assert dotted in shipped, f"{rel} is not listed in [tool.setuptools] packages"
    for pattern_owner in config["package-data"]:
        assert pattern_owner in shipped
    assert (
        list((ROOT / "recipes").glob("*.yaml")) == []
        or "*.yaml" in config["package-data"]["lightning_bppsa.recipes"]
    )


def test_public_api_declared():
    import lightning_bppsa
    import lightning_bppsa.jacobians
    import lightning_bppsa.nn

    for module in (lightning_bppsa, lightning_bppsa.jacobians, lightning_bppsa.nn):
        assert all(isinstance(name, str) and hasattr(module, name) for name in module.__all__)
