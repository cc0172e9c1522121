"""What the model families share: the model interfaces (`AsrModel`, `FramePosteriors`), the
CTC head (`CTCHead`: of CTC, CTC-CRF and U2 models, and a transducer's auxiliary one), loss
normalisation, batch checks, blank-heavy output init.

Usage:
    feats, feat_lens = on_device(device, feats, feat_lens)
    check_batch(feats, feat_lens, labels, label_lens)
    init_blank_bias(head, blank_prob=0.9)
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

LOSS_NORMALIZATIONS = ("utterance", "token")


@runtime_checkable
class AsrModel(Protocol):
    """What the trainer and decoding use of a model (a family's; the registry checks a
    built model against it). The contract of each method: `cat.ctc.model`'s docstring.

    * `model(feats, feat_lens, labels, label_lens) -> (loss, stats)`: the training loss;
    * `encoder` (an `Encoder`), `num_classes` (blank 0 included);
    * `decode(feats, feat_lens, method, beam_size, **search) -> token ids per utterance`,
      with `decode_methods` the methods it has and `search_settings` the names of the
      `DecodeOptions` its searches take as `**search` (e.g. `blank_penalty`);
    * `search_inputs(feats, feat_lens)`: one network forward, and
      `nbest(inputs, beam_size, fusion, **search)`: N-best lists (token ids, score) of it,
      once per shallow-fusion setting.
    """

    encoder: nn.Module
    num_classes: int
    search_settings: tuple[str, ...]

    @property
    def decode_methods(self) -> tuple[str, ...]: ...

    def __call__(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                 label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]: ...

    def decode(self, feats: torch.Tensor, feat_lens: torch.Tensor, method: str = ...,
               beam_size: int = ..., **search: Any) -> list[list[int]]: ...

    def search_inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> Any: ...

    def nbest(self, inputs: Any, beam_size: int, fusion: Any = None,
              **search: Any) -> list: ...


@runtime_checkable
class FramePosteriors(Protocol):
    """A model whose head gives log-probabilities per encoder frame (CTC, CTC-CRF, U2): what
    WFST (TLG) decoding and streaming CTC search consume.

    * `log_probs(feats, feat_lens) -> (log-probabilities [B, T', V] float32, lengths [B])`.
    """

    def log_probs(self, feats: torch.Tensor,
                  feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def check_decode_method(model: AsrModel, method: str, what: str,
                        missing_head: str | None = None) -> None:
    """ValueError naming `method` when `model` (a `what` model) does not decode with it;
    `missing_head`, when given, says what the model lacks for a method it could have."""
    if method not in model.decode_methods:
        hint = f" ({missing_head})" if missing_head else ""
        raise ValueError(f"unknown {what} decoding method {method!r}; allowed: "
                         f"{', '.join(model.decode_methods)}{hint}")


def on_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move lengths and labels to the features' device (collate output may be on CPU)."""
    return tuple(t.to(device) for t in tensors)


