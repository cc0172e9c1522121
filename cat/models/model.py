"""The model: an encoder and heads, the one model class the trainer and decoding use.

`AsrModel(encoder, heads, weights, specaug, loss_normalization)` holds an `Encoder`
(`cat.models.encoder`) and named heads over its output (interfaces: `cat.models.heads`),
built by `cat.models.registry` from `config.json`'s sections. The first head decodes: a
transducer's (`cat.rnnt.model`), else the CTC or CTC-CRF head. Every head trains::

    loss of an utterance = sum over heads of weight x the head's loss

with the weights of the config (`ctc.weight` beside a transducer, `attention.ctc_weight`
beside a CTC head; 1 for a head alone). A CUSIDE model (`chunking`, config.json's
`trainer.chunk_size`: `cat.models.cuside`) adds, per utterance, the same heads' losses on
its chunked forward and the simulation network's weighted L1 loss (stats
`chunk_loss_sum`, `simu_loss_sum`). A head may ask for passes of its own and read the
training progress (`ProgressHead`: the forward's `step`, the optimizer updates done, which
the trainer passes): a head of `views` 2 (CR-CTC, `cat.ctc.crctc`) has the batch run as two
independently SpecAugmented views stacked into one encoder call, every head's loss read on
both and averaged per utterance, so that its consistency loss lives in its own module. The
other heads may rank the first head's N-best again, a decoding method each (`Rescorer`): the
attention decoder's `attention_rescoring`, an auxiliary CTC head's `joint_rescoring`.

What the trainer and decoding use:

  * `loss, stats = model(feats, feat_lens, labels, label_lens, step=0)`
      - `feats` [B, T, D] float, `feat_lens` [B] long,
      - `labels` [B, U] long padded with 0 (positions >= `label_lens` are ignored),
        `label_lens` [B] long;
      - `loss`: scalar, the summed per-utterance loss divided by `stats["normalizer"]`;
      - `stats`: floats `loss` (= loss.item()), `loss_sum`, `normalizer`, `num_utts`,
        `num_tokens`, `num_frames` (encoder frames) and `num_infeasible` (utterances the
        first head cannot align: their loss is 0 and they get no gradient); with several
        heads also each head's `<stat_name>_loss_sum`; the heads' own stats (`att_acc`,
        CR-CTC's `cr_loss_sum`). They are read when first asked for
        (`cat.models.stats.Stats`: one copy from the device for all of them), and lengths
        and labels given on the CPU are checked and counted there, so that the forward
        never waits for the device (the trainer passes the batch's CPU lengths and labels
        beside its features on the device);
      - `step`: the optimizer updates done before this batch, handed to the heads that
        read it (`cat.models.heads.Progress`).
  * `decode(feats, feat_lens, method, beam_size, **search) -> token ids per utterance`,
    `decode_methods` the methods it has and `search_settings` the names of the
    `DecodeOptions` its searches take (e.g. `blank_penalty`; `method_settings(method)` adds a
    rescoring method's weights); `search_inputs(feats,
    feat_lens)`: one network forward, and `nbest(inputs, beam_size, fusion, method,
    **search)`: N-best lists (token ids, score) of it, once per shallow-fusion setting.
  * `encode(feats, feat_lens)`: the encoder output the searches read, full context or in
    the chunks `set_decode_chunk_size(chunk_size, right_context)` asks for (U2's chunk
    mask; CUSIDE's windows with a right context).
  * `streaming`: the encoder's streaming strategy (`cat.models.streaming`: U2's caches or
    CUSIDE's windows, as the config trained it), whose chunk encoder decoding and serving
    stream with and whose step `streaming.onnx` traces.
  * `log_probs(feats, feat_lens) -> (log-probabilities [B, T', V] float32, lengths [B])`
    when the first head gives frame posteriors (`frame_posteriors`: CTC and CTC-CRF),
    what WFST decoding, streaming CTC search and the CTC export read.

Loss normalisation (`loss_normalization`): "utterance" divides the batch sum by the number
of utterances, "token" by the number of label tokens. For gradient accumulation and DDP,
where micro-batches differ in size, a trainer gets the exact mean over a whole optimizer
step by back-propagating `loss * stats["normalizer"] * world_size / step_normalizer`, where
`step_normalizer` is the sum of `normalizer` over every micro-batch of the step on every
rank (all-reduce it; DDP averages gradients over ranks, hence the `world_size`). With equal
micro-batches this reduces to `loss / accum_steps`. SpecAugment, when configured, is
applied only in training mode.

State-dict keys: `encoder.*` and each head under its name (`ctc.*` for the CTC and CTC-CRF
heads, `transducer.predictor.*`, `transducer.joiner.*`, `attention.*`). Checkpoints of the
earlier layout, one model class per family (`head.*`, `ctc_head.*`, `predictor.*`,
`joiner.*`, `simple_am.*`, `simple_lm.*`), load unchanged: `upgrade_state_dict` renames
their keys, in `load_state_dict` and wherever state dicts are read without a model
(checkpoint averaging).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from cat.models.cuside import ContextChunking
from cat.models.cuside_streaming import CusideStreaming
from cat.models.heads import (
    LOSS_NORMALIZATIONS,
    FramePosteriors,
    Head,
    NBest,
    Progress,
    ProgressHead,
    Rescorer,
    SearchHead,
    batch_loss,
    check_batch,
    on_device,
)
from cat.models.specaug import SpecAugment
from cat.models.stats import Stats
from cat.models.streaming import StreamingStrategy, strategy_class

#: Key prefixes of checkpoints written before the model had heads, and where they are now.
OLD_KEY_PREFIXES: Mapping[str, str] = {
    "head.": "ctc.", "ctc_head.": "ctc.", "predictor.": "transducer.predictor.",
    "joiner.": "transducer.joiner.", "simple_am.": "transducer.simple_am.",
    "simple_lm.": "transducer.simple_lm."}


def upgrade_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """`state` with the keys of the earlier layout (`OLD_KEY_PREFIXES`) renamed; a state
    dict of the current layout comes back as it is (as a new dict)."""
    upgraded = {}
    for key, value in state.items():
        for old, new in OLD_KEY_PREFIXES.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        upgraded[key] = value
    return upgraded


def _upgrade_hook(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """`load_state_dict` pre-hook: rename the earlier layout's keys in place."""
    if prefix:
        return
    upgraded = upgrade_state_dict(state)
    if upgraded.keys() != state.keys():
        state.clear()
        state.update(upgraded)


