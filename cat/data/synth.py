"""Synthetic Mandarin corpora spoken by espeak-ng, laid out like the real releases.

The toolkit's recipes, tests and CI run on these corpora: they exercise every
real code path (release layout parsing, features, packing, training, decoding)
without the real data. Two layouts are produced:

* AISHELL-1: ``data_aishell/wav/{train,dev,test}/S0002/BAC009S0002W0001.wav``
  (16 kHz 16-bit mono) and ``data_aishell/transcript/aishell_transcript_v0.8.txt``
  with word-segmented transcripts. As in the real release, a few audio files
  have no transcript line and a few transcript lines have no audio.
* WenetSpeech: ``WenetSpeech.json`` (``audios[]`` with ``segments[]`` carrying
  ``subsets`` tags S within M within L, DEV, TEST_NET, TEST_MEETING) and long Ogg
  Opus recordings ``audio/<set>/podcast/B00000/<aid>.opus`` made of several
  utterances separated by pauses.

Text: sentences assembled from words of jieba's bundled dictionary, restricted
to a character inventory of ``--num-chars`` frequent characters. With
``--distinct-sounds syllable`` (default) the inventory keeps, in frequency
order, only characters whose espeak-ng syllable differs from that of every
character already chosen, tone ignored: espeak-ng realises Mandarin tones
weakly, so characters differing only in tone are close to homophones, which no
acoustic model can tell apart without a language model. ``tone`` keeps
characters whose syllable or tone differs; ``none`` takes the most frequent
characters as they come. Speakers are espeak-ng voice variants with their own pitch,
speaking rate and noise level; speaker profiles are disjoint across
train/dev/test, and dev/test sentences never occur in train.

Everything is deterministic for a given seed and espeak-ng version. A corpus
directory records its parameters in ``synthetic.json`` (outside the release
layout); generating again with the same parameters is a no-op, and an
interrupted generation resumes.

Language-model text (`lm-text`): more sentences from the same generator and inventory,
none of them in the corpus's train, dev or test sets, so that the effect of a language
model trained on text alone can be measured.

Usage:
    python -m cat.data.synth aishell corpus/aishell --num-utts 3000 --seed 0
    python -m cat.data.synth wenetspeech corpus/wenetspeech --hours 0.5 --nj 2
    python -m cat.data.synth lm-text corpus/aishell data/lm_text/text --num-sentences 50000
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import soundfile as sf

from cat.core.io import atomic_write, setup_logging

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
AISHELL_SPEAKER_BASE = {"train": 2, "dev": 724, "test": 764}  # first speaker number, as released
WENET_SETS = {"train": None, "dev": "DEV", "test_net": "TEST_NET", "test_meeting": "TEST_MEETING"}


class SynthesisError(RuntimeError):
    """espeak-ng or sox failed, or the corpus directory is inconsistent."""


# --------------------------------------------------------------------------- text


@dataclasses.dataclass(frozen=True)
class Lexicon:
    """The character inventory and the dictionary words built from it."""

    chars: tuple[str, ...]
    words: tuple[str, ...]
    cumulative_weights: tuple[float, ...]

    def sample_word(self, rng: random.Random) -> str:
        x = rng.random() * self.cumulative_weights[-1]
        return self.words[bisect.bisect_right(self.cumulative_weights, x)]


def _is_cjk(char: str) -> bool:
    return "\u4e00" <= char <= "\u9fff"


def read_jieba_dictionary() -> list[tuple[str, int]]:
    """Return (word, frequency) pairs of jieba's bundled dictionary."""
    import jieba  # imported here: jieba prints a banner and builds caches lazily

    words = []
    with jieba.dt.get_dict_file() as f:
        for lineno, raw in enumerate(f, 1):
            fields = raw.decode("utf-8").split()
            if len(fields) < 2:
                raise SynthesisError(f"jieba dictionary line {lineno} is malformed: {raw!r}")
            words.append((fields[0], int(fields[1])))
    return words


