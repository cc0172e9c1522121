"""Sentences of the synthetic corpora: a lexicon of distinct-sounding words, sampled text.

`build_lexicon` takes words from jieba's dictionary whose characters all belong to a
character inventory and sound distinct to the synthesis voice (`pronunciations`, from
espeak-ng; `sound_key` decides what counts as distinct: syllable, tone or nothing);
`sample_sentence(s)` draws sentences from it by word frequency, with a seeded generator.

Usage:
    lexicon = build_lexicon(num_chars=350, seed=0)
    sentences = sample_sentences(lexicon, 100, np.random.default_rng(0))
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import random
import re
import subprocess
from collections import Counter
from collections.abc import Sequence

from cat.data.voices import DEFAULT_VOICE, SynthesisError

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- lexicon


def _espeak_lines(texts: Sequence[str], voice: str) -> list[str]:
    """espeak-ng's phoneme line of each text (one clause each, in as few calls as keep
    the lines one per text)."""
    def run(chunk: Sequence[str]) -> list[str]:
        proc = subprocess.run(["espeak-ng", "-v", voice, "-q", "-x"],
                              input="。".join(chunk) + "。", capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise SynthesisError(f"espeak-ng -x failed: {proc.stderr.strip()}")
        return [line.strip() for line in proc.stdout.strip().split("\n")]

    def split(chunk: Sequence[str]) -> list[str]:
        # espeak-ng joins some clauses (e.g. of Latin pinyin): halve until they line up.
        lines = run(chunk)
        if len(lines) == len(chunk):
            return lines
        if len(chunk) == 1:
            return [" ".join(lines)]
        half = len(chunk) // 2
        return split(chunk[:half]) + split(chunk[half:])

    return split(list(texts))


def _syllables(line: str) -> list[str]:
    return [s.strip("_|").replace("'", "").replace(",", "") for s in line.split()]


def spoken_lexicon(words: Sequence[str], voice: str = DEFAULT_VOICE
                   ) -> tuple[list[tuple[str, list[str]]], int]:
    """AISHELL-style pronunciations (`cat.text.lexicon.pinyin_phones`) of `words` as the
    synthesis voice says their characters, and the number of characters where that failed.

    For each character, the candidates are pypinyin's readings (heteronyms included); the
    ones whose espeak-ng rendering (the voice reads tone-numbered pinyin) equals what
    espeak-ng says for the character match, and pypinyin's reading of the word is kept
    when it is among them, else the first match: a polyphone reads as the synthetic audio
    speaks it (espeak-ng says 行 as xing2, in 银行 too). Where no candidate matches,
    pypinyin's reading of the word is kept (counted).
    """
    from pypinyin import Style, lazy_pinyin, pinyin

    from cat.text.lexicon import pinyin_phones

    chars = sorted({c for w in words for c in w})
    said = dict(zip(chars, (next(iter(_syllables(line)), "")
                            for line in _espeak_lines(chars, voice)), strict=True))
    candidates = {c: pinyin(c, style=Style.TONE3, heteronym=True,
                            neutral_tone_with_five=True)[0] for c in chars}
    readings = sorted({r for rs in candidates.values() for r in rs})
    sound = dict(zip(readings, (next(iter(_syllables(line)), "")
                                for line in _espeak_lines(readings, voice)), strict=True))
    matched = {c: [r for r in candidates[c] if sound[r] == said[c]] for c in chars}
    entries = []
    for word in words:
        default = lazy_pinyin(word, style=Style.TONE3, neutral_tone_with_five=True)
        if len(default) != len(word):
            default = [candidates[c][0] for c in word]
        phones: list[str] = []
        for char, reading in zip(word, default, strict=True):
            options = matched[char]
            phones.extend(pinyin_phones(reading if not options or reading in options
                                        else options[0]))
        entries.append((word, phones))
    return entries, sum(1 for c in chars if not matched[c])
