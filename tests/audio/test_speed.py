"""Online speed perturbation against the real `sox speed` on synthetic Mandarin speech.

The comparison is on what the model sees: 80-dim Kaldi log-mel features (the project's
stage-1 fbank). sox runs with `-D` (no dither) and our output is rounded to 16 bits, so
both carry the same rounding noise where the band is empty: with sox's default dither
its empty bands would sit on a dither floor that a float waveform does not have.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import torchaudio.functional

from cat.audio.codec import to_int16
from cat.audio.speed import choose_factor, perturbed_num_samples, speed_perturb
from cat.data.voices import Speaker, add_noise, synthesize
from cat.features.fbank import compute_fbank

RATE = 16000
TOP_BINS = slice(75, 80)
# Per-bin mean log-mel may differ this much from sox's (natural log of energy).
BIN_TOLERANCE = 0.1
# The top bins may exceed sox's by this much at most.
TOP_BIN_MARGIN = 0.05


@dataclasses.dataclass
class Comparison:
    """Mean log-mel per bin of a perturbation and of sox's output on the same input."""

    frames: int
    sox_frames: int
    bins: np.ndarray
    sox_bins: np.ndarray

    @property
    def max_bin_difference(self) -> float:
        return float(np.abs(self.bins - self.sox_bins).max())

    @property
    def top(self) -> float:
        return float(self.bins[TOP_BINS].mean())

    @property
    def sox_top(self) -> float:
        return float(self.sox_bins[TOP_BINS].mean())

    def matches_sox(self) -> bool:
        return (self.frames == self.sox_frames
                and self.max_bin_difference <= BIN_TOLERANCE
                and bool(np.all(self.bins[TOP_BINS] <= self.sox_bins[TOP_BINS] + TOP_BIN_MARGIN)))

    def __str__(self) -> str:
        return (f"frames {self.frames} (sox {self.sox_frames}), bins 75-79 mean "
                f"{self.top:.2f} (sox {self.sox_top:.2f}), largest per-bin difference "
                f"{self.max_bin_difference:.3f} at bin "
                f"{int(np.abs(self.bins - self.sox_bins).argmax())}")


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> tuple[np.ndarray, Path]:
    """About 5 s of espeak-ng Mandarin with silences and a 30 dB noise floor, as int16."""
    voice = synthesize("今天天气很好我们一起去公园散步然后吃午饭", Speaker("m3", 50, 170, 30.0))
    padded = np.concatenate([np.zeros(3000, np.float32), voice, np.zeros(3000, np.float32)])
    samples = to_int16(add_noise(padded, 30.0, np.random.default_rng(0)))
    path = tmp_path_factory.mktemp("speech") / "utt.wav"
    soundfile.write(path, samples, RATE, subtype="PCM_16")
    return samples, path


def _sox_speed(path: Path, factor: float) -> np.ndarray:
    out = path.with_name(f"sox-{factor}.wav")
    subprocess.run(["sox", "-D", str(path), str(out), "speed", str(factor)], check=True,
                   capture_output=True, timeout=60)
    samples, rate = soundfile.read(out, dtype="int16")
    assert rate == RATE
    return samples


def _compare(perturbed: np.ndarray, sox: np.ndarray) -> Comparison:
    ours = compute_fbank(to_int16(perturbed).astype(np.float32) / 32768, RATE)
    theirs = compute_fbank(sox.astype(np.float32) / 32768, RATE)
    return Comparison(len(ours), len(theirs), ours.mean(axis=0), theirs.mean(axis=0))


@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_online_perturbation_matches_sox(speech, factor):
    samples, path = speech
    sox = _sox_speed(path, factor)
    perturbed = speed_perturb(samples, RATE, factor)
    assert perturbed.size == sox.size == perturbed_num_samples(samples.size, factor)
    comparison = _compare(perturbed, sox)
    assert comparison.matches_sox(), str(comparison)


def _torchaudio_speed(waveform: np.ndarray, factor: float) -> np.ndarray:
    """Speed perturbation with torchaudio's default resampling (stage 1's before
    `cat.audio.speed`)."""
    return torchaudio.functional.resample(torch.from_numpy(waveform), round(RATE * factor),
                                          RATE).numpy()


@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_torchaudio_resampling_fails_the_sox_comparison(speech, factor):
    """torchaudio's default sinc leaks energy into the top mel bins: the comparison sees it."""
    samples, path = speech
    comparison = _compare(_torchaudio_speed(samples.astype(np.float32) / 32768, factor),
                          _sox_speed(path, factor))
    assert not comparison.matches_sox(), str(comparison)
    if factor < 1:  # images above the new band edge (7.2 kHz) fill the top bins
        assert comparison.top > comparison.sox_top + 3.0, str(comparison)


def test_speed_changes_pitch_and_tempo():
    time = np.arange(RATE) / RATE
    tone = (0.5 * np.sin(2 * np.pi * 1000 * time)).astype(np.float32)
    faster = speed_perturb(tone, RATE, 1.25)
    assert faster.size == 12800
    spectrum = np.abs(np.fft.rfft(faster[2000:-2000] * np.hanning(faster.size - 4000)))
    peak_hz = spectrum.argmax() * RATE / (faster.size - 4000)
    assert abs(peak_hz - 1250) < 5


def test_factor_one_returns_the_samples():
    samples = np.array([0, 16384, -32768, 5], np.int16)
    np.testing.assert_array_equal(speed_perturb(samples, RATE, 1.0), samples / 32768)


def test_perturbed_length_is_predicted_exactly():
    rng = np.random.default_rng(0)
    for _ in range(50):
        size = int(rng.integers(1, 40000))
        factor = float(rng.choice([0.8, 0.9, 0.95, 1.05, 1.1, 1.2, 0.57]))
        waveform = rng.standard_normal(size).astype(np.float32) * 0.1
        assert speed_perturb(waveform, RATE, factor).size == perturbed_num_samples(size, factor)


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_factors_are_refused(factor):
    with pytest.raises(ValueError, match="speed factor"):
        speed_perturb(np.zeros(100, np.float32), RATE, factor)


def test_choose_factor_is_reproducible_and_uniform():
    factors = (0.9, 1.0, 1.1)
    keys = [f"BAC009S0002W{i:04d}" for i in range(3000)]
    first = [choose_factor(factors, 7, 2, key) for key in keys]
    assert first == [choose_factor(factors, 7, 2, key) for key in reversed(keys)][::-1]
    counts = [first.count(factor) for factor in factors]
    assert min(counts) > 900, counts
    other_epoch = [choose_factor(factors, 7, 3, key) for key in keys]
    assert sum(a != b for a, b in zip(first, other_epoch, strict=True)) > 1500
    with pytest.raises(ValueError, match="no speed factors"):
        choose_factor((), 0, 0, "utt")
