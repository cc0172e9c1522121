"""TLG decoding graphs: words from CTC log-posteriors through lexicon and word n-gram."""

from __future__ import annotations

import numpy as np
import pytest

from cat.graph.tlg import build_tlg, decode
from cat.lm.ngram import ArpaError, estimate, write_arpa

# units: 0 blank, 1 <unk>, 2 a, 3 b, 4 c
SPELLING = {"AB": [[2, 3]], "A": [[2]], "C": [[4]], "BC": [[3, 4]]}
SENTENCES = [["AB", "C"], ["AB", "C"], ["AB", "C"], ["A", "BC"], ["A", "C"]]


def write_lm(path):
    """The word bigram of SENTENCES: line 3 `ngram 2=7`, 6 `<s>`, 9 the unigram AB,
    12 BC, 14 `\\2-grams:`, 15 `<s> AB`, 21 the last bigram, 23 `\\end\\`."""
    write_arpa(estimate(SENTENCES, 2, discount_fallback=(0.5, 1.0, 1.5)), path)
    return path


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return build_tlg(SPELLING.get, 5, write_lm(tmp_path_factory.mktemp("lm") / "lm.arpa"))


def posteriors(frames, vocab=5, sharp=-0.01):
    out = np.full((len(frames), vocab), -8.0, np.float32)
    for t, k in enumerate(frames):
        out[t, k] = sharp
    return out


def test_graph_counts_what_it_left_out(graph):
    assert graph.info["unpronounced"] == 1  # <unk> has no spelling
    # "A" is a prefix of "AB": it gets a disambiguation symbol, removed from the graph
    assert graph.info["disambig"] == 1 and graph.info["TLG_arcs"] > 0


@pytest.mark.parametrize(("frames", "words"), [
    ([2, 2, 0, 3, 4, 0], ["AB", "C"]),
    ([2, 0, 2, 4], ["A", "A", "C"]),  # a blank separates a repeated unit
    ([0, 4, 4, 0], ["C"]),
])
def test_decodes_the_spoken_words(graph, frames, words):
    assert decode(graph, posteriors(frames)) == words


def test_the_word_lm_chooses_between_homophone_segmentations(graph):
    # a b c is "AB C" or "A BC"; the LM has seen "AB C" three times, "A BC" once
    assert decode(graph, posteriors([2, 3, 4])) == ["AB", "C"]
    # with a flat acoustic preference for nothing, an empty utterance decodes to nothing
    assert decode(graph, np.zeros((0, 5), np.float32)) == []


def test_a_word_spelt_several_ways_is_decoded_from_each(graph, tmp_path):
    # BC also spelt "c b" (an alternative pronunciation): both are paths of L
    spelling = {**SPELLING, "BC": [[3, 4], [4, 3]]}
    both = build_tlg(spelling.get, 5, write_lm(tmp_path / "lm.arpa"))
    assert both.info["pronunciations"] == graph.info["pronunciations"] + 1 == 5
    assert decode(both, posteriors([2, 0, 4, 3])) == ["A", "BC"]
    assert decode(graph, posteriors([2, 0, 4, 3])) != ["A", "BC"]
    assert decode(both, posteriors([3, 4])) == ["BC"]


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines(True)


