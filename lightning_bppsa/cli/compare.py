"""``lightning-bppsa compare --config RECIPE [--max-steps N | --max-epochs N] [overrides]``.

Trains the recipe twice from the same seed, autograd (``strategy="auto"``) then BPPSA, each comparison
into its own folder ``<save-dir>/<recipe>/compare/version_N/`` (Lightning's numbering): the TensorBoard
runs ``autograd/`` and ``bppsa/``, the table ``compare.md`` and the plot ``loss_vs_time.png``. A folder
holds an ``INCOMPLETE`` marker until its comparison has finished: an interrupted one (Ctrl-C, a crash)
keeps it, and later comparisons take the next number instead of mixing their events into it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_bppsa.callbacks import GradientCheck
from lightning_bppsa.cli.config import CLIError, find_recipe
from lightning_bppsa.cli.fit import BPPSACLI, DEFAULT_SAVE_DIR, logger_arg
from lightning_bppsa.cli.report import (
    RunSummary,
    format_comparison,
    plot_loss_curves,
    speedups,
    summarise_run,
)

__all__ = ["DEFAULT_COMPARE_STEPS", "INCOMPLETE", "compare", "incomplete_comparisons", "main"]

DEFAULT_COMPARE_STEPS = 1000
DEFAULT_CHECK_EVERY_WITH_EPOCHS = 250
INCOMPLETE = "INCOMPLETE"
RUNS = (("autograd", "auto"), ("bppsa", "bppsa"))  # (label, strategy)

#: Trainer options ``compare`` sets itself, and why an override cannot be honoured.
SET_BY_COMPARE = {
    "--trainer.strategy": "compare runs strategy 'auto' (the autograd column) then 'bppsa'; to train "
    "under one strategy use `lightning-bppsa fit --config ... --trainer.strategy=...`",
    "--trainer.logger": "compare reads both runs back from its TensorBoard logs; choose where they go "
    "with --save-dir",
    "--trainer.log_every_n_steps": "compare logs every step (its table and plot need every step's time)",
    "--trainer.max_steps": "use --max-steps",
    "--trainer.max_epochs": "use --max-epochs",
}


def check_overrides(overrides: Sequence[str]) -> None:
    """Raise :class:`CLIError` for an override of an option ``compare`` sets itself (:data:`SET_BY_COMPARE`)."""
    for arg in overrides:
        name = arg.split("=", 1)[0]
        for option, why in SET_BY_COMPARE.items():
            if name == option or name.startswith(option + "."):
                raise CLIError(f"compare sets {option} itself, so {arg!r} cannot be given: {why}")


def incomplete_comparisons(root: Path) -> list[Path]:
    """The ``version_N`` folders under ``root`` still marked :data:`INCOMPLETE` (interrupted or running)."""
    return sorted(marker.parent for marker in root.glob(f"version_*/{INCOMPLETE}"))


def _next_version(root: Path) -> str:
    """``version_N`` with N one above the highest taken under ``root`` (complete or not)."""
    numbers = [p.name.removeprefix("version_") for p in root.glob("version_*")]
    return f"version_{max((int(n) for n in numbers if n.isdigit()), default=-1) + 1}"


def _build_run(strategy: str, args: Sequence[str], save_dir: str, check_every: int) -> BPPSACLI:
    """The run's LightningCLI, not yet fitted (config errors surface here, before any training)."""
    cli = BPPSACLI(args=[*args, f"--trainer.strategy={strategy}"], run=False, save_dir=save_dir)
    if strategy == "bppsa" and check_every:
        # first in the list: its two extra backward passes land in the step's forward time, not its backward
        cli.trainer.callbacks.insert(0, GradientCheck(every_n_steps=check_every))
    return cli


def _fit_and_summarise(label: str, cli: BPPSACLI) -> RunSummary:
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    final = {}
    if cli.datamodule is not None and cli.trainer.limit_val_batches:
        results = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        final = {k: float(v) for k, v in (results[0] if results else {}).items()}
    return summarise_run(label, cli.trainer.logger.log_dir, final)


