"""LightningCLI's parse errors in one line: what was wrong, where (file and line, or command line), the closest name."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_bppsa.cli import main
from lightning_bppsa.cli.config import find_recipe
from lightning_bppsa.cli.errors import class_parameters, closest, explain_parse_error, where


class FakeParser:
    """What :func:`option_names` reads of a jsonargparse parser."""

    class Action:
        def __init__(self, *option_strings: str) -> None:
            self.option_strings = list(option_strings)

    _actions = [Action("-h", "--help"), Action("--config"), Action("--trainer.max_steps"), Action("--model")]


def test_closest_names_a_near_match_only() -> None:
    assert closest("max_stepz", ["max_steps", "max_epochs"]) == "; did you mean 'max_steps'?"
    assert closest("frobnicate", ["max_steps"]) == ""


def test_class_parameters_follow_kwargs_up_the_mro() -> None:
    params = class_parameters("lightning_bppsa.recipes.rnn_bitstream.BitstreamDataModule")
    assert params[:3] == ["seq_len", "num_samples", "val_samples"] and "batch_size" in params
    assert class_parameters("no.such.Class") == []


def test_where_names_the_file_and_line_or_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  max_stepz: 3\n")
    assert where("trainer.max_stepz", [], config) == f"in {config}, line 2"
    assert where("trainer.max_stepz", ["--trainer.max_stepz=4"], config) == "on the command line"


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "Subcommand 'fit' does not accept option 'trainer.max_step'",
            "unknown option 'trainer.max_step' on the command line; did you mean 'trainer.max_steps'?",
        ),
        (
            "unrecognized arguments: --trainer.max_stepz=3",
            "unknown option 'trainer.max_stepz' on the command line",
        ),
        (
            'Parser key "data":\n  Does not validate\n  Errors:\n    - Problem with given class_path '
            "'lightning_bppsa.recipes.rnn_bitstream.BitstreamDataModule':\n        Option 'seq_lem' is not accepted\n",
            "unknown option 'data.seq_lem' on the command line; did you mean 'data.seq_len'?",
        ),
        (
            "Parser key \"data\":\n  Errors:\n    - Problem with given class_path 'x.Y':\n        Parser key "
            "\"seq_len\":\n          Expected a <class 'int'>. Got value: abc\n    - Expected a <class 'NoneType'>",
            "bad value for 'data.seq_len' on the command line: Expected a <class 'int'>. Got value: abc",
        ),
        ("Something else\n  went wrong", "Something else went wrong"),
    ],
)
def test_parse_errors_become_one_line(message: str, expected: str) -> None:
    assert explain_parse_error(message, FakeParser(), [], None).startswith(expected)


@pytest.mark.parametrize(
    ("typo", "line", "suggestion"),
    [
        (("    lr: ", "    lrr: "), 15, "'model.lr'"),
        (("  max_epochs:", "  max_epoch:"), 8, "'trainer.max_epochs'"),
        (("seed_everything:", "seed_everythin:"), 6, "'seed_everything'"),
    ],
)
def test_a_yaml_typo_is_named_with_its_file_line_and_closest_key(
    workdir: Path, typo: tuple[str, str], line: int, suggestion: str, capsys: pytest.CaptureFixture
) -> None:
    config = workdir / "typo.yaml"
    config.write_text(find_recipe("rnn_bitstream").read_text().replace(*typo))
    assert config.read_text().splitlines()[line - 1].startswith(typo[1])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    message = str(exit_info.value)
    assert f"in {config}, line {line}; did you mean {suggestion}?" in message and "\n" not in message
    assert "usage:" not in capsys.readouterr().err