def pronunciations(chars: Sequence[str], voice: str = DEFAULT_VOICE) -> dict[str, str]:
    """Map each character to espeak-ng's phoneme string for it (tone included)."""
    # One clause per character, all in one espeak-ng call: it prints one line per clause.
    proc = subprocess.run(
        ["espeak-ng", "-v", voice, "-q", "-x"],
        input="。".join(chars) + "。",
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0:
        raise SynthesisError(f"espeak-ng -x failed: {proc.stderr.strip()}")
    lines = [line.strip().rstrip("|_ ") for line in proc.stdout.strip().split("\n")]
    if len(lines) != len(chars):
        raise SynthesisError(
            f"espeak-ng printed {len(lines)} pronunciations for {len(chars)} characters"
        )
    return dict(zip(chars, lines, strict=True))


DISTINCT_SOUNDS = ("syllable", "tone", "none")


def sound_key(pronunciation: str, distinct_sounds: str) -> str:
    """What must differ between two inventory characters: the syllable, or syllable + tone."""
    if distinct_sounds == "syllable":
        return re.sub(r"[0-9]", "", pronunciation)  # espeak-ng writes tones as pitch digits
    return pronunciation


def build_lexicon(
    num_chars: int,
    distinct_sounds: str = "syllable",
    voice: str = DEFAULT_VOICE,
    max_word_chars: int = 4,
    frequency_exponent: float = 0.3,
) -> Lexicon:
    """Choose `num_chars` frequent characters and the jieba words made only of them.

    Words are drawn with probability proportional to frequency**`frequency_exponent`:
    a flattened Zipf distribution, so rare inventory characters still occur.
    """
    dictionary = read_jieba_dictionary()
    char_freq: Counter[str] = Counter()
    for word, freq in dictionary:
        for char in word:
            if _is_cjk(char):
                char_freq[char] += freq
    candidates = [c for c, _ in char_freq.most_common()]
    if num_chars > len(candidates):
        raise SynthesisError(f"--num-chars {num_chars} exceeds the {len(candidates)} characters")
    if distinct_sounds not in DISTINCT_SOUNDS:
        raise ValueError(f"distinct_sounds must be one of {DISTINCT_SOUNDS}, "
                         f"got {distinct_sounds!r}")
    if distinct_sounds != "none":
        pool = candidates[: min(len(candidates), max(15 * num_chars, 6000))]
        sounds = {c: sound_key(p, distinct_sounds) for c, p in pronunciations(pool, voice).items()}
        chosen, taken = [], set()
        for char in pool:
            if sounds[char] and sounds[char] not in taken:
                taken.add(sounds[char])
                chosen.append(char)
                if len(chosen) == num_chars:
                    break
        if len(chosen) < num_chars:
            raise SynthesisError(
                f"only {len(chosen)} characters with distinct sounds ({distinct_sounds}) among the "
                f"{len(pool)} most frequent; lower --num-chars or relax --distinct-sounds"
            )
    else:
        chosen = candidates[:num_chars]
    inventory = set(chosen)
    weights: dict[str, float] = {}
    for word, freq in dictionary:
        if len(word) <= max_word_chars and freq > 0 and all(c in inventory for c in word):
            weights[word] = max(weights.get(word, 0.0), freq**frequency_exponent)
    floor = min(weights.values()) if weights else 1.0
    for char in chosen:  # every inventory character is reachable as a word
        weights.setdefault(char, floor)
    words = sorted(weights)
    return Lexicon(
        chars=tuple(chosen),
        words=tuple(words),
        cumulative_weights=tuple(itertools.accumulate(weights[w] for w in words)),
    )


def sample_sentence(
    rng: random.Random, lexicon: Lexicon, min_chars: int, max_chars: int
) -> list[str]:
    """Draw words until the sentence holds between `min_chars` and `max_chars` characters."""
    target = rng.randint(min_chars, max_chars)
    words: list[str] = []
    length = 0
    for _ in range(100 * max_chars):
        word = lexicon.sample_word(rng)
        if length + len(word) > max_chars:
            continue
        words.append(word)
        length += len(word)
        if length >= target:
            break
    return words


def sample_sentences(
    rng: random.Random, lexicon: Lexicon, count: int, min_chars: int, max_chars: int,
    exclude: set[str],
) -> list[list[str]]:
    """`count` distinct sentences not in `exclude` (compared without spaces); updates `exclude`."""
    sentences = []
    attempts = 0
    while len(sentences) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise SynthesisError(
                "cannot draw enough distinct sentences; raise --num-chars or --max-chars"
            )
        words = sample_sentence(rng, lexicon, min_chars, max_chars)
        key = "".join(words)
        if key in exclude:
            continue
        exclude.add(key)
        sentences.append(words)
    return sentences


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


# ------------------------------------------------------------------ corpus driver


def _run_parallel(jobs: Sequence[Callable[[], None]], nj: int, what: str) -> None:
    """Run independent jobs on `nj` threads (they wait on subprocesses); stop at the first error."""
    from tqdm import tqdm

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, nj)) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for future in tqdm(concurrent.futures.as_completed(futures), total=len(futures),
                               desc=what, unit="file", mininterval=2.0, leave=False):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _write_wav(path: Path, samples: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    sf.write(tmp, samples, SAMPLE_RATE, subtype="PCM_16", format="WAV")
    os.replace(tmp, path)


@functools.lru_cache(maxsize=1)
def _ogg_crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        table.append(crc & 0xFFFFFFFF)
    return tuple(table)


def set_ogg_serial(data: bytes, serial: int) -> bytes:
    """Rewrite the stream serial number of every Ogg page (and its CRC).

    libsndfile picks a random serial number, which would make the Opus files
    (and the md5 sums in WenetSpeech.json) differ between runs with one seed.
    """
    table = _ogg_crc_table()
    out = bytearray(data)
    pos = 0
    while pos < len(out):
        if out[pos:pos + 4] != b"OggS":
            raise SynthesisError(f"not an Ogg page at byte {pos}")
        num_segments = out[pos + 26]
        size = 27 + num_segments + sum(out[pos + 27:pos + 27 + num_segments])
        out[pos + 14:pos + 18] = serial.to_bytes(4, "little")
        out[pos + 22:pos + 26] = b"\0\0\0\0"
        crc = 0
        for byte in out[pos:pos + size]:
            crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ byte]
        out[pos + 22:pos + 26] = crc.to_bytes(4, "little")
        pos += size
    return bytes(out)


