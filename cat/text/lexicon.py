"""Pronunciation lexicons and the lexicon (phone) tokenizer of CTC-CRF.

Lexicon files have AISHELL's `resource_aishell/lexicon.txt` format: one entry per line,
``WORD PHONE PHONE ...`` separated by whitespace; a word may have several lines (the first
is the one used). Phones are AISHELL's: an initial and a final with its tone digit
(``今天 j in1 t ian1``); zero-initial syllables get a pseudo-initial made of their first
vowel doubled (``一 ii i1``, ``安 aa an1``, ``鱼 vv v2``). Entries whose word is a
bracketed symbol (``<SPOKEN_NOISE>``) or whose phone is ``sil`` are not speech and are left
out.

`LexiconTokenizer` (CAT's `JiebaComposeLexiconTokenizer`) maps text to phone ids:

1. the text is normalised like the other tokenizers' and segmented by jieba (HMM off)
   with the lexicon's words loaded as a user dictionary, so words of the lexicon are kept
   whole;
2. a word of the lexicon gives its first pronunciation;
3. a word missing from the lexicon is split greedily into the longest lexicon words from
   its left end (down to single characters) and those are looked up (CAT maps the whole
   word to `<unk>`);
4. a character that no entry covers gives `<unk>` (id 1) and is counted in `missing`;
   the denominator graph leaves transcripts holding `<unk>` out of its LM (counted), and
   training counts their utterances as infeasible (no path).

Units: `<blk>` 0, `<unk>` 1, then the phones sorted. Decoding ids to text is not defined
for phones (`decode` joins the phones with spaces).

Usage::

    lexicon = read_lexicon("resource_aishell/lexicon.txt")
    tokenizer = LexiconTokenizer.from_lexicon(lexicon)
    tokenizer.encode("今天天气")  # phone ids
"""

from __future__ import annotations

import collections
import io
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cat.core.io import PathLike
from cat.text.tokenizer import BLANK, UNK, Tokenizer, _check_config_keys

logger = logging.getLogger(__name__)

NON_SPEECH = re.compile(r"^<.*>$|^\[.*\]$")
ZERO_INITIALS = {"a": "aa", "o": "oo", "e": "ee", "i": "ii", "u": "uu", "v": "vv"}


class LexiconError(ValueError):
    """A lexicon file that cannot be used; the message names the file and line."""


def read_lexicon(path: PathLike) -> dict[str, list[str]]:
    """{word: phones of its first entry} of a lexicon file (see the module docstring)."""
    lexicon: dict[str, list[str]] = {}
    if not os.path.isfile(path):
        raise LexiconError(f"lexicon {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            fields = raw.split()
            if not fields:
                continue
            if len(fields) == 1:
                raise LexiconError(f"{path}:{lineno}: word {fields[0]!r} has no phones")
            word, phones = fields[0], fields[1:]
            if NON_SPEECH.match(word) or phones == ["sil"]:
                continue
            lexicon.setdefault(word, phones)
    if not lexicon:
        raise LexiconError(f"{path}: no entries")
    return lexicon


def pinyin_phones(syllable: str) -> list[str]:
    """AISHELL phones of a tone-numbered pinyin syllable (`hang2` -> `h ang2`,
    `yi1` -> `ii i1`, `lv4` -> `l v4`; neutral tone 5)."""
    from pypinyin.contrib.tone_convert import to_finals_tone3, to_initials

    if not syllable[-1:].isdigit():
        syllable += "5"
    initial = to_initials(syllable, strict=True)
    final = to_finals_tone3(syllable, strict=True, neutral_tone_with_five=True)
    final = final.replace("ü", "v")
    if not initial:
        initial = ZERO_INITIALS.get(final[0], final[0] * 2)
    return [initial, final]


def format_lexicon(entries: Iterable[tuple[str, Sequence[str]]]) -> str:
    """Lexicon file text of (word, phones) pairs."""
    return "".join(f"{word} {' '.join(phones)}\n" for word, phones in entries)


class LexiconTokenizer(Tokenizer):
    """Words (jieba, lexicon words kept whole) to phones; see the module docstring."""

    type_name = "lexicon"

    def __init__(self, units: Sequence[str], lexicon: Mapping[str, Sequence[str]],
                 whitespace: str = "remove") -> None:
        super().__init__(whitespace)
        units = list(units)
        if units[:2] != [BLANK, UNK]:
            raise ValueError(f"lexicon units must start with {BLANK!r}, {UNK!r}")
        self.units = units
        self.unit_to_id = {u: i for i, u in enumerate(units)}
        if len(self.unit_to_id) != len(units):
            raise ValueError("lexicon units hold a phone twice")
        self.lexicon = {w: list(p) for w, p in lexicon.items()}
        for word, phones in self.lexicon.items():
            if not phones:
                raise ValueError(f"lexicon word {word!r} has no phones")
            unknown = [p for p in phones if p not in self.unit_to_id]
            if unknown:
                raise ValueError(f"lexicon word {word!r}: phone {unknown[0]!r} is not a unit")
        self.longest = max(map(len, self.lexicon))
        self.missing: collections.Counter[str] = collections.Counter()
        self._segmenter = None

    @classmethod
    def from_lexicon(cls, lexicon: Mapping[str, Sequence[str]],
                     whitespace: str = "remove") -> LexiconTokenizer:
        phones = sorted({p for ps in lexicon.values() for p in ps})
        return cls([BLANK, UNK, *phones], lexicon, whitespace)

    def _get_segmenter(self):
        if self._segmenter is None:
            import jieba

            logging.getLogger("jieba").setLevel(logging.WARNING)
            segmenter = jieba.Tokenizer()
            segmenter.initialize()
            words = "".join(f"{w}\n" for w in self.lexicon if " " not in w)
            segmenter.load_userdict(io.BytesIO(words.encode("utf-8")))
            self._segmenter = segmenter
        return self._segmenter

    def words(self, text: str) -> list[str]:
        """jieba words of normalised `text` (whitespace dropped)."""
        text = self.normalize(text)
        return [w for w in self._get_segmenter().cut(text, HMM=False) if not w.isspace()]

    def pronounce(self, word: str) -> list[str]:
        """Phones of one word by rules 2-4 of the module docstring (`<unk>` for what no
        entry covers)."""
        if word in self.lexicon:
            return self.lexicon[word]
        phones: list[str] = []
        start = 0
        while start < len(word):
            for end in range(min(len(word), start + self.longest), start, -1):
                piece = word[start:end]
                if piece in self.lexicon:
                    phones.extend(self.lexicon[piece])
                    start = end
                    break
            else:
                self.missing[word[start]] += 1
                phones.append(UNK)
                start += 1
        return phones

    @property
    def vocab_size(self) -> int:
        return len(self.units)

    def encode(self, text: str) -> list[int]:
        return [self.unit_to_id[p] for w in self.words(text) for p in self.pronounce(w)]

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self.units[token_id]

    def _decode_pieces(self, ids: list[int]) -> str:
        return " ".join(self.units[i] for i in ids)

    def to_config(self) -> dict[str, Any]:
        return {"units": list(self.units), "lexicon": self.lexicon,
                "whitespace": self.whitespace}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LexiconTokenizer:
        _check_config_keys(cls, config, {"units", "lexicon", "whitespace"})
        if not isinstance(config["units"], list) or not isinstance(config["lexicon"], dict):
            raise ValueError("lexicon: 'units' must be a list and 'lexicon' an object")
        return cls(config["units"], config["lexicon"], config["whitespace"])

    def __getstate__(self) -> dict[str, Any]:
        return self.to_config()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["units"], state["lexicon"], state["whitespace"])


