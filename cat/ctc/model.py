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
  * `model.decode(feats, feat_lens, method="greedy"|"beam", beam_size=10) -> list[list[int]]`.
  * `model.log_probs(feats, feat_lens) -> (log_probs [B, T', V], lengths [B])` (CTC only).

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
from cat.ctc.search import ctc_greedy_search, ctc_prefix_beam_search
from cat.lm.scorer import ShallowFusion
from cat.models.heads import (
    LOSS_NORMALIZATIONS,
    batch_loss,
    check_batch,
    init_blank_bias,
    on_device,
)
from cat.models.specaug import SpecAugment


def ctc_min_frames(labels: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
    """Frames CTC needs for each label sequence: length + number of adjacent repeats."""
    valid = torch.arange(labels.size(1), device=labels.device)[None, :] < label_lens[:, None]
    repeats = (labels[:, 1:] == labels[:, :-1]) & valid[:, 1:]
    return label_lens + repeats.sum(dim=1)


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
    """

    # CTC needs at least as many encoder frames as labels (plus adjacent repeats): the
    # trainer's length filter checks it when this is set.
    ctc_alignment = True

    def __init__(self, encoder: nn.Module, num_classes: int, specaug: SpecAugment | None = None,
                 dropout: float = 0.0, loss_normalization: str = "utterance",
                 blank_init_prob: float = 0.5) -> None:
        super().__init__()
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
                             f"got {loss_normalization!r}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2 (blank + tokens), got {num_classes}")
        self.encoder = encoder
        self.specaug = specaug
        self.num_classes = num_classes
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.output_dim, num_classes)
        init_blank_bias(self.head, blank_init_prob)
        self.loss_normalization = loss_normalization

    def log_probs(self, feats: torch.Tensor,
                  feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder-side CTC log-probabilities: ([B, T', V] float32, lengths [B])."""
        hidden, lengths = self.encoder(feats, feat_lens.to(feats.device))
        logits = self.head(self.dropout(hidden))
        # log_softmax in float32 even under autocast: CTC needs the precision.
        return torch.log_softmax(logits.float(), dim=-1), lengths

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (normalised loss, stats); see the module docstring."""
        feat_lens, labels, label_lens = on_device(feats.device, feat_lens, labels, label_lens)
        check_batch(feats, feat_lens, labels, label_lens, self.num_classes)
        if self.training and self.specaug is not None:
            feats = self.specaug(feats, feat_lens)
        log_probs, lengths = self.log_probs(feats, feat_lens)
        if log_probs.size(1) == 0:
            # ctc_loss rejects an empty time axis; a frame nobody may use keeps it defined.
            log_probs = nn.functional.pad(log_probs, (0, 0, 0, 1))
        losses = nn.functional.ctc_loss(
            log_probs.transpose(0, 1), labels, lengths, label_lens, blank=0,
            reduction="none", zero_infinity=True)
        infeasible = lengths < ctc_min_frames(labels, label_lens)
        return batch_loss(losses, labels, label_lens, lengths, infeasible,
                          self.loss_normalization)

    @torch.no_grad()
    def search_inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `nbest` searches: the log-probabilities and their lengths (one network
        forward for any number of searches)."""
        return self.log_probs(feats, feat_lens)

    def nbest(self, inputs: tuple[torch.Tensor, torch.Tensor], beam_size: int,
              fusion: ShallowFusion | None = None) -> list:
        """N-best lists of a batch: CTC prefix beam search, with shallow fusion when given."""
        return ctc_prefix_beam_search(*inputs, beam_size, fusion=fusion)

    def decode(self, feats: torch.Tensor, feat_lens: torch.Tensor, method: str = "greedy",
               beam_size: int = 10, token_topk: int | None = None) -> list[list[int]]:
        """Decode a batch to token ids (blank removed) with greedy or prefix beam search.

        Uses the module's current mode: call `model.eval()` first.
        """
        log_probs, lengths = self.log_probs(feats, feat_lens)
        if method == "greedy":
            return ctc_greedy_search(log_probs, lengths)
        if method == "beam":
            nbest = ctc_prefix_beam_search(log_probs, lengths, beam_size, token_topk)
            return [hyps[0][0] if hyps else [] for hyps in nbest]
        raise ValueError(f"unknown CTC decoding method {method!r}; allowed: greedy, beam")


def build_model(config: dict[str, Any], encoder: nn.Module, num_classes: int,
                specaug: SpecAugment | None, source: str = "config.json") -> CTCModel:
    """The CTC model of `config` (`ctc` and `trainer` sections) around `encoder`."""
    try:
        return CTCModel(encoder, num_classes, specaug,
                        **{**config["ctc"], **config.get("trainer", {})})
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
