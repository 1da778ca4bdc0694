"""``lightning-bppsa compare --config RECIPE [--max-steps N | --max-epochs N] [--threads N] [overrides]``.

Trains the recipe twice from the same seed, autograd (``strategy="auto"``) and BPPSA, taking turns every
``--block-steps`` steps (A/B/A/B: a change of machine load hits both runs alike, and the table reports the
spread of the per-block speedups), each comparison into its own folder ``<save-dir>/<recipe>/compare/version_N/`` (Lightning's numbering): the TensorBoard
runs ``autograd/`` and ``bppsa/``, the table ``compare.md`` and the plot ``loss_vs_time.png``. A folder
holds an ``INCOMPLETE`` marker until its comparison has finished: an interrupted one (Ctrl-C, a crash)
keeps it, and later comparisons take the next number instead of mixing their events into it.

Before its first step each run does one warm-up step that leaves its training untouched
(:class:`~lightning_bppsa.bench.trial.WarmUp`): kernel builds get a row of their own in the table instead
of sitting in the first step. Without ``--threads`` the torch thread count is measured first
(:func:`torch_threads`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import move_data_to_device
from typing_extensions import override

from lightning_bppsa.bench.measure import (
    default_threads,
    fastest_threads,
    load_average,
    set_threads,
    thread_counts,
    usable_cpus,
)
from lightning_bppsa.bench.trial import NotMeasurable, WarmUp, rng_kept, synchronize, trial_step
from lightning_bppsa.callbacks import GradientCheck
from lightning_bppsa.cli.config import CLIError, find_recipe
from lightning_bppsa.cli.errors import closest
from lightning_bppsa.cli.fit import BPPSACLI, DEFAULT_SAVE_DIR, logger_arg
from lightning_bppsa.cli.report import (
    Conditions,
    RunSummary,
    format_comparison,
    plot_loss_curves,
    speedups,
    summarise_run,
)

__all__ = [
    "DEFAULT_COMPARE_STEPS",
    "INCOMPLETE",
    "Interrupted",
    "Turns",
    "autograd_step_timer",
    "compare",
    "incomplete_comparisons",
    "main",
    "torch_threads",
]

DEFAULT_COMPARE_STEPS = 1000
DEFAULT_BLOCKS = 20  # turns per run over a --max-steps budget
DEFAULT_BLOCK_STEPS_WITH_EPOCHS = 50
DEFAULT_CHECK_EVERY_WITH_EPOCHS = 250
INCOMPLETE = "INCOMPLETE"
RUNS = (("autograd", "auto"), ("bppsa", "bppsa"))  # (label, strategy)
MEASURED_STEPS = 3  # timed steps of the baseline per thread count (after one untimed)

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


class Interrupted(Exception):
    """Raised inside a run's thread when the comparison stops (Ctrl-C, or the other run failed)."""


class Turns:
    """Lets training runs in several threads take turns: one runs while the others wait (no overlap).

    Run ``i`` calls :meth:`wait` before it starts and :meth:`hand_on` at every block boundary and when it
    ends (``finished=True``); the turn goes round the runs that have not finished. :meth:`abort` makes
    every waiting or later :meth:`wait` / :meth:`check` raise :class:`Interrupted`.
    """

    def __init__(self, runs: int) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._finished = [False] * runs
        self._aborted = False

    def wait(self, run: int) -> None:
        """Block until it is ``run``'s turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == run or self._aborted)
        self.check()

    def check(self) -> None:
        """Raise :class:`Interrupted` once :meth:`abort` was called."""
        if self._aborted:
            raise Interrupted("compare was interrupted")

    def hand_on(self, run: int, finished: bool = False) -> None:
        """End ``run``'s turn: the next unfinished run (or ``run`` itself, when alone) goes on."""
        with self._cond:
            self._finished[run] |= finished
            others = [(run + k) % len(self._finished) for k in range(1, len(self._finished) + 1)]
            self._turn = next((r for r in others if not self._finished[r]), run)
            self._cond.notify_all()

    def abort(self) -> None:
        """Make every run stop at its next :meth:`wait` (or :meth:`hand_on` boundary)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class TakeTurns(Callback):
    """Hands the turn on every ``block_steps`` training steps, before the step's timers start; prints progress."""

    def __init__(self, turns: Turns, run: int, label: str, block_steps: int) -> None:
        self.turns, self.run, self.label, self.block_steps = turns, run, label, block_steps
        self._block_start: tuple[int, float] | None = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.turns.check()
        step = trainer.global_step
        if self._block_start is not None and step > self._block_start[0] and step % self.block_steps == 0:
            first, start = self._block_start
            seconds = (time.perf_counter() - start) / (step - first)
            total = trainer.max_steps if trainer.max_steps > 0 else "?"
            loss = trainer.callback_metrics.get("train/loss")
            shown = f", train/loss {float(loss):.4f}" if loss is not None else ""
            print(
                f"  {self.label:>8}: step {step}/{total}, {1000 * seconds:.1f} ms/step over the last block{shown}",
                flush=True,
            )
            self.turns.hand_on(self.run)
            self.turns.wait(self.run)
        if self._block_start is None or step % self.block_steps == 0:
            self._block_start = (step, time.perf_counter())


