"""The transducer's token frames: the Viterbi path of its lattice, against every path."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from cat.rnnt.align import FRAMES_PER_PIECE, _lattice, _viterbi, rnnt_token_frames
from cat.rnnt.model import JointNet, LSTMPredictor


def best_path_by_enumeration(blank: np.ndarray, emit: np.ndarray) -> tuple[int, ...]:
    """The emission frames of the best path, trying every non-decreasing frame tuple."""
    frames, count = emit.shape
    best, best_frames = -np.inf, ()
    for choice in itertools.combinations_with_replacement(range(frames), count):
        score, t, u = 0.0, 0, 0
        for frame in choice:
            while t < frame:
                score += blank[t, u]
                t += 1
            score += emit[t, u]
            u += 1
        while t < frames - 1:
            score += blank[t, u]
            t += 1
        if score > best:
            best, best_frames = score, choice
    return best_frames


def test_viterbi_finds_the_best_path():
    rng = np.random.default_rng(0)
    for _ in range(20):
        frames, count = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        blank = np.log(rng.uniform(0.05, 1, (frames, count + 1)))
        emit = np.log(rng.uniform(0.05, 1, (frames, count)))
        spans = _viterbi(blank, emit)
        assert tuple(first for first, _, _ in spans) == best_path_by_enumeration(blank, emit)
        assert all(first == last for first, last, _ in spans)
        assert [score for *_, score in spans] == [emit[t, u] for u, (t, _, _) in
                                                  enumerate(spans)]


def test_token_frames_of_a_model_are_monotonic_inside_the_utterance():
    torch.manual_seed(0)
    predictor = LSTMPredictor(7, 8, 8).eval()
    joiner = JointNet(6, 8, 7, 8).eval()
    frames = FRAMES_PER_PIECE + 9  # the lattice is computed in two pieces
    encoder_out = torch.randn(2, frames, 6)
    hyps = [[1, 2, 2, 5], []]
    spans = rnnt_token_frames(predictor, joiner, encoder_out, torch.tensor([frames, 3]), hyps)
    assert spans[1] == []
    starts = [first for first, _, _ in spans[0]]
    assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] < frames
    # The lattice in pieces is the lattice computed whole.
    blank, emit = _lattice(predictor, joiner, encoder_out[0], hyps[0])
    with torch.no_grad():
        whole = torch.log_softmax(joiner(encoder_out[:1], predictor(
            torch.tensor([hyps[0]]))), dim=-1)[0]
    np.testing.assert_allclose(blank, whole[:, :, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(emit, whole[:, torch.arange(4), torch.tensor(hyps[0])].numpy(),
                               atol=1e-5)
