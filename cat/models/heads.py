"""Heads over the encoder output: their interfaces (`Head`, `SearchHead`, `Rescorer`,
`FramePosteriors`, `ProgressHead`, which `cat.models.model.AsrModel` uses), the declaration
of the decoding methods they offer (`DecodeMethod`, `DecodeOption`), and what heads
share: loss normalisation, batch checks, blank-heavy output init, training
progress (`Progress`). The heads live with their own code: the CTC head in `cat.ctc.head`,
CR-CTC's in `cat.ctc.crctc`, the transducer's in `cat.rnnt.model`, CTC-CRF's in
`cat.crf.model`, the attention decoder's in `cat.models.attention`.

Usage:
    feats, feat_lens = on_device(device, feats, feat_lens)
    check_batch(feats, feat_lens, labels, label_lens)
    init_blank_bias(head, blank_prob=0.9)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from cat.core.config import ConfigError
from cat.models.stats import Stats

if TYPE_CHECKING:
    from cat.lm.scorer import Fusion

LOSS_NORMALIZATIONS = ("utterance", "token")


NBest = list[tuple[list[int], float]]


@dataclasses.dataclass(frozen=True)
class DecodeOption:
    """A setting of a decoding method, as the method that takes it declares it.

    `hyper-p.json: inference.infer.option` and the decoding command line (`--<key>`) hold
    one value per key, so a key several methods take (`DECODE_METHODS` of two heads) is one
    setting: its `schema` (the JSON schema of the value, bounds included) and `default` are
    the same in every declaration, and each method says what it means for it
    (`description`). `unused`: why a value other than the default is an error for a model
    whose method does not take the setting (None: such a value is ignored)."""

    schema: Mapping[str, Any]
    default: Any
    description: str
    unused: str | None = None


@dataclasses.dataclass(frozen=True)
class DecodeMethod:
    """A decoding method a head offers, what its module's `DECODE_METHODS` ({method name:
    DecodeMethod}) declares and the registry collects (`cat.models.registry.
    decode_methods`): a search of the first head (its `search_methods`; the settings its
    `search` and `nbest` take are its `search_settings`), or a ranking of the first head's
    N-best by another head (a `Rescorer`'s `rescoring_method`, its `rescoring_weights`).
    `description`: what the method does with this head; `options`: the settings it takes
    ({key: DecodeOption})."""

    description: str
    options: Mapping[str, DecodeOption] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Head(Protocol):
    """A head over the encoder output (`cat.models.model.AsrModel` holds one or more).

    * `losses(hidden [B, T', D], lengths [B], labels [B, U], label_lens [B]) ->
      (per-utterance losses [B], infeasible [B] bool, stats)`: `infeasible` marks the
      utterances the head cannot align (loss 0 there, no gradient); `stats` what the
      trainer logs beside the loss, floats or one-element tensors (read when logged:
      `cat.models.stats`);
    * `stat_name`: the prefix of the head's `<stat_name>_loss_sum` in a model of several
      heads;
    * `ctc_alignment`: the head needs as many encoder frames as labels plus repeats (the
      trainer's length filter checks it when the model's first head says so).
    """

    stat_name: str
    ctc_alignment: bool

    def losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float | torch.Tensor]]: ...


@runtime_checkable
class SearchHead(Head, Protocol):
    """A head that decodes (a model's first head: CTC, CTC-CRF or transducer).

    * `search_methods`: its own methods (`greedy`, `beam`); `search_settings`: the names of
      the decoding options its searches take as `**settings` (a transducer's blank
      penalty), as its module's `DECODE_METHODS` declares them (`DecodeMethod`);
    * `search(hidden, lengths, method, beam_size, **settings) -> token ids per utterance`;
    * `nbest(hidden, lengths, beam_size, fusion, **settings) -> an N-best list (token ids,
      score) per utterance`, with shallow fusion (and hotwords) when `fusion` is given;
    * `sequence_log_likelihoods(hidden [T', D], hyps) -> [N]`: each token sequence's
      log-likelihood given one utterance's encoder output, summed over all alignments.
    """

    search_methods: tuple[str, ...]
    search_settings: tuple[str, ...]
    num_classes: int

    def search(self, hidden: torch.Tensor, lengths: torch.Tensor, method: str,
               beam_size: int, **settings: Any) -> list[list[int]]: ...

    def nbest(self, hidden: torch.Tensor, lengths: torch.Tensor, beam_size: int,
              fusion: Fusion | None = None, **settings: Any) -> list[NBest]: ...

    def sequence_log_likelihoods(self, hidden: torch.Tensor,
                                 hyps: list[list[int]]) -> torch.Tensor: ...


@runtime_checkable
class Rescorer(Protocol):
    """A head that ranks the first head's N-best again (decoding method
    `rescoring_method`): `rescore(hidden, lengths, nbest, first, fusion, beam_size,
    **weights) -> N-best lists`, `first` being the model's first head (a `SearchHead`),
    `weights` the decoding options named by `rescoring_weights` (its module's
    `DECODE_METHODS[rescoring_method]` declares them)."""

    rescoring_method: str
    rescoring_weights: tuple[str, ...]

    def rescore(self, hidden: torch.Tensor, lengths: torch.Tensor, nbest: list[NBest],
                first: SearchHead, fusion: Fusion | None, beam_size: int,
                **weights: float) -> list[NBest]: ...


@runtime_checkable
class FramePosteriors(Protocol):
    """A head that gives log-probabilities per encoder frame (CTC, CTC-CRF): what WFST
    (TLG) decoding and streaming CTC search consume, through the model's `log_probs`
    when this head is its first.

    * `log_probs(hidden [B, T', D]) -> [B, T', V] float32`;
    * `search_log_probs(log_probs, lengths, beam_size, fusion) -> an N-best list per
      utterance`: its beam search of log-probabilities it gave (streaming with hotwords
      searches those of the chunks so far).
    """

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def search_log_probs(self, log_probs: torch.Tensor, lengths: torch.Tensor,
                         beam_size: int, fusion: Fusion | None = None) -> list[NBest]: ...


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a `ProgressHead`'s loss reads beside the batch (`AsrModel.forward` makes it).

    * `step`: the optimizer updates done before this batch (the trainer's, which
      checkpoints keep: a resumed run goes on at the same step); 0 when not given;
    * `views`: the copies of each utterance the batch holds, stacked view-major (row
      `v * B + b` is view `v` of utterance `b`): `ProgressHead.views` in training mode,
      1 in evaluation.
    """

    step: int = 0
    views: int = 1


@runtime_checkable
class ProgressHead(Head, Protocol):
    """A head that asks the model for passes beyond one forward of the batch and reads the
    training progress (CR-CTC's consistency loss, a loss that warms up with the step).

    * `views`: augmented views of each utterance its loss compares (1: the batch as it is;
      2: CR-CTC). The model stacks that many independently SpecAugmented copies of the
      batch into one encoder call (time warp once per utterance, masks per copy), every
      head's loss reads all of them, and each utterance's loss is the mean over its views;
    * `progress_losses(hidden, lengths, labels, label_lens, progress)`: `losses` of the
      stacked views (`hidden` [views x B, T', D], labels repeated alike) with the batch's
      `Progress`; its stats are per utterance already (summed over views, divided by
      `progress.views`).
    """

    views: int

    def progress_losses(self, hidden: torch.Tensor, lengths: torch.Tensor,
                        labels: torch.Tensor, label_lens: torch.Tensor, progress: Progress
                        ) -> tuple[torch.Tensor, torch.Tensor,
                                   dict[str, float | torch.Tensor]]: ...


def on_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Move lengths and labels to the features' device (collate output may be on CPU),
    without waiting for the copies: the host goes on queuing work."""
    return tuple(t.to(device, non_blocking=True) for t in tensors)


def check_batch(feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor, num_classes: int) -> None:
    """Raise ValueError on shapes or label values a model cannot train on. It reads the
    lengths and labels: on the CPU that costs nothing, on a GPU it waits for the device
    (the trainer hands the model the CPU ones)."""
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


def pad_hyps(hyps: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences as padded labels [N, max(1, longest)] (0-padded) and lengths [N]."""
    label_lens = torch.tensor([len(h) for h in hyps], dtype=torch.long, device=device)
    labels = torch.zeros(len(hyps), max(int(label_lens.max()) if hyps else 0, 1),
                         dtype=torch.long, device=device)
    for row, hyp in enumerate(hyps):
        labels[row, :len(hyp)] = torch.tensor(hyp, dtype=torch.long)
    return labels, label_lens


def batch_loss(losses: torch.Tensor, labels: torch.Tensor, label_lens: torch.Tensor,
               lengths: torch.Tensor, infeasible: torch.Tensor, loss_normalization: str
               ) -> tuple[torch.Tensor, Stats]:
    """The batch's loss from per-utterance `losses`, divided by its utterances or label
    tokens (`loss_normalization`), and the statistics the trainer logs and sums;
    `num_infeasible` counts the utterances of `infeasible` (no alignment: their loss is 0,
    they get no gradient), which the trainer adds up per epoch (`log/epoch-<EEE>.json`,
    `log/coverage.jsonl`: `infeasible`). Counts of `label_lens` given on the CPU are
    floats; the others stay tensors until read (`Stats`), so nothing here waits for the
    device."""
    loss_sum = losses.sum()
    num_tokens = label_lens.sum()
    if label_lens.device.type == "cpu":
        num_tokens = float(num_tokens)
    if loss_normalization == "utterance":
        normalizer: float | torch.Tensor = float(labels.size(0))
    elif isinstance(num_tokens, float):
        normalizer = max(num_tokens, 1.0)
    else:
        normalizer = num_tokens.clamp(min=1).float()
    loss = loss_sum / normalizer
    stats = Stats(loss=loss, loss_sum=loss_sum, normalizer=normalizer,
                  num_utts=float(labels.size(0)), num_tokens=num_tokens,
                  num_frames=lengths.sum(), num_infeasible=infeasible.sum())
    return loss, stats


def build_component(registry: Mapping[str, type[nn.Module]], section: dict[str, Any],
                    where: str, source: str, *args: Any) -> nn.Module:
    """`registry[section["type"]](*args, **section["kwargs"])`, the encoder's or a head's
    part named in config.json (`registry`: an explicit dict of classes); errors name
    `where`."""
    try:
        return registry[section["type"]](*args, **section.get("kwargs", {}))
    except ValueError as error:
        raise ConfigError(f"{source}: {where}: {error}") from None


class TokenChunkSearch:
    """What a family's token search over chunks (its `stream.ChunkSearch`, which
    `cat.decoding.online` runs) shares: nothing to do at the end, its text the tokenizer's
    of its token ids."""

    tokens: list[int]

    def finish(self) -> None:
        """Nothing is held back: the tokens are final as they come."""

    def text(self, tokenizer: Any) -> str:
        return tokenizer.decode(self.tokens)
