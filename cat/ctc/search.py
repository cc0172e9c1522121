"""The CTC head's searches (CTC, CTC-CRF and U2 models, a transducer's auxiliary head):
batched greedy search and batched prefix beam search.

Both take frame log-probabilities `[B, T, V]` (log-softmax outputs, blank = 0)
and lengths `[B]`; frames at or beyond an utterance's length are ignored.

Prefix beam search keeps, for each prefix, the log-probability of all paths
that produce it and end in blank (`p_b`) or in its last token (`p_nb`), and
merges paths that reach the same prefix, so with a beam as large as the
number of prefixes it returns the exact probability of every labeling. It
runs on a whole batch at once with numpy, one frame at a time: per frame the
candidate extensions form a `[B, beam, topk]` array. Prefixes are nodes of a
trie shared by the batch (hash-consed, so equal prefixes have equal ids).

Per-frame token pruning: only the `token_topk` most likely non-blank tokens of
a frame extend prefixes. The default `beam_size + 1` loses nothing: a token
outside the frame's top `beam + 1` is beaten, for the same prefix, by at least
`beam` other extensions, so it can never enter the beam.

Shallow fusion (`fusion`, e.g. `cat.lm.scorer.ShallowFusion`): every trie node
also holds the weighted language-model score of its prefix (`alpha` times the
token LM's log-probability, minus the LODR term, plus `beta` per token) and the
LM state after it, computed once per (prefix, token) and cached. Prefixes are
ranked by acoustic log-probability plus that score (plus the end-of-sentence
score at the end), while `p_b`/`p_nb` stay acoustic, so paths merging into one
prefix still add up exactly. With an LM the token pruning above is a heuristic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from cat.lm.scorer import Fusion

BLANK = 0


@torch.no_grad()
def ctc_greedy_search(log_probs: torch.Tensor, lengths: torch.Tensor,
                      blank: int = BLANK) -> list[list[int]]:
    """Best path per frame, repeats collapsed, blanks removed: one token list per utterance."""
    best = log_probs.argmax(dim=-1)  # [B, T]
    keep = best != blank
    keep[:, 1:] &= best[:, 1:] != best[:, :-1]
    frame_index = torch.arange(best.size(1), device=best.device)[None, :]
    keep &= frame_index < lengths.to(best.device)[:, None]
    best, keep = best.cpu(), keep.cpu()
    return [best[index][keep[index]].tolist() for index in range(best.size(0))]


class _PrefixTrie:
    """Prefixes as nodes `(parent, token)`; node 0 is the empty prefix.

    With `fusion`, `score[node]` is the prefix's weighted LM score and `states[node]` the
    LM state after it.
    """

    def __init__(self, fusion: Fusion | None = None) -> None:
        self.parent = np.full(1024, -1, dtype=np.int64)
        self.token = np.full(1024, -1, dtype=np.int64)
        self.score = np.zeros(1024)
        self.size = 1
        self.children: dict[tuple[int, int], int] = {}
        self.fusion = fusion
        self.states: list[Any] = [fusion.initial_state() if fusion is not None else None]
        self._steps: dict[tuple[int, int], tuple[float, Any]] = {}

    def step(self, node: int, token: int) -> tuple[float, Any]:
        """The fusion score of extending `node` by `token`, and the LM state after it."""
        key = (node, token)
        result = self._steps.get(key)
        if result is None:
            result = self.fusion.step(self.states[node], token)
            self._steps[key] = result
        return result

    def child(self, parent: int, token: int) -> int:
        key = (parent, token)
        node = self.children.get(key)
        if node is None:
            node = self.size
            if node == len(self.parent):
                self.parent = np.concatenate([self.parent, np.full_like(self.parent, -1)])
                self.token = np.concatenate([self.token, np.full_like(self.token, -1)])
                self.score = np.concatenate([self.score, np.zeros_like(self.score)])
            self.parent[node], self.token[node] = parent, token
            if self.fusion is not None:
                delta, state = self.step(parent, token)
                self.score[node] = self.score[parent] + delta
                self.states.append(state)
            else:
                self.states.append(None)
            self.size += 1
            self.children[key] = node
        return node

    def extension_scores(self, node: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """[B, K, M] fusion scores of extending prefixes `node` [B, K] by `tokens` [B, M]."""
        delta = np.zeros((*node.shape, tokens.shape[1]))
        if self.fusion is None:
            return delta
        for b, k in zip(*np.nonzero(node >= 0), strict=True):
            parent = int(node[b, k])
            delta[b, k] = [self.step(parent, int(token))[0] for token in tokens[b]]
        return delta

    def tokens(self, node: int) -> list[int]:
        result = []
        while node > 0:
            result.append(int(self.token[node]))
            node = int(self.parent[node])
        return result[::-1]


def ctc_prefix_beam_search(log_probs: torch.Tensor, lengths: torch.Tensor, beam_size: int = 10,
                           token_topk: int | None = None, blank: int = BLANK,
                           fusion: Fusion | None = None) -> list[list[tuple[list[int], float]]]:
    """CTC prefix beam search on a batch.

    Args:
        log_probs: [B, T, V] frame log-probabilities (log-softmax over V).
        lengths: [B] number of valid frames per utterance.
        beam_size: prefixes kept per frame.
        token_topk: non-blank tokens per frame allowed to extend prefixes
            (default `beam_size + 1`, which is exact; smaller is faster and approximate).
        blank: blank id.
        fusion: a language model for shallow fusion (see the module doc), or None.

    Returns:
        For each utterance, up to `beam_size` `(tokens, score)` pairs, best first, where
        `score` is the total log-probability of the labeling `tokens`, plus, with
        `fusion`, its weighted LM score including the end of the sentence.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if blank != 0:
        raise ValueError("prefix beam search assumes blank = 0")
    scores = log_probs.detach().float().cpu().numpy()
    batch, num_frames, vocab = scores.shape
    frame_counts = lengths.cpu().numpy()
    beam = beam_size
    topk = min(vocab - 1, token_topk if token_topk is not None else beam + 1)
    if topk < 1:
        raise ValueError(f"token_topk must be >= 1, got {token_topk}")
    neg_inf = -np.inf
    trie = _PrefixTrie(fusion)
    rows = np.arange(batch)[:, None]
    node = np.full((batch, beam), -1, dtype=np.int64)
    node[:, 0] = 0
    last = np.full((batch, beam), -1, dtype=np.int64)
    p_blank = np.full((batch, beam), neg_inf)
    p_blank[:, 0] = 0.0
    p_nonblank = np.full((batch, beam), neg_inf)

    for t in range(num_frames):
        active = t < frame_counts
        if not active.any():
            break
        frame = scores[:, t, :].astype(np.float64)  # [B, V]
        valid = node >= 0
        total = np.logaddexp(p_blank, p_nonblank)
        # Candidate tokens: the frame's top-k non-blank tokens, [B, M].
        if topk < vocab - 1:
            tokens = np.argpartition(-frame[:, 1:], topk - 1, axis=1)[:, :topk] + 1
        else:
            tokens = np.broadcast_to(np.arange(1, vocab), (batch, vocab - 1))
        token_scores = np.take_along_axis(frame, tokens, axis=1)
        last_scores = np.where(last >= 0, np.take_along_axis(frame, np.maximum(last, 0), axis=1),
                               neg_inf)
        # Stay on the same prefix: emit blank, or repeat the last token.
        stay_blank = total + frame[:, blank][:, None]
        stay_nonblank = p_nonblank + last_scores
        # Extend prefix k with token c; a repeated token needs a blank in between.
        is_last = tokens[:, None, :] == last[:, :, None]  # [B, K, M]: c == last token of k
        extend = np.where(is_last, p_blank[:, :, None], total[:, :, None]) \
            + token_scores[:, None, :]
        extend[~valid] = neg_inf
        # Prefix j = prefix k + token: fold that extension into prefix j's p_nb.
        parent = np.where(valid, trie.parent[np.maximum(node, 0)], -2)
        is_parent = (parent[:, :, None] == node[:, None, :]) & valid[:, None, :]  # [B, J, K]
        has_parent = is_parent.any(axis=2)
        parent_slot = is_parent.argmax(axis=2)
        parent_total = np.take_along_axis(total, parent_slot, axis=1)
        parent_blank = np.take_along_axis(p_blank, parent_slot, axis=1)
        parent_last = np.take_along_axis(last, parent_slot, axis=1)
        merged = np.where(parent_last == last, parent_blank, parent_total) + last_scores
        stay_nonblank = np.where(has_parent, np.logaddexp(stay_nonblank, merged), stay_nonblank)
        # The folded extension must not also compete as a separate candidate.
        fold = has_parent & is_last.any(axis=2)
        fold_rows, fold_slots = np.nonzero(fold)
        extend[fold_rows, parent_slot[fold_rows, fold_slots],
               is_last[fold_rows, fold_slots].argmax(axis=1)] = neg_inf

        candidates = np.concatenate(
            [np.logaddexp(stay_blank, stay_nonblank), extend.reshape(batch, -1)], axis=1)
        if fusion is not None:
            prefix_score = trie.score[node]  # [B, K]; rows of invalid slots are -inf anyway
            ranks = candidates + np.concatenate(
                [prefix_score, (prefix_score[:, :, None] + trie.extension_scores(
                    np.where(active[:, None], node, -1), tokens)).reshape(batch, -1)],
                axis=1)
        else:
            ranks = candidates
        chosen = np.argpartition(-ranks, beam - 1, axis=1)[:, :beam]
        chosen_scores = candidates[rows, chosen]
        is_stay = chosen < beam
        slot = np.where(is_stay, chosen, (chosen - beam) // topk)
        token_index = np.where(is_stay, 0, (chosen - beam) % topk)
        new_token = tokens[rows, token_index]
        new_node = np.where(is_stay, node[rows, slot], -1)
        grow = ~is_stay & np.isfinite(chosen_scores) & active[:, None]
        for b, k in zip(*np.nonzero(grow), strict=True):
            new_node[b, k] = trie.child(int(node[b, slot[b, k]]), int(new_token[b, k]))
        new_node[~np.isfinite(chosen_scores)] = -1
        new_last = np.where(is_stay, last[rows, slot], new_token)
        new_blank = np.where(is_stay, stay_blank[rows, slot], neg_inf)
        new_nonblank = np.where(is_stay, stay_nonblank[rows, slot], chosen_scores)
        invalid = new_node < 0
        new_blank[invalid] = neg_inf
        new_nonblank[invalid] = neg_inf

        keep = active[:, None]
        node = np.where(keep, new_node, node)
        last = np.where(keep, new_last, last)
        p_blank = np.where(keep, new_blank, p_blank)
        p_nonblank = np.where(keep, new_nonblank, p_nonblank)

    totals = np.logaddexp(p_blank, p_nonblank)
    if fusion is not None:
        for b, k in zip(*np.nonzero(node >= 0), strict=True):
            prefix = int(node[b, k])
            totals[b, k] += trie.score[prefix] + fusion.final(trie.states[prefix])
    results = []
    for b in range(batch):
        order = np.argsort(-totals[b], kind="stable")
        results.append([(trie.tokens(int(node[b, k])), float(totals[b, k]))
                        for k in order if node[b, k] >= 0])
    return results
