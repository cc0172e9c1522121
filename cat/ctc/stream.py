"""Streaming CTC decoding: greedy search over encoder chunks (`cat.decoding.online`).

Usage:
    python -m cat.ctc.stream exp/synth-ctc-stream --wav-scp data/test/wav.scp \
        --chunk-size 16 --out exp/synth-ctc-stream/stream-c16/test
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from cat.ctc.search import BLANK
from cat.models.heads import TokenChunkSearch


class CtcChunkSearch(TokenChunkSearch):
    """Greedy CTC search carried over chunks: the same tokens as `ctc_greedy_search` of
    the whole utterance."""

    def __init__(self, model: nn.Module, chunk_size: int = 0) -> None:
        self.head = model.first_head
        self.tokens: list[int] = []
        self.last = BLANK

    def step(self, encoder_out: torch.Tensor) -> None:
        """Search one chunk's encoder output [T', D]."""
        self.step_log_probs(self.head(encoder_out))

    def step_log_probs(self, scores: torch.Tensor) -> None:
        """Search one chunk's frame scores [T', V] (log-probabilities or logits)."""
        for token in scores.argmax(dim=-1).tolist():
            if token != BLANK and token != self.last:
                self.tokens.append(token)
            self.last = token


#: This family's chunk search, as `python -m cat.stream` finds it
#: (`cat.models.registry.family(kind, "stream")`).
ChunkSearch = CtcChunkSearch

if __name__ == "__main__":
    from cat.core.commands import run_verb

    sys.exit(run_verb("cat.ctc.stream"))
