"""``lightning-bppsa recipes [ls]`` lists the shipped recipes; ``recipes cp NAME [DEST]`` copies one's YAML out.

Like torchtune's ``ls`` / ``cp``: copy a recipe, edit the copy, run it with ``--config path/to/copy.yaml``.
A recipe's one-line description is the first line of its YAML's header comment.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

from lightning_bppsa.cli.config import CLIError, available_recipes, find_recipe
from lightning_bppsa.cli.errors import closest

__all__ = ["copy_recipe", "describe", "list_recipes", "main"]


def describe(path: Path) -> str:
    """The first line of the YAML's header comment, without the ``#``; ``""`` when it has none."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return ""
        if line.strip("# "):
            return line.lstrip("# ").strip()
    return ""


def list_recipes() -> str:
    """One line per shipped recipe: its name and its description."""
    names = available_recipes()
    width = max(map(len, names), default=0)
    return "\n".join(f"{name.ljust(width)}  {describe(find_recipe(name))}" for name in names)


def copy_recipe(name: str, dest: str | None = None) -> Path:
    """Copy shipped recipe ``name``'s YAML to ``dest`` (a file, or a folder; default ``./<name>.yaml``).

    Refuses to overwrite an existing file. Returns the written path.
    """
    if name not in available_recipes():
        raise CLIError(
            f"unknown recipe {name!r}{closest(name, available_recipes())}; see `lightning-bppsa recipes`"
        )
    target = Path(dest) if dest is not None else Path(f"{name}.yaml")
    if target.is_dir():
        target = target / f"{name}.yaml"
    if target.exists():
        raise CLIError(f"{target} exists; give another destination (recipes cp {name} DEST)")
    shutil.copyfile(find_recipe(name), target)
    return target


def main(argv: Sequence[str]) -> None:
    """``lightning-bppsa recipes ...``: parse ``argv``, list or copy."""
    parser = argparse.ArgumentParser(
        prog="lightning-bppsa recipes", description="List the shipped recipes, or copy one's YAML to edit it."
    )
    actions = parser.add_subparsers(dest="action")
    actions.add_parser("ls", help="list the recipes with a one-line description (the default)")
    cp = actions.add_parser("cp", help="copy a recipe's YAML out: recipes cp NAME [DEST]")
    cp.add_argument("name")
    cp.add_argument("dest", nargs="?", default=None, help="file or folder (default ./NAME.yaml)")
    args = parser.parse_args(argv)
    if args.action == "cp":
        path = copy_recipe(args.name, args.dest)
        print(f"copied recipe {args.name!r} to {path}; run it with: lightning-bppsa fit --config {path}")
    else:
        print(list_recipes())