def encode_batch(model: nn.Module, feats: torch.Tensor, feat_lens: torch.Tensor,
                 labels: torch.Tensor, label_lens: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every model's training forward starts with: lengths and labels moved to the
    features' device, the batch checked (`check_batch`), `model.specaug` in training mode,
    `model.encoder`: (hidden [B, T', D], lengths [B], labels, label_lens)."""
    feat_lens, labels, label_lens = on_device(feats.device, feat_lens, labels, label_lens)
    check_batch(feats, feat_lens, labels, label_lens, model.num_classes)
    if model.training and model.specaug is not None:
        feats = model.specaug(feats, feat_lens)
    hidden, lengths = model.encoder(feats, feat_lens)
    return hidden, lengths, labels, label_lens


def check_batch(feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor, num_classes: int) -> None:
    """Raise ValueError on shapes or label values a model cannot train on."""
    batch = feats.size(0)
    if feats.dim() != 3:
        raise ValueError(f"feats must be [B, T, D], got shape {tuple(feats.shape)}")
    if labels.dim() != 2:
        raise ValueError(f"labels must be [B, U], got shape {tuple(labels.shape)}")
    if (feat_lens.shape != (batch,) or label_lens.shape != (batch,)
            or labels.size(0) != batch):
        raise ValueError(f"batch size mismatch: feats {tuple(feats.shape)}, feat_lens "
                         f"{tuple(feat_lens.shape)}, labels {tuple(labels.shape)}, label_lens "
                         f"{tuple(label_lens.shape)}")
    if batch and (int(feat_lens.max()) > feats.size(1) or int(label_lens.max()) > labels.size(1)
                  or int(feat_lens.min()) < 0 or int(label_lens.min()) < 0):
        raise ValueError("feat_lens/label_lens exceed the padded sizes or are negative")
    valid = torch.arange(labels.size(1), device=labels.device)[None, :] < label_lens[:, None]
    bad = valid & ((labels < 1) | (labels >= num_classes))
    if bad.any():
        row = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(f"labels of utterance {row} in the batch hold ids outside "
                         f"[1, {num_classes}) (0 is blank): {labels[row][valid[row]].tolist()}")


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


def init_blank_bias(head: nn.Linear, blank_prob: float) -> None:
    """Make the output start with probability `blank_prob` for blank (0), the rest uniform.

    From a near-uniform start, a CTC or RNN-T model first lowers its loss by emitting
    blank everywhere, and the quickest way there is to make its output independent of
    the input: a saddle it can take thousands of steps to leave, the longer the larger
    the vocabulary. Starting at that point already leaves the first gradients to telling
    the tokens apart. `blank_prob` 0 keeps PyTorch's default initialisation.
    """
    if not 0.0 <= blank_prob < 1.0:
        raise ValueError(f"blank_init_prob must be in [0, 1), got {blank_prob}")
    if blank_prob == 0.0:
        return
    num_tokens = head.out_features - 1
    with torch.no_grad():
        head.bias.zero_()
        head.bias[0] = math.log(blank_prob / (1.0 - blank_prob) * num_tokens)


class CTCHead(nn.Linear):
    """A CTC head over encoder output: dropout, then a linear layer to `num_classes` (blank
    0) that starts blank-heavy (`init_blank_bias`); the head of CTC, CTC-CRF and U2 models
    and the auxiliary one of a transducer. Called, it gives logits (what exports and chunk
    searches read); `log_probs` gives float32 log-probabilities (dropout in training mode);
    `losses` per-utterance CTC losses (`ctc_losses`)."""

    def __init__(self, input_dim: int, num_classes: int, dropout: float = 0.0,
                 blank_init_prob: float = 0.5) -> None:
        super().__init__(input_dim, num_classes)
        self.dropout = nn.Dropout(dropout)
        init_blank_bias(self, blank_init_prob)

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T', V] float32 log-probabilities of encoder output `hidden` [B, T', D]."""
        # log_softmax in float32 even under autocast: CTC needs the precision.
        return torch.log_softmax(self(self.dropout(hidden)).float(), dim=-1)

    def losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-utterance CTC losses of `hidden` and which utterances are infeasible."""
        return ctc_losses(self.log_probs(hidden), lengths, labels, label_lens)


def batch_loss(losses: torch.Tensor, labels: torch.Tensor, label_lens: torch.Tensor,
               lengths: torch.Tensor, infeasible: torch.Tensor, loss_normalization: str
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """The batch's loss from per-utterance `losses`, divided by its utterances or label
    tokens (`loss_normalization`), and the statistics the trainer logs and sums;
    `num_infeasible` counts the utterances of `infeasible` (no alignment: their loss is 0,
    they get no gradient), which the trainer adds up per epoch (`log/epoch-<EEE>.json`,
    `log/coverage.jsonl`: `infeasible`)."""
    loss_sum = losses.sum()
    num_tokens = int(label_lens.sum())
    normalizer = float(labels.size(0) if loss_normalization == "utterance"
                       else max(num_tokens, 1))
    loss = loss_sum / normalizer
    stats = {"loss": float(loss.detach()), "loss_sum": float(loss_sum.detach()),
             "normalizer": normalizer, "num_utts": float(labels.size(0)),
             "num_tokens": float(num_tokens), "num_frames": float(lengths.sum()),
             "num_infeasible": float(infeasible.sum())}
    return loss, stats
