"""``lightning-bppsa fit|validate|test|predict --config RECIPE [overrides]``: LightningCLI on a recipe.

``--config`` takes a YAML path or the name of a recipe shipped in ``lightning_bppsa.recipes``. Defaults:
``strategy="bppsa"``, a TensorBoardLogger into ``runs/<recipe>/version_N``, and a
:class:`~lightning_bppsa.callbacks.BackwardTimer`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_bppsa  # noqa: F401  (registers strategy "bppsa")
from lightning_bppsa.callbacks import BackwardTimer
from lightning_bppsa.cli.config import CLIError, split_config

__all__ = ["DEFAULT_SAVE_DIR", "BPPSACLI", "logger_arg", "run_lightning"]

DEFAULT_SAVE_DIR = "runs"
TENSORBOARD = "lightning.pytorch.loggers.TensorBoardLogger"


def logger_arg(save_dir: str, name: str, version: str | None = None) -> str:
    """The ``--trainer.logger=...`` argument of a TensorBoardLogger into ``save_dir/name[/version]``."""
    init_args: dict[str, Any] = {"save_dir": save_dir, "name": name}
    if version is not None:
        init_args["version"] = version
    return "--trainer.logger=" + json.dumps({"class_path": TENSORBOARD, "init_args": init_args})


def check_accelerator_available(accelerator: Any) -> None:
    """Raise :class:`CLIError` when ``accelerator`` (``--trainer.accelerator``) asks for a missing GPU.

    Lightning would say "No supported gpu backend found!" from deep inside the Trainer.
    """
    if not isinstance(accelerator, str) or accelerator.lower() not in ("gpu", "cuda"):
        return
    if CUDAAccelerator.is_available() or (accelerator.lower() == "gpu" and MPSAccelerator.is_available()):
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    raise CLIError(
        f"--trainer.accelerator={accelerator}: no GPU is visible to torch ({torch.__version__}, {build}); "
        "use --trainer.accelerator=cpu, or auto to take a GPU when there is one"
    )


class BPPSACLI(LightningCLI):
    """LightningCLI with this project's defaults (strategy ``"bppsa"``, TensorBoard, a BackwardTimer).

    Model and data are given by class path (``model.class_path``, ``data.class_path``), as the recipe
    YAMLs do; ``--model.<arg>`` / ``--data.<arg>`` override their init arguments.

    Args:
        recipe: the TensorBoard run name (``save_dir/recipe/version_N``).
        save_dir: the TensorBoard root folder.
    """

    def __init__(
        self, *args: Any, recipe: str = "run", save_dir: str = DEFAULT_SAVE_DIR, **kwargs: Any
    ) -> None:
        trainer_defaults = {
            "strategy": "bppsa",
            "logger": {"class_path": TENSORBOARD, "init_args": {"save_dir": save_dir, "name": recipe}},
        }
        super().__init__(
            *args,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults=trainer_defaults,
            save_config_kwargs={"overwrite": True},
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(BackwardTimer, "timer")

    def before_instantiate_classes(self) -> None:
        check_accelerator_available(self._get(self.config, "trainer").get("accelerator"))


def run_lightning(subcommand: str, argv: Sequence[str]) -> None:
    """Run LightningCLI's ``subcommand`` (``fit``, ``validate``, ``test``, ``predict``) on ``--config``."""
    if any(arg in ("-h", "--help") for arg in argv) and not any(arg.startswith("--config") for arg in argv):
        BPPSACLI(args=[subcommand, *argv])  # LightningCLI's own help
        return
    config, rest = split_config(argv)
    BPPSACLI(args=[subcommand, "--config", str(config), *rest], recipe=config.stem)
