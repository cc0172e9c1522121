"""N-gram language models: interpolated modified Kneser-Ney estimation and ARPA files.

No n-gram trainer installs from the package registries (the `kenlm` Python module only
queries), so the estimator is written here, with numpy, following Chen & Goodman (1998)
and the conventions of KenLM's `lmplz`:

* Sentences are padded as `<s> w1 ... wk </s>`. Counted n-grams are every window of
  the padded sentence of length `order`, plus the shorter windows that start with `<s>`
  (they cannot be extended to the left).
* Adjusted counts: the highest order and n-grams starting with `<s>` keep their raw
  counts; every other n-gram counts its distinct left extensions (`N1+(. w)`).
* Discounts per order from the count-of-counts `t_k` of the adjusted counts
  (`Y = t1 / (t1 + 2 t2)`, `D_k = k - (k + 1) Y t_{k+1} / t_k` for k = 1, 2, 3+).
* Interpolation: `p(w | h) = (a(h w) - D(a)) / sum_v a(h v) + gamma(h) p(w | h')`,
  `gamma(h) = (D1 N1(h .) + D2 N2(h .) + D3 N3+(h .)) / sum_v a(h v)`, with the unigrams
  interpolated with the uniform distribution over the vocabulary (`<unk>` and `</s>`
  included, `<s>` excluded); `<unk>` gets only that share. `gamma(h)` is the ARPA backoff
  of `h`.

An n-gram is stored as (index of its prefix in the table one order lower, last token),
so the tables of every order are plain sorted integer arrays however large the
vocabulary.

ARPA files, whoever wrote them, are read by `iter_arpa` (streaming) and `read_arpa`
(into tables), which check the whole file and raise an ArpaError naming the file, the
line and what is wrong (see `iter_arpa`); tools that abort the process on a bad file
(kaldilm) are given only files that passed.

Usage:
    model = estimate([["今", "天"], ["天", "气"]], order=3)
    write_arpa(model, "lm.arpa")
    tables = read_arpa("lm.arpa")
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from cat.core.io import BYTE_ORDER_MARK, PathLike, atomic_write, not_utf8_message

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
LOG10_ZERO = -99.0  # ARPA's log10 probability of <s>, which is never predicted
LN10 = math.log(10.0)


class DiscountError(ValueError):
    """Modified Kneser-Ney discounts cannot be computed (too little or artificial data)."""


@dataclasses.dataclass(frozen=True)
class NGramModel:
    """An estimated model. Per order n (index n - 1):

    * `grams[n-1]`: [M_n, n] token ids, lexicographically sorted;
    * `log10_prob[n-1]`: interpolated log10 p(w_n | w_1 .. w_{n-1});
    * `log10_backoff[n-1]`: log10 gamma of the n-gram as a context (0 where it is none);
    * `adjusted_counts[n-1]` and `discounts[n-1]` = (D1, D2, D3+).
    """

    vocab: tuple[str, ...]
    grams: tuple[np.ndarray, ...]
    log10_prob: tuple[np.ndarray, ...]
    log10_backoff: tuple[np.ndarray, ...]
    adjusted_counts: tuple[np.ndarray, ...]
    discounts: tuple[tuple[float, float, float], ...]

    @property
    def order(self) -> int:
        return len(self.grams)

    def entries(self, order: int) -> dict[tuple[str, ...], tuple[float, float]]:
        """{n-gram tokens: (log10 prob, log10 backoff)} of one order (for tests and tools)."""
        index = order - 1
        words = self.vocab
        return {tuple(words[t] for t in row): (float(p), float(b)) for row, p, b in zip(
            self.grams[index].tolist(), self.log10_prob[index], self.log10_backoff[index],
            strict=True)}


# ------------------------------------------------------------------------ counting


@dataclasses.dataclass
class _Order:
    """The distinct n-grams of one order, as found in the corpus."""

    keys: np.ndarray  # prefix index * vocab size + last token, sorted
    first: np.ndarray  # a position in the flat corpus where each n-gram starts
    raw: np.ndarray  # raw counts


def check_token(token: str, number: int) -> None:
    """Refuse a token an ARPA file cannot hold (empty, with whitespace, or a sentence
    boundary); `number` is the sentence's, for the message."""
    if not token or token.isspace() or any(c.isspace() for c in token):
        raise ValueError(f"sentence {number}: token {token!r} is empty or holds "
                         "whitespace, which an ARPA file cannot represent")
    if token in (BOS, EOS):
        raise ValueError(f"sentence {number}: {token} is reserved for sentence boundaries")


