"""Token spans: where on the encoder frames each token of a hypothesis was spoken, what
the heads give and decoding turns into times (`cat.decoding.timestamps`).

A head that can align hypotheses to the encoder frames (a `TokenAligner`:
`token_frames(hidden, lengths, hyps)` takes the encoder output, what the model's
`search_inputs` returns, and the token ids of one hypothesis per utterance, from any of its
searches) gives each token's frame span and log-probability on the best alignment of that
hypothesis:

* CTC heads (`ctc_token_frames`): the Viterbi (forced) alignment of the token sequence to
  the frame log-probabilities (torchaudio's `forced_align`); a token's span is the frames
  of its spike (the frames the path emits it on), its log-probability the best of them.
  For greedy search this is the greedy path itself.
* transducers (`cat.rnnt.align`): the frame each token is emitted on, on the Viterbi path
  through the transducer's lattice.

This module is below the model families and decoding alike, so that a head never imports
decoding.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

#: A token's span on the encoder frames: (first frame, last frame, log-probability).
Span = tuple[int, int, float]


@runtime_checkable
class TokenAligner(Protocol):
    """A head whose hypotheses align to the encoder frames (see the module doc)."""

    def token_frames(self, hidden: torch.Tensor, lengths: torch.Tensor,
                     hyps: Sequence[Sequence[int]]) -> list[list[Span]]: ...


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
