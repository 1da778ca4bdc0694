"""The lightning-bppsa console script: fit, compare, bench and their error messages."""

from __future__ import annotations

import csv
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_bppsa import cli

TINY = [
    "--data.seq_len=20",
    "--data.num_samples=64",
    "--data.val_samples=16",
    "--data.batch_size=8",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_shipped_yaml_is_a_recipe() -> None:
    recipes = cli.available_recipes()
    assert "rnn_bitstream" in recipes
    for name in recipes:
        assert cli.find_recipe(name).name == f"{name}.yaml"


def test_fit_by_recipe_name_logs_timings_to_tensorboard(workdir: Path) -> None:
    cache = f"--data.cache_dir={workdir / 'cache'}"
    cli.main(
        [
            "fit",
            "--config",
            "rnn_bitstream",
            *TINY,
            cache,
            "--trainer.max_steps=4",
            "--trainer.log_every_n_steps=1",
        ]
    )
    run = workdir / "runs" / "rnn_bitstream" / "version_0"
    scalars = cli.read_scalars(str(run))
    assert len(scalars["time/backward"]) == 4
    assert all(value > 0 for _, _, value in scalars["time/step"])
    assert "train/loss" in scalars


def test_compare_writes_both_runs_the_table_and_the_plot(
    workdir: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [*TINY, f"--data.cache_dir={workdir / 'cache'}"]
    autograd, bppsa = cli.compare(
        "rnn_bitstream", max_steps=6, save_dir=str(workdir / "runs"), overrides=overrides
    )
    out = workdir / "runs" / "rnn_bitstream"
    for label in ("autograd", "bppsa"):
        assert list((out / label).glob("events.out.tfevents.*")), label
    assert autograd.seconds["backward"] > 0 and bppsa.seconds["backward"] > 0
    assert [step for step, _, _ in autograd.loss_curve] == [step for step, _, _ in bppsa.loss_curve]
    assert {"val/loss", "val/acc", "train/loss"} <= set(bppsa.final)
    table = (out / "compare.md").read_text()
    for row in ("forward ms/step", "backward ms/step", "total ms/step", "final val/acc"):
        assert row in table
    assert "backward ms/step" in capsys.readouterr().out
    assert (out / "loss_vs_time.png").read_bytes().startswith(b"\x89PNG")


def test_compare_same_seed_same_initial_loss(workdir: Path) -> None:
    overrides = [*TINY, f"--data.cache_dir={workdir / 'cache'}"]
    autograd, bppsa = cli.compare(
        "rnn_bitstream", max_steps=3, save_dir=str(workdir / "runs"), overrides=overrides
    )
    assert autograd.loss_curve[0][2] == pytest.approx(bppsa.loss_curve[0][2], rel=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "--config", "no_such_recipe"], "unknown recipe"),
        (["fit"], "--config is required"),
        (["compare", "--config", "nope.yaml"], "shipped recipes: "),
        (["frobnicate"], "unknown command"),
        (["bench", "rnn", "--benchmarks-dir", "/nonexistent"], "benchmark script not found"),
    ],
)
def test_errors_are_one_clear_line(workdir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert message in str(exit_info.value)


def test_usage_lists_commands_and_recipes(capsys: pytest.CaptureFixture) -> None:
    cli.main([])
    out = capsys.readouterr().out
    assert "compare --config rnn_bitstream" in out and "vgg11_pruned" in out


def test_compare_needs_a_budget(workdir: Path) -> None:
    with pytest.raises(cli.CLIError, match="--max-steps"):
        cli.compare("rnn_bitstream", max_steps=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--config", "rnn_bitstream", "--data.num_samples=4", "--data.batch_size=8"],
            "num_samples >= batch_size",
        ),
        (["--config", "lenet5_convergence", "--data.data_dir=missing"], "data_batch_1 .. "),
    ],
)
def test_bad_recipe_config_is_one_clear_line(workdir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *argv])
    assert message in str(exit_info.value)


def test_bench_follows_the_script_contract(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "rnn.py").write_text(
        textwrap.dedent(
            """
            def bench_rows(*, quick=False, cell="rnn"):
                for T in (10, 100):
                    for B in (2, 16):
                        yield {"method": "autograd", "T": T, "B": B, "backward_s": 1e-3 * T, "cell": cell}
                        yield {"method": "bppsa", "T": T, "B": B, "backward_s": 1e-3 * T / 4, "cell": cell}
            """
        )
    )
    out = cli.bench("gru", benchmarks_dir=str(tmp_path), quick=True, out=str(tmp_path / "results"))
    rows = (out / "bench-gru.csv").read_text().splitlines()
    assert rows[0] == "method,T,B,backward_s,cell" and len(rows) == 9 and rows[1].endswith(",gru")
    assert "| 4.00x |" in (out / "bench-gru.md").read_text()
    for plot in ("bench-gru-vs-T.png", "bench-gru-vs-invB.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    assert "bench_rows" not in sys.modules


def test_bench_rejects_a_script_without_the_contract(tmp_path: Path) -> None:
    (tmp_path / "vgg.py").write_text("x = 1\n")
    with pytest.raises(cli.CLIError, match="defines no bench_rows"):
        cli.bench("vgg", benchmarks_dir=str(tmp_path))


BENCHMARKS_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize(("name", "cell", "points"), [("rnn", "RNN", 4), ("gru", "GRU", 4), ("vgg", None, 2)])
def test_bench_runs_the_real_scripts_quick(
    tmp_path: Path, name: str, cell: str | None, points: int, capsys: pytest.CaptureFixture
) -> None:
    cli.main(["bench", name, "--quick", "--benchmarks-dir", str(BENCHMARKS_DIR), "--out", str(tmp_path)])
    with open(tmp_path / f"bench-{name}.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * points
    grid = {(row["T"], row["B"]) for row in rows}
    assert len(grid) == points
    for point in grid:
        methods = sorted(row["method"] for row in rows if (row["T"], row["B"]) == point)
        assert methods == ["autograd", "bppsa"], point
    for row in rows:
        for key in ("backward_s", "forward_s", "step_s"):
            assert 0 < float(row[key]) < 60, (key, row)
        assert int(row["peak_bytes"]) >= 0 and int(row["T"]) >= 1 and int(row["B"]) >= 1
        if cell is not None:
            assert row["cell"] == cell and row["path"] in ("scan", "autograd")
        else:
            assert row["T"] == "21" and row["weights"] == "pruned 97%"
    table = (tmp_path / f"bench-{name}.md").read_text()
    assert table.count("x |") == points and table in capsys.readouterr().out + "\n"
    assert (tmp_path / f"bench-{name}-vs-invB.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / f"bench-{name}-vs-T.png").exists() == (cell is not None)  # VGG's T is fixed


def test_rnn_bench_rows_forced_scan_takes_the_scan_path() -> None:
    module = cli._load_script(BENCHMARKS_DIR / "rnn.py")
    rows = list(
        module.bench_rows(cell="rnn", lengths=(12,), batches=(3,), algorithm="chunked", min_run_time=0)
    )
    bppsa = next(row for row in rows if row["method"] == "bppsa")
    assert bppsa["path"] == "scan" and bppsa["algorithm"] == "chunked" and bppsa["backward_s"] > 0
