"""RNN-T decoding: batched greedy search and modified beam search.

Both work on encoder outputs `[B, T, E]` with lengths `[B]` and a predictor /
joiner pair following the interfaces of `cat.rnnt.model` (`initial_state`,
`step`, `project_encoder`, `project_predictor`, `joint`). Blank is 0.

  * `rnnt_greedy_search`: the whole batch advances frame by frame; on each
    frame every utterance emits its best non-blank token until blank wins or
    `max_symbols_per_frame` tokens were emitted on that frame. The predictor is
    stepped once per emission round for the batch, and states of utterances
    that did not emit are kept.
  * `rnnt_modified_beam_search`: the "modified beam search" of icefall/ESPnet
    (Kang et al. 2022): at most one symbol per frame, so every hypothesis moves
    to the next frame after either blank or one token. Per frame, each of the
    `beam_size` hypotheses is extended by blank and by every token;
    hypotheses that reach the same token sequence are merged by adding their
    probabilities (log-sum-exp) before the best `beam_size` are kept. With a
    beam as large as the number of token sequences this is the exact best
    sequence under the one-symbol-per-frame topology. Predictor outputs and
    states are cached per token sequence, and the new sequences of a frame are
    fed to the predictor in one batch. Utterances are searched one at a time.

Blank penalty (`blank_penalty`, sherpa-onnx's setting of that name): a constant taken from
the blank logit before each decision, in both searches; an under-trained transducer whose
errors are mostly deletions gives up some of them for insertions. 0 changes nothing.

Shallow fusion and LODR (`fusion`, e.g. `cat.lm.scorer.ShallowFusion`): each token
sequence also caches its weighted LM score (`alpha` log p_LM - `lodr_weight`
log p_LODR + `beta` per token) and LM state. Hypotheses are ranked by acoustic
score plus that score (plus the end-of-sentence score at the end); acoustic
scores alone are merged, so merging stays exact. Only the `token_topk` (default
`beam_size + 1`) acoustically best tokens of a hypothesis are scored by the LM on
each frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from cat.lm.scorer import Fusion

BLANK = 0
State = tuple[torch.Tensor, ...]


def joint_logits(joiner: nn.Module, encoder_proj: torch.Tensor, predictor_proj: torch.Tensor,
                 blank_penalty: float = 0.0) -> torch.Tensor:
    """The joiner's logits with `blank_penalty` taken from blank's."""
    logits = joiner.joint(encoder_proj, predictor_proj)
    if blank_penalty:
        logits = logits.clone()
        logits[..., BLANK] -= blank_penalty
    return logits


def where_state(mask: torch.Tensor, new: State, old: State) -> State:
    """Per hypothesis, take `new` where `mask` [n] is True, else `old`."""
    return tuple(torch.where(mask.view(-1, *([1] * (n.dim() - 1))), n, o)
                 for n, o in zip(new, old, strict=True))


def select_state(state: State, index: torch.Tensor) -> State:
    """Gather hypotheses `index` [m] from each tensor of `state`."""
    return tuple(s[index] for s in state)


@torch.no_grad()
def rnnt_greedy_search(predictor: nn.Module, joiner: nn.Module, encoder_out: torch.Tensor,
                       lengths: torch.Tensor, max_symbols_per_frame: int = 3,
                       blank_penalty: float = 0.0) -> list[list[int]]:
    """Batched greedy search; returns one token list per utterance."""
    if max_symbols_per_frame < 1:
        raise ValueError(f"max_symbols_per_frame must be >= 1, got {max_symbols_per_frame}")
    batch, num_frames, _ = encoder_out.shape
    device = encoder_out.device
    lengths = lengths.to(device)
    encoder_proj = joiner.project_encoder(encoder_out)
    tokens = torch.full((batch,), BLANK, dtype=torch.long, device=device)
    out, state = predictor.step(tokens, predictor.initial_state(batch, device))
    predictor_proj = joiner.project_predictor(out)
    hyps: list[list[int]] = [[] for _ in range(batch)]
    for t in range(num_frames):
        may_emit = t < lengths
        for _ in range(max_symbols_per_frame):
            best = joint_logits(joiner, encoder_proj[:, t], predictor_proj,
                                blank_penalty).argmax(dim=-1)
            emit = may_emit & (best != BLANK)
            if not emit.any():
                break
            for index in emit.nonzero()[:, 0].tolist():
                hyps[index].append(int(best[index]))
            out, new_state = predictor.step(best, state)
            predictor_proj = torch.where(emit[:, None], joiner.project_predictor(out),
                                         predictor_proj)
            state = where_state(emit, new_state, state)
            may_emit = emit
    return hyps


class _FusionCache:
    """Weighted LM score and state per token sequence (see the module doc)."""

    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion
        self.entries: dict[tuple[int, ...], tuple[float, Any]] = {
            (): (0.0, fusion.initial_state())}

    def score(self, hyp: tuple[int, ...]) -> float:
        return self.entries[hyp][0]

    def extend(self, hyp: tuple[int, ...], token: int) -> float:
        """The score of `hyp + (token,)`, computed and cached on first use."""
        new = (*hyp, token)
        entry = self.entries.get(new)
        if entry is None:
            score, state = self.entries[hyp]
            delta, new_state = self.fusion.step(state, token)
            entry = (score + delta, new_state)
            self.entries[new] = entry
        return entry[0]

    def final(self, hyp: tuple[int, ...]) -> float:
        score, state = self.entries[hyp]
        return score + self.fusion.final(state)


def _fusion_ranks(lm: _FusionCache, hyps: list[tuple[int, ...]], stay: torch.Tensor,
                  extend: torch.Tensor, log_probs: torch.Tensor, token_topk: int) -> torch.Tensor:
    """Acoustic candidates plus LM scores; extensions outside each hypothesis's
    `token_topk` best tokens are dropped."""
    prefix = torch.tensor([lm.score(h) for h in hyps], dtype=stay.dtype, device=stay.device)
    ranked = torch.full_like(extend, float("-inf"))
    topk = min(token_topk, log_probs.size(1) - 1)
    best = log_probs[:, 1:].topk(topk, dim=1).indices + 1
    for k, h in enumerate(hyps):
        tokens = best[k].tolist()
        scores = torch.tensor([lm.extend(h, token) for token in tokens], dtype=stay.dtype,
                              device=stay.device)
        ranked[k, best[k]] = extend[k, best[k]] + scores
    return torch.cat([stay + prefix, ranked.reshape(-1)])


def _beam_search_one(predictor: nn.Module, joiner: nn.Module, encoder_proj: torch.Tensor,
                     beam_size: int, fusion: Fusion | None = None,
                     token_topk: int | None = None, blank_penalty: float = 0.0
                     ) -> list[tuple[list[int], float]]:
    """Modified beam search on one utterance's projected encoder frames [T, H]."""
    device = encoder_proj.device
    out, state = predictor.step(torch.full((1,), BLANK, dtype=torch.long, device=device),
                                predictor.initial_state(1, device))
    # token sequence -> (projected predictor output [H], state with a batch of 1)
    cache: dict[tuple[int, ...], tuple[torch.Tensor, State]] = {
        (): (joiner.project_predictor(out)[0], state)}
    lm = _FusionCache(fusion) if fusion is not None else None
    hyps: list[tuple[int, ...]] = [()]
    scores = torch.zeros(1, device=device)
    for t in range(encoder_proj.size(0)):
        num_hyps = len(hyps)
        predictor_proj = torch.stack([cache[h][0] for h in hyps])
        log_probs = torch.log_softmax(joint_logits(
            joiner, encoder_proj[t][None], predictor_proj, blank_penalty).float(), dim=-1)
        stay = scores + log_probs[:, BLANK]
        extend = scores[:, None] + log_probs
        extend[:, BLANK] = float("-inf")
        # A hypothesis extended by one token may equal another hypothesis: merge them.
        slots = {h: k for k, h in enumerate(hyps)}
        for j, h in enumerate(hyps):
            parent = slots.get(h[:-1]) if h else None
            if parent is not None:
                stay[j] = torch.logaddexp(stay[j], extend[parent, h[-1]])
                extend[parent, h[-1]] = float("-inf")
        candidates = torch.cat([stay, extend.reshape(-1)])
        if lm is not None:
            ranks = _fusion_ranks(lm, hyps, stay, extend, log_probs,
                                  token_topk or beam_size + 1)
        else:
            ranks = candidates
        top_ranks, top_index = ranks.topk(min(beam_size, ranks.numel()))
        top_scores = candidates[top_index]
        vocab = log_probs.size(1)
        new_hyps: list[tuple[int, ...]] = []
        keep_scores = []
        to_feed: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
        for rank, score, index in zip(top_ranks.tolist(), top_scores.tolist(),
                                      top_index.tolist(), strict=True):
            if rank == float("-inf"):
                continue
            if index < num_hyps:
                new_hyps.append(hyps[index])
            else:
                parent_hyp = hyps[(index - num_hyps) // vocab]
                token = (index - num_hyps) % vocab
                new_hyps.append((*parent_hyp, token))
                if new_hyps[-1] not in cache:
                    to_feed.append((new_hyps[-1], parent_hyp, token))
            keep_scores.append(score)
        if to_feed:
            parent_state = tuple(torch.cat(parts) for parts in
                                 zip(*(cache[p][1] for _, p, _ in to_feed), strict=True))
            tokens = torch.tensor([token for _, _, token in to_feed], device=device)
            out, new_state = predictor.step(tokens, parent_state)
            projected = joiner.project_predictor(out)
            for row, (hyp, _, _) in enumerate(to_feed):
                cache[hyp] = (projected[row], tuple(s[row:row + 1] for s in new_state))
        hyps = new_hyps
        scores = torch.tensor(keep_scores, device=device)
    if lm is not None:
        scores = scores + torch.tensor([lm.final(h) for h in hyps], device=device)
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    return [(list(hyps[k]), float(scores[k])) for k in order]


@torch.no_grad()
def rnnt_modified_beam_search(predictor: nn.Module, joiner: nn.Module, encoder_out: torch.Tensor,
                              lengths: torch.Tensor, beam_size: int = 4,
                              fusion: Fusion | None = None, token_topk: int | None = None,
                              blank_penalty: float = 0.0
                              ) -> list[list[tuple[list[int], float]]]:
    """Modified beam search (one symbol per frame at most) for each utterance of a batch.

    Returns, per utterance, up to `beam_size` `(tokens, score)` pairs, best first;
    `score` sums the probabilities of all alignments kept for that sequence (log), plus,
    with `fusion`, the sequence's weighted LM score including the end of the sentence.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    encoder_proj = joiner.project_encoder(encoder_out)
    return [_beam_search_one(predictor, joiner, encoder_proj[index, :length], beam_size,
                             fusion, token_topk, blank_penalty)
            for index, length in enumerate(lengths.tolist())]
