"""The attention decoder head (WeNet's U2 / U2++ decoder) and attention rescoring.

A Transformer decoder reads the encoder output and predicts the label sequence left to
right; with `r2l_layers` > 0 a second decoder predicts it right to left. Trained jointly
with the CTC head of the same encoder::

    loss = ctc_weight * ctc + (1 - ctc_weight) * attention
    attention = (1 - reverse_weight) * left_to_right + reverse_weight * right_to_left

each decoder's loss being the label-smoothed cross entropy of `y1 .. yU, <eos>` given
`<sos>, y1 .. yU`, summed over the utterance's tokens (the trainer then normalises by
utterances or tokens as for CTC). `<sos>` and `<eos>` are the CTC blank (id 0), which no
label sequence holds, so the decoder needs no class of its own.

Attention rescoring (`rescore`): the N-best hypotheses of CTC prefix beam search, each
scored by the decoders with teacher forcing, ranked by::

    ctc_weight * search score + decoder_weight * ((1 - reverse_weight) * l2r + reverse_weight * r2l)

With `decoder_weight` 0 (and `ctc_weight` > 0) the ranking is the prefix beam search's.

config.json, beside the `ctc` section (keys and defaults: `cat/core/schemas/config.schema.json`,
`$defs.attention`)::

    "attention": {"num_layers": 3, "num_heads": 4, "ffn_dim": 576, "dropout": 0.1,
                  "r2l_layers": 0, "ctc_weight": 0.3, "reverse_weight": 0.0,
                  "label_smoothing": 0.1}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from cat.models.heads import DecodeMethod, DecodeOption
from cat.models.layer import lengths_to_padding_mask

SOS = EOS = 0  # the CTC blank: never a label

#: A weight of a rescoring method's score (the same setting as joint rescoring's).
WEIGHT = {"type": "number", "minimum": 0}
#: The decoding method the attention decoder offers (`cat.models.heads.DecodeMethod`).
DECODE_METHODS = {
    "attention_rescoring": DecodeMethod(
        "CTC models with an 'attention' head: the prefix beam's N-best ranked again by the "
        "attention decoder",
        {"ctc_weight": DecodeOption(WEIGHT, 0.5, "weight of the search's score"),
         "decoder_weight": DecodeOption(WEIGHT, 1.0, "weight of the decoders' score (log "
                                                     "probability)"),
         "reverse_weight": DecodeOption(
             {"type": "number", "minimum": 0, "maximum": 1}, None,
             "share of the right to left decoder in the decoder's score (default: the "
             "training's attention.reverse_weight)")}),
}


class PositionalEncoding(nn.Module):
    """Scaled token embeddings plus sinusoidal positions (Vaswani et al.), then dropout."""

    def __init__(self, dim: int, dropout: float, max_len: int = 5000) -> None:
        super().__init__()
        self.dim = dim
        self.dropout = nn.Dropout(dropout)
        self.max_len = max_len
        self.register_buffer("table", self._table(max_len), persistent=False)

    def _table(self, length: int) -> torch.Tensor:
        position = torch.arange(length, dtype=torch.float32)[:, None]
        rate = torch.exp(torch.arange(0, self.dim, 2, dtype=torch.float32)
                         * (-math.log(10000.0) / self.dim))
        table = torch.zeros(length, self.dim)
        table[:, 0::2] = torch.sin(position * rate)
        table[:, 1::2] = torch.cos(position * rate)
        return table

    def forward(self, embedded: torch.Tensor) -> torch.Tensor:
        length = embedded.size(1)
        if length > self.table.size(0):
            self.table = self._table(length).to(self.table.device)
        return self.dropout(embedded * math.sqrt(self.dim) + self.table[:length])


class TransformerDecoder(nn.Module):
    """Token embedding, `num_layers` pre-norm Transformer decoder layers attending to the
    encoder output, and a linear output over the vocabulary."""

    def __init__(self, num_classes: int, dim: int, num_layers: int, num_heads: int,
                 ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(num_classes, dim)
        self.positional = PositionalEncoding(dim, dropout)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(dim, num_heads, ffn_dim, dropout, batch_first=True,
                                       norm_first=True)
            for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                memory_lens: torch.Tensor) -> torch.Tensor:
        """`tokens` [B, L] (padded, lengths `token_lens`) over `memory` [B, T, D] ->
        log-probabilities [B, L, V] of the next token at each position."""
        length = tokens.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        padding = lengths_to_padding_mask(token_lens, length)
        memory_padding = lengths_to_padding_mask(memory_lens.clamp(min=1), memory.size(1))
        hidden = self.positional(self.embed(tokens))
        for layer in self.layers:
            hidden = layer(hidden, memory, tgt_mask=causal, tgt_key_padding_mask=padding,
                           memory_key_padding_mask=memory_padding)
        return torch.log_softmax(self.out(self.norm(hidden)).float(), dim=-1)


def teacher_forcing(labels: torch.Tensor, label_lens: torch.Tensor,
                    reverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs `<sos> y1 .. yU` and targets `y1 .. yU <eos>` [B, U+1] of padded
    `labels` (reversed within each sequence with `reverse`); padding is 0 (masked)."""
    batch, longest = labels.size(0), int(label_lens.max()) if labels.numel() else 0
    positions = torch.arange(longest, device=labels.device)[None, :]
    valid = positions < label_lens[:, None]
    labels = labels[:, :longest]
    if reverse:
        labels = labels.gather(1, (label_lens[:, None] - 1 - positions).clamp(min=0))
    labels = labels.masked_fill(~valid, 0)
    start = torch.full((batch, 1), SOS, dtype=labels.dtype, device=labels.device)
    inputs = torch.cat([start, labels], dim=1)
    # Position U of each row is <eos> (0), as is the padding after it (masked by lengths).
    targets = torch.cat([labels, torch.full_like(start, EOS)], dim=1)
    return inputs, targets


