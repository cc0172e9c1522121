"""Pronunciation lexicons and the lexicon (phone) tokenizer of CTC-CRF.

Lexicon files have AISHELL's `resource_aishell/lexicon.txt` format: one entry per line,
``WORD PHONE PHONE ...`` separated by whitespace, UTF-8 (a byte-order mark at the start
is left out, with a warning; other bytes than UTF-8 are a LexiconError naming the file and
line, with the GB18030 reading when there is one). Phones are AISHELL's: an initial and a
final with its tone digit (``今天 j in1 t ian1``); zero-initial syllables get a
pseudo-initial made of their first vowel doubled (``一 ii i1``, ``安 aa an1``,
``鱼 vv v2``). Entries whose word is a bracketed symbol (``<SPOKEN_NOISE>``) or whose
phone is ``sil`` are not speech and are left out. A phone may not be a symbol the
toolkit reserves (``<blk>``, ``<unk>``, ``<s>``, ``</s>``, ``<eps>``, ``#0``, ``#1``, ...):
a LexiconError names the file, the line and the symbol.

**Alternative pronunciations.** A word may have several lines with different phones
(Kaldi lexicons list a polyphonic word's readings so: ``行 x ing2`` and ``行 h ang2``).
The first is the word's *training* pronunciation: the tokenizer spells transcripts with
it, so that each training transcript has one label sequence (the CTC-CRF targets and the
denominator LM need one). Every distinct one is kept (`LexiconTokenizer.alternatives`,
in the tokenizer file) and spells the word in decoding graphs (`pronunciations`: each is
a path of the TLG's `L`, as in Kaldi's `L.fst`); their phones are units too.
`lexicon_tokenizer` logs how many words have alternatives. A line repeating an entry
(same word, same phones) adds nothing.

`LexiconTokenizer` (CAT's `JiebaComposeLexiconTokenizer`) maps text to phone ids:

1. the text is normalised like the other tokenizers' and segmented by jieba (HMM off)
   with the lexicon's words loaded as a user dictionary, so words of the lexicon are kept
   whole;
2. a word of the lexicon gives its first pronunciation;
3. a word missing from the lexicon is split greedily into the longest lexicon words from
   its left end (down to single characters) and those are looked up, first
   pronunciations (CAT maps the whole word to `<unk>`);
4. a character that no entry covers gives `<unk>` (id 1) and is counted in `missing`;
   the denominator graph leaves transcripts holding `<unk>` out of its LM (counted), and
   training counts their utterances as infeasible (no path).

Units: `<blk>` 0, `<unk>` 1, then the phones sorted. Decoding ids to text is not defined
for phones (`decode` joins the phones with spaces).

Usage::

    tokenizer = lexicon_tokenizer("resource_aishell/lexicon.txt")
    tokenizer.encode("今天天气")  # phone ids (first pronunciations)
    tokenizer.pronunciations("行")  # [["x", "ing2"], ["h", "ang2"]]
"""

from __future__ import annotations

import collections
import io
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from cat.core.io import BYTE_ORDER_MARK, PathLike, not_utf8_message
from cat.text.tokenizer import BLANK, UNK, Tokenizer, _check_config_keys

logger = logging.getLogger(__name__)

NON_SPEECH = re.compile(r"^<.*>$|^\[.*\]$")
ZERO_INITIALS = {"a": "aa", "o": "oo", "e": "ee", "i": "ii", "u": "uu", "v": "vv"}


class LexiconError(ValueError):
    """A lexicon file that cannot be used; the message names the file and line."""


#: Symbols the toolkit gives a meaning of its own, which a phone cannot be.
RESERVED_PHONES = {BLANK: "the CTC blank", UNK: "unknown text", "<s>": "sentence start",
                   "</s>": "sentence end", "<eps>": "the graphs' epsilon"}
DISAMBIGUATION = re.compile(r"^#\d+$")


