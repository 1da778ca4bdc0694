"""Every shipped recipe trains end to end on its generated stand-in, under both strategies, in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_bppsa import cli
from lightning_bppsa.cli.fit import BPPSACLI
from lightning_bppsa.cli.report import read_scalars

BITSTREAM = ["--data.seq_len=30", "--data.num_samples=32", "--data.val_samples=8", "--data.batch_size=8"]
# Tiny sizes per recipe: a recipe shipped without an entry here fails test_every_recipe_has_a_smoke_config.
SMOKE = {
    "rnn_bitstream": BITSTREAM,
    "rnn_bitstream_paper": BITSTREAM,  # the same recipe module with the paper's lr
    "gru_irmas": ["--model.size=L", "--data.size=L", "--data.stand_in_clips=40", "--data.batch_size=8"],
    "vgg11_pruned": [
        "--model.width=0.0625",
        "--model.dense_epochs=0",
        "--data.stand_in_train=32",
        "--data.stand_in_val=8",
        "--data.batch_size=8",
    ],
    "ligru_bitstream": ["--data.seq_len=30", "--data.num_samples=32", "--data.val_samples=8", "--data.batch_size=8"],
    "lenet5_convergence": ["--data.stand_in_train=64", "--data.stand_in_val=16", "--data.batch_size=16"],
}
COMMON = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
]


def test_every_recipe_has_a_smoke_config() -> None:
    assert sorted(SMOKE) == cli.available_recipes()


@pytest.mark.slow
def test_gru_irmas_rejects_model_and_data_of_different_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--config", "gru_irmas", "--model.size=S", "--data.size=L", *SMOKE["gru_irmas"][2:], *COMMON]
    with pytest.raises(SystemExit, match="--model.size=L --data.size=L"):
        cli.main(["fit", *args, f"--data.cache_dir={tmp_path}"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["bppsa", "auto"])
@pytest.mark.parametrize("recipe", sorted(SMOKE))
def test_recipe_fits_on_generated_data(
    recipe: str,
    strategy: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", recipe, *SMOKE[recipe], *COMMON, f"--data.cache_dir={tmp_path / 'cache'}"]
    cli.main([*args, f"--trainer.strategy={strategy}"])
    scalars = read_scalars(str(tmp_path / "runs" / recipe / "version_0"))
    assert len(scalars["train/loss"]) == 3
    assert "val/acc" in scalars
    assert list((tmp_path / "cache").iterdir()), "the built tensors are cached"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")  # args given on purpose, as cli.main does
@pytest.mark.parametrize("recipe", ["rnn_bitstream", "gru_irmas", "vgg11_pruned"])
def test_shared_datamodule_arguments_reach_every_recipe_through_the_cli(
    recipe: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_size`` / ``seed`` / ``cache_dir`` live in TensorDataModule; the recipes forward ``**common``."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(cli.find_recipe(recipe)), "--data.seed=7", "--data.batch_size=3"]
    data = BPPSACLI(args=[*args, f"--data.cache_dir={tmp_path}"], run=False).datamodule
    assert (data.seed, data.batch_size, data.cache_dir) == (7, 3, tmp_path)
    assert "seed7" in data.cache_name()


def test_datamodule_defaults_are_kept() -> None:
    from lightning_bppsa.recipes.cifar10 import CIFAR10DataModule
    from lightning_bppsa.recipes.gru_irmas import IRMASDataModule
    from lightning_bppsa.recipes.rnn_bitstream import BitstreamDataModule

    assert [m().batch_size for m in (BitstreamDataModule, IRMASDataModule, CIFAR10DataModule)] == [
        16,
        16,
        256,
    ]
    assert BitstreamDataModule().seed == 0 and CIFAR10DataModule(seed=5).seed == 5
