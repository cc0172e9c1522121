"""Tests of CTC greedy and prefix beam search against brute-force enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from cat.ctc.search import ctc_greedy_search, ctc_prefix_beam_search


def random_log_probs(batch: int, frames: int, vocab: int, seed: int,
                     sharpness: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(batch, frames, vocab, generator=generator)
    return torch.log_softmax(logits, dim=-1)


def collapse(path: tuple[int, ...]) -> tuple[int, ...]:
    """CTC path -> labeling: merge repeats, then drop blanks."""
    labeling = []
    previous = None
    for token in path:
        if token != previous and token != 0:
            labeling.append(token)
        previous = token
    return tuple(labeling)


def brute_force_labelings(log_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Exact log-probability of every labeling of one utterance [T, V] by path enumeration."""
    frames, vocab = log_probs.shape
    table = log_probs.double()
    totals: dict[tuple[int, ...], list[float]] = {}
    for path in itertools.product(range(vocab), repeat=frames):
        score = float(sum(table[t, token] for t, token in enumerate(path)))
        totals.setdefault(collapse(path), []).append(score)
    return {labeling: float(torch.logsumexp(torch.tensor(scores, dtype=torch.float64), 0))
            for labeling, scores in totals.items()}


def test_greedy_equals_argmax_collapse():
    log_probs = random_log_probs(3, 12, 5, seed=0)
    lengths = torch.tensor([12, 7, 1])
    expected = [list(collapse(tuple(log_probs[b, :n].argmax(-1).tolist())))
                for b, n in enumerate(lengths.tolist())]
    assert ctc_greedy_search(log_probs, lengths) == expected


def test_greedy_collapses_repeats_but_keeps_blank_separated_ones():
    path = [1, 1, 0, 1, 2, 2, 0, 0, 3]
    log_probs = torch.full((1, len(path), 4), -10.0)
    for t, token in enumerate(path):
        log_probs[0, t, token] = 0.0
    assert ctc_greedy_search(log_probs, torch.tensor([len(path)])) == [[1, 1, 2, 3]]
    assert ctc_greedy_search(log_probs, torch.tensor([4])) == [[1, 1]]


@pytest.mark.parametrize(("frames", "vocab", "seed"), [(4, 3, 0), (5, 3, 1), (3, 4, 2)])
def test_prefix_beam_search_with_full_beam_is_exact(frames, vocab, seed):
    log_probs = random_log_probs(1, frames, vocab, seed, sharpness=0.5)
    exact = brute_force_labelings(log_probs[0])
    nbest = ctc_prefix_beam_search(log_probs, torch.tensor([frames]), beam_size=len(exact))
    found = {tuple(tokens): score for tokens, score in nbest[0]}
    assert set(found) == set(exact)
    for labeling, score in exact.items():
        assert found[labeling] == pytest.approx(score, abs=1e-5)
    best = max(exact, key=exact.get)
    assert nbest[0][0][0] == list(best)
    scores = [score for _, score in nbest[0]]
    assert scores == sorted(scores, reverse=True)
    assert math.log(sum(math.exp(s) for s in scores)) == pytest.approx(0.0, abs=1e-5)


def test_batch_with_different_lengths_equals_one_by_one():
    log_probs = random_log_probs(3, 9, 6, seed=3)
    lengths = torch.tensor([9, 5, 2])
    batch = ctc_prefix_beam_search(log_probs, lengths, beam_size=5)
    for index, length in enumerate(lengths.tolist()):
        alone = ctc_prefix_beam_search(log_probs[index:index + 1, :length],
                                       torch.tensor([length]), beam_size=5)[0]
        assert [tokens for tokens, _ in batch[index]] == [tokens for tokens, _ in alone]
        for (_, a), (_, b) in zip(batch[index], alone, strict=True):
            assert a == pytest.approx(b, abs=1e-9)


def test_default_token_pruning_loses_nothing():
    log_probs = random_log_probs(4, 20, 30, seed=4, sharpness=2.0)
    lengths = torch.tensor([20, 18, 11, 3])
    pruned = ctc_prefix_beam_search(log_probs, lengths, beam_size=4)
    full = ctc_prefix_beam_search(log_probs, lengths, beam_size=4, token_topk=29)
    assert pruned == full


def test_small_beam_finds_the_best_labeling_on_peaked_input():
    log_probs = random_log_probs(2, 6, 3, seed=5, sharpness=3.0)
    lengths = torch.tensor([6, 6])
    results = ctc_prefix_beam_search(log_probs, lengths, beam_size=3)
    for index in range(2):
        exact = brute_force_labelings(log_probs[index])
        best = max(exact, key=exact.get)
        assert results[index][0][0] == list(best)
        # Paths through pruned prefixes are lost: the beam score is a lower bound.
        assert results[index][0][1] <= exact[best] + 1e-9