def compare(
    config: str,
    *,
    max_steps: int | None = DEFAULT_COMPARE_STEPS,
    max_epochs: int | None = None,
    save_dir: str = DEFAULT_SAVE_DIR,
    check_every: int | None = None,
    overrides: Sequence[str] = (),
) -> tuple[RunSummary, RunSummary]:
    """Train recipe ``config`` under ``"auto"`` then ``"bppsa"`` from the same seed; report and plot.

    Args:
        config: recipe name or YAML path.
        max_steps: training steps per run (ignored when ``max_epochs`` is given).
        max_epochs: train whole epochs instead of ``max_steps``.
        save_dir: TensorBoard root; this comparison goes to ``<save_dir>/<recipe>/compare/version_N``.
        check_every: the BPPSA run checks its gradients against autograd every ``check_every`` steps
            (:class:`~lightning_bppsa.callbacks.GradientCheck`, logged as ``bppsa/grad_rel_diff``);
            default: 4 checks over ``max_steps``, or every 250 steps with ``max_epochs``; 0 = none.
        overrides: further LightningCLI arguments, applied to both runs (not the options in
            :data:`SET_BY_COMPARE`).

    Returns the two run summaries (autograd, bppsa). Writes ``compare.md`` and ``loss_vs_time.png`` into
    the comparison's folder and logs the speedups as ``compare/backward_speedup`` and
    ``compare/step_speedup`` into the BPPSA run's TensorBoard log.
    """
    path = find_recipe(config)
    recipe = path.stem
    if max_epochs is not None and max_epochs < 1 or max_steps is not None and max_steps < 1:
        raise CLIError(f"give --max-steps >= 1 or --max-epochs >= 1; got {max_steps=}, {max_epochs=}")
    if max_epochs:
        budget = [f"--trainer.max_epochs={max_epochs}", "--trainer.max_steps=-1"]
    elif max_steps and max_steps > 0:
        budget = [f"--trainer.max_steps={max_steps}", "--trainer.max_epochs=-1"]
    else:
        raise CLIError("give --max-steps >= 1 or --max-epochs >= 1")
    if check_every is None:
        check_every = DEFAULT_CHECK_EVERY_WITH_EPOCHS if max_epochs else max(1, max_steps // 4)
    if check_every < 0:
        raise CLIError(f"--check-every must be >= 0; got {check_every}")
    check_overrides(overrides)
    root = Path(save_dir) / recipe / "compare"
    for folder in incomplete_comparisons(root):
        print(f"ignoring {folder}: marked {INCOMPLETE} (interrupted or still running)", flush=True)
    version = _next_version(root)
    out = root / version
    summaries: list[RunSummary] = []
    for label, strategy in RUNS:
        print(f"=== {recipe}: {label} (strategy={strategy!r}) -> {out / label} ===", flush=True)
        args = [
            "--config", str(path), *budget, "--trainer.log_every_n_steps=1",
            logger_arg(save_dir, f"{recipe}/compare", f"{version}/{label}"), *overrides,
        ]  # fmt: skip
        cli = _build_run(strategy, args, save_dir, check_every)
        if not summaries:  # the first run's config is valid: claim the folder
            try:
                out.mkdir(parents=True)
            except FileExistsError:
                raise CLIError(f"{out} appeared meanwhile (another compare?); run again") from None
            (out / INCOMPLETE).write_text(
                "This comparison has not finished (interrupted, crashed or still running); its logs are "
                "partial. `lightning-bppsa compare` never reads them: each comparison has its own folder.\n"
            )
        try:
            summaries.append(_fit_and_summarise(label, cli))
        except BaseException:  # Ctrl-C included (Lightning turns it into SystemExit)
            print(f"\ncompare: {out} stays marked {INCOMPLETE}", file=sys.stderr, flush=True)
            raise
    autograd, bppsa = summaries
    bppsa_logger = cli.trainer.logger  # the loop's last run is BPPSA's
    ratios = {f"compare/{key}_speedup": value for key, value in speedups(autograd, bppsa).items()}
    bppsa_logger.log_metrics(ratios, step=cli.trainer.global_step)
    bppsa_logger.finalize("success")
    table = format_comparison(autograd, bppsa)
    (out / "compare.md").write_text(f"# {recipe}: autograd vs BPPSA\n\n{table}\n")
    print(f"\n{recipe}: autograd vs BPPSA\n{table}")
    png = plot_loss_curves(summaries, out / "loss_vs_time.png", f"{recipe}: autograd vs BPPSA")
    (out / INCOMPLETE).unlink()
    print(f"\nTensorBoard: tensorboard --logdir {out}\nplot: {png}")
    return autograd, bppsa


def main(argv: Sequence[str]) -> None:
    """``lightning-bppsa compare ...``: parse ``argv`` and run :func:`compare`."""
    parser = argparse.ArgumentParser(
        prog="lightning-bppsa compare",
        description="Train a recipe under autograd, then under BPPSA from the same seed; print the table, write the plot.",
    )
    parser.add_argument("--config", required=True, help="recipe name or YAML path")
    parser.add_argument("--max-steps", type=int, default=DEFAULT_COMPARE_STEPS, help="training steps per run")
    parser.add_argument(
        "--max-epochs", type=int, default=None, help="train whole epochs instead of --max-steps"
    )
    parser.add_argument("--save-dir", default=DEFAULT_SAVE_DIR, help="TensorBoard root folder")
    parser.add_argument(
        "--check-every", type=int, default=None,
        help="gradient check of the BPPSA run every N steps (default: 4 checks; 0 = none)",
    )  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    compare(
        args.config,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        save_dir=args.save_dir,
        check_every=args.check_every,
        overrides=overrides,
    )
