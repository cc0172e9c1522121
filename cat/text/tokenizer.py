"""Tokenizers: text <-> integer ids, saved to one self-contained, code-free file.

Two kinds share one API (`Tokenizer`):

* `SentencePieceTokenizer`: SentencePiece `char`, `unigram` or `bpe` models.
* `JiebaTokenizer`: words from jieba segmentation (HMM off) of the training text.

Special ids, the same for every tokenizer:

* 0 = `<blk>`: the CTC/RNN-T blank, also used as padding; never produced by `encode`,
  ignored by `decode`.
* 1 = `<unk>`: anything outside the vocabulary.
* 2 onwards: user symbols (in the order given), then the learned pieces or words.

Whitespace: Chinese transcripts often carry spaces between words or characters. A
model trained without them would map every space to `<unk>`, so text is normalised
before training and before encoding. `whitespace="cjk"` (the default) deletes spaces
next to a CJK character and collapses the others (so English words stay apart),
`"remove"` deletes all whitespace, `"keep"` only collapses runs to one space.

File format (`.tknz`): one UTF-8 JSON object
``{"format": "cat-tokenizer", "version": 1, "type": <registry name>, "config": {...}}``;
the SentencePiece model is embedded as base64 in `config["model"]`. Loading parses
JSON only and resolves `type` through a fixed registry: nothing in the file is executed.

Usage:
    python -m cat.text.tokenizer train --type sentencepiece --model-type char \
        --vocab-size 0 --text data/train/text --out exp/asr/tokenizer.tknz
    echo "今天 天气 很好" | python -m cat.text.tokenizer encode --tokenizer exp/asr/tokenizer.tknz
    echo "5 9 7" | python -m cat.text.tokenizer decode --tokenizer exp/asr/tokenizer.tknz
    python -m cat.text.tokenizer vocab --tokenizer exp/asr/tokenizer.tknz | head
"""

from __future__ import annotations

import abc
import argparse
import base64
import binascii
import collections
import hashlib
import io
import json
import logging
import os
import re
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import sentencepiece

from cat.core.io import PathLike, atomic_write, iter_table, setup_logging

logger = logging.getLogger(__name__)

BLANK_ID = 0
UNK_ID = 1
BLANK = "<blk>"
UNK = "<unk>"
FILE_FORMAT = "cat-tokenizer"
FILE_VERSION = 1
WHITESPACE_MODES = ("cjk", "remove", "keep")
SENTENCEPIECE_MODEL_TYPES = ("char", "unigram", "bpe")

# Ideographs (basic, extensions A-F, compatibility), CJK punctuation, kana and full-width
# forms. Hangul is left out on purpose: Korean separates words with spaces.
_CJK = (
    "\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
    "\U00020000-\U0002ffff"
)
_SPACE_NEXT_TO_CJK = re.compile(rf"\s+(?=[{_CJK}])|(?<=[{_CJK}])\s+")
_SPACE_RUN = re.compile(r"\s+")


class TokenizerFileError(ValueError):
    """A tokenizer file is malformed; the message names the file."""


def normalize_whitespace(text: str, mode: str = "cjk") -> str:
    """Apply a whitespace policy (`cjk`, `remove` or `keep`, see the module doc) to `text`."""
    if mode == "remove":
        return _SPACE_RUN.sub("", text)
    if mode == "cjk":
        text = _SPACE_NEXT_TO_CJK.sub("", text)
    elif mode != "keep":
        raise ValueError(f"unknown whitespace mode {mode!r}; expected one of {WHITESPACE_MODES}")
    return _SPACE_RUN.sub(" ", text).strip()


