"""The ``lightning-bppsa`` console script: ``fit`` (LightningCLI), ``compare`` and ``bench``.

``lightning-bppsa fit --config rnn_bitstream [--trainer.strategy=auto] [overrides]``
    LightningCLI on a recipe; ``--config`` takes a YAML path or the name of a recipe shipped in
    ``lightning_bppsa.recipes``. Defaults: ``strategy="bppsa"``, a TensorBoardLogger into
    ``runs/<recipe>``, and a :class:`~lightning_bppsa.callbacks.BackwardTimer`.
    ``validate`` / ``test`` / ``predict`` work the same way.

``lightning-bppsa compare --config rnn_bitstream [--max-steps N | --max-epochs N] [overrides]``
    Trains the recipe twice from the same seed, autograd (``strategy="auto"``) then BPPSA, into
    ``<save-dir>/<recipe>/autograd`` and ``.../bppsa``; prints and writes (``compare.md``) the table of
    forward / backward / Jacobian / total time per step, the speedups and the final losses and
    accuracies, and plots training loss against wall-clock time (``loss_vs_time.png``, paper Fig. 7).

``lightning-bppsa bench rnn|gru|vgg [--benchmarks-dir DIR] [--quick] [--out DIR]``
    Runs a grid from ``benchmarks/`` (see :data:`BENCHMARKS` for the contract a script follows) and
    writes CSV, markdown and the latency / speedup plots of paper Fig. 8.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_bppsa  # noqa: F401  (registers strategy "bppsa")
from lightning_bppsa.callbacks import BackwardTimer
from lightning_bppsa.recipes._common import RecipeConfigError

__all__ = [
    "BENCHMARKS",
    "BPPSACLI",
    "RunSummary",
    "available_recipes",
    "bench",
    "compare",
    "find_recipe",
    "format_comparison",
    "main",
    "plot_loss_curves",
    "read_scalars",
    "speedup_rows",
    "summarise_run",
]

DEFAULT_SAVE_DIR = "runs"
DEFAULT_COMPARE_STEPS = 1000
TIMING_KEYS = ("forward", "backward", "jacobian", "step")


class CLIError(Exception):
    """A mistake in the command line or the configuration: printed without a traceback."""


def available_recipes() -> list[str]:
    """Names of the recipes shipped in ``lightning_bppsa.recipes`` (one per ``*.yaml`` there)."""
    folder = resources.files("lightning_bppsa.recipes")
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def find_recipe(name_or_path: str) -> Path:
    """The YAML config for ``name_or_path``: an existing file, or the name of a shipped recipe."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = Path(str(resources.files("lightning_bppsa.recipes") / f"{path.stem}.yaml"))
    if path.suffix in ("", ".yaml") and path.parent == Path(".") and shipped.is_file():
        return shipped
    raise CLIError(
        f"unknown recipe or missing config file {name_or_path!r}; "
        f"shipped recipes: {', '.join(available_recipes())}"
    )


class BPPSACLI(LightningCLI):
    """LightningCLI with this project's defaults (strategy ``"bppsa"``, TensorBoard, a BackwardTimer).

    Model and data are given by class path (``model.class_path``, ``data.class_path``), as the
    recipe YAMLs do; ``--model.<arg>`` / ``--data.<arg>`` override their init arguments.
    """

    def __init__(
        self, *args: Any, recipe: str = "run", save_dir: str = DEFAULT_SAVE_DIR, **kwargs: Any
    ) -> None:
        trainer_defaults = {
            "strategy": "bppsa",
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": save_dir, "name": recipe},
            },
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


def _split_config(argv: Sequence[str]) -> tuple[Path, list[str]]:
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


def _logger_arg(save_dir: str, recipe: str, version: str | None = None) -> str:
    init_args: dict[str, Any] = {"save_dir": save_dir, "name": recipe}
    if version is not None:
        init_args["version"] = version
    logger = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": init_args}
    return "--trainer.logger=" + json.dumps(logger)


