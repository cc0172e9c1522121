"""Text to language-model tokens: characters, jieba words, or an experiment's tokenizer.

The same function turns training text and decoding hypotheses into tokens, so a model
is always queried with the units it was estimated on.

* `char`: every character, whitespace removed (the units of a SentencePiece `char`
  tokenizer on Chinese text).
* `word`: jieba words (default dictionary, HMM off, whitespace dropped), as CAT's word
  n-grams; AISHELL-1's own transcript segmentation is discarded so that training text and
  hypotheses (which carry no spaces) are segmented alike.
* `tokenizer`: the pieces of a `cat.text.tokenizer` file (`<unk>` for unknown text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from cat.core.io import PathLike, iter_table
from cat.text.tokenizer import BLANK, UNK, JiebaTokenizer, Tokenizer, normalize_whitespace
from cat.text.tokenizer import load as load_tokenizer

UNITS = ("char", "word", "tokenizer")

Splitter = Callable[[str], list[str]]


def make_splitter(unit: str, tokenizer: PathLike | Tokenizer | None = None) -> Splitter:
    """A function text -> tokens for `unit` (see the module doc)."""
    if unit == "char":
        return lambda text: list(normalize_whitespace(text, "remove"))
    if unit == "word":
        return JiebaTokenizer([BLANK, UNK]).words
    if unit == "tokenizer":
        if tokenizer is None:
            raise ValueError("unit 'tokenizer' needs a tokenizer file")
        model = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        return lambda text: [model.id_to_piece(i) for i in model.encode(text)]
    raise ValueError(f"unknown language-model unit {unit!r}; allowed: {', '.join(UNITS)}")


def iter_text(paths: Sequence[PathLike], kaldi: bool = True) -> Iterator[str]:
    """Sentences of text files: Kaldi `text` files (`<utt> <transcript>`, the id dropped)
    or, with `kaldi=False`, one sentence per line. Empty sentences are skipped."""
    for path in paths:
        if kaldi:
            for _, transcript in iter_table(path, allow_empty_value=True):
                if transcript.strip():
                    yield transcript
        else:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield line.strip()
