"""Speakers of the synthetic corpora: espeak-ng voices that vary per speaker, and rendering.

A `Speaker` is a voice variant, pitch, speaking rate and noise level (`make_speakers`
draws them per set with a seed); `synthesize` speaks a sentence with espeak-ng (16 kHz
mono), `render_utterance` adds the speaker's noise and converts to int16.

Usage:
    speakers = make_speakers(10, seed=0)
    samples = render_utterance("今天 天气", speakers[0], seed=(0, 1), voice=DEFAULT_VOICE)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import subprocess
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

SAMPLE_RATE = 16000
# espeak-ng's plain `cmn` voice reads the pinyin it derives from Chinese
# characters with English letter rules; `cmn-latn-pinyin` speaks it as Mandarin.
DEFAULT_VOICE = "cmn-latn-pinyin"
# espeak-ng voice variants that sound like (varied) human speakers; the robotic,
# whispered and joke variants are left out.
VARIANTS = (
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5",
    "adam", "Alex", "Alicia", "Andrea", "Andy", "Annie", "anika", "antonio", "aunty",
    "belinda", "benjamin", "boris", "caleb", "david", "Denis", "Diogo", "ed", "edward",
    "Gene", "grandma", "grandpa", "gustave", "Henrique", "Hugo", "iven", "Jacky", "john",
    "Lee", "linda", "Marco", "marcelo", "Mario", "max", "Michael", "michel", "miguel",
    "Mike", "Nguyen", "norbert", "pablo", "paul", "pedro", "quincy", "rob", "robert",
    "sandro", "shelby", "steph", "travis", "victor", "zac",
)


class SynthesisError(RuntimeError):
    """espeak-ng or sox failed, or the corpus directory is inconsistent."""


# ----------------------------------------------------------------------- speakers


@dataclasses.dataclass(frozen=True)
class Speaker:
    """An espeak-ng voice variant with its own pitch, rate and recording noise."""

    variant: str
    pitch: int  # espeak-ng -p, 0..99
    rate: int  # espeak-ng -s, words per minute
    snr_db: float  # white noise added relative to the speech power

    @property
    def profile(self) -> tuple[str, int, int]:
        return (self.variant, self.pitch, self.rate)


def make_speakers(
    rng: random.Random, count: int, taken: set[tuple[str, int, int]]
) -> list[Speaker]:
    """`count` speakers whose profiles are not in `taken` (which is updated)."""
    speakers = []
    while len(speakers) < count:
        speaker = Speaker(
            variant=rng.choice(VARIANTS),
            pitch=rng.randint(25, 80),
            rate=rng.randint(150, 230),
            snr_db=round(rng.uniform(20.0, 45.0), 1),
        )
        if speaker.profile not in taken:
            taken.add(speaker.profile)
            speakers.append(speaker)
    return speakers


def synthesize(text: str, speaker: Speaker, voice: str = DEFAULT_VOICE) -> np.ndarray:
    """Speak `text` with espeak-ng; returns 16 kHz mono float32 samples in [-1, 1].

    espeak-ng writes 22.05 kHz audio; sox converts it (no dither, so the result
    is repeatable).
    """
    espeak = subprocess.Popen(
        ["espeak-ng", "-v", f"{voice}+{speaker.variant}", "-s", str(speaker.rate),
         "-p", str(speaker.pitch), "--stdout"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    sox = subprocess.Popen(
        ["sox", "-D", "-t", "wav", "-", "-t", "raw", "-r", str(SAMPLE_RATE), "-e", "signed-integer",
         "-b", "16", "-c", "1", "-"],
        stdin=espeak.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    espeak.stdout.close()  # sox owns the pipe now
    espeak.stdin.write(text.encode("utf-8"))
    espeak.stdin.close()
    raw, sox_err = sox.communicate()
    espeak_err = espeak.stderr.read()
    espeak.stderr.close()
    if espeak.wait() != 0 or sox.returncode != 0 or not raw:
        raise SynthesisError(
            f"synthesis failed for {text!r} with {speaker}: "
            f"espeak-ng: {espeak_err.decode(errors='replace').strip()} "
            f"sox: {sox_err.decode(errors='replace').strip()}"
        )
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def add_noise(samples: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """Add white noise at `snr_db` below the power of the non-silent part."""
    voiced = samples[np.abs(samples) > 1e-3]
    power = float(np.mean(voiced**2)) if voiced.size else 1e-6
    noise = rng.standard_normal(samples.shape[0]).astype(np.float32)
    return samples + noise * math.sqrt(power / 10 ** (snr_db / 10))


def to_int16(samples: np.ndarray) -> np.ndarray:
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


def render_utterance(text: str, speaker: Speaker, seed: Sequence[int], voice: str) -> np.ndarray:
    """One utterance with random leading/trailing silence and the speaker's noise; int16."""
    rng = np.random.default_rng(list(seed))
    speech = synthesize(text, speaker, voice)
    lead, trail = (int(SAMPLE_RATE * rng.uniform(0.1, 0.4)) for _ in range(2))
    padded = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(trail, np.float32)])
    return to_int16(add_noise(padded, speaker.snr_db, rng))
