"""Online speed perturbation, the same signal as `sox <in> <out> speed <factor>`.

sox's `speed` changes tempo and pitch together: the samples are taken to be at
`rate * factor` and its `rate` effect resamples them back to `rate`, so an utterance of
`n` samples becomes `floor(n / factor + 0.5)` samples long. `speed_perturb` does exactly
that with libsoxr "HQ" (the library sox's rate effect comes from), whose low-pass keeps
nothing above the output's Nyquist frequency from folding back (factor > 1) and adds no
images above the new band edge (factor < 1). On 16-bit 16 kHz speech, the 80-dim
log-mel features of the result agree with those of sox's output within 0.02 in every bin,
with the same number of frames (`tests/audio/test_speed.py`).

Stage 1's offline copies (`cat.features.extract --speed-perturb`) use it too. Its former
method, `torchaudio.functional.resample` with its defaults (6 zero crossings, rolloff
0.99), lets energy through in the top mel bins: images of the band edge at factor 0.9
(bins 75-79 of 80: mean log-mel 16.9 where sox gives 11.1) and aliasing at 1.1; see the
test's comparison.

`choose_factor` picks an utterance's factor from a set, as a pure function of the seed,
the epoch and the utterance key, so an exact resume perturbs every utterance the same way
without saving any generator state.

Usage:
    factor = choose_factor((0.9, 1.0, 1.1), seed=0, epoch=3, key="BAC009S0002W0122")
    perturbed = speed_perturb(waveform, 16000, factor)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from cat.audio.codec import resample, to_float32


def perturbed_num_samples(num_samples: int, factor: float) -> int:
    """Length of `speed_perturb`'s output for `num_samples` input samples."""
    _check_factor(factor)
    return math.floor(num_samples / factor + 0.5) if factor != 1.0 else num_samples


def speed_perturb(waveform: np.ndarray, sample_rate: int, factor: float) -> np.ndarray:
    """Change the speed of a mono waveform (int16 or float) by `factor` -> float32.

    Tempo and pitch change together (`factor` 1.1 is 10 % faster and higher); the rate
    stays `sample_rate`. Factor 1 returns the samples unchanged (as float32).
    """
    _check_factor(factor)
    waveform = to_float32(waveform)
    if factor == 1.0:
        return waveform
    # The rate as a float, as sox has it: 16000 * 0.9 is not rounded to whole Hz.
    return resample(waveform, sample_rate * factor, sample_rate)


def choose_factor(factors: Sequence[float], seed: int, epoch: int, key: str) -> float:
    """The speed factor of utterance `key` in `epoch`: uniform over `factors`, reproducible.

    A hash of (seed, epoch, key) picks it, so it does not depend on the order in which
    utterances are read, on the worker or on the rank.
    """
    if not factors:
        raise ValueError("no speed factors to choose from")
    for factor in factors:
        _check_factor(factor)
    digest = hashlib.blake2b(f"{seed}\0{epoch}\0{key}".encode(), digest_size=8).digest()
    return factors[int.from_bytes(digest, "little") % len(factors)]


def _check_factor(factor: float) -> None:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"speed factor must be a positive number, got {factor}")
