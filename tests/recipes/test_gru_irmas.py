"""IRMAS features: the paper's shapes, the torch MFCC, the real-folder loader's errors, size checks."""

from __future__ import annotations

import sys
import types
import wave
from pathlib import Path

import pytest
import torch
from lightning_bppsa.recipes._common import MissingDataError, RecipeConfigError
from lightning_bppsa.recipes.gru_irmas import (
    IRMASDataModule,
    feature_shape,
    generate_irmas_stand_in,
    load_irmas,
    mfcc,
    standardised_features,
)


@pytest.mark.parametrize(("size", "shape"), [("S", (259, 38)), ("M", (517, 24)), ("L", (1034, 12))])
def test_stand_in_has_the_papers_feature_shapes(size: str, shape: tuple[int, int]) -> None:
    assert feature_shape(size) == shape
    x, y = generate_irmas_stand_in(3, size, seed=0)
    assert x.shape == (3, *shape) and x.dtype == torch.float32 and y.shape == (3,)
    torch.testing.assert_close(
        x.mean(1), torch.zeros(3, shape[1]), atol=1e-4, rtol=0
    )  # standardised over time


def test_standardised_features_drop_c0_and_concatenate_channels() -> None:
    coefficients = torch.randn(2, 5, 40) * 3 + 7
    features = standardised_features(coefficients)
    assert features.shape == (40, 8)
    left = coefficients[0, 1:]
    torch.testing.assert_close(
        features[:, :4].T, (left - left.mean(-1, keepdim=True)) / left.std(-1, keepdim=True)
    )


def test_mfcc_of_a_tone_has_frames_and_energy_where_expected() -> None:
    t = torch.arange(22050) / 22050
    low, high = torch.sin(2 * torch.pi * 200 * t), torch.sin(2 * torch.pi * 5000 * t)
    coefficients = mfcc(torch.stack([low, high]), 22050, n_mfcc=13, n_fft=1024, hop_length=256)
    assert coefficients.shape == (2, 13, 1 + 22050 // 256)
    assert not torch.allclose(
        coefficients[0], coefficients[1], atol=1.0
    )  # different timbres, different MFCCs


def _write_wav(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(2)
        handle.setsampwidth(2)
        handle.setframerate(44100)
        handle.writeframes(bytes(4 * 44100))


def test_real_loader_prints_the_folder_layout_when_empty(tmp_path: Path) -> None:
    with pytest.raises(MissingDataError, match="pia/\\*.wav"):
        load_irmas(tmp_path, "S")


def test_real_loader_needs_the_audio_extra_or_reads_with_librosa(tmp_path: Path) -> None:
    _write_wav(tmp_path / "cel" / "a.wav")
    _write_wav(tmp_path / "voi" / "b.wav")
    try:
        import librosa  # noqa: F401
    except ImportError:
        with pytest.raises(RecipeConfigError, match=r"lightning-bppsa\[audio\]"):
            load_irmas(tmp_path, "L")
    else:
        x, y = load_irmas(tmp_path, "L")
        assert x.shape == (2, 1034, 12) and y.tolist() == [0, 10]


def test_an_unreadable_clip_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """librosa itself is an optional extra: a stand-in raises what soundfile raises on a non-audio file."""
    (tmp_path / "cel").mkdir()
    (tmp_path / "cel" / "broken.wav").write_bytes(b"definitely not RIFF audio")

    def load(path, **kwargs):
        raise RuntimeError(f"Error opening {str(path)!r}: Format not recognised.")

    monkeypatch.setitem(sys.modules, "librosa", types.SimpleNamespace(load=load))
    with pytest.raises(RecipeConfigError, match=r"IRMAS: cannot read .*cel/broken.wav as audio") as error:
        load_irmas(tmp_path, "L")
    assert "Format not recognised" in str(error.value) and "44.1 kHz" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": "XL"}, "size must be one of"),
        ({"val_fraction": 1.5}, "val_fraction"),
        ({"stand_in_clips": 3}, "batch"),
    ],
)
def test_bad_data_config_is_rejected(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(RecipeConfigError, match=message):
        IRMASDataModule(cache_dir=str(tmp_path), **kwargs).prepare_data()