def teacher_forced(decoder: TransformerDecoder, memory: torch.Tensor, memory_lens: torch.Tensor,
                   labels: torch.Tensor, label_lens: torch.Tensor, reverse: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder pass over `teacher_forcing`'s inputs: log-probabilities [B, U+1, V], the
    targets [B, U+1], and which positions are real (`<eos>` included) [B, U+1]."""
    inputs, targets = teacher_forcing(labels, label_lens, reverse)
    log_probs = decoder(inputs, label_lens + 1, memory, memory_lens)
    return log_probs, targets, ~lengths_to_padding_mask(label_lens + 1, inputs.size(1))


class AttentionHead(nn.Module):
    """The attention decoder(s) of a CTC model (see the module docstring): a `Head` beside
    the CTC head, and the `Rescorer` of method `attention_rescoring`."""

    stat_name = "att"
    ctc_alignment = False
    rescoring_method = "attention_rescoring"
    rescoring_weights = tuple(DECODE_METHODS[rescoring_method].options)

    def __init__(self, dim: int, num_classes: int, num_layers: int = 3, num_heads: int = 4,
                 ffn_dim: int = 1024, dropout: float = 0.1, r2l_layers: int = 0,
                 ctc_weight: float = 0.3, reverse_weight: float = 0.0,
                 label_smoothing: float = 0.1) -> None:
        super().__init__()
        if not 0.0 <= ctc_weight < 1.0:
            raise ValueError(f"attention.ctc_weight must be in [0, 1) (1 would leave the "
                             f"decoder untrained), got {ctc_weight}")
        if (reverse_weight > 0) != (r2l_layers > 0) or not 0.0 <= reverse_weight < 1.0:
            raise ValueError(f"attention.reverse_weight={reverse_weight} (in [0, 1)) and "
                             f"attention.r2l_layers={r2l_layers}: a right-to-left decoder "
                             f"needs both above 0, or both 0")
        if dim % num_heads:
            raise ValueError(f"attention.num_heads={num_heads} must divide the encoder's "
                             f"output dimension {dim}")
        self.ctc_weight = ctc_weight
        self.reverse_weight = reverse_weight
        self.label_smoothing = label_smoothing
        self.l2r = TransformerDecoder(num_classes, dim, num_layers, num_heads, ffn_dim, dropout)
        self.r2l = (TransformerDecoder(num_classes, dim, r2l_layers, num_heads, ffn_dim,
                                       dropout) if r2l_layers else None)

    def _decoder_losses(self, decoder: TransformerDecoder, memory: torch.Tensor,
                        memory_lens: torch.Tensor, labels: torch.Tensor,
                        label_lens: torch.Tensor, reverse: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, targets, valid = teacher_forced(decoder, memory, memory_lens, labels,
                                                   label_lens, reverse)
        nll = nn.functional.nll_loss(log_probs.transpose(1, 2), targets, reduction="none")
        smooth = -log_probs.mean(dim=-1)
        losses = ((1 - self.label_smoothing) * nll + self.label_smoothing * smooth)
        correct = (log_probs.argmax(dim=-1) == targets) & valid
        return (losses * valid).sum(dim=1), correct.sum()

    def losses(self, memory: torch.Tensor, memory_lens: torch.Tensor, labels: torch.Tensor,
               label_lens: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float | torch.Tensor]]:
        """Per-utterance attention losses [B] of the encoder output `memory` [B, T, D], no
        infeasible utterance, and the decoder's token accuracy (`att_acc`, left to right,
        `<eos>` included)."""
        losses, correct = self._decoder_losses(self.l2r, memory, memory_lens, labels,
                                               label_lens, reverse=False)
        if self.r2l is not None:
            reverse, _ = self._decoder_losses(self.r2l, memory, memory_lens, labels,
                                              label_lens, reverse=True)
            losses = (1 - self.reverse_weight) * losses + self.reverse_weight * reverse
        positions = (label_lens + 1).sum().clamp(min=1)
        # a tensor until read (cat.models.stats): no wait for the device here
        return (losses, torch.zeros_like(label_lens, dtype=torch.bool),
                {"att_acc": correct.double() / positions.double()})

    def rescore(self, memory: torch.Tensor, lengths: torch.Tensor,
                nbest: Sequence[Sequence[tuple[Sequence[int], float]]], first: Any,
                fusion: Any, beam_size: int, ctc_weight: float = 0.5,
                decoder_weight: float = 1.0, reverse_weight: float | None = None
                ) -> list[list[tuple[list[int], float]]]:
        """`attention_rescoring` of the first head's `nbest` (`rescore`; the search scores
        hold the fusion's already)."""
        return rescore(self, memory, lengths, nbest, ctc_weight, decoder_weight, reverse_weight)

    @torch.no_grad()
    def score(self, memory: torch.Tensor, length: int, hyps: Sequence[Sequence[int]],
              reverse_weight: float) -> torch.Tensor:
        """Log-probabilities [N] of the hypotheses `hyps` (`<eos>` included) given one
        utterance's encoder output `memory` [T, D] of `length` frames: left to right, mixed
        with right to left by `reverse_weight` when the head has that decoder."""
        count = len(hyps)
        lens = torch.tensor([len(h) for h in hyps], dtype=torch.long, device=memory.device)
        labels = torch.zeros(count, max(int(lens.max()), 1), dtype=torch.long,
                             device=memory.device)
        for row, hyp in enumerate(hyps):
            labels[row, :len(hyp)] = torch.tensor(list(hyp), dtype=torch.long)
        memory = memory[None, :max(length, 1)].expand(count, -1, -1)
        memory_lens = torch.full((count,), length, dtype=torch.long, device=memory.device)

        def sequence_log_probs(decoder: TransformerDecoder, reverse: bool) -> torch.Tensor:
            log_probs, targets, valid = teacher_forced(decoder, memory, memory_lens, labels,
                                                       lens, reverse)
            return (log_probs.gather(2, targets[:, :, None])[:, :, 0] * valid).sum(dim=1)

        scores = sequence_log_probs(self.l2r, False)
        if self.r2l is not None and reverse_weight > 0:
            scores = ((1 - reverse_weight) * scores
                      + reverse_weight * sequence_log_probs(self.r2l, True))
        return scores