# Each kind of malformed ARPA file, and the message that replaces kaldilm's abort.
MALFORMED = {
    "empty": (lambda lines: [],
              r"lm\.arpa: no \\data\\ section with 'ngram N=COUNT' lines \(empty file\)"),
    "header_only": (lambda lines: lines[:4],
                    r"lm\.arpa:3: the file ends after the \\data\\ section without \\end\\ "
                    r"\(truncated file\?\)"),
    "NaN": (lambda lines: [*lines[:8], "nan\tAB\t-0.30103\n", *lines[9:]],
            r"lm\.arpa:9: log10 probability nan is not a finite number \(kaldilm cannot read "
            r"it\): leave a never-seen n-gram out, or give it a floor such as -99"),
    "-inf": (lambda lines: [*lines[:14], "-inf\t<s> AB\n", *lines[15:]],
             r"lm\.arpa:15: log10 probability -inf is not a finite number"),
    "truncated": (lambda lines: lines[:12],
                  r"lm\.arpa:12: the file ends in the 1-grams section without \\end\\ "
                  r"\(truncated file\?\)"),
    "wrong_counts": (lambda lines: [lines[0], lines[1], "ngram 2=9\n", *lines[3:]],
                     r"lm\.arpa:3: the header declares 9 2-grams, the \\2-grams: section "
                     r"\(lines 14-21\) holds 7"),
    "reserved_word": (lambda lines: [*lines[:11], lines[11].replace("BC", "#0"), *lines[12:]],
                      r"lm\.arpa:12: word '#0' is reserved in decoding graphs \(the back-off "
                      r"disambiguation symbol\)"),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_arpa_is_an_error_naming_file_and_line(tmp_path, kind):
    # built in this process: kaldilm, which would abort it, never sees the file
    arpa = write_lm(tmp_path / "lm.arpa")
    damage, message = MALFORMED[kind]
    arpa.write_text("".join(damage(_lines(arpa))), encoding="utf-8")
    with pytest.raises(ArpaError, match=message):
        build_tlg(SPELLING.get, 5, arpa)


def test_chunk_by_chunk_decoding_ends_with_the_whole_utterance_result(graph):
    """Log-posteriors fed in chunks of any size (`ChunkDecoder`): partial words grow as the
    chunks come, and the final words are `decode`'s of the whole utterance, for noisy
    posteriors where the LM decides."""
    from cat.graph.tlg import ChunkDecoder

    rng = np.random.default_rng(0)
    frames = [2, 2, 0, 3, 4, 0, 2, 0, 4, 0, 2, 3, 0, 4, 4, 0, 2, 0, 3, 4] * 2
    noisy = posteriors(frames, sharp=-0.5) + rng.normal(0, 1.5, (len(frames), 5)).astype(
        np.float32)
    whole = decode(graph, noisy, lm_weight=0.7)
    assert len(whole) >= 6
    for _ in range(4):
        decoder, start, partials = ChunkDecoder(graph, lm_weight=0.7), 0, []
        while start < len(frames):
            size = int(rng.integers(1, 9))
            decoder.accept(noisy[start:start + size])
            partials.append(decoder.words())
            start += size
        assert decoder.words(final=True) == whole
        assert partials[0] != partials[-1] and len(partials[len(partials) // 2]) >= 2
    assert ChunkDecoder(graph).words(final=True) == []  # no frame, no words


def test_hotwords_boost_their_words_and_add_the_ones_the_lm_lacks(graph, tmp_path):
    """WFST contextual biasing (`build_tlg(hotwords=...)`): a boosted
    word wins where the LM preferred another segmentation, a phrase the LM lacks becomes a
    word decoded whole, a partial match earns nothing, an empty list changes nothing."""
    from cat.graph.tlg import build_tlg
    from cat.lm.ngram import read_arpa

    arpa = write_lm(tmp_path / "lm.arpa")
    spelling = {**SPELLING, "ABC": [[2, 3, 4]]}
    assert decode(graph, posteriors([2, 3, 4])) == ["AB", "C"]
    boosted = build_tlg(spelling.get, 5, arpa, {"BC": 3.0})
    assert boosted.info["hotwords"] == {"boosted": 1, "added": 0}
    assert decode(boosted, posteriors([2, 3, 4])) == ["A", "BC"]
    added = build_tlg(spelling.get, 5, arpa, {"ABC": 4.0})
    assert added.info["hotwords"] == {"boosted": 0, "added": 1} and "ABC" in added.words
    assert decode(added, posteriors([2, 3, 4])) == ["ABC"]
    assert decode(added, posteriors([2, 3, 0, 2])) == decode(graph, posteriors([2, 3, 0, 2]))
    empty = build_tlg(spelling.get, 5, arpa, {})
    assert empty.words == graph.words and decode(empty, posteriors([2, 3, 4])) == ["AB", "C"]
    # The LM as a file with the unigrams it lacked: counts, and the n-grams it had.
    from cat.graph.tlg import add_unigrams

    out = tmp_path / "extended.arpa"
    assert add_unigrams(arpa, ["BC", "ABC", "ABC"], out) == ["ABC"]
    before, after = read_arpa(arpa), read_arpa(out)
    assert len(after[0]) == len(before[0]) + 1 and after[1] == before[1]
    assert after[0][("ABC",)][0] == min(p for g, (p, _) in before[0].items() if g != ("<s>",))