def _build_run(strategy: str, args: Sequence[str], save_dir: str, check_every: int, config: Path) -> BPPSACLI:
    """The run's LightningCLI, not yet fitted (config errors surface here, before any training)."""
    cli = BPPSACLI(
        args=[*args, f"--trainer.strategy={strategy}"], run=False, save_dir=save_dir, config=config
    )
    if strategy == "bppsa" and check_every:
        # its seconds are logged and left out of compare's medians and clock
        cli.trainer.callbacks.insert(0, GradientCheck(every_n_steps=check_every))
    return cli


def autograd_step_timer(
    cli: BPPSACLI, steps: int = MEASURED_STEPS, clock: Callable[[], float] = time.perf_counter
) -> Callable[[int], float]:
    """``threads -> seconds``: the median of ``steps`` forward + backward passes (:func:`trial_step`) of
    ``cli``'s model on its first training batch, on the device it will train on, after one untimed pass.

    It runs a copy of the model and of the datamodule, with every generator restored (:func:`rng_kept`):
    the run itself trains as if nothing had been measured.

    Raises:
        NotMeasurable: without a datamodule to take the batch from, or under manual optimization.
    """
    if cli.datamodule is None:
        raise NotMeasurable("no datamodule to take a training batch from")
    device = cli.trainer.strategy.root_device
    with rng_kept(device):  # a datamodule may draw its data or its shuffle from the global generators
        data = copy.deepcopy(cli.datamodule)
        data.prepare_data()
        data.setup("fit")
        batch = move_data_to_device(next(iter(data.train_dataloader())), device)
    model = copy.deepcopy(cli.model).to(device)

    def seconds_at(threads: int) -> float:
        set_threads(threads)
        times = []
        for _ in range(steps + 1):  # the first untimed: it starts the new thread pool
            start = clock()
            trial_step(model, lambda: model.training_step(batch, 0))
            synchronize(device)
            times.append(clock() - start)
        return statistics.median(times[1:])

    return seconds_at


def torch_threads(
    threads: int | None,
    cli: BPPSACLI,
    timer: Callable[[BPPSACLI], Callable[[int], float]] = autograd_step_timer,
    cpus: int | None = None,
) -> tuple[int, str]:
    """The torch thread count for both runs, and the line that says why.

    ``threads`` given (``--threads``): that, unmeasured. Otherwise the fastest count for the autograd
    run's step, ``timer(cli)(n)`` seconds at each ``n`` of :func:`thread_counts` over ``cpus`` (default:
    the CPUs this process may use). Measured, because the core count misleads: on a 2-vCPU machine two
    threads ran the baseline 6.5x slower than one (359 vs 55 ms a step) and inflated the speedup 7x.
    Where no step can be measured (:class:`NotMeasurable`), one thread per physical core.
    """
    if threads is not None:
        return threads, f"torch threads: {threads} (--threads)"
    cpus = len(usable_cpus()) if cpus is None else cpus
    try:
        return fastest_threads(timer(cli), thread_counts(cpus), "autograd forward + backward")
    except NotMeasurable as why:
        count = default_threads()
        return (
            count,
            f"torch threads: {count} (one per physical core; not measured: {why}; --threads to override)",
        )


