"""The chain (un-smoothed, Kaldi-style) token LM of the CTC-CRF denominator graph against
plain counting, and its size against the Kneser-Ney graph."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from cat.graph.denominator import (
    DenGraph,
    DenGraphError,
    build_den_graph,
    chain_lm_acceptor,
    load_den_graph,
    save_den_graph,
)
from cat.testing.lm import token_sentences

CORPUS = [[1, 2, 3], [2, 3], [3, 1, 2, 2], [1, 1], [2, 1, 3, 1], [3, 2], [1, 2, 3, 1]]
BOS, EOS = "<s>", "</s>"


def reference_lm(sentences, order, no_prune_order=3, extra_states=None):
    """log p(sentence) of the chain rule by plain counting over tuples: the kept
    histories, the walk by the longest kept suffix of the whole history, ML ratios."""
    positions = []  # (whole history, next symbol)
    for s in sentences:
        symbols = [BOS, *s]
        for i in range(len(symbols)):
            whole = tuple(symbols[max(0, i + 2 - order):i + 1]) if order > 1 else ()
            positions.append((whole, symbols[i + 1] if i + 1 < len(symbols) else EOS))
    seen = Counter(whole[len(whole) - n:] if n else () for whole, _ in positions
                   for n in range(len(whole) + 1))
    kept = {h for h in seen if len(h) < no_prune_order or h == (BOS,)}
    longer = sorted((h for h in seen if h not in kept),
                    key=lambda h: (-seen[h], len(h), [math.inf if x == BOS else x for x in h]))
    kept |= set(longer if extra_states is None else longer[:extra_states])

    def state_of(whole):
        return next(whole[n:] for n in range(len(whole) + 1) if whole[n:] in kept)

    counts = Counter((state_of(whole), nxt) for whole, nxt in positions)
    totals = Counter()
    for (state, _), c in counts.items():
        totals[state] += c

    def log_prob(tokens):
        symbols, total = [BOS, *tokens], 0.0
        for i in range(len(symbols)):
            whole = tuple(symbols[max(0, i + 2 - order):i + 1]) if order > 1 else ()
            nxt = symbols[i + 1] if i + 1 < len(symbols) else EOS
            state = state_of(whole)
            if counts[(state, nxt)] == 0:
                return -math.inf
            total += math.log(counts[(state, nxt)] / totals[state])
        return total
    return log_prob


def total_mass(lm):
    arcs = np.zeros((lm.num_states, lm.num_states))
    np.add.at(arcs, (lm.src, lm.dst), np.exp(lm.weight))
    return np.linalg.solve(np.eye(lm.num_states) - arcs, np.exp(lm.final))[lm.start]


@pytest.mark.parametrize(("order", "extra_states"), [(1, None), (2, None), (3, None),
                                                     (4, None), (4, 0), (4, 2), (5, 3)])
def test_sentences_get_the_product_of_their_ml_ratios(order, extra_states):
    graph = build_den_graph(CORPUS, 4, order=order, extra_states=extra_states)
    assert graph.info["estimator"] == "chain"
    lm = graph.lm
    # Each state's arcs and final weight are a distribution.
    mass = np.exp(lm.final)
    np.add.at(mass, lm.src, np.exp(lm.weight))
    assert np.allclose(mass, 1.0, atol=1e-12)
    # Deterministic: one arc per (state, token).
    assert len(set(zip(lm.src.tolist(), lm.label.tolist(), strict=True))) == lm.num_arcs
    reference = reference_lm(CORPUS, order, extra_states=extra_states)
    for sentence in CORPUS:
        assert abs(graph.lm_log_prob(sentence) - reference(sentence)) < 1e-9
    for other in ([1, 2, 1, 1], [3, 3, 3], [2, 2, 1], [3, 1, 2, 3, 1]):
        got, expected = graph.lm_log_prob(other), reference(other)
        assert got == expected or abs(got - expected) < 1e-9


def test_an_unseen_bigram_has_probability_zero():
    graph = build_den_graph(CORPUS, 5, order=2)
    assert math.isfinite(graph.lm_log_prob([2, 1, 3, 2]))
    assert graph.lm_log_prob([2, 1, 3, 3, 2]) == -math.inf  # 3 is never followed by 3
    assert graph.lm_log_prob([1, 4]) == -math.inf  # 4 never occurs
    assert graph.lm_log_prob([]) == -math.inf  # no empty sentence
    kneser_ney = build_den_graph(CORPUS, 5, order=2, estimator="kneser-ney")
    assert math.isfinite(kneser_ney.lm_log_prob([2, 1, 3, 3, 2]))  # backed off


@pytest.mark.parametrize(("order", "no_prune_order", "extra_states"),
                         [(2, 3, None), (3, 3, 0), (4, 3, 0), (4, 3, 5), (4, 2, 3),
                          (5, 3, 10), (5, 1, 4), (6, 3, None)])
def test_the_acceptor_is_a_distribution_over_all_strings(order, no_prune_order,
                                                         extra_states):
    sentences = token_sentences(300, 7, seed=order, successors=3)
    lm = chain_lm_acceptor(sentences, 7, order, no_prune_order, extra_states)
    assert abs(total_mass(lm) - 1.0) < 1e-9
    reference = reference_lm(sentences, order, no_prune_order, extra_states)
    graph = DenGraph(7, lm, lm, {})
    for sentence in sentences[:40]:
        assert abs(graph.lm_log_prob(sentence) - reference(sentence)) < 1e-9


def test_histories_shorter_than_no_prune_order_are_all_kept():
    sentences = token_sentences(200, 9, seed=5)
    lm = chain_lm_acceptor(sentences, 9, order=4, no_prune_order=3, extra_states=0)
    trigram = chain_lm_acceptor(sentences, 9, order=3, no_prune_order=3, extra_states=None)
    assert lm.num_states == trigram.num_states and lm.num_arcs == trigram.num_arcs
    more = chain_lm_acceptor(sentences, 9, order=4, no_prune_order=3, extra_states=20)
    assert trigram.num_states < more.num_states <= trigram.num_states + 20


def test_chain_graph_is_much_smaller_than_the_kneser_ney_one():
    sentences = token_sentences(400, 30, seed=1)
    chain = build_den_graph(sentences, 30, order=3)
    kneser_ney = build_den_graph(sentences, 30, order=3, estimator="kneser-ney")
    assert kneser_ney.info["estimator"] == "kneser-ney"
    pairs = set()
    for s in sentences:
        symbols = [0, *s]
        for i in range(1, len(symbols)):
            pairs.add((tuple(symbols[max(0, i - 2):i]), symbols[i]))
    assert chain.lm.num_arcs <= len(pairs)
    assert chain.den.num_arcs * 5 < kneser_ney.den.num_arcs


def test_estimator_is_checked():
    with pytest.raises(ValueError, match="estimator 'witten-bell': expected one of chain"):
        build_den_graph(CORPUS, 4, estimator="witten-bell")
    with pytest.raises(ValueError, match=r"label 4 is outside 1\.\.3"):
        build_den_graph([[1, 4]], 4)


@pytest.mark.parametrize("no_prune_order", [1, 2, 3])
def test_ties_keep_the_shorter_history_so_the_walk_and_the_arcs_agree(no_prune_order):
    # Every history of these sentences occurs equally often: the kept set stays closed
    # under prefixes and suffixes only if ties go to the shorter history.
    sentences = [[1, 2, 3, 4], [1, 2, 3, 4], [4, 3, 2, 1], [4, 3, 2, 1]]
    for extra_states in range(12):
        lm = chain_lm_acceptor(sentences, 5, 5, no_prune_order, extra_states)
        assert abs(total_mass(lm) - 1.0) < 1e-9
        reference = reference_lm(sentences, 5, no_prune_order, extra_states)
        graph = DenGraph(5, lm, lm, {})
        for sentence in [*sentences, [1, 2, 1], [4, 3, 4]]:
            got, expected = graph.lm_log_prob(sentence), reference(sentence)
            assert got == expected or abs(got - expected) < 1e-9, (extra_states, sentence)


def _truncate(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _flip(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 8]) + data[middle + 8:]


@pytest.mark.parametrize(("damage", "why"), [
    (_truncate, r"BadZipFile: File is not a zip file"),
    (_flip, r"BadZipFile: Bad CRC-32 for file '\w+\.npy'"),
    (lambda data: b"", r"ValueError: empty file"),
    (lambda data: b"\\data\\\n", r"ValueError: not an \.npz \(zip\) file"),
], ids=["truncated", "damaged", "empty", "not_npz"])
def test_a_damaged_den_lm_names_the_file_and_how_to_rebuild_it(tmp_path, damage, why):
    path = tmp_path / "den_lm.npz"
    save_den_graph(build_den_graph(CORPUS, 4, order=2), path)
    assert load_den_graph(path, 4).num_classes == 4
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DenGraphError, match=(
            r"den_lm\.npz: not a readable denominator graph file, damaged or truncated \("
            + why + r"\); rebuild it: remove it and run stage 2 of the recipe again \(bash "
            r"run\.sh --stage 2 --stop_stage 2 --exp <exp dir>\), or build it with python -m "
            r"cat\.graph\.den_graph")):
        load_den_graph(path, 4)