def reserved_phone(phone: str) -> str | None:
    """What `phone` is reserved for, or None when it is an ordinary phone."""
    if DISAMBIGUATION.match(phone):
        return "a disambiguation symbol of the decoding graphs"
    return RESERVED_PHONES.get(phone)


def _entry(path: PathLike, lineno: int, line: str) -> tuple[str, list[str]] | None:
    """(word, phones) of one lexicon line; None for a blank or non-speech one."""
    fields = line.split()
    if not fields:
        return None
    if len(fields) == 1:
        raise LexiconError(f"{path}:{lineno}: word {fields[0]!r} has no phones")
    word, phones = fields[0], fields[1:]
    if NON_SPEECH.match(word) or phones == ["sil"]:
        return None
    for phone in phones:
        why = reserved_phone(phone)
        if why:
            raise LexiconError(f"{path}:{lineno}: word {word!r}: phone {phone!r} is a "
                               f"reserved symbol ({why}); rename the phone")
    return word, phones


def read_pronunciations(path: PathLike) -> dict[str, list[list[str]]]:
    """{word: its distinct pronunciations, in file order} of a lexicon file (see the
    module docstring); errors are LexiconErrors naming the file and line."""
    if not os.path.isfile(path):
        raise LexiconError(f"lexicon {path} does not exist")
    entries: dict[str, list[list[str]]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if lineno == 1 and line.startswith(BYTE_ORDER_MARK):
                    logger.warning("%s: starts with a UTF-8 byte-order mark (BOM); it is "
                                   "ignored", path)
                    line = line[len(BYTE_ORDER_MARK):]
                entry = _entry(path, lineno, line)
                if entry:
                    prons = entries.setdefault(entry[0], [])
                    if entry[1] not in prons:
                        prons.append(entry[1])
    except UnicodeDecodeError as error:
        raise LexiconError(not_utf8_message(path, error)) from None
    if not entries:
        raise LexiconError(f"{path}: no entries")
    return entries


def read_lexicon(path: PathLike) -> dict[str, list[str]]:
    """{word: its first (training) pronunciation} of a lexicon file."""
    return {word: prons[0] for word, prons in read_pronunciations(path).items()}


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
                 whitespace: str = "remove",
                 alternatives: Mapping[str, Sequence[Sequence[str]]] | None = None) -> None:
        """`lexicon`: {word: first (training) pronunciation}; `alternatives`: {word: its
        other pronunciations} (decoding graphs only)."""
        super().__init__(whitespace)
        units = list(units)
        if units[:2] != [BLANK, UNK]:
            raise ValueError(f"lexicon units must start with {BLANK!r}, {UNK!r}")
        _check_units(units)
        self.units = units
        self.unit_to_id = {u: i for i, u in enumerate(units)}
        self.lexicon = {w: list(p) for w, p in lexicon.items()}
        self.alternatives = {w: [list(p) for p in ps] for w, ps in (alternatives or {}).items()}
        for word, phones in self._entries():
            if word not in self.lexicon:
                raise ValueError(f"lexicon word {word!r} has alternatives but no first "
                                 "pronunciation")
            self._check_pronunciation(word, phones)
        self.longest = max(map(len, self.lexicon))
        self.missing: collections.Counter[str] = collections.Counter()
        self._segmenter = None

    def _entries(self) -> Iterator[tuple[str, list[str]]]:
        yield from self.lexicon.items()
        for word, prons in self.alternatives.items():
            for phones in prons:
                yield word, phones

    def _check_pronunciation(self, word: str, phones: Sequence[str]) -> None:
        if not phones:
            raise ValueError(f"lexicon word {word!r} has no phones")
        unknown = [p for p in phones if p not in self.unit_to_id]
        if unknown:
            raise ValueError(f"lexicon word {word!r}: phone {unknown[0]!r} is not a unit")
        reserved = [p for p in phones if p in (BLANK, UNK)]
        if reserved:
            raise ValueError(f"lexicon word {word!r}: phone {reserved[0]!r} is a reserved "
                             f"symbol ({reserved_phone(reserved[0])})")

    @classmethod
    def from_lexicon(cls, lexicon: Mapping[str, Sequence[str]],
                     whitespace: str = "remove",
                     alternatives: Mapping[str, Sequence[Sequence[str]]] | None = None
                     ) -> LexiconTokenizer:
        """The tokenizer whose units are `<blk>`, `<unk>` and every phone, sorted."""
        prons = [*lexicon.items(), *((w, p) for w, ps in (alternatives or {}).items()
                                     for p in ps)]
        for word, phones in prons:
            for phone in phones:
                if reserved_phone(phone):
                    raise ValueError(f"lexicon word {word!r}: phone {phone!r} is a reserved "
                                     f"symbol ({reserved_phone(phone)})")
        phones = sorted({p for _, ps in prons for p in ps})
        return cls([BLANK, UNK, *phones], lexicon, whitespace, alternatives)

    @classmethod
    def from_pronunciations(cls, pronunciations: Mapping[str, Sequence[Sequence[str]]],
                            whitespace: str = "remove") -> LexiconTokenizer:
        """The tokenizer of `read_pronunciations`' result: first pronunciations to spell
        transcripts, the others as alternatives."""
        lexicon = {word: prons[0] for word, prons in pronunciations.items()}
        alternatives = {word: list(prons[1:]) for word, prons in pronunciations.items()
                        if len(prons) > 1}
        return cls.from_lexicon(lexicon, whitespace, alternatives)

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

    def pronunciations(self, word: str) -> list[list[str]]:
        """Every spelling of `word` for decoding graphs: a lexicon word's pronunciations
        (the first, then its alternatives), else the one `pronounce` gives."""
        return [self.pronounce(word), *self.alternatives.get(word, ())]

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
        config = {"units": list(self.units), "lexicon": self.lexicon,
                  "whitespace": self.whitespace}
        if self.alternatives:  # written only when there are some: older files stay alike
            config["alternatives"] = self.alternatives
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LexiconTokenizer:
        _check_config_keys(cls, config, {"units", "lexicon", "whitespace"}, {"alternatives"})
        if not isinstance(config["units"], list) or not isinstance(config["lexicon"], dict) \
                or not isinstance(config.get("alternatives", {}), dict):
            raise ValueError("lexicon: 'units' must be a list, 'lexicon' and 'alternatives' "
                             "objects")
        return cls(config["units"], config["lexicon"], config["whitespace"],
                   config.get("alternatives"))

    def __getstate__(self) -> dict[str, Any]:
        return self.to_config()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["units"], state["lexicon"], state["whitespace"],
                      state.get("alternatives"))