def rescore(head: AttentionHead, memory: torch.Tensor, lengths: torch.Tensor,
            nbest: Sequence[Sequence[tuple[Sequence[int], float]]], ctc_weight: float,
            decoder_weight: float, reverse_weight: float | None = None
            ) -> list[list[tuple[list[int], float]]]:
    """Each utterance's N-best list (token ids, search score) ranked again by attention
    rescoring (see the module docstring); `reverse_weight` None: the head's training
    weight. Scores are the combined ones, best first; ties keep the search's order."""
    if reverse_weight is None:
        reverse_weight = head.reverse_weight
    rescored = []
    for index, hyps in enumerate(nbest):
        if not hyps:
            rescored.append([])
            continue
        decoder = head.score(memory[index], int(lengths[index]), [h for h, _ in hyps],
                             reverse_weight).tolist() if decoder_weight else [0.0] * len(hyps)
        combined = [(list(tokens), ctc_weight * score + decoder_weight * attention)
                    for (tokens, score), attention in zip(hyps, decoder, strict=True)]
        rescored.append(sorted(combined, key=lambda pair: -pair[1]))
    return rescored


def build_head(config: dict[str, Any], encoder_dim: int, num_classes: int,
               source: str = "config.json") -> tuple[AttentionHead, float]:
    """The head of config.json's `attention` section and its loss weight, 1 - `ctc_weight`
    (the CTC head beside it takes the rest)."""
    head = AttentionHead(encoder_dim, num_classes, **config["attention"])
    return head, 1 - head.ctc_weight
