"""Where a transducer emits each token of a hypothesis: the Viterbi path through its lattice.

For one utterance's encoder output [T, D] and a token sequence y_1..y_U, the lattice has a
node (t, u) per frame and number of tokens emitted; from (t, u) blank moves to (t + 1, u)
and y_{u+1} to (t, u + 1), with the joiner's log-probabilities (no blank penalty). The best
path from (0, 0) through a final blank at (T - 1, U) emits each token on one frame: its
span is that frame alone, its log-probability the token's there. The joiner runs over the
lattice `FRAMES_PER_PIECE` frames at a time, so an alignment holds
`FRAMES_PER_PIECE x (U + 1) x V` logits at most, whatever the length.

Usage:
    spans = rnnt_token_frames(model.predictor, model.joiner, encoder_out, lengths, hyps)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

BLANK = 0
FRAMES_PER_PIECE = 64


@torch.no_grad()
def _lattice(predictor: nn.Module, joiner: nn.Module, encoder_out: torch.Tensor,
             tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(blank [T, U+1], emit [T, U]) log-probabilities of one utterance's lattice."""
    device = encoder_out.device
    labels = torch.tensor([tokens], dtype=torch.long, device=device)
    predictor_proj = joiner.project_predictor(predictor(labels))[0]  # [U+1, H]
    encoder_proj = joiner.project_encoder(encoder_out)  # [T, H]
    index = torch.tensor(tokens, dtype=torch.long, device=device)
    blank, emit = [], []
    for start in range(0, encoder_proj.size(0), FRAMES_PER_PIECE):
        piece = encoder_proj[start:start + FRAMES_PER_PIECE]
        log_probs = torch.log_softmax(joiner.joint(piece[:, None], predictor_proj[None])
                                      .float(), dim=-1)  # [c, U+1, V]
        blank.append(log_probs[:, :, BLANK].cpu())
        rows = torch.arange(len(tokens), device=device)
        emit.append(log_probs[:, rows, index].cpu())
    return torch.cat(blank).numpy(), torch.cat(emit).numpy()


def _viterbi(blank: np.ndarray, emit: np.ndarray) -> list[tuple[int, int, float]]:
    """Emission frame and log-probability of each token on the best lattice path."""
    frames, count = emit.shape
    best = np.full((frames, count + 1), -np.inf)
    came_by_emit = np.zeros((frames, count + 1), dtype=bool)
    for t in range(frames):
        if t == 0:
            best[0, 0] = 0.0
        else:
            best[t] = best[t - 1] + blank[t - 1]
        for u in range(1, count + 1):
            by_emit = best[t, u - 1] + emit[t, u - 1]
            if by_emit > best[t, u]:
                best[t, u], came_by_emit[t, u] = by_emit, True
    spans: list[tuple[int, int, float]] = []
    t, u = frames - 1, count
    while u > 0:
        if came_by_emit[t, u]:
            spans.append((t, t, float(emit[t, u - 1])))
            u -= 1
        else:
            t -= 1
    return spans[::-1]


@torch.no_grad()
def rnnt_token_frames(predictor: nn.Module, joiner: nn.Module, encoder_out: torch.Tensor,
                      lengths: torch.Tensor, hyps: Sequence[Sequence[int]]
                      ) -> list[list[tuple[int, int, float]]]:
    """Per utterance of encoder output `encoder_out` [B, T, D] (`lengths` [B]), each token
    of its hypothesis in `hyps` as (frame, frame, log-probability); see the module doc."""
    results = []
    for index, tokens in enumerate(hyps):
        tokens = [int(token) for token in tokens]
        length = int(lengths[index])
        if not tokens:
            results.append([])
            continue
        if length < 1:
            raise ValueError(f"utterance {index} of the batch has no frames to align "
                             f"{len(tokens)} tokens to")
        blank, emit = _lattice(predictor, joiner, encoder_out[index, :length], tokens)
        results.append(_viterbi(blank, emit))
    return results
