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

Usage:
    model = estimate([["今", "天"], ["天", "气"]], order=3)
    write_arpa(model, "lm.arpa")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from cat.core.io import PathLike, atomic_write

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


def read_arpa(path: PathLike) -> list[dict[tuple[str, ...], tuple[float, float]]]:
    """Per order, {n-gram: (log10 prob, log10 backoff)}; errors name the file and line."""
    tables: list[dict[tuple[str, ...], tuple[float, float]]] = []
    declared: list[int] = []
    section = "header"
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            where = f"{path}:{lineno}"
            if not line:
                continue
            if line == "\\data\\":
                section = "data"
            elif line == "\\end\\":
                section = "end"
            elif line.startswith("\\") and line.endswith("-grams:"):
                n = int(line[1:-len("-grams:")])
                if n != len(tables) + 1:
                    raise ValueError(f"{where}: {n}-grams section out of order")
                tables.append({})
                section = "grams"
            elif section == "data":
                if not line.startswith("ngram ") or "=" not in line:
                    raise ValueError(f"{where}: expected 'ngram N=COUNT', got {line!r}")
                declared.append(int(line.split("=", 1)[1]))
            elif section == "grams":
                fields = line.split("\t")
                n = len(tables)
                words = tuple(fields[1].split(" ")) if len(fields) > 1 else ()
                if len(fields) not in (2, 3) or len(words) != n:
                    raise ValueError(f"{where}: expected 'LOGPROB<tab>{n} words"
                                     f"[<tab>BACKOFF]', got {line!r}")
                tables[-1][words] = (float(fields[0]),
                                     float(fields[2]) if len(fields) == 3 else 0.0)
    if section != "end":
        raise ValueError(f"{path}: no \\end\\ line (truncated file?)")
    counts = [len(t) for t in tables]
    if counts != declared:
        raise ValueError(f"{path}: the header declares {declared} n-grams per order, "
                         f"the file holds {counts}")
    return tables
