"""Token spans: where on the encoder frames each token of a hypothesis was spoken, what
the heads give and decoding turns into times (`cat.decoding.timestamps`).

A head that can align hypotheses to the encoder frames (a `TokenAligner`:
`token_frames(hidden, lengths, hyps)` takes the encoder output, what the model's
`search_inputs` returns, and the token ids of one hypothesis per utterance, from any of its
searches) gives each token's frame span and log-probability on the best alignment of that
hypothesis:

* CTC heads (`cat.ctc.align`): the Viterbi (forced) alignment of the token sequence to
  the frame log-probabilities; a token's span is the frames of its spike (the frames the
  path emits it on), its log-probability the best of them.
* transducers (`cat.rnnt.align`): the frame each token is emitted on, on the Viterbi path
  through the transducer's lattice.

This module is below the model families and decoding alike, so that a head never imports
decoding.
"""

from __future__ import annotations

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
