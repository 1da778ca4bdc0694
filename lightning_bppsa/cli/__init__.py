"""The ``lightning-bppsa`` console script, one module per subcommand.

- :mod:`~lightning_bppsa.cli.fit`: ``fit`` / ``validate`` / ``test`` / ``predict`` (LightningCLI on a recipe);
- :mod:`~lightning_bppsa.cli.compare`: ``compare`` (autograd vs BPPSA on one recipe: table and plot);
- :mod:`~lightning_bppsa.cli.bench`: ``bench`` (a benchmark grid: CSV, markdown, plots);
- :mod:`~lightning_bppsa.cli.report`: reading runs back from TensorBoard, the tables and the plots;
- :mod:`~lightning_bppsa.cli.config`: finding and checking recipe configs, :class:`CLIError`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

from lightning_bppsa.cli import bench, compare
from lightning_bppsa.cli.config import CLIError, available_recipes, find_recipe
from lightning_bppsa.cli.fit import BPPSACLI, run_lightning
from lightning_bppsa.recipes._common import RecipeConfigError

__all__ = ["BPPSACLI", "CLIError", "available_recipes", "find_recipe", "main"]

USAGE = """usage: lightning-bppsa {{fit,validate,test,predict,compare,bench}} ...

  lightning-bppsa fit --config rnn_bitstream [--trainer.strategy=auto] [--data.seq_len=300 ...]
  lightning-bppsa compare --config rnn_bitstream [--max-steps {steps} | --max-epochs N]
  lightning-bppsa bench rnn|gru|vgg [--quick]
  lightning-bppsa COMMAND --help

recipes: {recipes}"""


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-bppsa`` console script (``argv`` defaults to ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(recipes=", ".join(available_recipes()), steps=compare.DEFAULT_COMPARE_STEPS))
        return
    command, rest = argv[0], argv[1:]
    # We hand LightningCLI the rewritten argv on purpose; its warning about sys.argv would only confuse.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        if command == "compare":
            compare.main(rest)
        elif command == "bench":
            bench.main(rest)
        elif command in ("fit", "validate", "test", "predict"):
            run_lightning(command, rest)
        else:
            raise CLIError(f"unknown command {command!r}; use fit, validate, test, predict, compare or bench")
    except (CLIError, RecipeConfigError) as error:
        sys.exit(f"lightning-bppsa: error: {error}")