class Tokenizer(abc.ABC):
    """Maps text to ids and back; id 0 is `<blk>`, id 1 is `<unk>`."""

    #: Name under which the class is stored in tokenizer files (see `TOKENIZERS`).
    type_name: ClassVar[str]

    def __init__(self, whitespace: str = "cjk") -> None:
        if whitespace not in WHITESPACE_MODES:
            raise ValueError(f"unknown whitespace mode {whitespace!r}; "
                             f"expected one of {WHITESPACE_MODES}")
        self.whitespace = whitespace

    def normalize(self, text: str) -> str:
        """The text the model actually sees (whitespace policy applied)."""
        return normalize_whitespace(text, self.whitespace)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, specials included (ids are 0 .. vocab_size - 1)."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`; never contains `BLANK_ID`."""

    @abc.abstractmethod
    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id."""

    @abc.abstractmethod
    def _decode_pieces(self, ids: list[int]) -> str:
        """Text of ids already checked and stripped of blanks."""

    @abc.abstractmethod
    def to_config(self) -> dict[str, Any]:
        """JSON-serialisable state; `from_config(to_config())` rebuilds the tokenizer."""

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: Mapping[str, Any]) -> Tokenizer:
        """Rebuild from `to_config()` output; raises ValueError naming a bad key."""

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; blanks (0) are skipped, an id outside the vocabulary is an error."""
        kept = []
        for token_id in ids:
            token_id = int(token_id)
            self._check_id(token_id)
            if token_id != BLANK_ID:
                kept.append(token_id)
        return self._decode_pieces(kept)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"id {token_id} is outside the vocabulary (size {self.vocab_size})")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.to_config() == other.to_config()

    __hash__ = None  # type: ignore[assignment]  # mutable-looking state; no hashing