class AsrModel(nn.Module):
    """An encoder and heads (see the module docstring).

    Args:
        encoder: an `Encoder` (e.g. `ConformerNet`).
        heads: name -> head, the decoding (first) head first; each a `Head`, the first a
            `SearchHead`.
        weights: name -> the head's weight in the loss (all of `heads`).
        specaug: optional SpecAugment applied to the features in training mode.
        loss_normalization: "utterance" or "token" (see the module docstring).
        chunking: CUSIDE's chunked forward (`cat.models.cuside.ContextChunking`), which
            trains the heads on chunks too and decodes in chunks when set to.
    """

    def __init__(self, encoder: nn.Module, heads: Mapping[str, nn.Module],
                 weights: Mapping[str, float], specaug: SpecAugment | None = None,
                 loss_normalization: str = "utterance",
                 chunking: ContextChunking | None = None) -> None:
        super().__init__()
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
                             f"got {loss_normalization!r}")
        if not heads or set(weights) != set(heads):
            raise ValueError(f"every head needs a loss weight: heads {sorted(heads)}, "
                             f"weights {sorted(weights)}")
        first = next(iter(heads.values()))
        if not isinstance(first, SearchHead):
            raise TypeError(f"the first head ({type(first).__name__}) must decode: it is not "
                            "a SearchHead")
        for name, head in heads.items():
            if not isinstance(head, Head):
                raise TypeError(f"head {name!r} ({type(head).__name__}) is not a Head")
        self.encoder = encoder
        self.specaug = specaug
        self.chunking = chunking
        self.loss_normalization = loss_normalization
        self.head_names = tuple(heads)
        for name, head in heads.items():
            self.add_module(name, head)
        self.weights = dict(weights)
        self.num_classes = int(first.num_classes)
        #: augmented views of each utterance a training batch runs as (the most a head
        #: asks for: `ProgressHead.views`)
        self.views = max((int(head.views) for head in heads.values()
                          if isinstance(head, ProgressHead)), default=1)
        if self.views > 1 and chunking is not None:
            raise ValueError(f"a head asking for {self.views} augmented views (CR-CTC: "
                             "ctc.cr_ctc) does not train with CUSIDE's chunked forward "
                             "(trainer.chunk_size); remove one of them")
        self.rescorers: dict[str, Rescorer] = {
            head.rescoring_method: head for head in list(heads.values())[1:]
            if isinstance(head, Rescorer)}
        self.register_load_state_dict_pre_hook(_upgrade_hook)

    @property
    def heads(self) -> dict[str, nn.Module]:
        """name -> head, the first head first."""
        return {name: getattr(self, name) for name in self.head_names}

    @property
    def first_head(self) -> SearchHead:
        """The head that decodes."""
        return getattr(self, self.head_names[0])

    @property
    def ctc_alignment(self) -> bool:
        """Whether the trainer's length filter must leave CTC enough frames (the first
        head's need)."""
        return self.first_head.ctc_alignment

    @property
    def frame_posteriors(self) -> bool:
        """Whether the first head gives log-probabilities per frame (`log_probs`)."""
        return isinstance(self.first_head, FramePosteriors)

    def prepare_training(self, units: Sequence[str] | None = None) -> None:
        """What heads read before training (the CTC-CRF head its denominator graph)."""
        for head in self.heads.values():
            prepare = getattr(head, "prepare_training", None)
            if prepare is not None:
                prepare(units)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, Stats]:
        """Return (normalised loss, stats); see the module docstring. `step`: the optimizer
        updates done before this batch, which the heads are handed (`Progress`)."""
        # Lengths and labels given on the CPU are checked and counted there, and moved
        # to the device without waiting: nothing here waits for the device.
        check_batch(feats, feat_lens, labels, label_lens, self.num_classes)
        given_label_lens = label_lens
        clean = feats
        batch = feats.size(0)
        views = self.views if self.training else 1
        progress = Progress(step=step, views=views)
        if self.training and self.specaug is not None:
            feats = self.specaug(feats, feat_lens, views=views)
        elif views > 1:
            feats = feats.repeat(views, 1, 1)
        if views > 1:
            # The heads' second augmented view (CR-CTC): one encoder call on the views
            # stacked view-major, the labels repeated alike.
            feat_lens, labels, label_lens = (feat_lens.repeat(views),
                                             labels.repeat(views, 1), label_lens.repeat(views))
        feat_lens, labels, label_lens = on_device(feats.device, feat_lens, labels, label_lens)
        hidden, lengths = self.encoder(feats, feat_lens)
        combined, infeasible, extra = self._head_losses(hidden, lengths, labels, label_lens,
                                                        progress)
        if self.chunking is not None:
            # CUSIDE's unified training: the heads on the chunked forward too, plus the
            # simulation's loss (`cat.models.cuside`).
            hidden, chunk_lengths, simulation = self.chunking.training_pass(
                self.encoder, feats, clean, feat_lens)
            chunked, chunk_infeasible, _ = self._head_losses(hidden, chunk_lengths, labels,
                                                             label_lens, progress)
            combined, infeasible = combined + chunked, infeasible | chunk_infeasible
            extra["chunk_loss_sum"] = chunked.detach().masked_fill(infeasible, 0).sum()
            if simulation is not None:
                extra["simu_loss_sum"] = simulation.detach().sum()
                combined = combined + simulation
        if views > 1:
            # An utterance's loss is the mean over its views.
            combined = combined.view(views, batch).mean(dim=0)
            infeasible = infeasible.view(views, batch).any(dim=0)
            labels, lengths = labels[:batch], lengths[:batch]
        combined = combined.masked_fill(infeasible, 0.0)
        loss, stats = batch_loss(combined, labels, given_label_lens, lengths, infeasible,
                                 self.loss_normalization)
        stats.update(extra)
        return loss, stats

    def _head_losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
                     label_lens: torch.Tensor, progress: Progress
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float | torch.Tensor]]:
        """The heads' weighted per-utterance losses summed, the first head's infeasible
        utterances, each head's own stats, and with several heads each head's loss sum
        (per utterance: divided by `progress.views`)."""
        combined = infeasible = None
        extra: dict[str, float | torch.Tensor] = {}
        for name, head in self.heads.items():
            if isinstance(head, ProgressHead):
                losses, head_infeasible, stats = head.progress_losses(
                    hidden, lengths, labels, label_lens, progress)
            else:
                losses, head_infeasible, stats = head.losses(hidden, lengths, labels,
                                                             label_lens)
            weighted = losses if len(self.head_names) == 1 else self.weights[name] * losses
            if infeasible is None:  # the first head's
                infeasible = head_infeasible
                combined = weighted
            else:
                combined = combined + weighted
            extra.update(stats)
            if len(self.head_names) > 1:
                loss_sum = losses.detach().sum()
                extra[f"{head.stat_name}_loss_sum"] = (loss_sum if progress.views == 1
                                                       else loss_sum / progress.views)
        return combined, infeasible, extra

    def encode(self, feats: torch.Tensor,
               feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output decoding searches: full context, or in the chunks
        `set_decode_chunk_size` set (the chunk-masked forward of a U2 model, CUSIDE's
        chunked forward)."""
        feat_lens = feat_lens.to(feats.device)
        if self.chunking is not None and self.chunking.decode_chunk_size:
            hidden, lengths, _ = self.chunking.encode_chunks(self.encoder, feats, feat_lens)
            return hidden, lengths
        return self.encoder(feats, feat_lens)

    def set_decode_chunk_size(self, chunk_size: int, right_context: str | None = None) -> None:
        """Decode in chunks of `chunk_size` encoder frames (0: full context); a CUSIDE
        model with `right_context` (`cat.models.cuside.RIGHT_CONTEXTS`; None: its
        default). ValueError for chunks the model was not trained for."""
        if self.chunking is not None:
            self.chunking.set_decode(chunk_size, right_context)
            return
        if right_context is not None:
            raise ValueError(f"right context {right_context!r}: only CUSIDE models "
                             "(trainer.chunk_size) decode chunks with a right context")
        self.encoder.set_decode_chunk_size(chunk_size)

    @property
    def streaming(self) -> StreamingStrategy:
        """How the encoder streams (`cat.models.streaming`), as the config trained it:
        CUSIDE's windows of context with `chunking` (`trainer.chunk_size`), else the
        encoder's own strategy (`Encoder.streaming_strategy`: a `ConformerNet`'s U2
        chunk-masked forward with caches, `encoder.kwargs.max_chunk_size`). Its
        `chunk_encoder`, `step` and right contexts are what decoding, serving and export
        stream with."""
        if self.chunking is not None:
            return CusideStreaming(self.encoder, self.chunking)
        return strategy_class(self.encoder.streaming_strategy)(self.encoder)

    @property
    def decode_methods(self) -> tuple[str, ...]:
        """The `method`s `decode` accepts: the first head's searches and the rescorings of
        the others."""
        return tuple(self.first_head.search_methods) + tuple(self.rescorers)

    @property
    def search_settings(self) -> tuple[str, ...]:
        """The `DecodeOptions` the first head's searches take besides the rescoring weights."""
        return tuple(self.first_head.search_settings)

    def method_settings(self, method: str) -> tuple[str, ...]:
        """The `DecodeOptions` `decode` and `nbest` take with `method`: the first head's
        `search_settings`, and for a rescoring method its head's `rescoring_weights`."""
        self.check_method(method)
        rescorer = self.rescorers.get(method)
        return self.search_settings + (tuple(rescorer.rescoring_weights) if rescorer else ())

    def check_method(self, method: str) -> None:
        """ValueError naming `method` when the model does not decode with it (and which
        head the rescoring methods need)."""
        if method not in self.decode_methods:
            raise ValueError(f"unknown decoding method {method!r} for this model; allowed: "
                             f"{', '.join(self.decode_methods)} (attention_rescoring needs "
                             "config.json's 'attention' head, joint_rescoring a 'ctc' head "
                             "beside a transducer)")

    def log_probs(self, feats: torch.Tensor,
                  feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first head's log-probabilities per frame: ([B, T', V] float32, lengths [B]);
        TypeError when it gives none (a transducer)."""
        if not self.frame_posteriors:
            raise TypeError(f"this model's first head ({self.head_names[0]}) gives no "
                            "log-probabilities per frame")
        hidden, lengths = self.encode(feats, feat_lens)
        return self.first_head.log_probs(hidden), lengths

    @torch.no_grad()
    def search_inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `nbest` searches: the encoder output and its lengths (one network forward
        for any number of searches)."""
        return self.encode(feats, feat_lens)

    def nbest(self, inputs: tuple[torch.Tensor, torch.Tensor], beam_size: int,
              fusion: Any = None, method: str = "beam", **search: Any) -> list[NBest]:
        """N-best lists of a batch: the first head's beam search (with shallow fusion and
        hotwords as `fusion`, and its `search_settings` from `search`), ranked again by
        the rescoring head of `method` with the rest of `search` (its weights)."""
        self.check_method(method)
        hidden, lengths = inputs
        settings = {key: search.pop(key) for key in self.search_settings if key in search}
        nbest = self.first_head.nbest(hidden, lengths, beam_size, fusion, **settings)
        if method in self.first_head.search_methods:
            if search:
                raise ValueError(f"method {method!r} takes no {', '.join(sorted(search))}")
            return nbest
        return self.rescorers[method].rescore(hidden, lengths, nbest, self.first_head, fusion,
                                              beam_size, **search)

    def decode(self, feats: torch.Tensor, feat_lens: torch.Tensor, method: str = "greedy",
               beam_size: int = 10, **search: Any) -> list[list[int]]:
        """Decode a batch to token ids with the first head's `method` (greedy, beam) or a
        rescoring method (`search` as in `nbest`).

        Uses the module's current mode: call `model.eval()` first.
        """
        self.check_method(method)
        if method in self.first_head.search_methods:
            hidden, lengths = self.encode(feats, feat_lens)
            return self.first_head.search(hidden, lengths, method, beam_size, **search)
        nbest = self.nbest(self.search_inputs(feats, feat_lens), beam_size, None, method,
                           **search)
        return [hyps[0][0] if hyps else [] for hyps in nbest]