def lexicon_tokenizer(lexicon_path: PathLike,
                      text_files: Sequence[PathLike] = ()) -> LexiconTokenizer:
    """The tokenizer of a lexicon file; with `text_files`, logs how many characters of
    their transcripts no entry covers (they will become `<unk>`)."""
    from cat.text.tokenizer import iter_transcripts

    tokenizer = LexiconTokenizer.from_lexicon(read_lexicon(lexicon_path))
    for transcript in iter_transcripts(text_files):
        tokenizer.encode(transcript)
    if tokenizer.missing:
        logger.warning("%d characters of the transcripts (%d distinct, e.g. %s) have no "
                       "pronunciation in %s: they become <unk>", sum(tokenizer.missing.values()),
                       len(tokenizer.missing), "".join(c for c, _ in
                                                        tokenizer.missing.most_common(10)),
                       lexicon_path)
    tokenizer.missing.clear()
    return tokenizer


def pinyin_lexicon(text_files: Sequence[PathLike]) -> tuple[list[tuple[str, list[str]]], int]:
    """A lexicon of the jieba words (default dictionary, HMM off) of Kaldi `text` files,
    pronounced by pypinyin (phrase readings, tone numbers, neutral tone 5) in AISHELL's
    phones; words with a character pypinyin cannot read (Latin letters, digits, symbols)
    are left out and counted (their characters then become `<unk>`). This is how the
    WenetSpeech recipe, whose release has no lexicon, gets one covering its transcripts."""
    import jieba
    from pypinyin import Style, lazy_pinyin

    from cat.text.tokenizer import iter_transcripts

    logging.getLogger("jieba").setLevel(logging.WARNING)
    segmenter = jieba.Tokenizer()
    words: set[str] = set()
    for transcript in iter_transcripts(text_files):
        words.update(w for w in segmenter.cut(re.sub(r"\s+", "", transcript), HMM=False))
    entries, unreadable = [], 0
    for word in sorted(words):
        readings = lazy_pinyin(word, style=Style.TONE3, neutral_tone_with_five=True,
                               errors=lambda chars: [None] * len(chars))
        if len(readings) != len(word) or any(not r or not r[-1].isdigit()
                                             for r in readings):
            unreadable += 1
            continue
        entries.append((word, [p for r in readings for p in pinyin_phones(r)]))
    return entries, unreadable


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m cat.text.lexicon pinyin --text data/train_l/text --out data/local/lexicon.txt`:
    write `pinyin_lexicon` of the transcripts (atomically)."""
    import argparse

    from cat.core.io import atomic_write, setup_logging

    parser = argparse.ArgumentParser(description="pronunciation lexicons")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("pinyin", help="lexicon of the transcripts' words, from pypinyin")
    build.add_argument("--text", nargs="+", required=True, help="Kaldi text files")
    build.add_argument("--out", required=True, help="lexicon file to write (word phone ...)")
    args = parser.parse_args(argv)
    setup_logging()
    entries, unreadable = pinyin_lexicon(args.text)
    with atomic_write(args.out) as f:
        f.write(format_lexicon(entries))
    logger.info("%s: %d words; %d words with characters pypinyin cannot read left out",
                args.out, len(entries), unreadable)


if __name__ == "__main__":
    main()