def _write_opus(path: Path, samples: np.ndarray, serial: int) -> None:
    buffer = io.BytesIO()
    sf.write(buffer, samples, SAMPLE_RATE, format="OGG", subtype="OPUS")
    with atomic_write(path, "wb") as f:
        f.write(set_ogg_serial(buffer.getvalue(), serial))


def _start_corpus(out_dir: Path, params: dict) -> bool:
    """Return True if `out_dir` already holds this corpus; refuse a different one."""
    meta_path = out_dir / "synthetic.json"
    if meta_path.exists():
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("params") != params:
            raise SynthesisError(
                f"{out_dir} holds a synthetic corpus made with other parameters "
                f"({meta.get('params')}); remove it or choose another directory"
            )
        if meta.get("complete"):
            return True
    out_dir.mkdir(parents=True, exist_ok=True)
    return False


def _finish_corpus(out_dir: Path, params: dict, info: dict) -> None:
    with atomic_write(out_dir / "synthetic.json") as f:
        json.dump({"params": params, "complete": True, **info}, f, ensure_ascii=False, indent=1)
        f.write("\n")


def _pilot_seconds_per_char(lexicon: Lexicon, voice: str, seed: int) -> float:
    """Average speech duration per character, from a small deterministic pilot."""
    rng = random.Random(f"pilot-{seed}")
    speakers = make_speakers(rng, 8, set())
    chars = seconds = 0.0
    for i in range(24):
        text = "".join(sample_sentence(rng, lexicon, 8, 12))
        chars += len(text)
        seconds += synthesize(text, speakers[i % len(speakers)], voice).shape[0] / SAMPLE_RATE
    return seconds / chars


def _split_counts(total: int, ratios: Sequence[float]) -> list[int]:
    if total < len(ratios):
        raise SynthesisError(f"need at least {len(ratios)} utterances, got {total}")
    counts = [max(1, round(total * r / sum(ratios))) for r in ratios]
    counts[0] = total - sum(counts[1:])
    return counts