def _flatten(sentences: Iterable[Sequence[str]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Vocabulary (specials first, then tokens by first appearance), the padded corpus as one
    id array, and for each position the end (exclusive) of its sentence."""
    index = {BOS: BOS_ID, EOS: EOS_ID, UNK: UNK_ID}
    ids: list[int] = []
    ends: list[int] = []
    for number, sentence in enumerate(sentences, 1):
        start = len(ids)
        ids.append(BOS_ID)
        for token in sentence:
            check_token(token, number)
            ids.append(index.setdefault(token, len(index)))
        ids.append(EOS_ID)
        ends.extend([len(ids)] * (len(ids) - start))
    if not ids:
        raise ValueError("no sentences to estimate a language model from")
    vocab = sorted(index, key=index.__getitem__)
    return vocab, np.asarray(ids, np.int64), np.asarray(ends, np.int64)


def _count(corpus: np.ndarray, ends: np.ndarray, vocab_size: int,
           order: int) -> tuple[list[_Order], list[np.ndarray]]:
    """Distinct n-grams of every order and, per order, the table index of the n-gram that
    starts at each corpus position (-1 where none fits)."""
    positions = np.arange(len(corpus))
    unigrams = _Order(np.arange(vocab_size), np.zeros(vocab_size, np.int64),
                      np.bincount(corpus, minlength=vocab_size))
    orders = [unigrams]
    index_at = [corpus.copy()]
    for n in range(2, order + 1):
        starts = positions[positions + n <= ends]
        keys = index_at[-1][starts] * vocab_size + corpus[starts + n - 1]
        unique, first, inverse, raw = np.unique(keys, return_index=True, return_inverse=True,
                                                return_counts=True)
        at = np.full(len(corpus), -1, np.int64)
        at[starts] = inverse
        orders.append(_Order(unique, starts[first], raw))
        index_at.append(at)
    return orders, index_at


def _suffix_index(orders: list[_Order], index_at: list[np.ndarray], n: int) -> np.ndarray:
    """For each n-gram (n >= 2), the index of its suffix (drop the first token) in order n-1."""
    return index_at[n - 2][orders[n - 1].first + 1]


def _adjusted_counts(orders: list[_Order], index_at: list[np.ndarray],
                     corpus: np.ndarray) -> list[np.ndarray]:
    top = len(orders)
    adjusted: list[np.ndarray] = [np.empty(0)] * top
    adjusted[top - 1] = orders[top - 1].raw.copy()
    for n in range(top - 1, 0, -1):
        table = orders[n - 1]
        continuation = np.bincount(_suffix_index(orders, index_at, n + 1),
                                   minlength=len(table.keys))
        if n == 1:
            counts = continuation
        else:
            starts_with_bos = corpus[table.first] == BOS_ID
            counts = np.where(starts_with_bos, table.raw, continuation)
        adjusted[n - 1] = counts
    adjusted[0] = adjusted[0].copy()
    adjusted[0][BOS_ID] = 0  # <s> is never predicted
    return adjusted


# ---------------------------------------------------------------------- estimation


def discounts_from_counts(counts: np.ndarray, order: int,
                          fallback: tuple[float, float, float] | None = None
                          ) -> tuple[float, float, float]:
    """(D1, D2, D3+) of one order from its adjusted counts (Chen & Goodman eq. 26)."""
    t = [int(np.count_nonzero(counts == k)) for k in range(1, 5)]
    try:
        for k in range(3):
            if t[k] == 0:
                raise DiscountError(
                    f"{order}-grams: no n-gram has adjusted count {k + 1}, so the modified "
                    f"Kneser-Ney discounts are undefined (count-of-counts {t}); the corpus is "
                    "too small or artificial: use more text or set discount_fallback")
        y = t[0] / (t[0] + 2 * t[1])
        values = tuple(k + 1 - (k + 2) * y * t[k + 1] / t[k] for k in range(3))
        for k, value in enumerate(values):
            if not 0.0 <= value <= k + 1:
                raise DiscountError(f"{order}-grams: discount D{k + 1} = {value:.4f} is out of "
                                    f"[0, {k + 1}] (count-of-counts {t}); set discount_fallback")
    except DiscountError:
        if fallback is None:
            raise
        return tuple(float(v) for v in fallback)  # type: ignore[return-value]
    return values  # type: ignore[return-value]


def _discount_of(counts: np.ndarray, discounts: tuple[float, float, float]) -> np.ndarray:
    table = np.array([0.0, *discounts])
    return table[np.minimum(counts, 3)]


def _context_sums(prefix: np.ndarray, counts: np.ndarray, size: int,
                  discounts: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Per context: the sum of adjusted counts, and gamma (the mass left for backing off)."""
    denominator = np.bincount(prefix, weights=counts, minlength=size)
    mass = np.bincount(prefix, weights=_discount_of(counts, discounts), minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        gamma = np.where(denominator > 0, mass / denominator, 0.0)
    return denominator, gamma


def estimate(sentences: Iterable[Sequence[str]], order: int,
             discount_fallback: tuple[float, float, float] | None = None) -> NGramModel:
    """Estimate an interpolated modified Kneser-Ney model of `order` from token lists.

    `discount_fallback` (e.g. lmplz's (0.5, 1.0, 1.5)) replaces the discounts of an order
    whose count-of-counts do not define them; without it such data raises DiscountError.
    """
    if order < 1:
        raise ValueError(f"order must be >= 1, got {order}")
    vocab, corpus, ends = _flatten(sentences)
    size = len(vocab)
    orders, index_at = _count(corpus, ends, size, order)
    adjusted = _adjusted_counts(orders, index_at, corpus) if order > 1 else \
        [np.where(np.arange(size) == BOS_ID, 0, orders[0].raw)]
    discounts = [discounts_from_counts(adjusted[n - 1], n, discount_fallback)
                 for n in range(1, order + 1)]

    # Unigrams: one context, interpolated with the uniform distribution (<s> excluded).
    counts = adjusted[0]
    denominator, gamma = _context_sums(np.zeros(size, np.int64), counts, 1, discounts[0])
    probs = [(counts - _discount_of(counts, discounts[0])) / denominator[0]
             + gamma[0] / (size - 1)]
    backoffs: list[np.ndarray] = []
    for n in range(2, order + 1):
        table = orders[n - 1]
        counts = adjusted[n - 1]
        prefix = table.keys // size
        denominator, gamma = _context_sums(prefix, counts, len(orders[n - 2].keys),
                                           discounts[n - 1])
        lower = probs[-1][_suffix_index(orders, index_at, n)]
        probs.append((counts - _discount_of(counts, discounts[n - 1])) / denominator[prefix]
                     + gamma[prefix] * lower)
        backoffs.append(gamma)
    backoffs.append(np.zeros(len(orders[-1].keys)))

    grams = tuple(corpus[table.first[:, None] + np.arange(n)]
                  for n, table in enumerate(orders, 1))
    grams = (np.arange(size)[:, None], *grams[1:])
    with np.errstate(divide="ignore"):
        log10_prob = [np.log10(p) for p in probs]
        log10_backoff = [np.where(b > 0, np.log10(np.where(b > 0, b, 1.0)), 0.0)
                         for b in backoffs]
    log10_prob[0][BOS_ID] = LOG10_ZERO
    return NGramModel(tuple(vocab), grams, tuple(log10_prob), tuple(log10_backoff),
                      tuple(adjusted), tuple(discounts))


# --------------------------------------------------------------------------- ARPA


def write_arpa(model: NGramModel, path: PathLike) -> None:
    """Write `model` as an ARPA file (atomically)."""
    with atomic_write(path) as f:
        f.write("\\data\\\n")
        for n, grams in enumerate(model.grams, 1):
            f.write(f"ngram {n}={len(grams)}\n")
        for n in range(1, model.order + 1):
            f.write(f"\n\\{n}-grams:\n")
            words = model.vocab
            highest = n == model.order
            for row, prob, backoff in zip(model.grams[n - 1].tolist(),
                                          model.log10_prob[n - 1].tolist(),
                                          model.log10_backoff[n - 1].tolist(), strict=True):
                text = " ".join(words[t] for t in row)
                if highest or row[-1] in (EOS_ID, UNK_ID):
                    f.write(f"{prob:.7g}\t{text}\n")
                else:
                    f.write(f"{prob:.7g}\t{text}\t{backoff:.7g}\n")
        f.write("\n\\end\\\n")


#: Whitespace (`str.isspace`) other than the field separators (spaces, tabs) and the line
#: end (LF): kaldilm splits fields on spaces and tabs only, `str.split` on all of these.
_OTHER_SPACE = re.compile("[\r\x0b\x0c\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029"
                          "\u202f\u205f\u3000]")


class ArpaError(ValueError):
    """An ARPA file that cannot be used; the message names the file and the line."""


class ArpaEntry(NamedTuple):
    """One n-gram line of an ARPA file."""

    line: int
    words: tuple[str, ...]
    log10_prob: float
    log10_backoff: float


@dataclasses.dataclass
class _ArpaScan:
    """Where `iter_arpa` is in a file: the declared counts and the sections read."""

    path: PathLike
    declared: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (count, line)
    order: int = 0  # the n-gram section being read (0: none yet)
    found: int = 0  # n-grams of that section so far
    section_line: int = 0
    unigrams: set[str] = dataclasses.field(default_factory=set)
    ended: bool = False

    def fail(self, line: int, what: str) -> ArpaError:
        return ArpaError(f"{self.path}:{line}: {what}")

    def close_section(self, line: int) -> None:
        """Check the section just read holds as many n-grams as the header declares."""
        if not self.order:
            return
        declared, header_line = self.declared[self.order - 1]
        if self.found != declared:
            raise self.fail(header_line, f"the header declares {declared} {self.order}-grams, "
                            f"the \\{self.order}-grams: section (lines {self.section_line}-"
                            f"{line}) holds {self.found}")

    def header(self, lineno: int, line: str) -> None:
        name, _, count = line.partition("=")
        fields = name.split()
        if len(fields) != 2 or fields[0] != "ngram" or not count.strip().isdigit():
            raise self.fail(lineno, f"expected 'ngram N=COUNT' in the \\data\\ section, "
                            f"got {line!r}")
        if fields[1] != str(len(self.declared) + 1):
            raise self.fail(lineno, f"'ngram {fields[1]}=' where 'ngram "
                            f"{len(self.declared) + 1}=' is expected (orders 1, 2, ... in turn)")
        self.declared.append((int(count), lineno))

    def section(self, lineno: int, line: str, last: int) -> None:
        """A `\\N-grams:` or `\\end\\` line (`last`: the line before it)."""
        if not self.declared:
            raise self.fail(lineno, f"{line} before any 'ngram N=COUNT' of the \\data\\ section")
        self.close_section(last)
        expected = self.order + 1
        if line == "\\end\\" and self.order == len(self.declared):
            self.ended = True
            return
        if line != f"\\{expected}-grams:" or expected > len(self.declared):
            want = "\\end\\" if expected > len(self.declared) else f"\\{expected}-grams:"
            raise self.fail(lineno, f"{line} where {want} is expected (the header declares "
                            f"{len(self.declared)} orders)")
        self.order, self.found, self.section_line = expected, 0, lineno

    def entry(self, lineno: int, line: str) -> ArpaEntry:
        n = self.order
        fields = line.split()
        top = n == len(self.declared)
        if not n + 1 <= len(fields) <= n + (1 if top else 2):
            shape = f"LOGPROB, {n} word(s)" + ("" if top else " [, BACKOFF]")
            raise self.fail(lineno, f"expected {shape} in the {n}-grams section"
                            f"{' (the highest order has no back-off)' if top else ''}, "
                            f"got {line!r}")
        prob = self.number(lineno, fields[0], "log10 probability")
        if prob > 0:
            raise self.fail(lineno, f"log10 probability {fields[0]} is above 0 "
                            "(a probability above 1)")
        backoff = self.number(lineno, fields[n + 1], "log10 back-off") \
            if len(fields) > n + 1 else 0.0
        words = tuple(fields[1:n + 1])
        self.check_words(lineno, words)
        self.found += 1
        return ArpaEntry(lineno, words, prob, backoff)

    def number(self, lineno: int, text: str, what: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise self.fail(lineno, f"{what} {text!r} is not a number") from None
        if not math.isfinite(value):
            raise self.fail(lineno, f"{what} {text} is not a finite number (kaldilm cannot "
                            f"read it): leave a never-seen n-gram out, or give it a floor "
                            f"such as {LOG10_ZERO:g}")
        return value

    def check_words(self, lineno: int, words: tuple[str, ...]) -> None:
        if BOS in words[1:] or EOS in words[:-1]:
            raise self.fail(lineno, f"n-gram {' '.join(words)!r}: {BOS} may only begin an "
                            f"n-gram and {EOS} only end one")
        if len(words) == 1:
            if words[0] in self.unigrams:
                raise self.fail(lineno, f"unigram {words[0]!r} given twice")
            self.unigrams.add(words[0])
            return
        unknown = [w for w in words if w not in self.unigrams]
        if unknown:
            raise self.fail(lineno, f"n-gram {' '.join(words)!r}: word {unknown[0]!r} is not "
                            "among the unigrams")

    def other_space(self, lineno: int, raw: str) -> ArpaError:
        char = _OTHER_SPACE.search(raw).group()
        if char == "\r":
            return self.fail(lineno, "Windows line end (CR LF), which kaldilm reads as part "
                             "of the last word: convert the file with dos2unix")
        return self.fail(lineno, f"holds the whitespace {char!r}, which kaldilm reads as "
                         "part of a word and this reader as a separator: use spaces or tabs "
                         "between fields, none inside words")

    def finish(self, last: int) -> None:
        if not self.declared:
            raise ArpaError(f"{self.path}: no \\data\\ section with 'ngram N=COUNT' lines"
                            f"{' (empty file)' if last == 0 else ''}")
        if not self.ended:
            where = f"in the {self.order}-grams section" if self.order > 0 else \
                "after the \\data\\ section"
            raise self.fail(last, f"the file ends {where} without \\end\\ (truncated file?)")
        missing = [w for w in (BOS, EOS) if w not in self.unigrams]
        if missing:
            raise ArpaError(f"{self.path}: no {missing[0]} unigram (every ARPA model "
                            f"has {BOS} and {EOS})")


def iter_arpa(path: PathLike) -> Iterator[ArpaEntry]:
    """Yield the n-grams of an ARPA file, lowest order first, checking the whole file
    before the last one is yielded: an ArpaError names the file and the line.

    What is refused (what kaldilm aborts the process on, or silently skips, and what
    kenlm refuses): a file without `\\data\\`, `ngram N=COUNT` lines out of order,
    sections missing, out of order or cut short (no `\\end\\`), a section whose n-grams
    are not as many as its header count, a line without the log10 probability and N
    words (fields separated by tabs or spaces, as both read them), a back-off on the
    highest order, a probability or back-off that is not a finite number (NaN, `inf`,
    `-inf`; floors such as -99, which SRILM and this module write for `<s>`, and lmplz's
    0 for `<s>` are fine), a probability above 1, a unigram given twice, a word of a
    longer n-gram that is no unigram, `<s>` other than first or `</s>` other than last,
    no `<s>` or `</s>` unigram, whitespace other than spaces and tabs (the CR of Windows
    line ends, no-break or ideographic spaces: kaldilm reads them as part of a word), a
    UTF-8 byte-order mark, bytes that are not UTF-8. Lines before `\\data\\` and after
    `\\end\\` are ignored. Longer n-grams given twice are not looked for (`read_arpa`
    does).
    """
    scan = _ArpaScan(path)
    try:
        with open(path, encoding="utf-8", newline="\n") as f:  # a CR stays, as for kaldilm
            yield from _scan_lines(scan, f)
    except UnicodeDecodeError as error:
        raise ArpaError(not_utf8_message(path, error)) from None


def _scan_lines(scan: _ArpaScan, lines: Iterable[str]) -> Iterator[ArpaEntry]:
    """`iter_arpa` of an open file. An n-gram line that passes the cheap checks here
    (most lines of a large file) is yielded at once; any other goes through `scan`, which
    finds what is wrong."""
    last = 0
    n, top = 0, False  # the n-gram section being read (0 outside one), the highest order?
    unigrams, other_space = scan.unigrams, _OTHER_SPACE.search
    for lineno, raw in enumerate(lines, 1):
        fields = raw.split()
        if not fields and not raw.strip(" \t\r\n"):  # blank, for kaldilm too
            continue
        if n > 1 and fields and fields[0][0] != "\\" and not other_space(raw):
            extra = len(fields) - n  # 1, or 2 with a back-off
            words = fields[1:n + 1]
            try:
                prob = float(fields[0])
                backoff = float(fields[-1]) if extra == 2 else 0.0
            except ValueError:
                prob = math.nan
            if (extra == 1 or (extra == 2 and not top)) and -math.inf < prob <= 0.0 \
                    and -math.inf < backoff < math.inf and unigrams.issuperset(words) \
                    and BOS not in words[1:] and EOS not in words[:-1]:
                scan.found += 1
                last = lineno
                yield ArpaEntry(lineno, tuple(words), prob, backoff)
                continue
        line = raw.strip()
        if lineno == 1 and line.startswith(BYTE_ORDER_MARK):
            raise scan.fail(1, "starts with a UTF-8 byte-order mark (BOM), which kaldilm "
                            "cannot read: remove it")
        if scan.ended:
            continue
        if (scan.order or line == "\\data\\") and _OTHER_SPACE.search(raw):
            raise scan.other_space(lineno, raw)
        if line == "\\data\\" and not scan.declared and not scan.order:
            scan.order = -1  # in the \data\ section
        elif line.startswith("\\"):
            scan.order = max(scan.order, 0)
            scan.section(lineno, line, last)
            n = 0 if scan.ended else scan.order
            top = n == len(scan.declared)
        elif scan.order == -1:
            scan.header(lineno, line)
        elif scan.order > 0:
            yield scan.entry(lineno, line)
        last = lineno
    scan.finish(last)


def write_arpa_tables(tables: Sequence[dict[tuple[str, ...], tuple[float, float]]],
                      path: PathLike) -> None:
    """Write `read_arpa`'s tables (per order, {n-gram: (log10 prob, log10 backoff)}) as an
    ARPA file (atomically); a back-off of 0 is left out, as on the highest order."""
    with atomic_write(path) as f:
        f.write("\\data\\\n" + "".join(f"ngram {n}={len(table)}\n"
                                       for n, table in enumerate(tables, 1)))
        for n, table in enumerate(tables, 1):
            f.write(f"\n\\{n}-grams:\n")
            for gram, (prob, backoff) in table.items():
                tail = f"\t{backoff:.7g}" if n < len(tables) and backoff else ""
                f.write(f"{prob:.7g}\t{' '.join(gram)}{tail}\n")
        f.write("\n\\end\\\n")


def read_arpa(path: PathLike) -> list[dict[tuple[str, ...], tuple[float, float]]]:
    """Per order, {n-gram: (log10 prob, log10 backoff)}, checked by `iter_arpa` and for
    n-grams given twice; errors (ArpaError) name the file and line."""
    tables: list[dict[tuple[str, ...], tuple[float, float]]] = []
    for entry in iter_arpa(path):
        n = len(entry.words)
        if n > len(tables):
            tables.append({})
        if entry.words in tables[-1]:
            raise ArpaError(f"{path}:{entry.line}: n-gram {' '.join(entry.words)!r} given "
                            "twice")
        tables[-1][entry.words] = (entry.log10_prob, entry.log10_backoff)
    return tables
