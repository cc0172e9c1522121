"""Token times: CTC spikes of the forced alignment, seconds of encoder frames, words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cat.ctc.align import ctc_token_frames
from cat.ctc.search import ctc_greedy_search, ctc_prefix_beam_search
from cat.decoding.timestamps import TOKEN_TAIL_SECONDS, TimedUnit, group_words, token_times


def spiky_log_probs(num_frames: int, vocab: int, spikes: list[tuple[int, int, int]],
                    peak: float = 0.95) -> torch.Tensor:
    """[1, T, V] log-probabilities: blank everywhere but on `spikes` (token, first, last)."""
    probs = np.full((num_frames, vocab), (1 - peak) / (vocab - 1))
    probs[:, 0] = peak
    for token, first, last in spikes:
        probs[first:last + 1] = (1 - peak) / (vocab - 1)
        probs[first:last + 1, token] = peak
    return torch.tensor(np.log(probs), dtype=torch.float32)[None]


def test_ctc_spikes_of_greedy_and_prefix_beam_hypotheses():
    spikes = [(3, 2, 3), (5, 7, 7), (5, 9, 10), (2, 14, 14)]  # the repeat needs its blank
    log_probs = spiky_log_probs(18, 6, spikes)
    lengths = torch.tensor([18])
    greedy = ctc_greedy_search(log_probs, lengths)
    beam = [hyps[0][0] for hyps in ctc_prefix_beam_search(log_probs, lengths, 4)]
    assert greedy == beam == [[3, 5, 5, 2]]
    for hyps in (greedy, beam):
        (spans,) = ctc_token_frames(log_probs, lengths, hyps)
        assert [(first, last) for first, last, _ in spans] == [(2, 3), (7, 7), (9, 10),
                                                               (14, 14)]
        assert all(score == pytest.approx(np.log(0.95), abs=1e-5) for _, _, score in spans)


def test_frames_beyond_the_length_are_not_used_and_short_input_is_an_error():
    log_probs = spiky_log_probs(12, 4, [(1, 1, 1), (2, 10, 10)])
    (spans,) = ctc_token_frames(log_probs, torch.tensor([6]), [[1, 2]])
    assert spans[0][:2] == (1, 1) and spans[1][0] < 6
    with pytest.raises(ValueError, match="utterance 0 of the batch: 3 tokens need 4 frames, "
                                         "it has 3"):
        ctc_token_frames(log_probs, torch.tensor([3]), [[1, 1, 2]])
    assert ctc_token_frames(log_probs, torch.tensor([12]), [[]]) == [[]]


def test_seconds_follow_the_encoder_frame_rate():
    spans = [(2, 3, -0.1), (7, 7, 0.0)]
    times = token_times(spans, 4, ["a", "b"])
    # A token lasts TOKEN_TAIL_SECONDS past its last frame, or until the next one starts.
    assert TOKEN_TAIL_SECONDS == 0.16
    assert [(unit.start, unit.end) for unit in times] == [(0.08, 0.28), (0.28, 0.48)]
    assert [unit.confidence for unit in times] == pytest.approx([np.exp(-0.1), 1.0])
    assert [(unit.start, unit.end) for unit in token_times(spans, 8)] == [(0.16, 0.48),
                                                                        (0.56, 0.8)]
    # Never past the utterance's end.
    assert [(unit.start, unit.end) for unit in token_times(spans, 4, duration=0.3)] == [
        (0.08, 0.28), (0.28, 0.3)]
    # Tokens emitted on one frame (a transducer) share it in order.
    shared = token_times([(1, 1, 0.0), (3, 3, 0.0), (3, 3, 0.0), (3, 3, 0.0), (4, 4, 0.0)], 4)
    assert [(unit.start, unit.end) for unit in shared] == [
        (0.04, 0.12), (0.12, 0.133), (0.133, 0.147), (0.147, 0.16), (0.16, 0.36)]


def unit(text: str, start: float, end: float, confidence: float = 1.0) -> TimedUnit:
    return TimedUnit(text, start, end, confidence)


def test_words_of_pieces():
    pieces = [unit("\u2581he", 0.0, 0.1, 0.9), unit("llo", 0.2, 0.3, 0.5),
              unit("\u2581", 0.4, 0.45), unit("world", 0.5, 0.6),
              unit("\u2581中", 1.0, 1.1), unit("国", 1.2, 1.3), unit("\u2581ok", 2.0, 2.1)]
    words = group_words(pieces)
    assert [(w.text, w.start, w.end, w.confidence) for w in words] == [
        ("hello", 0.0, 0.3, 0.5), ("world", 0.5, 0.6, 1.0), ("中", 1.0, 1.1, 1.0),
        ("国", 1.2, 1.3, 1.0), ("ok", 2.0, 2.1, 1.0)]
    # Word-level tokens (jieba): each token is a word.
    assert [w.text for w in group_words([unit("今天", 0, 1), unit("天气", 1, 2)])] == [
        "今天", "天气"]