def _run_lightning(subcommand: str, argv: Sequence[str]) -> None:
    if any(arg in ("-h", "--help") for arg in argv) and not any(arg.startswith("--config") for arg in argv):
        BPPSACLI(args=[subcommand, *argv])  # LightningCLI's own help
        return
    config, rest = _split_config(argv)
    BPPSACLI(args=[subcommand, "--config", str(config), *rest], recipe=config.stem)


# ----------------------------------------------------------------------------------------------- compare


@dataclass
class RunSummary:
    """What ``compare`` keeps of one training run.

    ``seconds``: median seconds per step of each :data:`TIMING_KEYS` entry (warm-up steps excluded);
    ``loss_curve``: ``(step, wall-clock seconds since the first step, training loss)`` per logged step;
    ``final``: final metrics (``train/loss`` averaged over the last steps, ``val/loss``, ``val/acc``).
    """

    label: str
    log_dir: str
    seconds: dict[str, float] = field(default_factory=dict)
    loss_curve: list[tuple[int, float, float]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)


def read_scalars(log_dir: str) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar of a TensorBoard run as ``tag -> [(wall_time, step, value), ...]``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def summarise_run(label: str, log_dir: str, final: Mapping[str, float], warmup: int = 5) -> RunSummary:
    """Build a :class:`RunSummary` from a run's TensorBoard scalars (logged by :class:`BackwardTimer`)."""
    scalars = read_scalars(log_dir)
    summary = RunSummary(label, log_dir, final=dict(final))
    for key in TIMING_KEYS:
        values = [v for _, _, v in scalars.get(f"time/{key}", [])]
        if values:
            summary.seconds[key] = statistics.median(values[min(warmup, len(values) // 5) :])
    losses = scalars.get("train/loss", [])
    if losses:
        start = losses[0][0]
        summary.loss_curve = [(step, wall - start, value) for wall, step, value in losses]
        tail = [value for _, _, value in losses[-10:]]
        summary.final.setdefault("train/loss", sum(tail) / len(tail))
    return summary


def format_comparison(baseline: RunSummary, bppsa: RunSummary) -> str:
    """The comparison as a markdown table: per-step times (ms), speedups, final losses and accuracies."""

    def ms(summary: RunSummary, key: str) -> str:
        return f"{1000 * summary.seconds[key]:.2f}" if key in summary.seconds else "-"

    def speedup(key: str) -> str:
        slow, fast = baseline.seconds.get(key), bppsa.seconds.get(key)
        return f"{slow / fast:.2f}x" if slow and fast else ""

    rows = [("", "autograd", "bppsa", "speedup"), ("---", "---:", "---:", "---:")]
    names = {
        "forward": "forward ms/step",
        "backward": "backward ms/step",
        "jacobian": "Jacobian overhead ms/step",
    }
    names["step"] = "total ms/step"
    for key in TIMING_KEYS:
        rows.append(
            (
                names[key],
                ms(baseline, key),
                ms(bppsa, key),
                speedup(key) if key in ("backward", "step") else "",
            )
        )
    for metric in ("train/loss", "val/loss", "val/acc"):
        values = [f"{s.final[metric]:.4f}" if metric in s.final else "-" for s in (baseline, bppsa)]
        rows.append((f"final {metric}", *values, ""))
    ours = {step: loss for step, _, loss in bppsa.loss_curve}
    gaps = [abs(loss - ours[step]) for step, _, loss in baseline.loss_curve if step in ours]
    if gaps:
        rows.append(("max train-loss gap at the same step", "", f"{max(gaps):.2e}", ""))
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def _running_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at every position (fewer at the start)."""
    total, out = 0.0, []
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend (imported here: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(
    fig: Any, axes: Sequence[Any], path: Path, title: str, legend_size: int | None = None
) -> Path:
    """Legend every axis, title ``fig``, write it to ``path`` (format from the suffix) and close it."""
    for ax in axes:
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_loss_curves(runs: Sequence[RunSummary], path: Path, title: str) -> Path:
    """Training loss against wall-clock time (paper Fig. 7) and against the step (Fig. 6), one line per run.

    Returns ``path``.
    """
    fig, (by_time, by_step) = _pyplot().subplots(1, 2, figsize=(11, 4))
    for run, color in zip(runs, ("tab:blue", "tab:orange", "tab:green"), strict=False):
        if run.loss_curve:
            steps, seconds, losses = zip(*run.loss_curve, strict=True)
            smooth = _running_mean(losses, max(1, len(losses) // 50))
            for ax, x in ((by_time, seconds), (by_step, steps)):
                ax.plot(x, losses, color=color, linewidth=0.5, alpha=0.25)
                ax.plot(x, smooth, color=color, linewidth=1.5, label=run.label)
    by_time.set(xlabel="wall-clock time (s)", ylabel="training loss (faint: per step)", title="loss vs time")
    by_step.set(xlabel="step", ylabel="training loss (faint: per step)", title="loss vs step")
    return _save_figure(fig, (by_time, by_step), path, title)


def compare(
    config: str,
    *,
    max_steps: int | None = DEFAULT_COMPARE_STEPS,
    max_epochs: int | None = None,
    save_dir: str = DEFAULT_SAVE_DIR,
    overrides: Sequence[str] = (),
) -> tuple[RunSummary, RunSummary]:
    """Train recipe ``config`` under ``"auto"`` then ``"bppsa"`` from the same seed; report and plot.

    Args:
        config: recipe name or YAML path.
        max_steps: training steps per run (ignored when ``max_epochs`` is given).
        max_epochs: train whole epochs instead of ``max_steps``.
        save_dir: TensorBoard root; the runs go to ``<save_dir>/<recipe>/{autograd,bppsa}``.
        overrides: further LightningCLI arguments, applied to both runs.

    Returns the two run summaries (autograd, bppsa). Writes ``compare.md`` and ``loss_vs_time.png``
    into ``<save_dir>/<recipe>``.
    """
    path = find_recipe(config)
    recipe = path.stem
    if max_epochs:
        budget = [f"--trainer.max_epochs={max_epochs}", "--trainer.max_steps=-1"]
    elif max_steps and max_steps > 0:
        budget = [f"--trainer.max_steps={max_steps}", "--trainer.max_epochs=-1"]
    else:
        raise CLIError("give --max-steps >= 1 or --max-epochs >= 1")
    summaries = []
    for label, strategy in (("autograd", "auto"), ("bppsa", "bppsa")):
        print(f"=== {recipe}: {label} (strategy={strategy!r}) ===", flush=True)
        args = [
            "--config", str(path), *budget, "--trainer.log_every_n_steps=1", f"--trainer.strategy={strategy}",
            _logger_arg(save_dir, recipe, label), *overrides,
        ]  # fmt: skip
        cli = BPPSACLI(args=args, run=False, recipe=recipe, save_dir=save_dir)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        final = {}
        if cli.datamodule is not None and cli.trainer.limit_val_batches:
            results = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
            final = {k: float(v) for k, v in (results[0] if results else {}).items()}
        summaries.append(summarise_run(label, cli.trainer.logger.log_dir, final))
    out = Path(save_dir) / recipe
    table = format_comparison(*summaries)
    (out / "compare.md").write_text(f"# {recipe}: autograd vs BPPSA\n\n{table}\n")
    print(f"\n{recipe}: autograd vs BPPSA\n{table}")
    png = plot_loss_curves(summaries, out / "loss_vs_time.png", f"{recipe}: autograd vs BPPSA")
    print(f"\nTensorBoard: tensorboard --logdir {out}\nplot: {png}")
    return summaries[0], summaries[1]


# ------------------------------------------------------------------------------------------------- bench

BENCHMARKS: dict[str, tuple[str, dict[str, Any]]] = {
    "rnn": ("rnn.py", {"cell": "rnn"}),
    "gru": ("rnn.py", {"cell": "gru"}),
    "vgg": ("vgg.py", {}),
}
"""``bench`` name -> (script in ``benchmarks/``, keyword arguments for its ``bench_rows``).

The contract a benchmark script follows so that ``lightning-bppsa bench`` can run it:

- it defines ``bench_rows(*, quick: bool = False, **options) -> Iterable[dict]`` (``options`` are the
  ones listed here, e.g. ``cell="gru"``); ``quick=True`` runs a small grid in seconds;
- each row is one measurement: ``method`` (``"autograd"`` or ``"bppsa"``), ``backward_s`` (median
  seconds of one backward), and its grid point: ``T`` (sequence length / chain length) and ``B``
  (batch size); optional ``forward_s``, ``peak_bytes`` and any other column, all copied to the CSV;
- the script still runs on its own (``python benchmarks/rnn.py``) and importing it runs nothing.
"""


def _locate_script(script: str, benchmarks_dir: str | None) -> Path:
    candidates = [Path(benchmarks_dir)] if benchmarks_dir else [Path.cwd() / "benchmarks"]
    if not benchmarks_dir:
        candidates.append(Path(__file__).resolve().parents[1] / "benchmarks")  # source checkout
    for folder in candidates:
        if (folder / script).is_file():
            return folder / script
    looked = ", ".join(str(folder / script) for folder in candidates)
    raise CLIError(
        f"benchmark script not found (looked for {looked}). The benchmarks ship with the source repository, "
        "not the wheel: run from the repository root or pass --benchmarks-dir path/to/benchmarks"
    )


def _load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bppsa_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # scripts import their siblings (e.g. _common)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    if not callable(getattr(module, "bench_rows", None)):
        raise CLIError(
            f"{path} defines no bench_rows(*, quick=False, **options); see lightning_bppsa.cli.BENCHMARKS"
        )
    return module


def speedup_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Pair the autograd and BPPSA rows of every grid point ``(T, B)``: backward latencies and speedup."""
    points: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        point = points.setdefault((row.get("T"), row.get("B")), {"T": row.get("T"), "B": row.get("B")})
        point[f"{row['method']}_backward_s"] = float(row["backward_s"])
    paired = [p for p in points.values() if "autograd_backward_s" in p and "bppsa_backward_s" in p]
    for point in paired:
        point["speedup"] = point["autograd_backward_s"] / point["bppsa_backward_s"]
    return sorted(paired, key=lambda p: (p["B"] is None, p["B"] or 0, p["T"] is None, p["T"] or 0))


def _plot_grid(points: Sequence[Mapping[str, Any]], x: str, line: str, path: Path, title: str) -> Path:
    """Latency (both methods) and speedup against ``x`` (``"T"`` or ``"1/B"``); a line per ``line`` value."""
    key = "B" if x == "1/B" else x
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for point in points:
        groups.setdefault(point[line], []).append(point)
    fig, (latency, speed) = _pyplot().subplots(1, 2, figsize=(10, 4))
    for value, group in sorted(groups.items()):
        group = sorted(group, key=lambda p: 1 / p[key] if x == "1/B" else p[key])
        xs = [1 / p[key] if x == "1/B" else p[key] for p in group]
        latency.plot(
            xs, [p["autograd_backward_s"] * 1e3 for p in group], "--o", label=f"autograd {line}={value}"
        )
        latency.plot(xs, [p["bppsa_backward_s"] * 1e3 for p in group], "-o", label=f"bppsa {line}={value}")
        speed.plot(xs, [p["speedup"] for p in group], "-o", label=f"{line}={value}")
    latency.set(xscale="log", yscale="log", xlabel=x, ylabel="backward latency (ms)")
    speed.set(xscale="log", xlabel=x, ylabel="backward speedup (autograd / bppsa)")
    speed.axhline(1.0, color="grey", linewidth=0.8)
    return _save_figure(fig, (latency, speed), path, title, legend_size=7)


def bench(
    name: str, *, benchmarks_dir: str | None = None, quick: bool = False, out: str = "benchmarks/results"
) -> Path:
    """Run benchmark ``name`` (a key of :data:`BENCHMARKS`); write ``bench-<name>.{csv,md}`` and plots.

    Plots (paper Fig. 8): ``bench-<name>-vs-T.png`` (one line per B) and ``bench-<name>-vs-invB.png``
    (one line per T), each with backward latency and speedup; written when the grid varies that axis.
    Returns the output folder.
    """
    if name not in BENCHMARKS:
        raise CLIError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    script, options = BENCHMARKS[name]
    module = _load_script(_locate_script(script, benchmarks_dir))
    rows = [dict(row) for row in module.bench_rows(quick=quick, **options)]
    if not rows:
        raise CLIError(f"{script}: bench_rows returned no rows")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(folder / f"bench-{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, columns)
        writer.writeheader()
        writer.writerows(rows)
    points = speedup_rows(rows)
    lines = [
        f"# bench {name}",
        "",
        "| T | B | autograd backward ms | bppsa backward ms | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {p['T']} | {p['B']} | {1e3 * p['autograd_backward_s']:.3f} | {1e3 * p['bppsa_backward_s']:.3f} "
        f"| {p['speedup']:.2f}x |"
        for p in points
    ]
    (folder / f"bench-{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for x, line, suffix in (("T", "B", "vs-T"), ("1/B", "T", "vs-invB")):
        key = "B" if x == "1/B" else x
        if len({p[key] for p in points if p[key] is not None}) > 1 and all(p[key] for p in points):
            _plot_grid(
                points, x, line, folder / f"bench-{name}-{suffix}.png", f"bench {name}: backward vs {x}"
            )
    return folder


# -------------------------------------------------------------------------------------------------- main


def _compare_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-bppsa compare", description=compare.__doc__.splitlines()[0]
    )
    parser.add_argument("--config", required=True, help="recipe name or YAML path")
    parser.add_argument("--max-steps", type=int, default=DEFAULT_COMPARE_STEPS, help="training steps per run")
    parser.add_argument(
        "--max-epochs", type=int, default=None, help="train whole epochs instead of --max-steps"
    )
    parser.add_argument("--save-dir", default=DEFAULT_SAVE_DIR, help="TensorBoard root folder")
    args, overrides = parser.parse_known_args(argv)
    compare(
        args.config,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        save_dir=args.save_dir,
        overrides=overrides,
    )


def _bench_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightning-bppsa bench", description=bench.__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--benchmarks-dir", default=None, help="folder holding rnn.py / vgg.py")
    parser.add_argument("--quick", action="store_true", help="a small grid that runs in seconds")
    parser.add_argument("--out", default="benchmarks/results", help="where the CSV, markdown and PNGs go")
    args = parser.parse_args(argv)
    bench(args.name, benchmarks_dir=args.benchmarks_dir, quick=args.quick, out=args.out)


USAGE = """usage: lightning-bppsa {{fit,validate,test,predict,compare,bench}} ...

  lightning-bppsa fit --config rnn_bitstream [--trainer.strategy=auto] [--data.seq_len=300 ...]
  lightning-bppsa compare --config rnn_bitstream [--max-steps {steps} | --max-epochs N]
  lightning-bppsa bench rnn|gru|vgg [--quick]
  lightning-bppsa COMMAND --help

recipes: {recipes}"""


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-bppsa`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE.format(recipes=", ".join(available_recipes()), steps=DEFAULT_COMPARE_STEPS))
        return
    command, rest = argv[0], argv[1:]
    # We hand LightningCLI the rewritten argv on purpose; its warning about sys.argv would only confuse.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        if command == "compare":
            _compare_main(rest)
        elif command == "bench":
            _bench_main(rest)
        elif command in ("fit", "validate", "test", "predict"):
            _run_lightning(command, rest)
        else:
            raise CLIError(f"unknown command {command!r}; use fit, validate, test, predict, compare or bench")
    except (CLIError, RecipeConfigError) as error:
        sys.exit(f"lightning-bppsa: error: {error}")


if __name__ == "__main__":
    main()
