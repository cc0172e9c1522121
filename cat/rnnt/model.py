"""The transducer (RNN-T) head: predictor, joiner and the RNN-T loss (blank = 0).

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
  * `TransducerHead`: a `SearchHead` (`cat.models.heads`) of the model
    (`cat.models.model.AsrModel`): its loss, greedy and modified beam search, N-best lists
    and sequence log-likelihoods (for `joint_rescoring` with an auxiliary CTC head).

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

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torchaudio
from torch import nn

from cat.lm.scorer import ShallowFusion
from cat.models.heads import (
    DecodeMethod,
    DecodeOption,
    build_component,
    init_blank_bias,
    pad_hyps,
)
from cat.models.spans import Span
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


def loss_parts(lengths: torch.Tensor | Sequence[int], label_lens: torch.Tensor | Sequence[int],
               num_classes: int, limit: int | None = None) -> list[slice]:
    """Consecutive sub-batches whose logits, each trimmed to its own longest T' and U+1,
    hold at most `limit` (default `RNNT_LOSS_MAX_ELEMENTS`) elements: one part for
    every batch that fits. One utterance over the limit is a ValueError naming its size.
    The lengths may be tensors or, read already, lists."""
    limit = RNNT_LOSS_MAX_ELEMENTS if limit is None else limit
    frames = [max(int(t), 1) for t in _listed(lengths)]
    labels = [int(u) for u in _listed(label_lens)]
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


def _listed(values: torch.Tensor | Sequence[int]) -> Sequence[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else values


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

#: The blank penalty of both searches (`cat.rnnt.search`), sherpa-onnx's setting of that name.
BLANK_PENALTY = DecodeOption(
    {"type": "number", "minimum": 0}, 0.0,
    "a constant taken from the blank logit at every step (sherpa-onnx's blank_penalty); "
    "trades deletions for insertions",
    unused="this model's searches have no blank logit to lower (a transducer's have)")
#: The decoding methods a transducer head offers (`cat.models.heads.DecodeMethod`).
DECODE_METHODS = {
    "greedy": DecodeMethod("greedy search, up to 3 symbols a frame",
                           {"blank_penalty": BLANK_PENALTY}),
    "beam": DecodeMethod("modified beam search (one symbol a frame)",
                         {"blank_penalty": BLANK_PENALTY}),
}


class TransducerHead(nn.Module):
    """The transducer head: predictor and joiner over the encoder output, trained with
    `torchaudio.functional.rnnt_loss` (blank = 0); a model's first head when present.

    Args:
        predictor: `LSTMPredictor` or `StatelessPredictor`.
        joiner: `JointNet` built for the encoder/predictor output sizes.
        simple_loss_scale: with linear projections of the encoder and the predictor
            output to the vocabulary (`simple_am`, `simple_lm`), the loss becomes
            `RNN-T + simple_loss_scale * simple` (`simple_losses`; icefall's
            `simple_loss_scale`); 0: no such projections. Decoding does not use them.

    An auxiliary CTC head on the encoder (config.json's `ctc` section in an RNN-T model:
    icefall's `ctc_loss_scale`, WeNet's transducer `ctc_weight`) is a head of the model
    beside this one: the loss is `(1 - ctc.weight) * RNN-T + ctc.weight * CTC`, and it adds
    the decoding method `joint_rescoring` (`cat.ctc.head.CTCHead.rescore`).
    """

    stat_name = "rnnt"
    ctc_alignment = False
    search_methods = ("greedy", "beam")
    #: The decoding options `search` and `nbest` take (`DECODE_METHODS`).
    search_settings = tuple(DECODE_METHODS["beam"].options)

    def __init__(self, encoder_dim: int, predictor: nn.Module, joiner: JointNet,
                 simple_loss_scale: float = 0.0) -> None:
        super().__init__()
        if simple_loss_scale < 0:
            raise ValueError(f"trainer.simple_loss_scale must be >= 0, got {simple_loss_scale}")
        self.predictor = predictor
        self.joiner = joiner
        self.num_classes = joiner.out.out_features
        self.simple_loss_scale = simple_loss_scale
        if simple_loss_scale:
            self.simple_am = nn.Linear(encoder_dim, self.num_classes)
            self.simple_lm = nn.Linear(predictor.output_dim, self.num_classes)
            # Blank-heavy from the start as the other heads (`init_blank_bias`): from a
            # uniform start the simple loss holds the shared encoder at the all-blank saddle.
            init_blank_bias(self.simple_am, 0.5)
            nn.init.zeros_(self.simple_lm.bias)

    def losses(self, hidden: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-utterance RNN-T losses, in sub-batches where the logits would be too many
        (`loss_parts`); utterances without encoder frames are infeasible (loss 0)."""
        infeasible = lengths < 1
        # The sub-batches and their trimming need the lengths on the host: one copy.
        frames, label_counts = (torch.stack([lengths.long(), label_lens.long()]).tolist()
                                if lengths.numel() else ([], []))
        losses = torch.cat([self._losses(hidden[part], lengths[part], labels[part],
                                         label_lens[part], max(frames[part], default=0),
                                         max(label_counts[part], default=0))
                            for part in loss_parts(frames, label_counts, self.num_classes)])
        return losses.masked_fill(infeasible, 0.0), infeasible, {}

    def _losses(self, encoder_out: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor,
                label_lens: torch.Tensor, max_frames: int, max_labels: int) -> torch.Tensor:
        """Per-utterance RNN-T losses (with the simple loss, when it has a scale) of a
        (sub-)batch, trimmed to its longest T' (`max_frames`) and U (`max_labels`):
        rnnt_loss needs the padded sizes to equal the longest lengths."""
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

    def search(self, hidden: torch.Tensor, lengths: torch.Tensor, method: str,
               beam_size: int, max_symbols_per_frame: int = 3,
               blank_penalty: float = 0.0) -> list[list[int]]:
        """Greedy (batched, up to `max_symbols_per_frame` symbols a frame) or the best of
        modified beam search (one symbol a frame), both with `blank_penalty` taken from the
        blank logit (`cat.rnnt.search`)."""
        if method == "greedy":
            return rnnt_greedy_search(self.predictor, self.joiner, hidden, lengths,
                                      max_symbols_per_frame, blank_penalty)
        nbest = self.nbest(hidden, lengths, beam_size, blank_penalty=blank_penalty)
        return [hyps[0][0] if hyps else [] for hyps in nbest]

    def nbest(self, hidden: torch.Tensor, lengths: torch.Tensor, beam_size: int,
              fusion: ShallowFusion | None = None, blank_penalty: float = 0.0) -> list:
        """Modified beam search's N-best lists, with shallow fusion (and LODR) when given."""
        return rnnt_modified_beam_search(self.predictor, self.joiner, hidden, lengths,
                                         beam_size, fusion=fusion, blank_penalty=blank_penalty)

    def token_frames(self, hidden: torch.Tensor, lengths: torch.Tensor,
                     hyps: list[list[int]]) -> list[list[Span]]:
        """The frame each token of `hyps` is emitted on, on the Viterbi path through the
        lattice of the encoder output (`cat.rnnt.align`; `cat.models.spans`)."""
        return rnnt_token_frames(self.predictor, self.joiner, hidden, lengths, hyps)

    @torch.no_grad()
    def sequence_log_likelihoods(self, hidden: torch.Tensor,
                                 hyps: list[list[int]]) -> torch.Tensor:
        """Transducer log-likelihoods [N] of `hyps` given one utterance's encoder output
        `hidden` [T', D], each summed over all alignments."""
        labels, label_lens = pad_hyps(hyps, hidden.device)
        count, longest = len(hyps), int(label_lens.max())
        repeated = hidden[None].expand(count, -1, -1)
        lengths = torch.full((count,), hidden.size(0), dtype=torch.int32, device=hidden.device)
        logits = self.joiner(repeated, self.predictor(labels[:, :longest]))
        return -torchaudio.functional.rnnt_loss(
            logits.float().contiguous(), labels[:, :longest].int().contiguous(),
            lengths, label_lens.int(), blank=BLANK, reduction="none")


# Read-only registries of this family: config names map to classes here and nowhere else.
PREDICTORS: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LSTMPredictor": LSTMPredictor,
    "StatelessPredictor": StatelessPredictor,
})
JOINERS: Mapping[str, type[nn.Module]] = MappingProxyType({"JointNet": JointNet})


def build_head(config: dict[str, Any], encoder_dim: int, num_classes: int,
               source: str = "config.json") -> tuple[TransducerHead, float | None]:
    """The transducer head of `config` (`decoder`, `joiner`, `trainer.simple_loss_scale`)
    and its loss weight (None: what an auxiliary CTC head's `ctc.weight` leaves)."""
    predictor = build_component(PREDICTORS, config["decoder"], "decoder.kwargs", source,
                                num_classes)
    joiner = build_component(JOINERS, config["joiner"], "joiner.kwargs", source,
                             encoder_dim, predictor.output_dim, num_classes)
    trainer = config.get("trainer", {})
    scale = {"simple_loss_scale": trainer["simple_loss_scale"]} if (
        "simple_loss_scale" in trainer) else {}
    return TransducerHead(encoder_dim, predictor, joiner, **scale), None
