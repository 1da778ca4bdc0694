"""The ``lightning-bppsa`` entry point: usage, and mistakes reported in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_bppsa.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "--config", "no_such_recipe"], "unknown recipe"),
        (["fit"], "--config is required"),
        (["compare", "--config", "nope.yaml"], "shipped recipes: "),
        (["frobnicate"], "unknown command"),
    ],
)
def test_errors_are_one_clear_line(workdir: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert message in str(exit_info.value)


def test_usage_lists_commands_and_recipes(capsys: pytest.CaptureFixture) -> None:
    main([])
    out = capsys.readouterr().out
    assert "compare --config rnn_bitstream" in out and "vgg11_pruned" in out