def test_zero_length_utterance_gives_empty_hypothesis():
    log_probs = random_log_probs(2, 4, 3, seed=6)
    results = ctc_prefix_beam_search(log_probs, torch.tensor([4, 0]), beam_size=3)
    assert results[1] == [([], 0.0)]
    assert ctc_greedy_search(log_probs, torch.tensor([4, 0]))[1] == []


def test_many_utterances_decode_with_pruning():
    log_probs = random_log_probs(64, 100, 500, seed=7, sharpness=3.0)
    lengths = torch.randint(50, 101, (64,), generator=torch.Generator().manual_seed(0))
    results = ctc_prefix_beam_search(log_probs, lengths, beam_size=10)
    assert len(results) == 64
    greedy = ctc_greedy_search(log_probs, lengths)
    for nbest, greedy_tokens in zip(results, greedy, strict=True):
        assert len(nbest) == 10
        assert len({tuple(tokens) for tokens, _ in nbest}) == 10
        # The best labeling is at least as likely as the greedy one.
        greedy_score = dict((tuple(t), s) for t, s in nbest).get(tuple(greedy_tokens))
        if greedy_score is not None:
            assert nbest[0][1] >= greedy_score


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"beam_size": 0}, "beam_size"),
    ({"token_topk": 0}, "token_topk"),
])
def test_invalid_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ctc_prefix_beam_search(random_log_probs(1, 3, 3, seed=0), torch.tensor([3]), **kwargs)


class BigramFusion:
    """A fusion scorer from fixed random tables: score(previous token, token), and an end
    score per previous token (state = the previous token; 0 stands for <s>)."""

    def __init__(self, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=generator).double()
        self.end = torch.randn(vocab, generator=generator).double()

    def initial_state(self) -> int:
        return 0

    def step(self, state: int, token: int) -> tuple[float, int]:
        return float(self.table[state, token]), token

    def final(self, state: int) -> float:
        return float(self.end[state])

    def total(self, labeling: tuple[int, ...]) -> float:
        state, score = 0, 0.0
        for token in labeling:
            delta, state = self.step(state, token)
            score += delta
        return score + self.final(state)


@pytest.mark.parametrize(("frames", "vocab", "seed"), [(4, 3, 0), (5, 3, 1), (3, 4, 2)])
def test_fused_search_with_full_beam_scores_every_labeling_exactly(frames, vocab, seed):
    log_probs = random_log_probs(1, frames, vocab, seed, sharpness=0.5)
    fusion = BigramFusion(vocab, seed)
    exact = {labeling: score + fusion.total(labeling)
             for labeling, score in brute_force_labelings(log_probs[0]).items()}
    nbest = ctc_prefix_beam_search(log_probs, torch.tensor([frames]), beam_size=len(exact),
                                   token_topk=vocab - 1, fusion=fusion)[0]
    found = {tuple(tokens): score for tokens, score in nbest}
    assert set(found) == set(exact)
    for labeling, score in exact.items():
        assert found[labeling] == pytest.approx(score, abs=1e-5)
    assert tuple(nbest[0][0]) == max(exact, key=exact.get)


def test_fusion_moves_the_best_labeling_to_the_lm_preferred_one():
    log_probs = random_log_probs(1, 6, 4, seed=11, sharpness=1.5)
    acoustic = brute_force_labelings(log_probs[0])
    fusion = BigramFusion(4, seed=12)
    fusion.table *= 3.0  # a strong LM
    fused = {labeling: score + fusion.total(labeling) for labeling, score in acoustic.items()}
    assert max(fused, key=fused.get) != max(acoustic, key=acoustic.get)
    plain = ctc_prefix_beam_search(log_probs, torch.tensor([6]), beam_size=8)[0]
    with_lm = ctc_prefix_beam_search(log_probs, torch.tensor([6]), beam_size=8,
                                     fusion=fusion)[0]
    assert tuple(plain[0][0]) == max(acoustic, key=acoustic.get)
    assert tuple(with_lm[0][0]) == max(fused, key=fused.get)


def test_fused_batch_equals_one_by_one():
    log_probs = random_log_probs(3, 9, 6, seed=8)
    lengths = torch.tensor([9, 5, 2])
    fusion = BigramFusion(6, seed=9)
    batch = ctc_prefix_beam_search(log_probs, lengths, beam_size=5, fusion=fusion)
    for index, length in enumerate(lengths.tolist()):
        alone = ctc_prefix_beam_search(log_probs[index:index + 1, :length],
                                       torch.tensor([length]), beam_size=5, fusion=fusion)[0]
        assert [tokens for tokens, _ in batch[index]] == [tokens for tokens, _ in alone]
        for (_, a), (_, b) in zip(batch[index], alone, strict=True):
            assert a == pytest.approx(b, abs=1e-9)
