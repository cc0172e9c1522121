"""Token spans of CTC hypotheses (`cat.models.spans`): the Viterbi (forced) alignment of
each token sequence to the frame log-probabilities (torchaudio's `forced_align`); a
token's span is the frames of its spike (the frames the path emits it on), its
log-probability the best of them. For greedy search this is the greedy path itself. The
CTC and CTC-CRF heads give their `token_frames` with it.

Usage:
    spans = ctc_token_frames(log_probs, lengths, hyps)  # [(first, last, log-prob)] each
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from cat.models.spans import Span


@torch.no_grad()
def ctc_token_frames(log_probs: torch.Tensor, lengths: torch.Tensor,
                     hyps: Sequence[Sequence[int]], blank: int = 0) -> list[list[Span]]:
    """Each token's spike on the Viterbi alignment of `hyps` (one token list per utterance)
    to frame log-probabilities `log_probs` [B, T, V] of `lengths` [B] frames.

    A hypothesis that needs more frames than its utterance has (none a search of these
    log-probabilities returns) is a ValueError.
    """
    from torchaudio.functional import forced_align

    results = []
    for index, tokens in enumerate(hyps):
        tokens = [int(token) for token in tokens]
        if not tokens:
            results.append([])
            continue
        length = int(lengths[index])
        frames = log_probs[index, :length].detach().float().cpu()
        needed = len(tokens) + sum(a == b for a, b in itertools.pairwise(tokens))
        if needed > length:
            raise ValueError(f"utterance {index} of the batch: {len(tokens)} tokens need "
                             f"{needed} frames, it has {length}")
        path, _ = forced_align(frames[None], torch.tensor([tokens], dtype=torch.int32),
                               blank=blank)
        results.append(_spikes(path[0].tolist(), frames, blank))
    return results


def _spikes(path: list[int], frames: torch.Tensor, blank: int) -> list[Span]:
    """The runs of non-blank labels of a CTC path: a new token starts where the label
    changes or follows a blank."""
    spans: list[Span] = []
    previous = blank
    for t, label in enumerate(path):
        if label != blank:
            score = float(frames[t, label])
            if label != previous:
                spans.append((t, t, score))
            else:
                first, _, best = spans[-1]
                spans[-1] = (first, t, max(best, score))
        previous = label
    return spans
