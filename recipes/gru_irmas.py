"""GRU instrument recognition on IRMAS (BPPSA paper, Sec. 4.2, Table 3): the GRU benchmark workload.

Each 3 s stereo clip (44.1 kHz) becomes MFCC features with the paper's three configurations
(:data:`CONFIGS`): the first coefficient is dropped, each coefficient is standardised over time, and
the left and right channels are concatenated, giving ``(T, F)`` = S ``259 x 38``, M ``517 x 24``,
L ``1034 x 12``. A GRU (hidden 20) reads the sequence and a linear layer classifies its last hidden
state into the 11 instruments; Adam, lr 3e-4.

Real data: ``data_dir`` is the IRMAS training folder, one sub-folder of ``.wav`` files per instrument
(``cel/ cla/ flu/ gac/ gel/ org/ pia/ sax/ tru/ vio/ voi/``); features are computed with librosa
(``pip install 'lightning-bppsa[audio]'``) and cached. Without ``data_dir``: a stand-in of synthetic
harmonic tones (one timbre per class), featurised by this module's own small MFCC (no librosa).

    lightning-bppsa fit --config gru_irmas --data.size=M --model.size=M
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from lightning_bppsa.recipes._common import (
    ClassificationTask,
    MissingDataError,
    RecipeConfigError,
    Split,
    TensorDataModule,
    announce_stand_in,
)
from torch import Tensor, nn
from tqdm import tqdm

__all__ = ["CONFIGS", "INSTRUMENTS", "IRMASDataModule", "InstrumentGRU", "mfcc", "standardised_features"]

INSTRUMENTS = ("cel", "cla", "flu", "gac", "gel", "org", "pia", "sax", "tru", "vio", "voi")
SAMPLE_RATE = 44100
CLIP_SAMPLES = 3 * SAMPLE_RATE
CONFIGS: dict[str, tuple[int, int, int]] = {"S": (20, 4096, 512), "M": (13, 2048, 256), "L": (7, 1024, 128)}
"""Size -> ``(n_mfcc, n_fft, hop_length)`` (paper Table 3)."""


def feature_shape(size: str) -> tuple[int, int]:
    """``(T, F)`` of a 3 s clip under ``size``: ``T = 1 + samples // hop``, ``F = 2 (n_mfcc - 1)``."""
    if size not in CONFIGS:
        raise RecipeConfigError(f"gru_irmas: size must be one of {sorted(CONFIGS)}; got {size!r}")
    n_mfcc, _, hop = CONFIGS[size]
    return 1 + CLIP_SAMPLES // hop, 2 * (n_mfcc - 1)


def _mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> Tensor:
    """Triangular filters on the HTK mel scale, ``(n_mels, n_fft // 2 + 1)``, area-normalised (Slaney)."""
    mel = torch.linspace(0, 2595 * math.log10(1 + sample_rate / 2 / 700), n_mels + 2, dtype=torch.float64)
    hz = 700 * (10 ** (mel / 2595) - 1)
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lower, centre, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    rising, falling = (bins - lower) / (centre - lower), (upper - bins) / (upper - centre)
    return (torch.clamp(torch.minimum(rising, falling), min=0) * 2 / (upper - lower)).float()


def mfcc(
    audio: Tensor, sample_rate: int, n_mfcc: int, n_fft: int, hop_length: int, n_mels: int = 128
) -> Tensor:
    """MFCCs of ``audio (C, N)`` -> ``(C, n_mfcc, 1 + N // hop_length)``: power STFT (Hann, centred),
    mel filterbank, dB, orthonormal DCT-II. The same steps as ``librosa.feature.mfcc`` (small numeric
    differences aside), in torch, for the stand-in data."""
    spec = torch.stft(
        audio, n_fft, hop_length, window=torch.hann_window(n_fft), center=True, return_complex=True
    )
    mels = _mel_filterbank(sample_rate, n_fft, n_mels) @ spec.abs().square()
    db = 10 * torch.log10(mels.clamp(min=1e-10))
    db = torch.maximum(db, db.amax(dim=(-2, -1), keepdim=True) - 80)
    k, n = torch.arange(n_mfcc)[:, None], torch.arange(n_mels)[None]
    dct = torch.cos(math.pi / n_mels * (n + 0.5) * k) * math.sqrt(2 / n_mels)
    dct[0] /= math.sqrt(2)
    return dct @ db


