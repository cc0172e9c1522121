"""Tests of RNN-T greedy and modified beam search against reference implementations."""

from __future__ import annotations

import itertools

import pytest
import torch

from cat.rnnt.model import JointNet, LSTMPredictor, StatelessPredictor
from cat.rnnt.search import rnnt_greedy_search, rnnt_modified_beam_search


def components(kind: str, num_classes: int, seed: int, blank_bias: float = 0.0):
    """Random predictor + joiner; `blank_bias` shifts the blank logit."""
    torch.manual_seed(seed)
    if kind == "lstm":
        predictor = LSTMPredictor(num_classes, embed_dim=8, hdim=8, dropout=0.0)
    else:
        predictor = StatelessPredictor(num_classes, embed_dim=8, context_size=2)
    joiner = JointNet(6, predictor.output_dim, num_classes, hdim=8, blank_init_prob=0.0)
    with torch.no_grad():
        joiner.out.bias[0] += blank_bias
    return predictor.eval(), joiner.eval()


def reference_greedy(predictor, joiner, encoder_out, max_symbols):
    """Unbatched greedy search written directly from the definition."""
    hyp: list[int] = []
    with torch.no_grad():
        for t in range(encoder_out.size(0)):
            for _ in range(max_symbols):
                history = torch.tensor([[0, *hyp]])[:, 1:]
                predictor_out = predictor(history)[0, -1]
                logits = joiner(encoder_out[t][None, None], predictor_out[None, None])[0, 0, 0]
                token = int(logits.argmax())
                if token == 0:
                    break
                hyp.append(token)
    return hyp


@pytest.mark.parametrize("kind", ["lstm", "stateless"])
@pytest.mark.parametrize("max_symbols", [1, 3])
def test_batched_greedy_equals_reference(kind, max_symbols):
    predictor, joiner = components(kind, num_classes=5, seed=0, blank_bias=-0.5)
    generator = torch.Generator().manual_seed(1)
    encoder_out = 2 * torch.randn(3, 9, 6, generator=generator)
    lengths = torch.tensor([9, 6, 2])
    hyps = rnnt_greedy_search(predictor, joiner, encoder_out, lengths, max_symbols)
    expected = [reference_greedy(predictor, joiner, encoder_out[b, :n], max_symbols)
                for b, n in enumerate(lengths.tolist())]
    assert hyps == expected
    assert any(len(h) > 0 for h in hyps)
    assert all(len(h) <= max_symbols * n for h, n in zip(hyps, lengths.tolist(), strict=True))


def brute_force_sequences(predictor, joiner, encoder_out) -> dict[tuple[int, ...], float]:
    """Log-probability of every token sequence under one-symbol-per-frame alignments."""
    frames = encoder_out.size(0)
    num_classes = joiner.out.out_features
    totals: dict[tuple[int, ...], list[torch.Tensor]] = {}
    with torch.no_grad():
        for path in itertools.product(range(num_classes), repeat=frames):
            sequence: list[int] = []
            score = torch.zeros((), dtype=torch.float64)
            for t, token in enumerate(path):
                predictor_out = predictor(torch.tensor([sequence], dtype=torch.long))[0, -1]
                logits = joiner(encoder_out[t][None, None], predictor_out[None, None])[0, 0, 0]
                score = score + torch.log_softmax(logits.double(), -1)[token]
                if token != 0:
                    sequence.append(token)
            totals.setdefault(tuple(sequence), []).append(score)
    return {seq: float(torch.logsumexp(torch.stack(scores), 0)) for seq, scores in totals.items()}


@pytest.mark.parametrize("kind", ["lstm", "stateless"])
def test_beam_search_with_full_beam_is_exact(kind):
    predictor, joiner = components(kind, num_classes=3, seed=2)
    encoder_out = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(3))
    exact = brute_force_sequences(predictor, joiner, encoder_out[0])
    assert len(exact) == 1 + 2 + 4 + 8 + 16
    nbest = rnnt_modified_beam_search(predictor, joiner, encoder_out, torch.tensor([4]),
                                      beam_size=len(exact))[0]
    found = {tuple(tokens): score for tokens, score in nbest}
    assert set(found) == set(exact)
    for sequence, score in exact.items():
        assert found[sequence] == pytest.approx(score, abs=1e-4)
    assert tuple(nbest[0][0]) == max(exact, key=exact.get)


def test_beam_of_one_equals_greedy_with_one_symbol_per_frame():
    predictor, joiner = components("lstm", num_classes=6, seed=4, blank_bias=-1.0)
    encoder_out = 2 * torch.randn(3, 10, 6, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([10, 7, 3])
    beam = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam_size=1)
    greedy = rnnt_greedy_search(predictor, joiner, encoder_out, lengths, 1)
    assert [nbest[0][0] for nbest in beam] == greedy


