"""CTC acoustic model: encoder + linear head + CTC loss (blank = 0).

Interface shared with `cat.rnnt.model.TransducerModel` (what the trainer uses):

  * `loss, stats = model(feats, feat_lens, labels, label_lens)`
      - `feats` [B, T, D] float, `feat_lens` [B] long,
      - `labels` [B, U] long padded with 0 (positions >= `label_lens` are ignored),
        `label_lens` [B] long;
      - `loss`: scalar, the summed per-utterance loss divided by `stats["normalizer"]`;
      - `stats`: floats `loss` (= loss.item()), `loss_sum`, `normalizer`, `num_utts`,
        `num_tokens`, `num_frames` (encoder frames) and `num_infeasible`
        (utterances whose labels cannot fit the encoder frames; their loss is set
        to 0 and they get no gradient).
  * `model.decode(feats, feat_lens, method="greedy"|"beam", beam_size=10) -> list[list[int]]`;
    `decode_methods` names the methods a model has.
  * `model.log_probs(feats, feat_lens) -> (log_probs [B, T', V], lengths [B])` (CTC only).

With an attention decoder head (config.json `attention`, `cat.models.attention`) the loss
is `ctc_weight * ctc + (1 - ctc_weight) * attention` and decoding has the method
`attention_rescoring`: the prefix beam search's N-best ranked again by the decoder.

Loss normalisation (`loss_normalization`): "utterance" divides the batch sum
by the number of utterances, "token" by the number of label tokens. For
gradient accumulation and DDP, where micro-batches differ in size, a trainer
gets the exact mean over a whole optimizer step by back-propagating
`loss * stats["normalizer"] * world_size / step_normalizer`, where
`step_normalizer` is the sum of `normalizer` over every micro-batch of the
step on every rank (all-reduce it; DDP averages gradients over ranks, hence
the `world_size`). With equal micro-batches this reduces to `loss / accum_steps`.

SpecAugment, when configured, is applied only in training mode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cat.core.config import ConfigError
from cat.decoding.timestamps import Span, ctc_token_frames
from cat.lm.scorer import ShallowFusion
from cat.models.attention import AttentionHead, build_attention, rescore
from cat.models.ctc_search import ctc_greedy_search, ctc_prefix_beam_search
from cat.models.heads import (
    LOSS_NORMALIZATIONS,
    CTCHead,
    batch_loss,
    check_decode_method,
    ctc_losses,
    encode_batch,
)
from cat.models.specaug import SpecAugment


class CTCModel(nn.Module):
    """Encoder + dropout + linear head over `num_classes` (blank = 0), trained with CTC.

    Args:
        encoder: module mapping (feats, feat_lens) to ([B, T', H], lengths) with
            an `output_dim` attribute (e.g. `ConformerNet`).
        num_classes: vocabulary size including blank (0) and `<unk>` (1).
        specaug: optional SpecAugment applied to the features in training mode.
        dropout: dropout before the linear head.
        loss_normalization: "utterance" or "token" (see the module docstring).
        blank_init_prob: initial blank probability of the head (see `init_blank_bias`).
        attention: an attention decoder head trained with the CTC head (U2), or None.
    """

    #: The search settings (`DecodeOptions`) `decode` and `nbest` take besides the rescoring
    #: weights of attention_rescoring.
    search_settings: tuple[str, ...] = ()

    # CTC needs at least as many encoder frames as labels (plus adjacent repeats): the
    # trainer's length filter checks it when this is set.
    ctc_alignment = True

    def __init__(self, encoder: nn.Module, num_classes: int, specaug: SpecAugment | None = None,
                 dropout: float = 0.0, loss_normalization: str = "utterance",
                 blank_init_prob: float = 0.5, attention: AttentionHead | None = None) -> None:
        super().__init__()
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
                             f"got {loss_normalization!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (blank + tokens), got {num_classes}")
        self.encoder = encoder
        self.specaug = specaug
        self.num_classes = num_classes
        self.head = CTCHead(encoder.output_dim, num_classes, dropout, blank_init_prob)
        self.loss_normalization = loss_normalization
        self.attention = attention

    @property
    def decode_methods(self) -> tuple[str, ...]:
        """The `method`s `decode` accepts."""
        return ("greedy", "beam") + (("attention_rescoring",) if self.attention is not None else ())

    def ctc_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """CTC log-probabilities [B, T', V] (float32) of encoder output `hidden`."""
        return self.head.log_probs(hidden)

    def log_probs(self, feats: torch.Tensor,
                  feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder-side CTC log-probabilities: ([B, T', V] float32, lengths [B])."""
        hidden, lengths = self.encoder(feats, feat_lens.to(feats.device))
        return self.ctc_log_probs(hidden), lengths

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (normalised loss, stats); see the module docstring."""
        hidden, lengths, labels, label_lens = encode_batch(self, feats, feat_lens, labels,
                                                           label_lens)
        losses, infeasible = ctc_losses(self.ctc_log_probs(hidden), lengths, labels, label_lens)
        if self.attention is None:
            return batch_loss(losses, labels, label_lens, lengths, infeasible,
                              self.loss_normalization)
        attention, extra = self.attention.losses(hidden, lengths, labels, label_lens)
        weight = self.attention.ctc_weight
        combined = (weight * losses + (1 - weight) * attention).masked_fill(infeasible, 0.0)
        loss, stats = batch_loss(combined, labels, label_lens, lengths, infeasible,
                                 self.loss_normalization)
        stats.update(extra, ctc_loss_sum=float(losses.detach().sum()),
                     att_loss_sum=float(attention.detach().sum()))
        return loss, stats

    @torch.no_grad()
    def search_inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, ...]:
        """What `nbest` searches: the log-probabilities and their lengths, and the encoder
        output for attention rescoring when the model has that head (one network forward
        for any number of searches)."""
        hidden, lengths = self.encoder(feats, feat_lens.to(feats.device))
        log_probs = self.ctc_log_probs(hidden)
        return ((log_probs, lengths, hidden) if self.attention is not None
                else (log_probs, lengths))

    def nbest(self, inputs: tuple[torch.Tensor, ...], beam_size: int,
              fusion: ShallowFusion | None = None, **rescoring: Any) -> list:
        """N-best lists of a batch: CTC prefix beam search, with shallow fusion when given;
        with `rescoring` weights (`ctc_weight`, `decoder_weight`, `reverse_weight` of
        `cat.models.attention.rescore`) ranked again by attention rescoring."""
        nbest = ctc_prefix_beam_search(inputs[0], inputs[1], beam_size, fusion=fusion)
        if not rescoring:
            return nbest
        self._check_method("attention_rescoring")
        return rescore(self.attention, inputs[2], inputs[1], nbest, **rescoring)

    def token_frames(self, inputs: tuple[torch.Tensor, ...],
                     hyps: list[list[int]]) -> list[list[Span]]:
        """Each token's spike on the Viterbi alignment of `hyps` to `inputs` (what
        `search_inputs` returned); `cat.decoding.timestamps`."""
        return ctc_token_frames(inputs[0], inputs[1], hyps)

    def _check_method(self, method: str) -> None:
        check_decode_method(self, method, "CTC", None if self.attention is not None else
                            "attention_rescoring needs an attention decoder: config.json "
                            "'attention'")

    def decode(self, feats: torch.Tensor, feat_lens: torch.Tensor, method: str = "greedy",
               beam_size: int = 10, token_topk: int | None = None,
               **rescoring: Any) -> list[list[int]]:
        """Decode a batch to token ids (blank removed) with greedy or prefix beam search,
        or attention rescoring of the prefix beam's N-best (`rescoring` as in `nbest`).

        Uses the module's current mode: call `model.eval()` first.
        """
        self._check_method(method)
        if method == "attention_rescoring":
            nbest = self.nbest(self.search_inputs(feats, feat_lens), beam_size, **rescoring)
            return [hyps[0][0] if hyps else [] for hyps in nbest]
        log_probs, lengths = self.log_probs(feats, feat_lens)
        if method == "greedy":
            return ctc_greedy_search(log_probs, lengths)
        nbest = ctc_prefix_beam_search(log_probs, lengths, beam_size, token_topk)
        return [hyps[0][0] if hyps else [] for hyps in nbest]


def build_model(config: dict[str, Any], encoder: nn.Module, num_classes: int,
                specaug: SpecAugment | None, source: str = "config.json") -> CTCModel:
    """The CTC model of `config` (`ctc`, `trainer` and `attention` sections) around
    `encoder`."""
    try:
        attention = build_attention(config.get("attention"), encoder.output_dim, num_classes)
        return CTCModel(encoder, num_classes, specaug,
                        **{**config["ctc"], **config.get("trainer", {})}, attention=attention)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