def _run_in_turns(clis: Sequence[tuple[str, BPPSACLI]], block_steps: int, threads: int) -> list[RunSummary]:
    """Fit and validate every run in its own thread, taking turns every ``block_steps`` steps."""
    turns = Turns(len(clis))
    results: list[RunSummary | None] = [None] * len(clis)
    errors: list[BaseException | None] = [None] * len(clis)

    def work(run: int, label: str, cli: BPPSACLI) -> None:
        try:
            set_threads(threads)  # intra-op threads are set per calling thread under OpenMP
            turns.wait(run)
            results[run] = _fit_and_summarise(label, cli)
        except BaseException as error:  # handed to the main thread, which re-raises it
            errors[run] = error
            turns.abort()
        finally:
            turns.hand_on(run, finished=True)

    for run, (_, cli) in enumerate(clis):
        # first: the turn is handed on before BackwardTimer starts the step's clock
        cli.trainer.callbacks.insert(0, TakeTurns(turns, run, clis[run][0], block_steps))
        # before that: the warm-up runs in the run's turn, outside its first block and its step's clock
        cli.trainer.callbacks.insert(0, WarmUp())
    workers = [
        threading.Thread(target=work, args=(run, label, cli), name=f"compare-{label}", daemon=True)
        for run, (label, cli) in enumerate(clis)
    ]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            while worker.is_alive():
                worker.join(timeout=0.2)  # short waits: Ctrl-C reaches the main thread between them
    except KeyboardInterrupt:
        turns.abort()  # each run stops at its next step and Lightning tears it down
        for worker in workers:
            worker.join()
        raise SystemExit(1) from None  # as Lightning answers Ctrl-C
    for error in errors:  # the run that failed first, not the other one it stopped
        if error is not None and not isinstance(error, Interrupted):
            raise error
    return [result for result in results if result is not None]


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
    threads: int | None = None,
    block_steps: int | None = None,
    overrides: Sequence[str] = (),
) -> tuple[RunSummary, RunSummary]:
    """Train recipe ``config`` under ``"auto"`` and ``"bppsa"`` from the same seed, in turns; report and plot.

    Args:
        config: recipe name or YAML path.
        max_steps: training steps per run (ignored when ``max_epochs`` is given).
        max_epochs: train whole epochs instead of ``max_steps``.
        save_dir: TensorBoard root; this comparison goes to ``<save_dir>/<recipe>/compare/version_N``.
        check_every: the BPPSA run checks its gradients against autograd every ``check_every`` steps
            (:class:`~lightning_bppsa.callbacks.GradientCheck`, logged as ``bppsa/grad_rel_diff``);
            default: 4 checks over ``max_steps``, or every 250 steps with ``max_epochs``; 0 = none. A
            check's seconds are left out of the medians and the plot's clock.
        threads: torch's intra-op threads for both runs (default: the fastest for a few autograd steps,
            measured, :func:`torch_threads`).
        block_steps: the runs take turns every ``block_steps`` training steps (default: ``max_steps / 20``,
            or 50 with ``max_epochs``); the table gives the median and range of the per-block speedups.
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
    if block_steps is None:
        block_steps = DEFAULT_BLOCK_STEPS_WITH_EPOCHS if max_epochs else max(1, max_steps // DEFAULT_BLOCKS)
    if block_steps < 1:
        raise CLIError(f"--block-steps must be >= 1; got {block_steps}")
    if threads is not None and threads < 1:
        raise CLIError(f"--threads must be >= 1; got {threads}")
    check_overrides(overrides)
    root = Path(save_dir) / recipe / "compare"
    for folder in incomplete_comparisons(root):
        print(f"ignoring {folder}: marked {INCOMPLETE} (interrupted or still running)", flush=True)
    version = _next_version(root)
    out = root / version
    clis: list[tuple[str, BPPSACLI]] = []
    for label, strategy in RUNS:
        print(f"=== {recipe}: {label} (strategy={strategy!r}) -> {out / label} ===", flush=True)
        args = [
            "--config", str(path), *budget, "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",  # two runs in turns: TakeTurns prints the progress
            logger_arg(save_dir, f"{recipe}/compare", f"{version}/{label}"), *overrides,
        ]  # fmt: skip
        clis.append((label, _build_run(strategy, args, save_dir, check_every, path)))
        if len(clis) == 1:  # the first run's config is valid: claim the folder
            try:
                out.mkdir(parents=True)
            except FileExistsError:
                raise CLIError(f"{out} appeared meanwhile (another compare?); run again") from None
            (out / INCOMPLETE).write_text(
                "This comparison has not finished (interrupted, crashed or still running); its logs are "
                "partial. `lightning-bppsa compare` never reads them: each comparison has its own folder.\n"
            )
    try:
        threads, why = torch_threads(threads, clis[0][1])  # once both configs are valid
        set_threads(threads)
        print(f"{why}\ntraining in turns of {block_steps} steps, {threads} torch thread(s)", flush=True)
        load_start = load_average()
        autograd, bppsa = _run_in_turns(clis, block_steps, threads)
    except BaseException:  # Ctrl-C included
        print(f"\ncompare: {out} stays marked {INCOMPLETE}", file=sys.stderr, flush=True)
        raise
    conditions = Conditions(threads, load_start, load_average(), block_steps)
    summaries = [autograd, bppsa]
    cli = clis[-1][1]
    bppsa_logger = cli.trainer.logger
    ratios = {f"compare/{key}_speedup": value for key, value in speedups(autograd, bppsa).items()}
    bppsa_logger.log_metrics(ratios, step=cli.trainer.global_step)
    bppsa_logger.finalize("success")
    table = format_comparison(autograd, bppsa, conditions)
    (out / "compare.md").write_text(f"# {recipe}: autograd vs BPPSA\n\n{table}\n")
    print(f"\n{recipe}: autograd vs BPPSA\n{table}")
    png = plot_loss_curves(summaries, out / "loss_vs_time.png", f"{recipe}: autograd vs BPPSA")
    (out / INCOMPLETE).unlink()
    print(f"\nwritten: {out / 'compare.md'}, {png}\nTensorBoard: tensorboard --logdir {out}")
    return autograd, bppsa


#: LightningCLI's options that take no dot (``--trainer.x`` and the like are checked by LightningCLI itself)
_LIGHTNING_TOP_LEVEL = (
    "seed_everything",
    "trainer",
    "model",
    "data",
    "optimizer",
    "lr_scheduler",
    "ckpt_path",
    "timer",
)


def _check_unknown_options(parser: argparse.ArgumentParser, overrides: Sequence[str]) -> None:
    """Raise :class:`CLIError` for an option that is neither ``compare``'s nor a LightningCLI one."""
    own = [s[2:] for action in parser._actions for s in action.option_strings if s.startswith("--")]
    for arg in overrides:
        name = arg[2:].split("=", 1)[0] if arg.startswith("--") else None
        if name is not None and "." not in name and name not in _LIGHTNING_TOP_LEVEL:
            hint = closest(f"--{name}", [f"--{n}" for n in (*own, *_LIGHTNING_TOP_LEVEL)])
            raise CLIError(f"compare: unknown option --{name}{hint}")


def main(argv: Sequence[str]) -> None:
    """``lightning-bppsa compare ...``: parse ``argv`` and run :func:`compare`."""
    parser = argparse.ArgumentParser(
        prog="lightning-bppsa compare",
        description="Train a recipe under autograd and under BPPSA from the same seed, in turns; print the "
        "table, write the plot. Other --trainer.* / --model.* / --data.* options go to both runs.",
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
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: the fastest of 1, 2, 4, ... up to the usable CPUs, measured on a few "
        "autograd steps)",
    )  # fmt: skip
    parser.add_argument(
        "--block-steps", type=int, default=None,
        help=f"the runs take turns every N steps (default: max-steps / {DEFAULT_BLOCKS})",
    )  # fmt: skip
    args, overrides = parser.parse_known_args(argv)
    _check_unknown_options(parser, overrides)
    compare(
        args.config,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        save_dir=args.save_dir,
        check_every=args.check_every,
        threads=args.threads,
        block_steps=args.block_steps,
        overrides=overrides,
    )
