"""Streaming RNN-T decoding: greedy search over encoder chunks (`cat.decoding.online`).

Usage:
    python -m cat.rnnt.stream exp/synth-rnnt-stream --wav-scp data/test/wav.scp \
        --chunk-size 16 --out exp/synth-rnnt-stream/stream-c16/test
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from cat.models.heads import TokenChunkSearch
from cat.rnnt.model import BLANK

MAX_SYMBOLS_PER_FRAME = 3


class RnntChunkSearch(TokenChunkSearch):
    """Greedy RNN-T search carried over chunks (predictor state kept between them): the
    same tokens as `rnnt_greedy_search` of the whole utterance."""

    def __init__(self, model: nn.Module, chunk_size: int = 0) -> None:
        self.predictor, self.joiner = model.transducer.predictor, model.transducer.joiner
        self.tokens: list[int] = []
        with torch.inference_mode():
            tokens = torch.full((1,), BLANK, dtype=torch.long)
            out, self.state = self.predictor.step(tokens, self.predictor.initial_state(1, "cpu"))
            self.projected = self.joiner.project_predictor(out)

    def step(self, encoder_out: torch.Tensor) -> None:
        """Search one chunk's encoder output [T', D]."""
        self.step_projected(self.joiner.project_encoder(encoder_out))

    def step_projected(self, encoder_proj: torch.Tensor) -> None:
        """Search one chunk's encoder output through the joiner's projection [T', J]."""
        for frame in encoder_proj:
            for _ in range(MAX_SYMBOLS_PER_FRAME):
                best = self.joiner.joint(frame[None], self.projected).argmax(dim=-1)
                if int(best) == BLANK:
                    break
                self.tokens.append(int(best))
                out, self.state = self.predictor.step(best, self.state)
                self.projected = self.joiner.project_predictor(out)


#: This family's chunk search, as `python -m cat.stream` finds it
#: (`cat.models.registry.family(kind, "stream")`).
ChunkSearch = RnntChunkSearch

if __name__ == "__main__":
    from cat.core.commands import run_verb

    sys.exit(run_verb("cat.rnnt.stream"))