def _check_units(units: Sequence[str]) -> None:
    """Refuse a phone unit that is a reserved symbol or a unit given twice, naming it."""
    first: dict[str, int] = {}
    for i, unit in enumerate(units):
        why = reserved_phone(unit) if i >= 2 else None
        if why:
            raise ValueError(f"lexicon unit {unit!r} (id {i}) is a reserved symbol ({why})")
        if unit in first:
            raise ValueError(f"lexicon units hold {unit!r} twice (ids {first[unit]} and {i})")
        first[unit] = i


def lexicon_tokenizer(lexicon_path: PathLike,
                      text_files: Sequence[PathLike] = ()) -> LexiconTokenizer:
    """The tokenizer of a lexicon file (every pronunciation; the first spells the
    transcripts), logging how many words have alternative pronunciations; with
    `text_files`, logs how many characters of their transcripts no entry covers (they will
    become `<unk>`)."""
    from cat.text.tokenizer import iter_transcripts

    tokenizer = LexiconTokenizer.from_pronunciations(read_pronunciations(lexicon_path))
    if tokenizer.alternatives:
        logger.info("%s: %d words have alternative pronunciations (e.g. %s): the first spells "
                    "the training transcripts, all are in decoding graphs", lexicon_path,
                    len(tokenizer.alternatives), " ".join(list(tokenizer.alternatives)[:5]))
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

