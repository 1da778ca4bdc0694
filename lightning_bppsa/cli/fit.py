"""``lightning-bppsa fit|validate|test|predict --config RECIPE [overrides]``: LightningCLI on a recipe.

``--config`` takes a YAML path or the name of a recipe shipped in ``lightning_bppsa.recipes``. Defaults:
``strategy="bppsa"``, a TensorBoardLogger into ``runs/<recipe>/version_N``, and a
:class:`~lightning_bppsa.callbacks.BackwardTimer`.
"""

from __future__ import annotations

import json
from argparse import ArgumentError
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_bppsa  # noqa: F401  (registers strategy "bppsa")
from lightning_bppsa.callbacks import BackwardTimer
from lightning_bppsa.cli.config import CLIError, split_config
from lightning_bppsa.cli.errors import explain_parse_error

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

    A mistake in the arguments or the config file raises :class:`CLIError` with one line saying what was
    wrong, where (the file and line, or the command line) and the closest valid name, instead of the
    parser's full usage.

    Args:
        recipe: the TensorBoard run name (``save_dir/recipe/version_N``).
        save_dir: the TensorBoard root folder.
        config: the YAML given with ``--config``, named in error messages.
    """

    def __init__(
        self,
        *args: Any,
        recipe: str = "run",
        save_dir: str = DEFAULT_SAVE_DIR,
        config: Path | None = None,
        **kwargs: Any,
    ) -> None:
        self._config_file = config
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
            parser_kwargs={"exit_on_error": False},  # raise, so that parse_arguments can explain it
            **kwargs,
        )

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(BackwardTimer, "timer")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            argv = list(args or ())
            subcommands = getattr(parser, "_subcommands_action", None)
            if subcommands is not None and argv and argv[0] in subcommands._name_parser_map:
                parser = subcommands._name_parser_map[argv[0]]
            raise CLIError(explain_parse_error(str(error), parser, argv, self._config_file)) from None

    def before_instantiate_classes(self) -> None:
        check_accelerator_available(self._get(self.config, "trainer").get("accelerator"))


def run_lightning(subcommand: str, argv: Sequence[str]) -> None:
    """Run LightningCLI's ``subcommand`` (``fit``, ``validate``, ``test``, ``predict``) on ``--config``."""
    if any(arg in ("-h", "--help") for arg in argv) and not any(arg.startswith("--config") for arg in argv):
        BPPSACLI(args=[subcommand, *argv])  # LightningCLI's own help
        return
    config, rest = split_config(argv)
    BPPSACLI(args=[subcommand, "--config", str(config), *rest], recipe=config.stem, config=config)
