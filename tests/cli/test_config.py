"""Recipe configs: found by name or path, checked before LightningCLI sees them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_bppsa.cli import main
from lightning_bppsa.cli.config import CLIError, available_recipes, find_recipe, split_config


def test_every_shipped_yaml_is_a_recipe() -> None:
    recipes = available_recipes()
    assert "rnn_bitstream" in recipes
    for name in recipes:
        assert find_recipe(name).name == f"{name}.yaml"


def test_a_yaml_path_is_taken_as_it_is(tmp_path: Path) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text(find_recipe("rnn_bitstream").read_text())
    assert split_config(["--trainer.max_steps=1", f"--config={config}"]) == (
        config,
        ["--trainer.max_steps=1"],
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty; expected a mapping with trainer / model / data"),
        (b"# only a comment\n", "is empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is not a text (UTF-8) YAML file: byte 0x89 at offset 0"),
        (b"trainer: [unclosed\n", "is not valid YAML"),
        (b"- a\n- b\n", "holds a YAML list; expected a mapping"),
    ],
)
def test_an_unusable_config_file_is_named(tmp_path: Path, content: bytes, message: str) -> None:
    config = tmp_path / "broken.yaml"
    config.write_bytes(content)
    with pytest.raises(CLIError, match="config file .*broken.yaml") as error:
        find_recipe(str(config))
    assert message in str(error.value)
    with pytest.raises(SystemExit, match="broken.yaml"):  # one line from the console script, no traceback
        main(["fit", "--config", str(config)])
