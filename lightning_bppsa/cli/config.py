"""Finding and checking a recipe's YAML config; the error every CLI mistake is reported with."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import yaml

__all__ = ["CLIError", "available_recipes", "check_config_file", "find_recipe", "split_config"]


class CLIError(Exception):
    """A mistake in the command line or the configuration: printed in one message, without a traceback."""


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``lightning_bppsa.recipes`` (one per ``*.yaml`` there)."""
    folder = resources.files("lightning_bppsa.recipes")
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def check_config_file(path: Path) -> None:
    """Raise :class:`CLIError` naming ``path`` unless it holds a YAML mapping (text, parseable, not empty).

    LightningCLI would otherwise answer an empty file with "Unexpected config:" and a binary one with a
    ``UnicodeDecodeError`` traceback, neither naming the file.
    """
    example = "a mapping with trainer / model / data sections, like the shipped recipes/rnn_bitstream.yaml"
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CLIError(
            f"config file {path} is not a text (UTF-8) YAML file: byte 0x{raw[error.start]:02x} at offset "
            f"{error.start}; expected {example}"
        ) from None
    try:
        content = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise CLIError(f"config file {path} is not valid YAML: {error}") from None
    if content is None:
        raise CLIError(f"config file {path} is empty; expected {example}")
    if not isinstance(content, dict):
        raise CLIError(f"config file {path} holds a YAML {type(content).__name__}; expected {example}")


def find_recipe(name_or_path: str) -> Path:
    """The checked YAML config for ``name_or_path``: an existing file, or the name of a shipped recipe."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        shipped = Path(str(resources.files("lightning_bppsa.recipes") / f"{path.stem}.yaml"))
        if not (path.suffix in ("", ".yaml") and path.parent == Path(".") and shipped.is_file()):
            raise CLIError(
                f"unknown recipe or missing config file {name_or_path!r}; "
                f"shipped recipes: {', '.join(available_recipes())}"
            )
        path = shipped
    check_config_file(path)
    return path


def split_config(argv: Sequence[str]) -> tuple[Path, list[str]]:
    """Pull ``--config X`` / ``--config=X`` out of ``argv``; resolve X with :func:`find_recipe`."""
    rest, config = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            config = next(args, None)
            if config is None:
                raise CLIError("--config needs a recipe name or a YAML path")
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if config is None:
        raise CLIError(
            f"--config is required: a recipe name ({', '.join(available_recipes())}) or a YAML path"
        )
    return find_recipe(config), rest