def make_aishell(
    out_dir: str | os.PathLike,
    num_utts: int | None = None,
    hours: float | None = None,
    seed: int = 0,
    num_chars: int = 350,
    distinct_sounds: str = "syllable",
    min_chars: int = 6,
    max_chars: int = 14,
    utts_per_speaker: int = 25,
    split: Sequence[float] = (0.9, 0.05, 0.05),
    num_missing_transcripts: int | None = None,
    num_missing_audio: int | None = None,
    voice: str = DEFAULT_VOICE,
    nj: int = 2,
) -> Path:
    """Write a synthetic AISHELL-1 release under `out_dir/data_aishell`; returns that path.

    Give the size as `num_utts` (all sets together) or `hours` (estimated from a
    pilot synthesis). `num_missing_transcripts` audio files get no transcript
    line and `num_missing_audio` transcript lines get no audio, as in the real
    release (default: 0.2% of the utterances, at least one each).
    """
    if (num_utts is None) == (hours is None):
        raise ValueError("give exactly one of num_utts and hours")
    if not 0 < utts_per_speaker < 9000:  # ids W9000 and up hold the transcript-only lines
        raise ValueError(f"utts_per_speaker must be in 1..8999, got {utts_per_speaker}")
    out = Path(out_dir)
    params = {
        "layout": "aishell", "num_utts": num_utts, "hours": hours, "seed": seed,
        "num_chars": num_chars, "distinct_sounds": distinct_sounds, "min_chars": min_chars,
        "max_chars": max_chars, "utts_per_speaker": utts_per_speaker, "split": list(split),
        "num_missing_transcripts": num_missing_transcripts,
        "num_missing_audio": num_missing_audio, "voice": voice,
    }
    root = out / "data_aishell"
    if _start_corpus(out, params):
        logger.info("synthetic AISHELL-1 corpus already complete in %s", root)
        return root

    lexicon = build_lexicon(num_chars, distinct_sounds, voice)
    if num_utts is None:
        per_char = _pilot_seconds_per_char(lexicon, voice, seed)
        seconds_per_utt = per_char * (min_chars + max_chars) / 2 + 0.5  # + leading/trailing silence
        num_utts = max(len(split), math.ceil(hours * 3600 / seconds_per_utt))
    rng = random.Random(seed)
    counts = _split_counts(num_utts, split)
    extra = max(1, round(0.002 * num_utts))
    missing_transcripts = extra if num_missing_transcripts is None else num_missing_transcripts
    missing_audio = extra if num_missing_audio is None else num_missing_audio

    taken_profiles: set[tuple[str, int, int]] = set()
    seen_sentences: set[str] = set()
    utterances = []  # (set, speaker id, utt id, words, Speaker)
    for name, count in zip(("train", "dev", "test"), counts, strict=True):
        num_speakers = max(1, math.ceil(count / utts_per_speaker))
        first = AISHELL_SPEAKER_BASE[name]
        if first + num_speakers > 10000:
            raise SynthesisError(f"{num_speakers} {name} speakers do not fit 4-digit speaker ids")
        speakers = make_speakers(rng, num_speakers, taken_profiles)
        sentences = sample_sentences(rng, lexicon, count, min_chars, max_chars, seen_sentences)
        for i, words in enumerate(sentences):
            spk_index = i % num_speakers
            spk = f"S{first + spk_index:04d}"
            utt = f"BAC009{spk}W{i // num_speakers + 1:04d}"
            utterances.append((name, spk, utt, words, speakers[spk_index]))
    # Transcript lines without audio: extra ids on existing train speakers.
    orphan_lines = []
    train_utts = [u for u in utterances if u[0] == "train"]
    for j in range(missing_audio):
        _, spk, _, _, _ = train_utts[j % len(train_utts)]
        words = sample_sentences(rng, lexicon, 1, min_chars, max_chars, seen_sentences)[0]
        orphan_lines.append((f"BAC009{spk}W{9000 + j:04d}", words))
    chosen = rng.sample(utterances, min(missing_transcripts, len(utterances)))
    no_transcript = {u[2] for u in chosen}

    jobs = []
    for index, (name, spk, utt, words, speaker) in enumerate(utterances):
        path = root / "wav" / name / spk / f"{utt}.wav"
        if path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)

        def job(path=path, words=words, speaker=speaker, index=index) -> None:
            _write_wav(path, render_utterance("".join(words), speaker, (seed, index), voice))

        jobs.append(job)
    _run_parallel(jobs, nj, "synthesising AISHELL-1")

    lines = [(utt, words) for _, _, utt, words, _ in utterances if utt not in no_transcript]
    lines += orphan_lines
    lines.sort()
    with atomic_write(root / "transcript" / "aishell_transcript_v0.8.txt") as f:
        for utt, words in lines:
            f.write(f"{utt} {' '.join(words)}\n")

    _finish_corpus(out, params, {
        "num_utts": {name: c for name, c in zip(("train", "dev", "test"), counts, strict=True)},
        "audio_without_transcript": sorted(no_transcript),
        "transcript_without_audio": [utt for utt, _ in orphan_lines],
        "num_chars": len(lexicon.chars),
        "characters": "".join(lexicon.chars),
        "speakers": {spk: dataclasses.asdict(s) for _, spk, _, _, s in utterances},
    })
    logger.info("wrote synthetic AISHELL-1 (%s utterances: train/dev/test %s) to %s",
                num_utts, counts, root)
    return root


