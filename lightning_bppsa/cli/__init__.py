"""The ``lightning-bppsa`` console script, one module per subcommand.

- :mod:`~lightning_bppsa.cli.fit`: ``fit`` / ``validate`` / ``test`` / ``predict`` (LightningCLI on a recipe);
- :mod:`~lightning_bppsa.cli.compare`: ``compare`` (autograd vs BPPSA on one recipe: table and plot);
- :mod:`~lightning_bppsa.cli.bench`: ``bench`` (a benchmark grid: CSV, markdown, plots);
- :mod:`~lightning_bppsa.cli.recipes`: ``recipes`` (list them; ``recipes cp`` copies one's YAML out);
- :mod:`~lightning_bppsa.cli.report`: reading runs back from TensorBoard, the tables and the plots;
- :mod:`~lightning_bppsa.cli.config`: finding and checking recipe configs, :class:`CLIError`;
- :mod:`~lightning_bppsa.cli.errors`: one-line messages for LightningCLI's parse errors.

The subcommands are imported when they run: ``--help``, ``--version`` and ``recipes`` never load Lightning.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence

from lightning_bppsa.cli.config import CLIError, available_recipes, find_recipe
from lightning_bppsa.cli.errors import closest
from lightning_bppsa.recipes._errors import RecipeConfigError

__all__ = ["CLIError", "available_recipes", "find_recipe", "main"]

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
#: subcommand -> the module whose ``main(argv)`` runs it
COMMANDS = {"compare": "compare", "bench": "bench", "recipes": "recipes"}

USAGE = """usage: lightning-bppsa {{fit,validate,test,predict,compare,bench,recipes}} ... | --version

  lightning-bppsa compare --config rnn_bitstream [--max-steps N | --max-epochs N] [--threads N]
  lightning-bppsa fit --config rnn_bitstream [--trainer.strategy=auto] [--data.seq_len=300 ...]
  lightning-bppsa bench rnn|gru|vgg [--quick] [--threads N]
  lightning-bppsa recipes [ls | cp NAME [DEST]]
  lightning-bppsa COMMAND --help

recipes: {recipes}"""


def _version() -> str:
    import lightning_bppsa

    return lightning_bppsa.__version__


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-bppsa`` console script (``argv`` defaults to ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(recipes=", ".join(available_recipes())))
        return
    if argv[0] in ("-V", "--version"):
        print(f"lightning-bppsa {_version()}")
        return
    command, rest = argv[0], argv[1:]
    # We hand LightningCLI the rewritten argv on purpose; its warning about sys.argv would only confuse.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        if command in COMMANDS:
            importlib.import_module(f"lightning_bppsa.cli.{COMMANDS[command]}").main(rest)
        elif command in LIGHTNING_COMMANDS:
            from lightning_bppsa.cli.fit import run_lightning

            run_lightning(command, rest)
        else:
            known = [*LIGHTNING_COMMANDS, *COMMANDS]
            raise CLIError(
                f"unknown command {command!r} (commands: {', '.join(known)}){closest(command, known)}"
            )
    except (CLIError, RecipeConfigError) as error:
        sys.exit(f"lightning-bppsa: error: {error}")
