"""Silero VAD's speech probabilities (`cat.audio.vad`) on real speech, fed whole or in blocks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import soundfile

from cat.audio import vad
from cat.audio.vad import FRAME_SAMPLES, FRAME_SECONDS, SileroVad, VadError

REAL = Path(__file__).resolve().parents[1] / "decoding/real_speech"


def test_blocks_of_any_size_give_the_probabilities_of_the_whole():
    samples, rate = soundfile.read(REAL / "BAC009S0724W0121.flac", dtype="float32")
    assert rate == 16000
    samples = np.concatenate([samples, np.zeros(8000, np.float32), samples])
    detector = SileroVad()
    whole = detector.probabilities(samples)
    assert len(whole) == -(-len(samples) // FRAME_SAMPLES)
    rng = np.random.default_rng(0)
    detector.reset()
    pieces, start = [], 0
    while start < len(samples):
        size = int(rng.integers(1, 3 * FRAME_SAMPLES))
        pieces.append(detector.accept(samples[start:start + size]))
        start += size
    pieces.append(detector.finish())
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    # The recording's speech: from about 0.47 s to 3.8 s, twice; silence around it.
    speech = np.flatnonzero(whole[:len(whole) // 2 - 10] >= 0.5) * FRAME_SECONDS
    assert 0.40 <= speech[0] <= 0.55 and 3.7 <= speech[-1] <= 3.9, speech[[0, -1]]
    assert whole[:10].max() < 0.1 and SileroVad().probabilities(
        np.zeros(16000 * 3, np.float32)).max() < 0.1


def test_a_missing_package_is_an_error_naming_it_and_the_way_round(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "silero_vad" else real(name, *args))
    with pytest.raises(VadError, match=r"needs the silero-vad package .* or --vad none"):
        vad.model_path()