def make_wenetspeech(
    out_dir: str | os.PathLike,
    num_audios: int | None = None,
    hours: float | None = None,
    seed: int = 0,
    num_chars: int = 350,
    distinct_sounds: str = "syllable",
    min_chars: int = 6,
    max_chars: int = 14,
    utts_per_audio: tuple[int, int] = (3, 8),
    split: Sequence[float] = (0.85, 0.05, 0.05, 0.05),
    voice: str = DEFAULT_VOICE,
    nj: int = 2,
) -> Path:
    """Write a synthetic WenetSpeech release (`WenetSpeech.json` + Opus audio) under `out_dir`.

    Training segments are tagged L; half of them also M, and half of those
    also S (so S within M within L). Evaluation audios are DEV, TEST_NET and
    TEST_MEETING; meeting recordings alternate two or three speakers.
    """
    if (num_audios is None) == (hours is None):
        raise ValueError("give exactly one of num_audios and hours")
    out = Path(out_dir)
    params = {
        "layout": "wenetspeech", "num_audios": num_audios, "hours": hours, "seed": seed,
        "num_chars": num_chars, "distinct_sounds": distinct_sounds, "min_chars": min_chars,
        "max_chars": max_chars, "utts_per_audio": list(utts_per_audio), "split": list(split),
        "voice": voice,
    }
    if _start_corpus(out, params):
        logger.info("synthetic WenetSpeech corpus already complete in %s", out)
        return out

    lexicon = build_lexicon(num_chars, distinct_sounds, voice)
    if num_audios is None:
        per_char = _pilot_seconds_per_char(lexicon, voice, seed)
        seconds_per_utt = per_char * (min_chars + max_chars) / 2 + 0.8  # + pause
        num_audios = max(len(split), math.ceil(
            hours * 3600 / (seconds_per_utt * sum(utts_per_audio) / 2)))
    rng = random.Random(seed)
    counts = _split_counts(num_audios, split)
    taken_profiles: set[tuple[str, int, int]] = set()
    seen_sentences: set[str] = set()

    audios = []  # dicts for WenetSpeech.json, plus private fields for synthesis
    index = 0
    for (set_name, tag), count in zip(WENET_SETS.items(), counts, strict=True):
        voices_per_audio = 3 if set_name == "test_meeting" else 1
        speakers = make_speakers(rng, max(2, count * voices_per_audio // 2), taken_profiles)
        for k in range(count):
            aid = f"X{index:010d}_{rng.randrange(10**9):09d}"
            num = rng.randint(*utts_per_audio)
            cast = rng.sample(speakers, min(voices_per_audio, len(speakers)))
            sentences = sample_sentences(rng, lexicon, num, min_chars, max_chars, seen_sentences)
            segments = []
            for s, words in enumerate(sentences):
                if tag is None:
                    subsets = ["L"]
                    if rng.random() < 0.5:
                        subsets.insert(0, "M")
                        if rng.random() < 0.5:
                            subsets.insert(0, "S")
                else:
                    subsets = [tag]
                segments.append({
                    "sid": f"{aid}_S{s:05d}", "text": "".join(words),
                    "confidence": round(rng.uniform(0.95, 1.0), 2), "subsets": subsets,
                    "_speaker": cast[s % len(cast)], "_pause": rng.uniform(0.3, 1.2),
                })
            audios.append({
                "aid": aid, "path": f"audio/{set_name}/podcast/B{k // 1000:05d}/{aid}.opus",
                "_index": index, "segments": segments,
            })
            index += 1

    def render(audio: dict) -> dict:
        """Synthesise one recording; returns its JSON entry with times and md5."""
        noise_rng = np.random.default_rng([seed, audio["_index"]])
        pieces = [np.zeros(int(SAMPLE_RATE * noise_rng.uniform(0.2, 1.0)), np.float32)]
        position = pieces[0].shape[0]
        entry_segments = []
        snr = min(seg["_speaker"].snr_db for seg in audio["segments"])
        for seg in audio["segments"]:
            speech = synthesize(seg["text"], seg["_speaker"], voice)
            begin, end = position, position + speech.shape[0]
            pause = np.zeros(int(SAMPLE_RATE * seg["_pause"]), np.float32)
            pieces += [speech, pause]
            position = end + pause.shape[0]
            entry_segments.append({
                "sid": seg["sid"], "confidence": seg["confidence"],
                "begin_time": round(begin / SAMPLE_RATE, 2),
                "end_time": round(end / SAMPLE_RATE, 2),
                "subsets": seg["subsets"], "text": seg["text"],
            })
        samples = to_int16(add_noise(np.concatenate(pieces), snr, noise_rng))
        path = out / audio["path"]
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _write_opus(path, samples, serial=audio["_index"] + 1)
        return {
            "aid": audio["aid"], "duration": round(samples.shape[0] / SAMPLE_RATE, 2),
            "format": "opus", "md5": hashlib.md5(path.read_bytes()).hexdigest(),
            "path": audio["path"], "source": "podcast", "tag": "", "segments": entry_segments,
        }

    entries: list[dict | None] = [None] * len(audios)

    def job_for(i: int) -> Callable[[], None]:
        def job() -> None:
            entries[i] = render(audios[i])
        return job

    _run_parallel([job_for(i) for i in range(len(audios))], nj, "synthesising WenetSpeech")

    # Written entry by entry: the real file describes millions of segments.
    with atomic_write(out / "WenetSpeech.json") as f:
        f.write('{\n "dataset": "WenetSpeech",\n "language": "Mandarin",\n "version": "1.0.0",\n'
                ' "description": "Synthetic Mandarin corpus spoken by espeak-ng in the WenetSpeech'
                ' release layout",\n "url": "",\n "audios": [\n')
        for i, entry in enumerate(entries):
            separator = ",\n" if i + 1 < len(entries) else "\n"
            f.write("  " + json.dumps(entry, ensure_ascii=False) + separator)
        f.write(" ]\n}\n")

    _finish_corpus(out, params, {
        "num_audios": {n: c for n, c in zip(WENET_SETS, counts, strict=True)},
        "num_segments": sum(len(a["segments"]) for a in audios),
        "num_chars": len(lexicon.chars),
        "characters": "".join(lexicon.chars),
    })
    logger.info("wrote synthetic WenetSpeech (%d audios, %d segments) to %s",
                len(audios), sum(len(a["segments"]) for a in audios), out)
    return out


# ------------------------------------------------------------- language-model text


def corpus_sentences(corpus_dir: str | os.PathLike) -> set[str]:
    """Every sentence (spaces removed) of a synthetic AISHELL-1 or WenetSpeech corpus."""
    out = Path(corpus_dir)
    layout = _read_meta(out)["params"]["layout"]
    sentences = set()
    if layout == "aishell":
        transcript = out / "data_aishell" / "transcript" / "aishell_transcript_v0.8.txt"
        with open(transcript, encoding="utf-8") as f:
            for line in f:
                _, _, words = line.strip().partition(" ")
                sentences.add(words.replace(" ", ""))
    else:
        with open(out / "WenetSpeech.json", encoding="utf-8") as f:
            for audio in json.load(f)["audios"]:
                sentences.update(seg["text"].replace(" ", "") for seg in audio["segments"])
    return sentences


def _read_meta(out: Path) -> dict:
    meta_path = out / "synthetic.json"
    if not meta_path.is_file():
        raise SynthesisError(f"{meta_path} does not exist: {out} is not a synthetic corpus")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if not meta.get("complete"):
        raise SynthesisError(f"{meta_path}: the corpus is incomplete; generate it first")
    return meta


def make_lm_text(corpus_dir: str | os.PathLike, out_path: str | os.PathLike,
                 num_sentences: int, seed: int = 0) -> Path:
    """Write `num_sentences` text-only sentences for language models, drawn like the corpus's
    own (same inventory, words and lengths) but none of them in its train, dev or test sets.

    The output is a Kaldi `text` file (`lm-0000001 <sentence>`, no spaces, as stage 0 writes
    transcripts). The sentences depend on the corpus's parameters and `seed` only.
    """
    out = Path(corpus_dir)
    meta = _read_meta(out)
    params = meta["params"]
    lexicon = build_lexicon(params["num_chars"], params["distinct_sounds"], params["voice"])
    if "".join(lexicon.chars) != meta["characters"]:
        raise SynthesisError(f"{out}: the character inventory rebuilt now differs from the "
                             "corpus's (another espeak-ng version?); regenerate the corpus")
    exclude = corpus_sentences(out)
    rng = random.Random(f"lm-{params['seed']}-{seed}")
    sentences = sample_sentences(rng, lexicon, num_sentences, params["min_chars"],
                                 params["max_chars"], exclude)
    with atomic_write(out_path) as f:
        for index, words in enumerate(sentences, 1):
            f.write(f"lm-{index:07d} {''.join(words)}\n")
    logger.info("wrote %d language-model sentences (none in %s) to %s", num_sentences, out,
                out_path)
    return Path(out_path)


# ----------------------------------------------------------------------------- CLI


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-chars", type=int, default=350,
                        help="size of the character inventory")
    parser.add_argument("--distinct-sounds", choices=DISTINCT_SOUNDS, default="syllable",
                        help="keep only characters whose syllables (or syllables with tones) "
                             "differ")
    parser.add_argument("--min-chars", type=int, default=6, help="shortest sentence, in characters")
    parser.add_argument("--max-chars", type=int, default=14, help="longest sentence, in characters")
    parser.add_argument("--voice", default=DEFAULT_VOICE, help="espeak-ng voice (language)")
    parser.add_argument("--nj", type=int, default=2, help="parallel synthesis jobs")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="layout", required=True)
    aishell = sub.add_parser("aishell", help="AISHELL-1 layout")
    aishell.add_argument("out_dir")
    size = aishell.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-utts", type=int, help="utterances in train+dev+test")
    size.add_argument("--hours", type=float, help="approximate hours in train+dev+test")
    aishell.add_argument("--utts-per-speaker", type=int, default=25)
    aishell.add_argument("--split", default="0.9,0.05,0.05", help="train,dev,test ratios")
    _add_common(aishell)
    wenet = sub.add_parser("wenetspeech", help="WenetSpeech layout")
    wenet.add_argument("out_dir")
    size = wenet.add_mutually_exclusive_group(required=True)
    size.add_argument("--num-audios", type=int, help="long recordings in all sets")
    size.add_argument("--hours", type=float, help="approximate hours of speech in all sets")
    wenet.add_argument("--split", default="0.85,0.05,0.05,0.05",
                       help="train,dev,test_net,test_meeting ratios")
    _add_common(wenet)
    lm_text = sub.add_parser("lm-text", help="text-only sentences for language models, "
                             "disjoint from a generated corpus")
    lm_text.add_argument("out_dir", help="the synthetic corpus (AISHELL-1 or WenetSpeech)")
    lm_text.add_argument("text", help="output Kaldi text file")
    lm_text.add_argument("--num-sentences", type=int, required=True)
    lm_text.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    setup_logging()
    if args.layout == "lm-text":
        make_lm_text(args.out_dir, args.text, args.num_sentences, args.seed)
        return
    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        parser.error("espeak-ng and sox are required (bash tools/install.sh installs them)")
    common = dict(seed=args.seed, num_chars=args.num_chars,
                  distinct_sounds=args.distinct_sounds, min_chars=args.min_chars,
                  max_chars=args.max_chars, voice=args.voice, nj=args.nj,
                  split=[float(x) for x in args.split.split(",")])
    if args.layout == "aishell":
        make_aishell(args.out_dir, num_utts=args.num_utts, hours=args.hours,
                     utts_per_speaker=args.utts_per_speaker, **common)
    else:
        make_wenetspeech(args.out_dir, num_audios=args.num_audios, hours=args.hours, **common)


if __name__ == "__main__":
    main()
