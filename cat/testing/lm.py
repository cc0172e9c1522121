"""Language-model training text: sentences of words drawn from jieba's dictionary.

Words are drawn by their dictionary frequency (Chinese words only), so the text has the
long-tailed n-gram statistics of real transcripts, where modified Kneser-Ney discounts
are defined; sentences hold `min_chars`..`max_chars` characters (about 10 on average
with the defaults, as WenetSpeech transcripts).

Usage:
    write_lm_text("data/lm/text", num_sentences=2000, seed=0)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random

from cat.core.io import PathLike, atomic_write
from cat.data.sentences import read_jieba_dictionary


@functools.cache
def _lexicon(num_words: int | None) -> tuple[tuple[str, ...], tuple[int, ...]]:
    pairs = sorted(((w, f) for w, f in read_jieba_dictionary()
                    if all("\u4e00" <= c <= "\u9fff" for c in w)), key=lambda p: -p[1])
    pairs = pairs[:num_words]
    return tuple(w for w, _ in pairs), tuple(itertools.accumulate(f for _, f in pairs))


def lm_sentences(num_sentences: int, seed: int, min_chars: int = 4, max_chars: int = 16,
                 num_words: int | None = None) -> list[str]:
    """`num_sentences` sentences (strings without spaces), reproducible from `seed`, of the
    `num_words` most frequent words (None: the whole dictionary, about 330,000)."""
    words, cumulative = _lexicon(num_words)
    rng = random.Random(seed)
    total = cumulative[-1]
    sentences = []
    for _ in range(num_sentences):
        target = rng.randint(min_chars, max_chars)
        text = ""
        while len(text) < target:
            text += words[bisect.bisect_right(cumulative, rng.random() * total)]
        sentences.append(text)
    return sentences


def write_lm_text(path: PathLike, num_sentences: int, seed: int = 0, kaldi: bool = True,
                  **options) -> list[str]:
    """Write `lm_sentences(...)` as a Kaldi `text` file (`utt<i> <sentence>`) or, with
    `kaldi=False`, one sentence per line; returns the sentences."""
    sentences = lm_sentences(num_sentences, seed, **options)
    with atomic_write(path) as f:
        for number, sentence in enumerate(sentences):
            f.write(f"utt{number:07d} {sentence}\n" if kaldi else f"{sentence}\n")
    return sentences


def token_sentences(num_sentences: int, num_classes: int, seed: int, successors: int = 6,
                    min_len: int = 3, max_len: int = 12) -> list[list[int]]:
    """Token-id sentences (ids 1 .. num_classes - 1) from a Markov chain where each token
    has `successors` possible next tokens, so that, like phone transcripts, only a small
    part of the possible n-grams occurs; reproducible from `seed`."""
    rng = random.Random(seed)
    table = [[rng.randrange(1, num_classes) for _ in range(successors)]
             for _ in range(num_classes)]
    sentences = []
    for _ in range(num_sentences):
        token = rng.randrange(1, num_classes)
        sentence = [token]
        for _ in range(rng.randint(min_len, max_len) - 1):
            token = rng.choice(table[token])
            sentence.append(token)
        sentences.append(sentence)
    return sentences
