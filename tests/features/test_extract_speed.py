"""Stage 1's speed perturbation against the real `sox speed`, on what the model sees.

Stage 1 perturbs the float waveform and computes its fbank without rounding to 16 bits,
so sox writes 32-bit float output here (`-e floating-point -b 32`, and `-D`: no dither):
its 16-bit output would carry rounding noise in the band that a speed change below 1
leaves empty (above 7.2 kHz at 0.9), which the stage-1 waveform does not have. The
tolerances are those of `tests/audio/test_speed.py`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile

from cat.audio.codec import to_int16
from cat.audio.speed import perturbed_num_samples
from cat.data.voices import Speaker, add_noise, synthesize
from cat.features.extract import extract
from cat.features.fbank import compute_fbank, num_frames
from cat.testing.audio import synth_waveform, write_audio, write_kaldi_data_dir

RATE = 16000
FACTORS = (0.9, 1.1)
TOP_BINS = slice(75, 80)
# Per-bin mean log-mel may differ this much from sox's (natural log of energy).
BIN_TOLERANCE = 0.1
# The top bins may exceed sox's by this much at most.
TOP_BIN_MARGIN = 0.05


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory) -> tuple[Path, int, dict[str, np.ndarray]]:
    """About 5 s of espeak-ng Mandarin with silences and a 30 dB noise floor as a 16-bit
    WAV, and its stage-1 features with speed perturbation 0.9 and 1.1."""
    root = tmp_path_factory.mktemp("speech")
    voice = synthesize("今天天气很好我们一起去公园散步然后吃午饭", Speaker("m3", 50, 170, 30.0))
    padded = np.concatenate([np.zeros(3000, np.float32), voice, np.zeros(3000, np.float32)])
    samples = to_int16(add_noise(padded, 30.0, np.random.default_rng(0)))
    path = root / "utt.wav"
    soundfile.write(path, samples, RATE, subtype="PCM_16")
    data_dir = write_kaldi_data_dir(root / "data", {"utt": str(path)})
    extract(data_dir, root / "fbank", speed_factors=FACTORS, progress=False)
    feats = {key: np.asarray(matrix)
             for key, matrix in kaldiio.load_scp(str(root / "fbank" / "feats.scp")).items()}
    return path, samples.size, feats


def sox_speed_float(path: Path, factor: float) -> np.ndarray:
    out = path.with_name(f"sox-{factor}.wav")
    subprocess.run(["sox", "-D", str(path), "-e", "floating-point", "-b", "32", str(out),
                    "speed", str(factor)], check=True, capture_output=True, timeout=60)
    samples, rate = soundfile.read(out, dtype="float32")
    assert rate == RATE
    return samples


@pytest.mark.parametrize("factor", FACTORS)
def test_stage1_perturbation_matches_sox(perturbed, factor):
    path, num_samples, feats = perturbed
    sox = sox_speed_float(path, factor)
    ours = feats[f"sp{factor:g}-utt"]
    reference = compute_fbank(sox, RATE)
    # The whole recording: all of sox's floor(n / factor + 0.5) samples.
    assert sox.size == perturbed_num_samples(num_samples, factor)
    assert len(ours) == len(reference) == num_frames(sox.size)
    bins, sox_bins = ours.mean(axis=0), reference.mean(axis=0)
    difference = np.abs(bins - sox_bins)
    report = (f"bins 75-79 mean {bins[TOP_BINS].mean():.2f} (sox {sox_bins[TOP_BINS].mean():.2f})"
              f", largest per-bin difference {difference.max():.3f} at bin "
              f"{int(difference.argmax())}")
    assert difference.max() <= BIN_TOLERANCE, report
    assert np.all(bins[TOP_BINS] <= sox_bins[TOP_BINS] + TOP_BIN_MARGIN), report
    # The unperturbed copy is untouched.
    original, _ = soundfile.read(path, dtype="float32")
    np.testing.assert_array_equal(feats["utt"], compute_fbank(original, RATE))


def test_whole_recording_keeps_every_perturbed_sample(tmp_path):
    # 16104 / 1.1 = 14639.99...: sox gives 14640 samples, which complete frame 90.
    num_samples, factor = 16104, 1.1
    path = write_audio(tmp_path / "a.wav", synth_waveform(1.1, seed=3)[:num_samples], RATE)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"a": str(path)})
    extract(data_dir, tmp_path / "fbank", speed_factors=(factor,), progress=False)
    matrix = kaldiio.load_scp(str(tmp_path / "fbank" / "feats.scp"))["sp1.1-a"]
    assert perturbed_num_samples(num_samples, factor) == 14640
    assert len(matrix) == num_frames(14640) == 90
