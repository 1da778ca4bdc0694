"""Fixtures of the CLI tests: a scratch working folder and tiny recipe sizes."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path``, made the working folder (the CLI writes ``runs/`` there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tiny(workdir: Path) -> list[str]:
    """Overrides that make ``rnn_bitstream`` train in a second, its data cached under ``workdir``."""
    return [
        "--data.seq_len=20",
        "--data.num_samples=64",
        "--data.val_samples=16",
        "--data.batch_size=8",
        "--trainer.limit_val_batches=2",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        f"--data.cache_dir={workdir / 'cache'}",
    ]