def test_batch_results_equal_one_by_one_and_are_sorted():
    predictor, joiner = components("stateless", num_classes=6, seed=6, blank_bias=-0.5)
    encoder_out = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([8, 5, 0])
    batch = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam_size=4)
    for index, length in enumerate(lengths.tolist()):
        alone = rnnt_modified_beam_search(predictor, joiner, encoder_out[index:index + 1, :length],
                                          torch.tensor([length]), beam_size=4)[0]
        assert [t for t, _ in batch[index]] == [t for t, _ in alone]
        for (_, a), (_, b) in zip(batch[index], alone, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        scores = [score for _, score in batch[index]]
        assert scores == sorted(scores, reverse=True)
    assert batch[2] == [([], 0.0)]
    assert len(batch[0]) == 4
    assert len({tuple(t) for t, _ in batch[0]}) == 4


def test_invalid_arguments_raise():
    predictor, joiner = components("lstm", num_classes=4, seed=0)
    encoder_out, lengths = torch.randn(1, 3, 6), torch.tensor([3])
    with pytest.raises(ValueError, match="beam_size"):
        rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, beam_size=0)
    with pytest.raises(ValueError, match="max_symbols_per_frame"):
        rnnt_greedy_search(predictor, joiner, encoder_out, lengths, max_symbols_per_frame=0)


class BigramFusion:
    """A fusion scorer from fixed random tables (state = the previous token, 0 = <s>)."""

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

    def total(self, sequence: tuple[int, ...]) -> float:
        state, score = 0, 0.0
        for token in sequence:
            delta, state = self.step(state, token)
            score += delta
        return score + self.final(state)


@pytest.mark.parametrize("kind", ["lstm", "stateless"])
def test_fused_beam_search_with_full_beam_scores_every_sequence_exactly(kind):
    predictor, joiner = components(kind, num_classes=3, seed=2)
    encoder_out = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(3))
    fusion = BigramFusion(3, seed=4)
    exact = {sequence: score + fusion.total(sequence) for sequence, score in
             brute_force_sequences(predictor, joiner, encoder_out[0]).items()}
    nbest = rnnt_modified_beam_search(predictor, joiner, encoder_out, torch.tensor([4]),
                                      beam_size=len(exact), fusion=fusion, token_topk=2)[0]
    found = {tuple(tokens): score for tokens, score in nbest}
    assert set(found) == set(exact)
    for sequence, score in exact.items():
        assert found[sequence] == pytest.approx(score, abs=1e-4)
    assert tuple(nbest[0][0]) == max(exact, key=exact.get)


def test_fusion_moves_the_best_sequence_to_the_lm_preferred_one():
    predictor, joiner = components("lstm", num_classes=4, seed=5, blank_bias=-0.5)
    encoder_out = 2 * torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(6))
    acoustic = brute_force_sequences(predictor, joiner, encoder_out[0])
    fusion = BigramFusion(4, seed=7)
    fusion.table *= 3.0
    fused = {sequence: score + fusion.total(sequence) for sequence, score in acoustic.items()}
    assert max(fused, key=fused.get) != max(acoustic, key=acoustic.get)
    plain = rnnt_modified_beam_search(predictor, joiner, encoder_out, torch.tensor([4]),
                                      beam_size=16)[0]
    with_lm = rnnt_modified_beam_search(predictor, joiner, encoder_out, torch.tensor([4]),
                                        beam_size=16, fusion=fusion, token_topk=3)[0]
    assert tuple(plain[0][0]) == max(acoustic, key=acoustic.get)
    assert tuple(with_lm[0][0]) == max(fused, key=fused.get)


@pytest.mark.parametrize("penalty", [0.7, 2.5])
def test_blank_penalty_is_a_lower_blank_logit_in_both_searches(penalty):
    """A search with `blank_penalty` p equals the search of a joiner whose blank bias is
    lower by p, and it emits more tokens than without."""
    predictor, joiner = components("lstm", num_classes=5, seed=0, blank_bias=1.0)
    _, lowered = components("lstm", num_classes=5, seed=0, blank_bias=1.0 - penalty)
    generator = torch.Generator().manual_seed(1)
    encoder_out = 2 * torch.randn(3, 9, 6, generator=generator)
    lengths = torch.tensor([9, 6, 2])
    greedy = rnnt_greedy_search(predictor, joiner, encoder_out, lengths, 3, blank_penalty=penalty)
    assert greedy == rnnt_greedy_search(predictor, lowered, encoder_out, lengths, 3)
    beam = rnnt_modified_beam_search(predictor, joiner, encoder_out, lengths, 3,
                                     blank_penalty=penalty)
    expected = rnnt_modified_beam_search(predictor, lowered, encoder_out, lengths, 3)
    assert [[hyp for hyp, _ in lists] for lists in beam] == \
        [[hyp for hyp, _ in lists] for lists in expected]
    for lists, reference in zip(beam, expected, strict=True):
        assert [score for _, score in lists] == pytest.approx([s for _, s in reference])
    plain = rnnt_greedy_search(predictor, joiner, encoder_out, lengths, 3)
    assert sum(map(len, greedy)) > sum(map(len, plain))
