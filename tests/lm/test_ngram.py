"""The modified Kneser-Ney estimator against an independent, direct computation, and its
ARPA files read back by our reader and by kenlm."""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from cat.lm.ngram import (
    BOS,
    EOS,
    UNK,
    ArpaError,
    DiscountError,
    discounts_from_counts,
    estimate,
    read_arpa,
    write_arpa,
)

kenlm = pytest.importorskip("kenlm")


def make_corpus(num_sentences: int, seed: int) -> list[list[str]]:
    """Sentences with some structure: frequent words, fixed phrases, varied lengths."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(300)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    phrases = [["w1", "w2", "w3"], ["w4", "w1"], ["w7", "w7", "w2"]]
    sentences = []
    for _ in range(num_sentences):
        sentence: list[str] = []
        for _ in range(rng.randint(1, 9)):
            if rng.random() < 0.3:
                sentence += rng.choice(phrases)
            else:
                sentence.append(rng.choices(words, weights)[0])
        sentences.append(sentence)
    return sentences


class DirectKneserNey:
    """Interpolated modified Kneser-Ney written from the definitions, with dictionaries and
    recursion, sharing no code with `cat.lm.ngram`."""

    def __init__(self, sentences: list[list[str]], order: int) -> None:
        self.order = order
        occurrences: list[Counter] = [Counter() for _ in range(order + 1)]
        for sentence in sentences:
            padded = [BOS, *sentence, EOS]
            for n in range(1, order + 1):
                for i in range(len(padded) - n + 1):
                    occurrences[n][tuple(padded[i:i + n])] += 1
        self.vocab = {w for (w,) in occurrences[1]} | {UNK}
        left_extensions: list[defaultdict] = [defaultdict(set) for _ in range(order + 1)]
        for n in range(2, order + 1):
            for gram in occurrences[n]:
                left_extensions[n - 1][gram[1:]].add(gram[0])
        self.counts: list[dict] = [{} for _ in range(order + 1)]
        for n in range(1, order + 1):
            for gram, raw in occurrences[n].items():
                if gram == (BOS,):
                    continue
                if n == order or gram[0] == BOS:
                    self.counts[n][gram] = raw
                else:
                    self.counts[n][gram] = len(left_extensions[n][gram])
        self.discounts = [None] + [self._discounts(n) for n in range(1, order + 1)]
        self.context_total: list[Counter] = [Counter() for _ in range(order + 1)]
        self.context_mass: list[Counter] = [Counter() for _ in range(order + 1)]
        for n in range(1, order + 1):
            for gram, count in self.counts[n].items():
                self.context_total[n][gram[:-1]] += count
                self.context_mass[n][gram[:-1]] += self.discount(n, count)

    def _discounts(self, n: int) -> tuple[float, float, float]:
        t = Counter(c for c in self.counts[n].values() if c <= 4)
        y = t[1] / (t[1] + 2 * t[2])
        return (1 - 2 * y * t[2] / t[1], 2 - 3 * y * t[3] / t[2], 3 - 4 * y * t[4] / t[3])

    def discount(self, n: int, count: int) -> float:
        return 0.0 if count == 0 else self.discounts[n][min(count, 3) - 1]

    def gamma(self, context: tuple[str, ...]) -> float | None:
        n = len(context) + 1
        total = self.context_total[n].get(context, 0)
        return self.context_mass[n][context] / total if total else None

    def prob(self, word: str, context: tuple[str, ...]) -> float:
        """p(word | context) by the interpolation recursion."""
        if word not in self.vocab:
            word = UNK
        context = context[max(0, len(context) - (self.order - 1)):] if self.order > 1 else ()
        if not context:
            total = self.context_total[1][()]
            count = self.counts[1].get((word,), 0)
            uniform = 1.0 / (len(self.vocab) - 1)  # <unk> and </s> included, <s> excluded
            return (count - self.discount(1, count)) / total + self.gamma(()) * uniform
        gamma = self.gamma(context)
        if gamma is None:  # an unseen context passes everything to the shorter one
            return self.prob(word, context[1:])
        n = len(context) + 1
        count = self.counts[n].get((*context, word), 0)
        return ((count - self.discount(n, count)) / self.context_total[n][context]
                + gamma * self.prob(word, context[1:]))

    def sentence_log10(self, sentence: list[str]) -> float:
        history = [BOS]
        total = 0.0
        for word in [*sentence, EOS]:
            total += math.log10(self.prob(word, tuple(history)))
            history.append(word if word in self.vocab else UNK)
        return total


@pytest.fixture(scope="module")
def corpus() -> list[list[str]]:
    return make_corpus(400, seed=1)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_ngram_probability_and_backoff_match_the_direct_computation(corpus, order):
    model = estimate(corpus, order)
    direct = DirectKneserNey(corpus, order)
    for n in range(1, order + 1):
        np.testing.assert_allclose(model.discounts[n - 1], direct.discounts[n], rtol=1e-12)
        entries = model.entries(n)
        expected_grams = set(direct.counts[n]) | ({(BOS,), (UNK,)} if n == 1 else set())
        assert set(entries) == expected_grams
        for gram, (log10_prob, log10_backoff) in entries.items():
            if gram == (BOS,):
                assert log10_prob == -99.0
            else:
                expected = math.log10(direct.prob(gram[-1], gram[:-1]))
                assert log10_prob == pytest.approx(expected, abs=1e-10), gram
            gamma = direct.gamma(gram) if n < order else None
            expected_backoff = math.log10(gamma) if gamma else 0.0
            assert log10_backoff == pytest.approx(expected_backoff, abs=1e-10), gram


def test_probabilities_of_each_context_sum_to_one(corpus):
    model = estimate(corpus, 3)
    direct = DirectKneserNey(corpus, 3)
    vocabulary = sorted(direct.vocab - {BOS} | {EOS})
    for context in [(), ("w1",), (BOS, "w4"), ("w1", "w2"), ("w9", "w9")]:
        total = sum(direct.prob(w, context) for w in vocabulary)
        assert total == pytest.approx(1.0, abs=1e-12), context
    # The estimator's unigrams (with <unk>) are a distribution too.
    unigrams = model.entries(1)
    assert sum(10 ** p for g, (p, _) in unigrams.items() if g != (BOS,)) == \
        pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("order", [2, 3, 5])
def test_kenlm_scores_our_arpa_like_the_direct_computation(corpus, order, tmp_path):
    arpa = tmp_path / "lm.arpa"
    write_arpa(estimate(corpus, order), arpa)
    lm = kenlm.Model(str(arpa))
    direct = DirectKneserNey(corpus, order)
    held_out = [*make_corpus(60, seed=7), ["w1", "oov", "w2"], ["unseen", "words"], []]
    total_direct = total_kenlm = 0.0
    num_tokens = 0
    for sentence in held_out:
        expected = direct.sentence_log10(sentence)
        got = lm.score(" ".join(sentence), bos=True, eos=True)
        assert got == pytest.approx(expected, abs=1e-4), sentence
        total_direct += expected
        total_kenlm += got
        num_tokens += len(sentence) + 1
    perplexity_direct = 10 ** (-total_direct / num_tokens)
    perplexity_kenlm = 10 ** (-total_kenlm / num_tokens)
    assert perplexity_kenlm == pytest.approx(perplexity_direct, rel=1e-4)


def test_arpa_round_trip(corpus, tmp_path):
    model = estimate(corpus, 3)
    arpa = tmp_path / "lm.arpa"
    write_arpa(model, arpa)
    tables = read_arpa(arpa)
    assert len(tables) == 3
    for n, table in enumerate(tables, 1):
        entries = model.entries(n)
        assert set(table) == set(entries)
        for gram, (prob, backoff) in table.items():
            assert prob == pytest.approx(entries[gram][0], abs=1e-6)
            assert backoff == pytest.approx(entries[gram][1], abs=1e-6)


def test_discounts_from_known_count_of_counts():
    # t1..t4 = 3, 2, 1, 1: Y = 3/7, D1 = 3/7, D2 = 19/14, D3+ = 9/7 (Chen & Goodman eq. 26).
    d1, d2, d3 = discounts_from_counts(np.array([1, 1, 1, 2, 2, 3, 4, 9]), 1)
    assert (d1, d2, d3) == pytest.approx((3 / 7, 19 / 14, 9 / 7))


def test_too_little_data_raises_unless_fallback_is_given():
    sentences = [["a", "b"], ["a", "b"]]
    with pytest.raises(DiscountError, match="adjusted count"):
        estimate(sentences, 2)
    model = estimate(sentences, 2, discount_fallback=(0.5, 1.0, 1.5))
    assert model.discounts == ((0.5, 1.0, 1.5), (0.5, 1.0, 1.5))


def test_bad_tokens_name_the_sentence():
    with pytest.raises(ValueError, match="sentence 2: token 'a b'"):
        estimate([["x"], ["a b"]], 2)
    with pytest.raises(ValueError, match="sentence 1: </s> is reserved"):
        estimate([["x", EOS]], 2)


def test_truncated_arpa_is_an_error(corpus, tmp_path):
    arpa = tmp_path / "lm.arpa"
    write_arpa(estimate(corpus, 2), arpa)
    lines = arpa.read_text(encoding="utf-8").splitlines()
    (tmp_path / "cut.arpa").write_text("\n".join(lines[:-5]) + "\n", encoding="utf-8")
    with pytest.raises(ArpaError, match=r"cut\.arpa:\d+: the file ends in the 2-grams section "
                                        r"without \\end\\ \(truncated file\?\)"):
        read_arpa(tmp_path / "cut.arpa")


# The tiny model of tests/graph/test_tlg.py, as write_arpa writes it: line 9 is the
# unigram AB, 15 the bigram "<s> AB", 19 "A C".
SMALL = [["AB", "C"], ["AB", "C"], ["AB", "C"], ["A", "BC"], ["A", "C"]]


@pytest.fixture
def small_arpa(tmp_path):
    path = tmp_path / "lm.arpa"
    write_arpa(estimate(SMALL, 2, discount_fallback=(0.5, 1.0, 1.5)), path)
    return path


def _edit(path, old, new):
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_bytes(text.replace(old, new, 1).encode("utf-8"))  # no newline translation


@pytest.mark.parametrize(("old", "new", "message"), [
    ("\tA C\n", "\tA C\t-0.1\n",
     r":19: expected LOGPROB, 2 word\(s\) in the 2-grams section \(the highest order has no "
     r"back-off\), got '-0.\d+\\tA C\\t-0.1'"),
    ("\tA C\n", "\tA ZZ\n", r":19: n-gram 'A ZZ': word 'ZZ' is not among the unigrams"),
    ("\tA C\n", "\tA <s>\n", r":19: n-gram 'A <s>': <s> may only begin an n-gram"),
    ("\tBC\t", "\tA\t", r":12: unigram 'A' given twice"),
    ("-99\t<s>", "0.5\t<s>", r":6: log10 probability 0.5 is above 0 \(a probability above 1\)"),
    ("\tAB\t-0.30103", "\tAB\tinf", r":9: log10 back-off inf is not a finite number"),
    ("ngram 2=7", "ngram 3=7", r":3: 'ngram 3=' where 'ngram 2=' is expected"),
    ("ngram 2=7", "ngram 2=x", r":3: expected 'ngram N=COUNT' in the \\data\\ section"),
    ("\\2-grams:", "\\3-grams:", r":14: \\3-grams: where \\2-grams: is expected"),
    ("\\data\\", "\ufeff\\data\\", r":1: starts with a UTF-8 byte-order mark \(BOM\)"),
    ("\tA C\n", "\tA C\r\n", r":19: Windows line end \(CR LF\), which kaldilm reads as part "
                              r"of the last word: convert the file with dos2unix"),
    ("\tBC\t", "\tB\u3000C\t", r":12: holds the whitespace '\\u3000', which kaldilm reads "
                            r"as part of a word and this reader as a separator"),
], ids=["backoff_on_highest_order", "word_not_a_unigram", "bos_inside", "unigram_twice",
        "positive_log_prob", "infinite_backoff", "order_out_of_turn", "count_not_a_number",
        "section_out_of_order", "byte_order_mark", "crlf", "ideographic_space"])
def test_malformed_arpa_lines_are_named(small_arpa, old, new, message):
    _edit(small_arpa, old, new)
    with pytest.raises(ArpaError, match=r"lm\.arpa" + message):
        read_arpa(small_arpa)


def test_an_arpa_without_sentence_markers_or_in_gbk_is_refused(small_arpa, tmp_path):
    text = small_arpa.read_text(encoding="utf-8")
    no_bos = "".join(line for line in text.splitlines(True) if "<s>" not in line)
    (tmp_path / "no_bos.arpa").write_text(no_bos.replace("ngram 1=7", "ngram 1=6")
                                          .replace("ngram 2=7", "ngram 2=5"), encoding="utf-8")
    with pytest.raises(ArpaError, match=r"no_bos\.arpa: no <s> unigram"):
        read_arpa(tmp_path / "no_bos.arpa")
    (tmp_path / "gbk.arpa").write_bytes(text.replace("\tC\t", "\t天\t").encode("gb18030"))
    with pytest.raises(ArpaError, match=r"gbk\.arpa:10: not valid UTF-8 .* it may be "
                                        r"GBK/GB18030, which reads '-0.\d+\\t天"):
        read_arpa(tmp_path / "gbk.arpa")


def test_arpa_as_kenlm_and_srilm_write_it_is_read(tmp_path):
    # lmplz: <s> with log10 p = 0, </s> with a back-off of 0; SRILM-style spaces, -99
    kenlm_text = ("\\data\\\nngram 1=4\nngram 2=3\n\n\\1-grams:\n-0.9\t<unk>\t0\n"
                  "0\t<s>\t-0.07\n-0.9\t</s>\t0\n-0.7\ta\t-0.2\n\n\\2-grams:\n"
                  "-0.6\t<s> a\n-0.3\ta </s>\n-1.2\t<s> </s>\n\n\\end\\\n")
    (tmp_path / "kenlm.arpa").write_text(kenlm_text, encoding="utf-8")
    tables = read_arpa(tmp_path / "kenlm.arpa")
    assert tables[0][(BOS,)] == (0.0, -0.07) and tables[0][(EOS,)] == (-0.9, 0.0)
    assert tables[1][(BOS, EOS)] == (-1.2, 0.0)
    spaces = kenlm_text.replace("\t", " ").replace("0 <s>", "-99 <s>")
    (tmp_path / "spaces.arpa").write_text("written by hand\n" + spaces, encoding="utf-8")
    assert read_arpa(tmp_path / "spaces.arpa")[0][(BOS,)] == (-99.0, -0.07)
