"""RNN-T (transducer) model: encoder, predictor, joiner and the RNN-T loss (blank = 0).

Components:
  * Predictors (the "decoder" of config.json) turn label histories into
    vectors. `forward(labels [B, U]) -> [B, U+1, output_dim]` scores the
    history `<blank>, y1, ..., yU` (blank doubles as start symbol). For search,
    `initial_state(n, device)` and `step(tokens [n], state) -> (out [n, output_dim],
    state)` advance one token at a time. A state is a tuple of tensors whose
    first dimension indexes hypotheses, so it can be gathered or selected with
    `torch.where` generically.
      - `LSTMPredictor`: embedding -> LSTM (state: hidden and cell).
      - `StatelessPredictor`: embedding of the last `context_size` tokens mixed by
        a per-channel 1-D convolution (state: the last tokens).
  * `JointNet`: `out(tanh(enc_proj(enc) + pred_proj(pred)))`. The projections are
    exposed separately so search projects each encoder frame / history once.
  * `TransducerModel`: the common model interface (see `cat.ctc.model`):
    `forward(feats, feat_lens, labels, label_lens) -> (loss, stats)` and
    `decode(feats, feat_lens, method="greedy"|"beam", beam_size=...)`.

Memory: the joint network materialises `[B, T', U+1, hdim]` activations and
`[B, T', U+1, V]` logits, and `rnnt_loss` computes the logit gradients (same
size) during its forward pass, so a batch holds about
`B * T' * (U+1) * (hdim + 2V) * 4` bytes (float32), plus transient buffers of
similar size during backward. Example: 32 utterances of 10 s (T' = 250 after x4
subsampling), U = 40 characters, V = 4232, hdim = 320 need
32*250*41*(320+8464)*4 bytes, about 11.5 GB. Batches are trimmed to their
longest T' and U; bound batches by `B * T' * U` (sorting by length helps), or
raise the encoder's time reduction. A batch whose logits would exceed 2^31 - 1 elements is
computed in sub-batches (`loss_parts`): the loss kernel indexes them with 32-bit integers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torchaudio
from torch import nn

from cat.core.config import ConfigError
from cat.decoding.timestamps import Span
from cat.lm.scorer import ShallowFusion, sequence_score
from cat.models.ctc_search import ctc_prefix_beam_search
from cat.models.heads import (
    LOSS_NORMALIZATIONS,
    CTCHead,
    batch_loss,
    check_decode_method,
    encode_batch,
    init_blank_bias,
)
from cat.models.registry import build_component
from cat.models.specaug import SpecAugment
from cat.rnnt.align import rnnt_token_frames
from cat.rnnt.search import rnnt_greedy_search, rnnt_modified_beam_search

BLANK = 0
State = tuple[torch.Tensor, ...]


class LSTMPredictor(nn.Module):
    """Embedding -> dropout -> LSTM -> dropout; the start symbol is blank (0)."""

    def __init__(self, num_classes: int, embed_dim: int = 256, hdim: int = 320,
                 num_layers: int = 1, dropout: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed_dim, hdim, num_layers=num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.output_dim = hdim

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """`labels` [B, U] -> [B, U+1, hdim] for histories `<blank>, y1..yU`."""
        history = nn.functional.pad(labels, (1, 0), value=BLANK)
        out, _ = self.lstm(self.dropout(self.embedding(history)))
        return self.dropout(out)

    def initial_state(self, batch_size: int, device: torch.device) -> State:
        """Zero hidden and cell states, each [n, num_layers, hdim]."""
        shape = (batch_size, self.lstm.num_layers, self.lstm.hidden_size)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Feed one token per hypothesis: ([n, hdim], new state)."""
        hidden, cell = (s.transpose(0, 1).contiguous() for s in state)
        out, (hidden, cell) = self.lstm(self.dropout(self.embedding(tokens[:, None])),
                                        (hidden, cell))
        return self.dropout(out[:, 0]), (hidden.transpose(0, 1), cell.transpose(0, 1))


