"""``lightning-bppsa fit``: LightningCLI on a recipe, with TensorBoard timings and up-front checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

from lightning_bppsa.cli import main
from lightning_bppsa.cli.report import read_scalars


@pytest.mark.slow
def test_fit_by_recipe_name_logs_timings_to_tensorboard(workdir: Path, tiny: list[str]) -> None:
    main(
        ["fit", "--config", "rnn_bitstream", *tiny, "--trainer.max_steps=4", "--trainer.log_every_n_steps=1"]
    )
    scalars = read_scalars(str(workdir / "runs" / "rnn_bitstream" / "version_0"))
    assert len(scalars["time/backward"]) == 4
    assert all(value > 0 for _, _, value in scalars["time/step"])
    assert "train/loss" in scalars


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
        main(["fit", *argv])
    assert message in str(exit_info.value)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_accelerator_without_a_gpu_is_refused_before_any_work(
    workdir: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch, accelerator: str
) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "rnn_bitstream", *tiny, f"--trainer.accelerator={accelerator}"])
    message = str(exit_info.value)
    assert f"--trainer.accelerator={accelerator}: no GPU is visible to torch" in message
    assert "--trainer.accelerator=cpu" in message and "auto" in message
    assert not (workdir / "cache").exists(), "refused before the data was built"
