"""TLG decoding graphs: words from CTC log-posteriors through lexicon and word n-gram."""

from __future__ import annotations

import numpy as np
import pytest

from cat.graph.tlg import build_tlg, decode
from cat.lm.ngram import estimate, write_arpa

# units: 0 blank, 1 <unk>, 2 a, 3 b, 4 c
SPELLING = {"AB": [2, 3], "A": [2], "C": [4], "BC": [3, 4]}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    arpa = tmp_path_factory.mktemp("lm") / "lm.arpa"
    sentences = [["AB", "C"], ["AB", "C"], ["AB", "C"], ["A", "BC"], ["A", "C"]]
    write_arpa(estimate(sentences, 2, discount_fallback=(0.5, 1.0, 1.5)), arpa)
    return build_tlg(SPELLING.get, 5, arpa)


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