class StatelessPredictor(nn.Module):
    """Embedding of the last `context_size` tokens, mixed per channel, then ReLU.

    The "stateless" predictor of Ghodsi et al. 2020 / icefall: no recurrence, so
    its cost per step is constant. Histories shorter than the context are
    left-padded with blank.
    """

    def __init__(self, num_classes: int, embed_dim: int = 256, context_size: int = 2) -> None:
        super().__init__()
        if context_size < 1:
            raise ValueError(f"context_size must be >= 1, got {context_size}")
        self.embedding = nn.Embedding(num_classes, embed_dim)
        self.context_size = context_size
        self.conv = (nn.Conv1d(embed_dim, embed_dim, context_size, groups=embed_dim, bias=False)
                     if context_size > 1 else None)
        self.output_dim = embed_dim

    def _mix(self, embedded: torch.Tensor) -> torch.Tensor:
        """[B, L + context_size - 1, E] -> [B, L, E]."""
        if self.conv is not None:
            embedded = self.conv(embedded.transpose(1, 2)).transpose(1, 2)
        return torch.relu(embedded)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """`labels` [B, U] -> [B, U+1, E] for histories `<blank>, y1..yU`."""
        history = nn.functional.pad(labels, (self.context_size, 0), value=BLANK)
        return self._mix(self.embedding(history))

    def initial_state(self, batch_size: int, device: torch.device) -> State:
        """The last `context_size - 1` tokens of each history (all blank): ([n, C-1],)."""
        return (torch.full((batch_size, self.context_size - 1), BLANK, dtype=torch.long,
                           device=device),)

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Feed one token per hypothesis: ([n, E], new state)."""
        context = torch.cat([state[0], tokens[:, None]], dim=1)  # [n, C]
        out = self._mix(self.embedding(context))[:, -1]
        return out, (context[:, 1:],)


class JointNet(nn.Module):
    """`logits = out(activation(enc_proj(enc) + pred_proj(pred)))`."""

    def __init__(self, encoder_dim: int, predictor_dim: int, num_classes: int, hdim: int = 320,
                 activation: str = "tanh", blank_init_prob: float = 0.5) -> None:
        super().__init__()
        activations = {"tanh": nn.Tanh, "relu": nn.ReLU}
        if activation not in activations:
            raise ValueError(f"joiner activation must be one of {sorted(activations)}, "
                             f"got {activation!r}")
        self.enc_proj = nn.Linear(encoder_dim, hdim)
        self.pred_proj = nn.Linear(predictor_dim, hdim, bias=False)
        self.activation = activations[activation]()
        self.out = nn.Linear(hdim, num_classes)
        init_blank_bias(self.out, blank_init_prob)

    def project_encoder(self, encoder_out: torch.Tensor) -> torch.Tensor:
        """[..., encoder_dim] -> [..., hdim]."""
        return self.enc_proj(encoder_out)

    def project_predictor(self, predictor_out: torch.Tensor) -> torch.Tensor:
        """[..., predictor_dim] -> [..., hdim]."""
        return self.pred_proj(predictor_out)

    def joint(self, encoder_proj: torch.Tensor, predictor_proj: torch.Tensor) -> torch.Tensor:
        """Logits from projected inputs with broadcastable shapes [..., hdim] -> [..., V]."""
        return self.out(self.activation(encoder_proj + predictor_proj))

    def forward(self, encoder_out: torch.Tensor, predictor_out: torch.Tensor) -> torch.Tensor:
        """`encoder_out` [B, T, E], `predictor_out` [B, U+1, P] -> logits [B, T, U+1, V]."""
        return self.joint(self.project_encoder(encoder_out)[:, :, None],
                          self.project_predictor(predictor_out)[:, None])


#: Largest logits tensor one `rnnt_loss` call is given: its CUDA kernel indexes the
#: [B, T', U+1, V] logits with 32-bit integers, and a larger batch (e.g. 32 x 250 frames x
#: 61 x 5,537 classes, 2.7e9 elements) is an illegal memory access on the GPU.
RNNT_LOSS_MAX_ELEMENTS = 2**31 - 1


def loss_parts(lengths: torch.Tensor, label_lens: torch.Tensor, num_classes: int,
               limit: int | None = None) -> list[slice]:
    """Consecutive sub-batches whose logits, each trimmed to its own longest T' and U+1,
    hold at most `limit` (default `RNNT_LOSS_MAX_ELEMENTS`) elements: one part for
    every batch that fits. One utterance over the limit is a ValueError naming its size."""
    limit = RNNT_LOSS_MAX_ELEMENTS if limit is None else limit
    frames = lengths.clamp(min=1).tolist()
    labels = label_lens.tolist()
    parts: list[slice] = []
    start, longest_t, longest_u = 0, 0, 0
    for index, (t, u) in enumerate(zip(frames, labels, strict=True)):
        if t * (u + 1) * num_classes > limit:
            raise ValueError(f"utterance {index} of the batch: {t} encoder frames x {u + 1} "
                             f"label positions x {num_classes} classes exceed the RNN-T "
                             f"loss's {limit} logits; filter such utterances out")
        grown_t, grown_u = max(longest_t, t), max(longest_u, u)
        if index > start and (index - start + 1) * grown_t * (grown_u + 1) * num_classes > limit:
            parts.append(slice(start, index))
            start, grown_t, grown_u = index, t, u
        longest_t, longest_u = grown_t, grown_u
    if len(frames) > start or not parts:
        parts.append(slice(start, len(frames)))
    return parts


def simple_losses(am_logits: torch.Tensor, lm_logits: torch.Tensor, labels: torch.Tensor,
                  lengths: torch.Tensor, label_lens: torch.Tensor) -> torch.Tensor:
    """Per-utterance transducer losses of the "simple" joiner `am_logits[t] + lm_logits[u]`
    (am [B, T', V] from the encoder, lm [B, U+1, V] from the predictor; k2's
    `rnnt_loss_simple`, icefall's `simple_loss`), in O(B T' U) memory: the normaliser of
    every lattice node is `log(exp(am - max) @ exp(lm - max)^T) + maxes`, and the lattice
    needs only each node's blank and next-label log-probabilities, which `rnnt_loss`
    takes as a two-class input of log-probabilities (class 0 blank, class 1 the label)."""
    am_logits, lm_logits = am_logits.float(), lm_logits.float()
    am_max = am_logits.amax(-1, keepdim=True)  # [B, T, 1]
    lm_max = lm_logits.amax(-1, keepdim=True)  # [B, U+1, 1]
    norm = torch.log(torch.matmul((am_logits - am_max).exp(),
                                  (lm_logits - lm_max).exp().transpose(1, 2)).clamp_min(1e-30))
    norm = norm + am_max + lm_max.transpose(1, 2)  # [B, T, U+1]
    next_label = nn.functional.pad(labels, (0, 1)).long()  # the label after node u (pad at U)
    frames = am_logits.size(1)
    label_score = (torch.gather(am_logits, 2, next_label[:, None, :].expand(-1, frames, -1))
                   + torch.gather(lm_logits, 2, next_label[:, :, None]).squeeze(-1)[:, None])
    blank_score = am_logits[:, :, BLANK, None] + lm_logits[:, None, :, BLANK]
    log_probs = torch.stack([blank_score - norm, label_score - norm], dim=-1)
    return torchaudio.functional.rnnt_loss(
        log_probs.contiguous(), torch.ones_like(labels, dtype=torch.int32).contiguous(),
        lengths.clamp(min=1).int(), label_lens.int(), blank=BLANK, reduction="none",
        fused_log_softmax=False)


class TransducerModel(nn.Module):
    """RNN-T model trained with `torchaudio.functional.rnnt_loss` (blank = 0).

    Args:
        encoder: acoustic encoder with an `output_dim` attribute.
        predictor: `LSTMPredictor` or `StatelessPredictor`.
        joiner: `JointNet` built for the encoder/predictor output sizes.
        specaug: optional SpecAugment applied in training mode.
        loss_normalization: "utterance" or "token" (see `cat.ctc.model`).
        ctc_weight: with an auxiliary CTC head on the encoder (config.json's `ctc` section
            in an RNN-T model: icefall's `ctc_loss_scale`, WeNet's transducer `ctc_weight`),
            the loss is `(1 - ctc_weight) * RNN-T + ctc_weight * CTC`; 0: no such head.
            Decoding uses it in method `joint_rescoring` only (`nbest`).
        ctc_dropout, ctc_blank_init_prob: that head's dropout and initial blank
            probability (`ctc.dropout`, `ctc.blank_init_prob`).
        simple_loss_scale: with linear projections of the encoder and the predictor
            output to the vocabulary (`simple_am`, `simple_lm`), the RNN-T loss becomes
            `RNN-T + simple_loss_scale * simple` (`simple_losses`; icefall's
            `simple_loss_scale`); 0: no such projections. Decoding does not use them.
    """

    def __init__(self, encoder: nn.Module, predictor: nn.Module, joiner: JointNet,
                 specaug: SpecAugment | None = None,
                 loss_normalization: str = "utterance", ctc_weight: float = 0.0,
                 ctc_dropout: float = 0.0, ctc_blank_init_prob: float = 0.5,
                 simple_loss_scale: float = 0.0) -> None:
        super().__init__()
        if loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
                             f"got {loss_normalization!r}")
        if not 0.0 <= ctc_weight < 1.0:
            raise ValueError(f"ctc.weight must be in [0, 1) (0: no auxiliary CTC head), "
                             f"got {ctc_weight}")
        self.ctc_weight = ctc_weight
        self.ctc_head = (CTCHead(encoder.output_dim, joiner.out.out_features, ctc_dropout,
                                 ctc_blank_init_prob) if ctc_weight else None)
        if simple_loss_scale < 0:
            raise ValueError(f"trainer.simple_loss_scale must be >= 0, got {simple_loss_scale}")
        self.simple_loss_scale = simple_loss_scale
        if simple_loss_scale:
            self.simple_am = nn.Linear(encoder.output_dim, joiner.out.out_features)
            self.simple_lm = nn.Linear(predictor.output_dim, joiner.out.out_features)
            # Blank-heavy from the start as the other heads (`init_blank_bias`): from a
            # uniform start the simple loss holds the shared encoder at the all-blank saddle.
            init_blank_bias(self.simple_am, 0.5)
            nn.init.zeros_(self.simple_lm.bias)
        self.encoder = encoder
        self.predictor = predictor
        self.joiner = joiner
        self.specaug = specaug
        self.num_classes = joiner.out.out_features
        self.loss_normalization = loss_normalization

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Return (normalised loss, stats); see `cat.ctc.model` for the contract."""
        encoder_out, lengths, labels, label_lens = encode_batch(self, feats, feat_lens, labels,
                                                                label_lens)
        # Without frames nothing can be emitted: such utterances get loss 0.
        infeasible = lengths < 1
        losses = torch.cat([self._losses(encoder_out[part], lengths[part], labels[part],
                                         label_lens[part])
                            for part in loss_parts(lengths, label_lens, self.num_classes)])
        losses = losses.masked_fill(infeasible, 0.0)
        if self.ctc_head is None:
            return batch_loss(losses, labels, label_lens, lengths, infeasible,
                              self.loss_normalization)
        ctc, _ = self.ctc_head.losses(encoder_out, lengths, labels, label_lens)
        combined = (1 - self.ctc_weight) * losses + self.ctc_weight * ctc.masked_fill(
            infeasible, 0.0)
        loss, stats = batch_loss(combined, labels, label_lens, lengths, infeasible,
                                 self.loss_normalization)
        stats.update(rnnt_loss_sum=float(losses.detach().sum()),
                     ctc_loss_sum=float(ctc.detach().sum()))
        return loss, stats

    def _losses(self, encoder_out: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor) -> torch.Tensor:
        """Per-utterance RNN-T losses (with the simple loss, when it has a scale) of a
        (sub-)batch, trimmed to its longest T' and U (rnnt_loss needs the padded sizes to
        equal the longest lengths)."""
        max_frames = int(lengths.max()) if lengths.numel() else 0
        max_labels = int(label_lens.max()) if label_lens.numel() else 0
        encoder_out = encoder_out[:, :max(max_frames, 1)]
        labels = labels[:, :max_labels]
        if max_frames == 0:
            encoder_out = nn.functional.pad(encoder_out, (0, 0, 0, 1 - encoder_out.size(1)))
        predictor_out = self.predictor(labels)
        logits = self.joiner(encoder_out, predictor_out)
        losses = torchaudio.functional.rnnt_loss(
            logits.float().contiguous(), labels.int().contiguous(),
            lengths.clamp(min=1).int(), label_lens.int(), blank=BLANK, reduction="none")
        if not self.simple_loss_scale:
            return losses
        return losses + self.simple_loss_scale * simple_losses(
            self.simple_am(encoder_out), self.simple_lm(predictor_out), labels, lengths,
            label_lens)

    @property
    def decode_methods(self) -> tuple[str, ...]:
        """The `method`s `decode` accepts: `joint_rescoring` with an auxiliary CTC head."""
        return ("greedy", "beam") + (("joint_rescoring",) if self.ctc_head is not None else ())

    #: The search settings (`DecodeOptions`) `decode` and `nbest` take besides the rescoring
    #: weights of joint_rescoring.
    search_settings = ("blank_penalty",)

    @torch.no_grad()
    def search_inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `nbest` searches: the encoder output and its lengths (one network forward
        for any number of searches)."""
        return self.encoder(feats, feat_lens.to(feats.device))

    def nbest(self, inputs: tuple[torch.Tensor, torch.Tensor], beam_size: int,
              fusion: ShallowFusion | None = None, blank_penalty: float = 0.0,
              ctc_weight: float | None = None, decoder_weight: float = 1.0) -> list:
        """N-best lists of a batch: modified beam search, with shallow fusion (and LODR)
        when given, and `blank_penalty` taken from the blank logit (`cat.rnnt.search`).
        With `ctc_weight` (method joint_rescoring, a model with an auxiliary CTC head), the
        lists of the transducer's beam search and of the CTC head's prefix beam search
        (both with `fusion`) are merged and ranked by `ctc_weight` x the CTC head's
        log-likelihood + `decoder_weight` x the transducer's, each summed over all
        alignments (WeNet ranks a transducer's N-best by such weighted scores), plus the
        fusion's score of the sequence."""
        encoder_out, lengths = inputs
        nbest = rnnt_modified_beam_search(self.predictor, self.joiner, encoder_out, lengths,
                                          beam_size, fusion=fusion, blank_penalty=blank_penalty)
        if ctc_weight is None:
            return nbest
        self._check_method("joint_rescoring")
        ctc_nbest = ctc_prefix_beam_search(self.ctc_head.log_probs(encoder_out), lengths,
                                           beam_size, fusion=fusion)
        return [self._rescore(encoder_out[index, :length], hyps + ctc_hyps, fusion,
                              ctc_weight, decoder_weight)
                for index, (length, hyps, ctc_hyps) in enumerate(
                    zip(lengths.tolist(), nbest, ctc_nbest, strict=True))]

    @torch.no_grad()
    def sequence_log_likelihoods(self, encoder_out: torch.Tensor, hyps: list[list[int]]
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(transducer, CTC head) log-likelihoods [N] of token sequences `hyps` given one
        utterance's encoder output [T', D], each summed over all alignments (-inf where
        CTC has too few frames)."""
        count, frames = len(hyps), encoder_out.size(0)
        label_lens = torch.tensor([len(h) for h in hyps], device=encoder_out.device)
        labels = torch.zeros(count, max(int(label_lens.max()), 1), dtype=torch.long,
                             device=encoder_out.device)
        for row, hyp in enumerate(hyps):
            labels[row, :len(hyp)] = torch.tensor(hyp, dtype=torch.long)
        repeated = encoder_out[None].expand(count, -1, -1)
        lengths = torch.full((count,), frames, dtype=torch.long, device=encoder_out.device)
        longest = int(label_lens.max())
        logits = self.joiner(repeated, self.predictor(labels[:, :longest]))
        transducer = -torchaudio.functional.rnnt_loss(
            logits.float().contiguous(), labels[:, :longest].int().contiguous(),
            lengths.int(), label_lens.int(), blank=BLANK, reduction="none")
        log_probs = self.ctc_head.log_probs(encoder_out[None]).expand(count, -1, -1)
        ctc = -nn.functional.ctc_loss(log_probs.transpose(0, 1), labels, lengths, label_lens,
                                      blank=BLANK, reduction="none", zero_infinity=False)
        return transducer, ctc

    def _rescore(self, encoder_out: torch.Tensor, candidates: list, fusion: ShallowFusion | None,
                 ctc_weight: float, decoder_weight: float) -> list[tuple[list[int], float]]:
        """`candidates` ((tokens, score) pairs, duplicates allowed) ranked by the weighted
        log-likelihoods (see `nbest`), best first."""
        hyps = list(dict.fromkeys(tuple(tokens) for tokens, _ in candidates))
        if not hyps or encoder_out.size(0) == 0:
            return [(list(h), 0.0) for h in hyps]
        transducer, ctc = self.sequence_log_likelihoods(encoder_out, [list(h) for h in hyps])
        scores = (ctc_weight * ctc + decoder_weight * transducer).tolist()
        if fusion is not None:
            scores = [score + sequence_score(fusion, hyp)
                      for score, hyp in zip(scores, hyps, strict=True)]
        ranked = sorted(zip(hyps, scores, strict=True), key=lambda pair: -pair[1])
        return [(list(hyp), score) for hyp, score in ranked]

    def token_frames(self, inputs: tuple[torch.Tensor, torch.Tensor],
                     hyps: list[list[int]]) -> list[list[Span]]:
        """The frame each token of `hyps` is emitted on, on the Viterbi path through the
        lattice of `inputs` (what `search_inputs` returned); `cat.rnnt.align`."""
        return rnnt_token_frames(self.predictor, self.joiner, inputs[0], inputs[1], hyps)

    def _check_method(self, method: str) -> None:
        check_decode_method(self, method, "RNN-T", None if self.ctc_head is not None else
                            "joint_rescoring needs an auxiliary CTC head: config.json 'ctc' "
                            "with a weight")

    def decode(self, feats: torch.Tensor, feat_lens: torch.Tensor, method: str = "greedy",
               beam_size: int = 10, max_symbols_per_frame: int = 3,
               blank_penalty: float = 0.0, **rescoring: Any) -> list[list[int]]:
        """Decode a batch to token ids with greedy (batched) or modified beam search, or
        joint rescoring (`rescoring` weights as in `nbest`).

        Uses the module's current mode: call `model.eval()` first.
        `max_symbols_per_frame` applies to greedy search; beam search emits at most
        one symbol per frame; both take `blank_penalty` (see `cat.rnnt.search`).
        """
        self._check_method(method)
        encoder_out, lengths = self.encoder(feats, feat_lens.to(feats.device))
        if method == "greedy":
            return rnnt_greedy_search(self.predictor, self.joiner, encoder_out, lengths,
                                      max_symbols_per_frame, blank_penalty)
        if method == "joint_rescoring":
            nbest = self.nbest((encoder_out, lengths), beam_size, None, blank_penalty,
                               **rescoring)
        else:
            nbest = rnnt_modified_beam_search(self.predictor, self.joiner, encoder_out, lengths,
                                              beam_size, blank_penalty=blank_penalty)
        return [hyps[0][0] if hyps else [] for hyps in nbest]


# Read-only registries of this family: config names map to classes here and nowhere else.
PREDICTORS: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LSTMPredictor": LSTMPredictor,
    "StatelessPredictor": StatelessPredictor,
})
JOINERS: Mapping[str, type[nn.Module]] = MappingProxyType({"JointNet": JointNet})


def build_model(config: dict[str, Any], encoder: nn.Module, num_classes: int,
                specaug: SpecAugment | None, source: str = "config.json") -> TransducerModel:
    """The RNN-T model of `config` (`decoder`, `joiner`, `trainer`, and `ctc` for an
    auxiliary CTC head) around `encoder`."""
    predictor = build_component(PREDICTORS, config["decoder"], "decoder.kwargs", source,
                                num_classes)
    joiner = build_component(JOINERS, config["joiner"], "joiner.kwargs", source,
                             encoder.output_dim, predictor.output_dim, num_classes)
    try:
        # The `ctc` section (an auxiliary head) as `ctc_<key>` arguments: `weight`,
        # `dropout`, `blank_init_prob`, the defaults of the ones not given being the schema's.
        auxiliary = {f"ctc_{key}": value for key, value in config.get("ctc", {}).items()}
        return TransducerModel(encoder, predictor, joiner, specaug,
                               **config.get("trainer", {}), **auxiliary)
    except ValueError as error:
        raise ConfigError(f"{source}: {error}") from None
