"""The CTC head: of CTC, CTC-CRF and U2 models, and a transducer's auxiliary head.

config.json's `ctc` section (keys and defaults: `cat/core/schemas/config.schema.json`,
`$defs.ctc`): `dropout`, `blank_init_prob`, and `weight` beside a transducer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cat.ctc.align import ctc_token_frames
from cat.ctc.search import ctc_greedy_search, ctc_prefix_beam_search
from cat.lm.scorer import Fusion, sequence_score
from cat.models.heads import (
    DecodeMethod,
    DecodeOption,
    NBest,
    SearchHead,
    init_blank_bias,
    pad_hyps,
)
from cat.models.spans import Span

#: A weight of a rescoring method's score (the same setting as the attention decoder's).
WEIGHT = {"type": "number", "minimum": 0}
#: The decoding methods a CTC head offers (`cat.models.heads.DecodeMethod`): its searches
#: as a model's first head, and `joint_rescoring` as a transducer's auxiliary head.
DECODE_METHODS = {
    "greedy": DecodeMethod("the best token of each frame, repeats merged and blanks "
                           "removed"),
    "beam": DecodeMethod("prefix beam search"),
    "joint_rescoring": DecodeMethod(
        "transducers with an auxiliary CTC head: the N-best of both heads' beam searches "
        "ranked by ctc_weight x the CTC head's + decoder_weight x the transducer's "
        "log-likelihood",
        {"ctc_weight": DecodeOption(WEIGHT, 0.5, "weight of the CTC head's "
                                                 "log-likelihood"),
         "decoder_weight": DecodeOption(WEIGHT, 1.0, "weight of the transducer's "
                                                     "log-likelihood")}),
}


class CTCHead(nn.Linear):
    """A CTC head over encoder output: dropout, then a linear layer to `num_classes` (blank
    0) that starts blank-heavy (`init_blank_bias`); the head of CTC, CTC-CRF and U2 models
    and the auxiliary one of a transducer. Called, it gives logits (what exports and chunk
    searches read); `log_probs` gives float32 log-probabilities (dropout in training mode);
    `losses` per-utterance CTC losses (`ctc_losses`).

    As a model's first head it searches (greedy, prefix beam: `cat.ctc.search`); as
    an auxiliary head (a transducer's) it offers `joint_rescoring`: the union of the first
    head's N-best and its own prefix beam N-best, ranked by `ctc_weight` x its
    log-likelihood + `decoder_weight` x the first head's, each summed over all alignments
    (WeNet ranks a transducer's N-best by such weighted scores), plus the fusion's score.
    """

    stat_name = "ctc"
    ctc_alignment = True
    search_methods = ("greedy", "beam")
    search_settings: tuple[str, ...] = ()
    rescoring_method = "joint_rescoring"
    rescoring_weights = tuple(DECODE_METHODS[rescoring_method].options)

    def __init__(self, input_dim: int, num_classes: int, dropout: float = 0.0,
                 blank_init_prob: float = 0.5) -> None:
        super().__init__(input_dim, num_classes)
        self.dropout = nn.Dropout(dropout)
        init_blank_bias(self, blank_init_prob)

    @property
    def num_classes(self) -> int:
        """Output classes, blank (0) included."""
        return self.out_features

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T', V] float32 log-probabilities of encoder output `hidden` [B, T', D]."""
        # log_softmax in float32 even under autocast: CTC needs the precision.
        return torch.log_softmax(self(self.dropout(hidden)).float(), dim=-1)

    def losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-utterance CTC losses of `hidden`, which utterances are infeasible, no stats."""
        return (*ctc_losses(self.log_probs(hidden), lengths, labels, label_lens), {})

    def search(self, hidden: torch.Tensor, lengths: torch.Tensor, method: str,
               beam_size: int, token_topk: int | None = None) -> list[list[int]]:
        """Greedy search, or the best of prefix beam search (`token_topk` tokens per frame)."""
        if method == "greedy":
            return ctc_greedy_search(self.log_probs(hidden), lengths)
        nbest = ctc_prefix_beam_search(self.log_probs(hidden), lengths, beam_size, token_topk)
        return [hyps[0][0] if hyps else [] for hyps in nbest]

    def nbest(self, hidden: torch.Tensor, lengths: torch.Tensor, beam_size: int,
              fusion: Fusion | None = None) -> list[NBest]:
        """Prefix beam search's N-best lists, with `fusion` when given."""
        return self.search_log_probs(self.log_probs(hidden), lengths, beam_size, fusion)

    def search_log_probs(self, log_probs: torch.Tensor, lengths: torch.Tensor,
                         beam_size: int, fusion: Fusion | None = None) -> list[NBest]:
        """Prefix beam search's N-best lists of frame log-probabilities [B, T', V] (those
        `log_probs` gave, e.g. chunk by chunk), with `fusion` when given."""
        return ctc_prefix_beam_search(log_probs, lengths, beam_size, fusion=fusion)

    def token_frames(self, hidden: torch.Tensor, lengths: torch.Tensor,
                     hyps: list[list[int]]) -> list[list[Span]]:
        """Each token's spike on the Viterbi alignment of `hyps` to the log-probabilities
        (`cat.ctc.align.ctc_token_frames`)."""
        return ctc_token_frames(self.log_probs(hidden), lengths, hyps)

    @torch.no_grad()
    def sequence_log_likelihoods(self, hidden: torch.Tensor,
                                 hyps: list[list[int]]) -> torch.Tensor:
        """CTC log-likelihoods [N] of `hyps` given one utterance's `hidden` [T', D] (-inf
        where the frames are too few)."""
        labels, label_lens = pad_hyps(hyps, hidden.device)
        count = len(hyps)
        log_probs = self.log_probs(hidden[None]).expand(count, -1, -1)
        lengths = torch.full((count,), hidden.size(0), dtype=torch.long, device=hidden.device)
        return -nn.functional.ctc_loss(log_probs.transpose(0, 1), labels, lengths, label_lens,
                                       blank=0, reduction="none", zero_infinity=False)

    def rescore(self, hidden: torch.Tensor, lengths: torch.Tensor, nbest: list[NBest],
                first: SearchHead, fusion: Fusion | None, beam_size: int,
                ctc_weight: float = 0.5, decoder_weight: float = 1.0) -> list[NBest]:
        """`joint_rescoring` of the first head's `nbest` (see the class docstring)."""
        own = self.nbest(hidden, lengths, beam_size, fusion)
        return [_joint_rank(self, first, hidden[index, :length], hyps + own_hyps, fusion,
                            ctc_weight, decoder_weight)
                for index, (length, hyps, own_hyps) in enumerate(
                    zip(lengths.tolist(), nbest, own, strict=True))]


def _joint_rank(ctc: CTCHead, first: SearchHead, hidden: torch.Tensor, candidates: NBest,
                fusion: Fusion | None, ctc_weight: float, decoder_weight: float) -> NBest:
    """`candidates` ((tokens, score) pairs, duplicates allowed) of one utterance ranked by
    `ctc_weight` x CTC + `decoder_weight` x `first`'s log-likelihood (+ fusion), best first."""
    hyps = list(dict.fromkeys(tuple(tokens) for tokens, _ in candidates))
    if not hyps or hidden.size(0) == 0:
        return [(list(h), 0.0) for h in hyps]
    as_lists = [list(h) for h in hyps]
    scores = (ctc_weight * ctc.sequence_log_likelihoods(hidden, as_lists)
              + decoder_weight * first.sequence_log_likelihoods(hidden, as_lists)).tolist()
    if fusion is not None:
        scores = [score + sequence_score(fusion, hyp)
                  for score, hyp in zip(scores, hyps, strict=True)]
    ranked = sorted(zip(hyps, scores, strict=True), key=lambda pair: -pair[1])
    return [(list(hyp), score) for hyp, score in ranked]


def ctc_min_frames(labels: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
    """Frames CTC needs for each label sequence: length + number of adjacent repeats."""
    valid = torch.arange(labels.size(1), device=labels.device)[None, :] < label_lens[:, None]
    repeats = (labels[:, 1:] == labels[:, :-1]) & valid[:, 1:]
    return label_lens + repeats.sum(dim=1)


def ctc_losses(log_probs: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-utterance CTC losses (blank 0) of log-probabilities [B, T', V], and which
    utterances are infeasible (fewer frames than `ctc_min_frames`: loss 0, no gradient)."""
    if log_probs.size(1) == 0:
        # ctc_loss rejects an empty time axis; a frame nobody may use keeps it defined.
        log_probs = nn.functional.pad(log_probs, (0, 0, 0, 1))
    losses = nn.functional.ctc_loss(log_probs.transpose(0, 1), labels, lengths, label_lens,
                                    blank=0, reduction="none", zero_infinity=True)
    return losses, lengths < ctc_min_frames(labels, label_lens)


def build_head(config: dict[str, Any], encoder_dim: int, num_classes: int,
               source: str = "config.json") -> tuple[CTCHead, float | None]:
    """The CTC head of `config`'s `ctc` section and its loss weight: `ctc.weight` beside a
    transducer, else None (what the other heads leave: all of it alone, `ctc_weight` of an
    attention decoder's)."""
    section = dict(config["ctc"])
    weight = section.pop("weight", None)
    return CTCHead(encoder_dim, num_classes, **section), weight