def standardised_features(coefficients: Tensor) -> Tensor:
    """``(2, n_mfcc, T)`` stereo MFCCs -> ``(T, 2 (n_mfcc - 1))``: drop coefficient 0, standardise every
    coefficient over time, concatenate left and right."""
    kept = coefficients[:, 1:]
    kept = (kept - kept.mean(-1, keepdim=True)) / kept.std(-1, keepdim=True).clamp(min=1e-5)
    return torch.cat(list(kept), dim=0).T.contiguous()


def _synthetic_tone(label: int, generator: torch.Generator, timbres: Tensor) -> Tensor:
    """A 3 s stereo tone ``(2, CLIP_SAMPLES)``: the class timbre with random pitch, pan and noise."""
    pitch = 110 * 2 ** (torch.randint(0, 24, (1,), generator=generator).item() / 12)
    t = torch.arange(CLIP_SAMPLES) / SAMPLE_RATE
    harmonics = torch.arange(1, timbres.shape[1] + 1)[:, None]
    tone = (timbres[label, :, None] * torch.sin(2 * math.pi * pitch * harmonics * t)).sum(0)
    envelope = torch.exp(-t * (0.2 + 2 * timbres[label, 0]))
    pan = 0.3 + 0.4 * torch.rand(1, generator=generator)
    stereo = torch.stack([pan * tone, (1 - pan) * tone]) * envelope
    return stereo + 0.05 * torch.randn(2, CLIP_SAMPLES, generator=generator)


def generate_irmas_stand_in(num_clips: int, size: str, seed: int) -> tuple[Tensor, Tensor]:
    """Synthetic tones featurised by :func:`mfcc`: ``(num_clips, T, F)`` float32, labels ``(num_clips,)``."""
    n_mfcc, n_fft, hop = CONFIGS[size]
    generator = torch.Generator().manual_seed(seed)
    timbres = torch.rand(len(INSTRUMENTS), 8, generator=torch.Generator().manual_seed(1234))
    labels = torch.randint(len(INSTRUMENTS), (num_clips,), generator=generator)
    features = [
        standardised_features(
            mfcc(_synthetic_tone(int(c), generator, timbres), SAMPLE_RATE, n_mfcc, n_fft, hop)
        )
        for c in tqdm(labels, desc=f"IRMAS stand-in ({size})", unit="clip", leave=False)
    ]
    return torch.stack(features), labels


def load_irmas(root: Path, size: str) -> tuple[Tensor, Tensor]:
    """Featurise the IRMAS training folder ``root`` with librosa: ``(N, T, F)`` float32, labels ``(N,)``."""
    files = [
        (path, label)
        for label, name in enumerate(INSTRUMENTS)
        for path in sorted((root / name).glob("*.wav"))
    ]
    if not files:
        layout = "\n".join(f"  {root}/{name}/*.wav" for name in INSTRUMENTS)
        raise MissingDataError(
            f"IRMAS: no .wav file under {root}; expected the IRMAS training folder:\n{layout}"
        )
    try:
        import librosa
    except ImportError as error:
        raise RecipeConfigError(
            "gru_irmas: featurising the real IRMAS data needs librosa: pip install 'lightning-bppsa[audio]'"
        ) from error
    n_mfcc, n_fft, hop = CONFIGS[size]
    length = feature_shape(size)[0]
    features = []
    for path, _ in tqdm(files, desc=f"IRMAS MFCC ({size})", unit="clip"):
        try:  # soundfile / audioread / librosa raise their own error types on unreadable or empty files
            audio, rate = librosa.load(path, sr=SAMPLE_RATE, mono=False)
            audio = torch.as_tensor(audio).reshape(-1, audio.shape[-1]).expand(2, -1)  # mono: duplicate
            coefficients = librosa.feature.mfcc(
                y=audio.numpy(), sr=rate, n_mfcc=n_mfcc, n_fft=n_fft, hop_length=hop
            )
        except Exception as error:
            raise RecipeConfigError(
                f"IRMAS: cannot read {path} as audio ({type(error).__name__}: {error}); expected "
                "a .wav clip of the IRMAS training set (3 s, 44.1 kHz, stereo)"
            ) from error
        feats = standardised_features(torch.as_tensor(coefficients))
        features.append(torch.nn.functional.pad(feats[:length], (0, 0, 0, max(0, length - feats.shape[0]))))
    return torch.stack(features).float(), torch.tensor([label for _, label in files])


