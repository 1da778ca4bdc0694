"""The ``lightning-bppsa`` entry point: usage, and mistakes reported in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_bppsa
from lightning_bppsa.cli import main
from lightning_bppsa.cli.config import available_recipes, find_recipe
from lightning_bppsa.cli.recipes import describe


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "--config", "no_such_recipe"], "unknown recipe"),
        (["fit"], "--config is required"),
        (["compare", "--config", "nope.yaml"], "shipped recipes: "),
        (["frobnicate"], "unknown command 'frobnicate' (commands: fit, validate"),
        (
            ["fitt"],
            "unknown command 'fitt' (commands: fit, validate, test, predict, compare, bench, recipes); did you mean 'fit'?",
        ),
        (["recipes", "cp", "rnn_bitsream"], "unknown recipe 'rnn_bitsream'; did you mean 'rnn_bitstream'?"),
        (
            ["compare", "--config", "rnn_bitstream", "--check-evry", "3"],
            "compare: unknown option --check-evry; did you mean '--check-every'?",
        ),
        (["compare", "--config", "rnn_bitstream", "--frobnicate"], "compare: unknown option --frobnicate"),
        (
            ["compare", "--config", "rnn_bitstream", "--trainer.max_stepz=3"],
            "unknown option 'trainer.max_stepz' on the command line; did you mean 'trainer.max_steps'?",
        ),
    ],
)
def test_errors_are_one_clear_line(workdir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert message in str(exit_info.value)


def test_usage_lists_commands_and_recipes(capsys: pytest.CaptureFixture) -> None:
    main([])
    out = capsys.readouterr().out
    assert "compare --config rnn_bitstream" in out and "vgg11_pruned" in out and "--threads N" in out


def test_version(capsys: pytest.CaptureFixture) -> None:
    main(["--version"])
    assert capsys.readouterr().out == f"lightning-bppsa {lightning_bppsa.__version__}\n"


def test_recipes_are_listed_with_their_description(capsys: pytest.CaptureFixture) -> None:
    main(["recipes"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == available_recipes()
    paper = next(line for line in lines if line.startswith("rnn_bitstream_paper "))
    assert "Adam lr 1e-5" in paper
    assert describe(find_recipe("rnn_bitstream")) in next(
        line for line in lines if line.startswith("rnn_bitstream ")
    )


def test_a_recipe_is_copied_out_for_editing_and_never_over_a_file(
    workdir: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["recipes", "cp", "rnn_bitstream"])
    copy = workdir / "rnn_bitstream.yaml"
    assert copy.read_text() == find_recipe("rnn_bitstream").read_text()
    assert f"--config {Path('rnn_bitstream.yaml')}" in capsys.readouterr().out
    (workdir / "mine").mkdir()
    main(["recipes", "cp", "gru_irmas", "mine"])
    assert (workdir / "mine" / "gru_irmas.yaml").is_file()
    with pytest.raises(SystemExit, match="rnn_bitstream.yaml exists"):
        main(["recipes", "cp", "rnn_bitstream"])