def _check_config_keys(cls: type, config: Mapping[str, Any], required: set[str],
                       optional: set[str] = frozenset()) -> None:
    if not isinstance(config, Mapping):
        raise ValueError(f"{cls.type_name}: config must be an object, got {type(config).__name__}")
    unknown = sorted(set(config) - required - optional)
    if unknown:
        raise ValueError(f"{cls.type_name}: unknown config key {unknown[0]!r}; "
                         f"allowed: {sorted(required | optional)}")
    missing = sorted(required - set(config))
    if missing:
        raise ValueError(f"{cls.type_name}: missing config key {missing[0]!r}")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (char, unigram or bpe) trained with `<blk>`=0 and `<unk>`=1."""

    type_name = "sentencepiece"

    def __init__(self, model: bytes, whitespace: str = "cjk") -> None:
        super().__init__(whitespace)
        self.model = bytes(model)
        self._processor = self._load_processor(self.model)

    @staticmethod
    def _load_processor(model: bytes) -> sentencepiece.SentencePieceProcessor:
        try:
            processor = sentencepiece.SentencePieceProcessor(model_proto=model)
        except RuntimeError as error:
            raise ValueError(f"not a SentencePiece model: {error}") from None
        if processor.piece_to_id(BLANK) != BLANK_ID or processor.unk_id() != UNK_ID:
            raise ValueError(f"SentencePiece model must have {BLANK}={BLANK_ID} and "
                             f"{UNK}={UNK_ID}; got {processor.id_to_piece(0)!r}, "
                             f"{processor.id_to_piece(1)!r}")
        return processor

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(self.normalize(text), out_type=int)

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._processor.id_to_piece(token_id)

    def _decode_pieces(self, ids: list[int]) -> str:
        return self._processor.decode(ids)

    def to_config(self) -> dict[str, Any]:
        return {"model": base64.b64encode(self.model).decode("ascii"),
                "whitespace": self.whitespace}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SentencePieceTokenizer:
        _check_config_keys(cls, config, {"model", "whitespace"})
        if not isinstance(config["model"], str):
            raise ValueError("sentencepiece: config key 'model' must be a base64 string")
        try:
            model = base64.b64decode(config["model"], validate=True)
        except binascii.Error as error:
            raise ValueError(f"sentencepiece: config key 'model' is not base64: {error}") from None
        return cls(model, whitespace=config["whitespace"])

    # SentencePieceProcessor is a C++ object; DataLoader workers get a fresh one.
    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "whitespace": self.whitespace}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model"], state["whitespace"])


class JiebaTokenizer(Tokenizer):
    """Words from jieba segmentation (HMM off); words outside the vocabulary -> `<unk>`.

    `vocab` lists every entry by id and must start with `<blk>`, `<unk>`. `user_dict`
    is the text of a jieba user dictionary (one `word [freq [tag]]` per line) that is
    loaded on top of jieba's default dictionary; `user_symbols` are never split.
    """

    type_name = "jieba"

    def __init__(self, vocab: Sequence[str], user_dict: str | None = None,
                 user_symbols: Sequence[str] = (), whitespace: str = "cjk") -> None:
        super().__init__(whitespace)
        vocab = list(vocab)
        if vocab[:2] != [BLANK, UNK]:
            raise ValueError(f"jieba vocabulary must start with {BLANK!r}, {UNK!r}")
        self.vocab = vocab
        self.word_to_id: dict[str, int] = {}
        for index, word in enumerate(vocab):
            if not isinstance(word, str) or not word or word.isspace():
                raise ValueError(f"jieba vocabulary entry {index} is not a word: {word!r}")
            if word in self.word_to_id:
                raise ValueError(f"jieba vocabulary has {word!r} twice (ids "
                                 f"{self.word_to_id[word]} and {index})")
            self.word_to_id[word] = index
        self.user_dict = user_dict
        self.user_symbols = list(user_symbols)
        missing = [s for s in self.user_symbols if s not in self.word_to_id]
        if missing:
            raise ValueError(f"jieba user symbol {missing[0]!r} is not in the vocabulary")
        self._symbol_pattern = (
            re.compile("(" + "|".join(map(re.escape, sorted(self.user_symbols, key=len,
                                                            reverse=True))) + ")")
            if self.user_symbols else None
        )
        self._segmenter = None

    def _get_segmenter(self):
        # Built lazily: loading jieba's dictionary takes about a second.
        if self._segmenter is None:
            # Imported here: `import jieba` costs ~0.2 s (pkg_resources), which every
            # packing worker would otherwise pay through `cat.formats.mappack`.
            import jieba

            # jieba logs its dictionary loading at DEBUG through its own stderr handler.
            logging.getLogger("jieba").setLevel(logging.WARNING)
            segmenter = jieba.Tokenizer()
            segmenter.initialize()
            if self.user_dict:
                segmenter.load_userdict(io.BytesIO(self.user_dict.encode("utf-8")))
            self._segmenter = segmenter
        return self._segmenter

    def words(self, text: str) -> list[str]:
        """Segment normalised `text` into words (whitespace dropped, user symbols kept whole)."""
        text = self.normalize(text)
        parts = self._symbol_pattern.split(text) if self._symbol_pattern else [text]
        segmenter = self._get_segmenter()
        words: list[str] = []
        for index, part in enumerate(parts):
            if index % 2 == 1:  # a user symbol captured by the split
                words.append(part)
            elif part:
                words.extend(w for w in segmenter.cut(part, HMM=False) if not w.isspace())
        return words

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.word_to_id.get(word, UNK_ID) for word in self.words(text)]

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self.vocab[token_id]

    def _decode_pieces(self, ids: list[int]) -> str:
        pieces: list[str] = []
        for token_id in ids:
            word = self.vocab[token_id]
            # Chinese words join directly; two Latin words need their space back.
            if pieces and _ends_alnum(pieces[-1]) and _starts_alnum(word):
                pieces.append(" ")
            pieces.append(word)
        return "".join(pieces)

    def to_config(self) -> dict[str, Any]:
        return {"vocab": list(self.vocab), "user_dict": self.user_dict,
                "user_symbols": list(self.user_symbols), "whitespace": self.whitespace}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> JiebaTokenizer:
        _check_config_keys(cls, config, {"vocab", "user_dict", "user_symbols", "whitespace"})
        if not isinstance(config["vocab"], list):
            raise ValueError("jieba: config key 'vocab' must be a list of words")
        if config["user_dict"] is not None and not isinstance(config["user_dict"], str):
            raise ValueError("jieba: config key 'user_dict' must be a string or null")
        if not isinstance(config["user_symbols"], list):
            raise ValueError("jieba: config key 'user_symbols' must be a list")
        return cls(config["vocab"], config["user_dict"], config["user_symbols"],
                   config["whitespace"])

    # jieba's segmenter holds a lock; DataLoader workers rebuild it on first use.
    def __getstate__(self) -> dict[str, Any]:
        return self.to_config()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["vocab"], state["user_dict"], state["user_symbols"],
                      state["whitespace"])


def _ends_alnum(word: str) -> bool:
    return word[-1].isascii() and word[-1].isalnum()


def _starts_alnum(word: str) -> bool:
    return word[0].isascii() and word[0].isalnum()


#: Tokenizer classes by the `type` stored in tokenizer files. Read-only.
TOKENIZERS: Mapping[str, type[Tokenizer]] = types.MappingProxyType({
    SentencePieceTokenizer.type_name: SentencePieceTokenizer,
    JiebaTokenizer.type_name: JiebaTokenizer,
})


# --------------------------------------------------------------------------- files


def save(tokenizer: Tokenizer, path: PathLike) -> None:
    """Write `tokenizer` to `path` (JSON, atomically)."""
    document = {"format": FILE_FORMAT, "version": FILE_VERSION,
                "type": tokenizer.type_name, "config": tokenizer.to_config()}
    with atomic_write(path) as f:
        json.dump(document, f, ensure_ascii=False)
        f.write("\n")


def digest(tokenizer: Tokenizer) -> str:
    """A fingerprint of what a tokenizer maps text to and from (its type and state, not its
    file's formatting): equal for the same tokenizer saved twice, different for another
    one of the same size. Checkpoints and exports record it."""
    document = json.dumps({"type": tokenizer.type_name, "config": tokenizer.to_config()},
                          sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(document.encode("utf-8")).hexdigest()[:16]


def load(path: PathLike) -> Tokenizer:
    """Read a tokenizer written by `save`; a missing or malformed file is an error naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer file {path} does not exist") from None
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerFileError(f"{path}: not a tokenizer file (not UTF-8 JSON: {error})") \
            from None
    if not isinstance(document, dict) or document.get("format") != FILE_FORMAT:
        raise TokenizerFileError(f"{path}: not a tokenizer file "
                                 f"(expected a JSON object with format {FILE_FORMAT!r})")
    unknown = sorted(set(document) - {"format", "version", "type", "config"})
    if unknown:
        raise TokenizerFileError(f"{path}: unknown key {unknown[0]!r}")
    if document.get("version") != FILE_VERSION:
        raise TokenizerFileError(f"{path}: unsupported version {document.get('version')!r} "
                                 f"(this code reads version {FILE_VERSION})")
    type_name = document.get("type")
    from cat.text.lexicon import LexiconTokenizer  # it builds on this module

    known = {**TOKENIZERS, LexiconTokenizer.type_name: LexiconTokenizer}
    if not isinstance(type_name, str) or type_name not in known:
        raise TokenizerFileError(f"{path}: unknown tokenizer type {type_name!r}; "
                                 f"known: {sorted(known)}")
    try:
        return known[type_name].from_config(document.get("config"))
    except (ValueError, TypeError) as error:
        raise TokenizerFileError(f"{path}: {error}") from None


# --------------------------------------------------------------------------- training


def iter_transcripts(text_files: Sequence[PathLike]) -> Iterator[str]:
    """Transcripts of Kaldi `text` files (utterance ids stripped, empty ones skipped)."""
    for path in text_files:
        for _, transcript in iter_table(path, allow_empty_value=True):
            if transcript:
                yield transcript


def train_sentencepiece(
    text_files: Sequence[PathLike],
    model_type: str = "char",
    vocab_size: int = 0,
    user_symbols: Sequence[str] = (),
    whitespace: str = "cjk",
    character_coverage: float = 1.0,
    max_sentences: int = 0,
    add_dummy_prefix: bool = False,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model on Kaldi `text` files.

    `vocab_size` counts every id (specials and user symbols included); 0 means "all
    characters" and is only valid for `char` models. `max_sentences` > 0 trains on a
    random sample of that many transcripts. Normalisation is the identity (plus the
    whitespace policy), so `decode(encode(t)) == normalize(t)` for in-vocabulary text.
    """
    if model_type not in SENTENCEPIECE_MODEL_TYPES:
        raise ValueError(f"unknown SentencePiece model type {model_type!r}; "
                         f"expected one of {SENTENCEPIECE_MODEL_TYPES}")
    if vocab_size < 0 or (vocab_size == 0 and model_type != "char"):
        raise ValueError(f"vocab size {vocab_size} is invalid for a {model_type} model "
                         "(0 = all characters is only valid for char models)")
    user_symbols = _check_user_symbols(user_symbols)
    sentences = [normalize_whitespace(t, whitespace) for t in iter_transcripts(text_files)]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise ValueError(f"no transcripts to train on in {[str(p) for p in text_files]}")
    num_specials = 2 + len(user_symbols)
    use_all_vocab = vocab_size == 0
    if use_all_vocab:
        characters = set().union(*map(set, sentences))
        vocab_size = len(characters) + num_specials
    buffer = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=buffer, model_type=model_type,
            vocab_size=vocab_size, use_all_vocab=use_all_vocab,
            hard_vocab_limit=not use_all_vocab, character_coverage=character_coverage,
            pad_id=BLANK_ID, pad_piece=BLANK, unk_id=UNK_ID, unk_piece=UNK, unk_surface=UNK,
            bos_id=-1, eos_id=-1, user_defined_symbols=list(user_symbols),
            add_dummy_prefix=add_dummy_prefix, normalization_rule_name="identity",
            input_sentence_size=max_sentences, shuffle_input_sentence=True,
            num_threads=min(16, os.cpu_count() or 1), minloglevel=2,
        )
    except RuntimeError as error:
        raise ValueError(f"SentencePiece training failed ({model_type}, vocab size "
                         f"{vocab_size}): {error}") from None
    tokenizer = SentencePieceTokenizer(buffer.getvalue(), whitespace=whitespace)
    logger.info("trained a SentencePiece %s model: %d ids from %d transcripts",
                model_type, tokenizer.vocab_size, len(sentences))
    return tokenizer


def train_jieba(
    text_files: Sequence[PathLike],
    vocab_size: int = 0,
    min_count: int = 1,
    user_dict: PathLike | None = None,
    user_symbols: Sequence[str] = (),
    whitespace: str = "cjk",
) -> JiebaTokenizer:
    """Build a jieba word vocabulary from Kaldi `text` files.

    Words seen at least `min_count` times are kept, most frequent first (ties in
    byte order); `vocab_size` > 0 caps the total number of ids, specials included.
    `user_dict` is a jieba user dictionary file; its text is stored in the tokenizer.
    """
    if min_count < 1:
        raise ValueError(f"min count must be >= 1, got {min_count}")
    user_symbols = _check_user_symbols(user_symbols)
    specials = [BLANK, UNK, *user_symbols]
    if vocab_size and vocab_size <= len(specials):
        raise ValueError(f"vocab size {vocab_size} leaves no room for words after "
                         f"{len(specials)} special ids")
    user_dict_text = Path(user_dict).read_text(encoding="utf-8") if user_dict else None
    counter_tokenizer = JiebaTokenizer(specials, user_dict_text,
                                       user_symbols, whitespace)
    counts: collections.Counter[str] = collections.Counter()
    num_transcripts = 0
    for transcript in iter_transcripts(text_files):
        counts.update(counter_tokenizer.words(transcript))
        num_transcripts += 1
    if not num_transcripts:
        raise ValueError(f"no transcripts to train on in {[str(p) for p in text_files]}")
    for symbol in user_symbols:
        counts.pop(symbol, None)
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    if vocab_size:
        words = words[: vocab_size - len(specials)]
    tokenizer = JiebaTokenizer(specials + words, user_dict_text, user_symbols, whitespace)
    tokenizer._segmenter = counter_tokenizer._segmenter  # same dictionaries; loads in ~1 s
    logger.info("built a jieba vocabulary: %d ids (%d distinct words seen, %d kept) "
                "from %d transcripts", tokenizer.vocab_size, len(counts), len(words),
                num_transcripts)
    return tokenizer


def _check_user_symbols(user_symbols: Sequence[str]) -> list[str]:
    symbols = list(user_symbols)
    for symbol in symbols:
        if not symbol or any(c.isspace() for c in symbol) or symbol in (BLANK, UNK):
            raise ValueError(f"invalid user symbol {symbol!r} (empty, has whitespace or "
                             "is a reserved symbol)")
    if len(set(symbols)) != len(symbols):
        raise ValueError(f"duplicate user symbols in {symbols}")
    return symbols


# --------------------------------------------------------------------------- CLI


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cat.text.tokenizer",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a tokenizer on Kaldi text files")
    train.add_argument("--type", required=True, choices=sorted(TOKENIZERS),
                       help="tokenizer kind (hyper-p.json tokenizer.type)")
    train.add_argument("--text", required=True, action="extend", nargs="+",
                       help="Kaldi text file(s) (<utt> <transcript>); repeatable")
    train.add_argument("--out", required=True, help="tokenizer file to write")
    train.add_argument("--vocab-size", type=int, default=0,
                       help="number of ids incl. specials; 0 = all characters (char model) "
                            "or all words (jieba)")
    train.add_argument("--model-type", default="char", choices=SENTENCEPIECE_MODEL_TYPES,
                       help="SentencePiece model type")
    train.add_argument("--user-symbols", default="",
                       help="comma-separated symbols kept whole, ids 2, 3, ...")
    train.add_argument("--whitespace", default="cjk", choices=WHITESPACE_MODES,
                       help="whitespace policy applied before training and encoding")
    train.add_argument("--character-coverage", type=float, default=1.0,
                       help="SentencePiece character coverage")
    train.add_argument("--max-sentences", type=int, default=0,
                       help="SentencePiece: train on a sample of this many transcripts (0 = all)")
    train.add_argument("--user-dict", help="jieba user dictionary file")
    train.add_argument("--min-count", type=int, default=1, help="jieba: minimum word count")

    for name, help_text in (("encode", "print the ids of each input line"),
                            ("decode", "print the text of each line of ids")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--tokenizer", "-t", required=True, help="tokenizer file")
        command.add_argument("--table", action="store_true",
                             help="input lines are '<key> <value>'; the key is kept")
        command.add_argument("inputs", nargs="*", help="lines to process (default: stdin)")

    vocab = commands.add_parser("vocab", help="print '<id> <piece>' for every id")
    vocab.add_argument("--tokenizer", "-t", required=True, help="tokenizer file")
    return parser


def _run_train(args: argparse.Namespace) -> None:
    user_symbols = [s for s in args.user_symbols.split(",") if s]
    if args.type == "sentencepiece":
        tokenizer = train_sentencepiece(
            args.text, args.model_type, args.vocab_size, user_symbols, args.whitespace,
            args.character_coverage, args.max_sentences)
    else:
        tokenizer = train_jieba(args.text, args.vocab_size, args.min_count, args.user_dict,
                                user_symbols, args.whitespace)
    save(tokenizer, args.out)
    logger.info("wrote %s (%s, %d ids)", args.out, tokenizer.type_name, tokenizer.vocab_size)


def _run_convert(args: argparse.Namespace) -> None:
    tokenizer = load(args.tokenizer)
    lines = args.inputs or (line.rstrip("\r\n") for line in sys.stdin)
    for lineno, line in enumerate(lines, 1):
        key = None
        if args.table:
            key, _, line = line.partition(" ")
        if args.command == "encode":
            value = " ".join(map(str, tokenizer.encode(line)))
        else:
            try:
                value = tokenizer.decode(int(field) for field in line.split())
            except ValueError as error:
                raise SystemExit(f"input line {lineno}: {error}") from None
        print(value if key is None else f"{key} {value}")


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    args = _build_parser().parse_args(argv)
    setup_logging()
    if args.command == "train":
        _run_train(args)
    elif args.command in ("encode", "decode"):
        _run_convert(args)
    else:
        tokenizer = load(args.tokenizer)
        for token_id in range(tokenizer.vocab_size):
            print(token_id, tokenizer.id_to_piece(token_id))


if __name__ == "__main__":
    main()