class IRMASDataModule(TensorDataModule):
    """IRMAS MFCC sequences ``x (B, T, F)`` float32 and instrument labels ``y (B,)`` (11 classes).

    Args:
        size: MFCC configuration ``"S"``, ``"M"`` or ``"L"`` (:data:`CONFIGS`).
        data_dir: the IRMAS training folder; ``None`` trains on the generated stand-in.
        val_fraction: share of the clips held out for validation (a seeded random split).
        stand_in_clips: number of stand-in clips.
        **common: ``batch_size`` (default 16), ``seed`` (of the split and of the stand-in), ``cache_dir``
            (of the features), ``num_workers`` (see :class:`~lightning_bppsa.recipes._common.TensorDataModule`).
    """

    def __init__(
        self,
        size: str = "S",
        data_dir: str | None = None,
        val_fraction: float = 0.1,
        stand_in_clips: int = 550,
        **common: Any,
    ) -> None:
        super().__init__(**common)
        self.size = size
        self.data_dir = None if data_dir is None else Path(data_dir).expanduser().resolve()
        self.val_fraction, self.stand_in_clips = val_fraction, stand_in_clips

    def check(self) -> None:
        super().check()
        feature_shape(self.size)
        if not 0 < self.val_fraction < 1:
            raise RecipeConfigError(f"gru_irmas: val_fraction must be in (0, 1); got {self.val_fraction}")
        if self.data_dir is not None and not self.data_dir.is_dir():
            raise MissingDataError(f"IRMAS: data_dir {self.data_dir} does not exist")
        if self.data_dir is None and self.stand_in_clips * (1 - self.val_fraction) < self.batch_size:
            raise RecipeConfigError(
                f"gru_irmas: {self.stand_in_clips} stand-in clips leave fewer training clips than one batch "
                f"of {self.batch_size}"
            )

    def cache_name(self) -> str:
        if self.data_dir is not None:
            return f"irmas-{self.size}-{hashlib.sha1(str(self.data_dir).encode()).hexdigest()[:10]}.pt"
        return f"irmas-stand-in-{self.size}-{self.stand_in_clips}-seed{self.seed}.pt"

    def build(self) -> Split:
        if self.data_dir is None:
            x, y = generate_irmas_stand_in(self.stand_in_clips, self.size, self.seed)
        else:
            x, y = load_irmas(self.data_dir, self.size)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.seed))
        n_val = max(1, round(self.val_fraction * len(y)))
        val, train = order[:n_val], order[n_val:]
        return {"train_x": x[train], "train_y": y[train], "val_x": x[val], "val_y": y[val]}

    def setup(self, stage: str) -> None:
        if self.data_dir is None:
            announce_stand_in("IRMAS", f"{self.stand_in_clips} synthetic stereo tones, MFCC size {self.size}")
        super().setup(stage)


class InstrumentGRU(ClassificationTask):
    """GRU (hidden 20) over the MFCC sequence, linear classifier on the last hidden state (11 classes).

    Args:
        size: MFCC configuration; must match the DataModule's (it sets the input width F).
        hidden_size: GRU hidden size (the paper: 20).
        lr: Adam learning rate (the paper: 3e-4).
    """

    def __init__(self, size: str = "S", hidden_size: int = 20, lr: float = 3e-4) -> None:
        super().__init__(num_classes=len(INSTRUMENTS))
        self.save_hyperparameters()
        self.gru = nn.GRU(feature_shape(size)[1], hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, len(INSTRUMENTS))

    def setup(self, stage: str) -> None:
        data = getattr(self.trainer, "datamodule", None)
        if isinstance(data, IRMASDataModule) and data.size != self.hparams.size:
            raise RecipeConfigError(
                f"gru_irmas: model size {self.hparams.size!r} but data size {data.size!r}; set both, e.g. "
                f"--model.size={data.size} --data.size={data.size}"
            )

    def forward(self, features: Tensor) -> Tensor:
        """``features``: ``(B, T, F)`` -> logits ``(B, 11)``."""
        _, h_n = self.gru(features)
        return self.head(h_n[-1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
