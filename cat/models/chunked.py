"""Chunk-by-chunk inference of a chunk-trained `ConformerNet` with explicit state.

A model trained with `max_chunk_size` > 0 (and `causal_conv`) gives, on each chunk of
`chunk_size` output frames, the same output as its full forward with self-attention
limited to chunks (`set_decode_chunk_size`): a chunk depends on its own frames and the
earlier ones only. `StreamingEncoder.forward(feats, attn_cache, conv_cache)` encodes one
chunk from those earlier frames' state and returns the new state, so it exports to ONNX
with state in and state out.

Input of a chunk: `frames_per_chunk(chunk_size)` feature frames, `4 * r * chunk_size + 3`
(4x subsampling, extra reduction `r`; the 3 are the subsampling window's overlap), and
the next chunk starts `4 * r * chunk_size` frames later (`stride`). The last chunk of an
utterance may be shorter (at least 7 frames).

State (batch `B`, `L` cached frames, `layers` blocks, model dimension `D`, kernel `K`):
  * `attn_cache` [layers, B, L, D]: each block's self-attention input of the earlier
    frames (all of them, or the last `left_chunks * chunk_size`);
  * `conv_cache` [layers, B, D, K - 1]: each block's depthwise-convolution input of the
    last K - 1 frames (zeros at the start, as the causal convolution's padding).

Usage:
    streaming = StreamingEncoder(model.encoder, chunk_size=16)
    attn_cache, conv_cache = streaming.initial_state()
    out, attn_cache, conv_cache = streaming(feats[None, :streaming.frames_per_chunk],
                                            attn_cache, conv_cache)
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cat.models.encoder import ConformerNet
from cat.models.layer import ConformerBlock, RelPositionMultiHeadAttention

# Input frames a 4x conv subsampling needs beyond 4 per output frame.
SUBSAMPLING_OVERLAP = 3
MIN_INPUT_FRAMES = 7


def _attend(attn: RelPositionMultiHeadAttention, x: torch.Tensor, keys_in: torch.Tensor,
            pos_emb: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Self-attention of the chunk `x` [B, C, D] over `keys_in` [B, L + C, D] (the cached
    frames, then the chunk), `pos_emb` [1, 2(L + C) - 1, D]; `valid` as
    `_attend_projected`'s."""
    key = attn._split_heads(attn.linear_k(keys_in)).transpose(1, 2)  # [B, H, L+C, d]
    value = attn._split_heads(attn.linear_v(keys_in)).transpose(1, 2)
    return _attend_projected(attn, x, key, value, pos_emb, valid)


def _attend_projected(attn: RelPositionMultiHeadAttention, x: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, pos_emb: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """Self-attention of the chunk `x` [B, C, D] over projected keys and values [B, H, L + C,
    d] (the cached frames, then the chunk), `pos_emb` [1, 2(L + C) - 1, D]; `valid` [B, L + C]
    bool: the keys that may be attended to (None: all)."""
    chunk, keys = x.size(1), key.size(2)
    query = attn._split_heads(attn.linear_q(x))  # [B, C, H, d]
    position = attn._split_heads(attn.linear_pos(pos_emb)).transpose(1, 2)
    content = torch.matmul((query + attn.pos_bias_u).transpose(1, 2), key.transpose(-2, -1))
    by_position = torch.matmul((query + attn.pos_bias_v).transpose(1, 2),
                               position.transpose(-2, -1))  # [B, H, C, 2(L+C)-1]
    # Query i sits at position L + i; key j at j; relative position L + i - j is stored
    # at index (L + C - 1) - (L + i - j) = C - 1 - i + j.
    rows = torch.arange(chunk, device=x.device)
    columns = torch.arange(keys, device=x.device)
    index = (chunk - 1) - rows[:, None] + columns[None, :]
    by_position = by_position.gather(-1, index.expand(*by_position.shape[:2], chunk, keys))
    scores = (content + by_position) / math.sqrt(attn.head_dim)
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    context = torch.matmul(torch.softmax(scores, dim=-1), value)
    batch = context.size(0)
    return attn.linear_out(context.transpose(1, 2).reshape(batch, chunk, -1))


def _block_step(block: ConformerBlock, x: torch.Tensor, pos_emb: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, keep: int,
                valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Conformer block on a chunk, from and to its caches (`keep` < 0: all frames;
    `valid` [B, L + C]: the cached frames and the chunk's that exist, None: all)."""
    x = x + 0.5 * block.ffn_in(block.norm_ffn_in(x))
    attn_in = block.norm_attn(x)
    keys_in = torch.cat([attn_cache, attn_in], dim=1)
    x = x + _attend(block.attn, attn_in, keys_in, pos_emb, valid)
    new_attn_cache = keys_in if keep < 0 else keys_in[:, max(0, keys_in.size(1) - keep):]
    x, new_conv_cache = _conv_and_ffn_step(block, x, conv_cache)
    return x, new_attn_cache, new_conv_cache


def _conv_and_ffn_step(block: ConformerBlock, x: torch.Tensor, conv_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a block after self-attention: the causal convolution from its cache of
    the last K - 1 frames, the second feed-forward module, the final norm."""
    conv = block.conv
    glu = nn.functional.glu(conv.pointwise_in(block.norm_conv(x).transpose(1, 2)), dim=1)
    full = torch.cat([conv_cache, glu], dim=2)  # [B, D, K-1+C]
    new_conv_cache = full[:, :, full.size(2) - conv_cache.size(2):]
    y = conv.depthwise(full)
    if conv.norm_type == "batchnorm":
        y = conv.norm(y)
    else:
        y = conv.norm(y.transpose(1, 2)).transpose(1, 2)
    x = x + conv.pointwise_out(conv.activation(y)).transpose(1, 2)
    x = x + 0.5 * block.ffn_out(block.norm_ffn_out(x))
    return block.norm_final(x), new_conv_cache


class StreamingEncoder(nn.Module):
    """Chunk-by-chunk `ConformerNet` (eval mode) for chunks of `chunk_size` output frames;
    see the module docstring. Raises ValueError for a chunk size the model was not
    trained for."""

    def __init__(self, encoder: ConformerNet, chunk_size: int) -> None:
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        encoder.check_chunk_size(chunk_size)
        if not encoder.cells[0].conv.causal:
            raise ValueError("streaming needs causal convolutions (encoder.kwargs.causal_conv)")
        self.encoder = encoder.eval()
        self.chunk_size = chunk_size
        self.reduction = encoder.time_reduction.factor if encoder.time_reduction else 1
        self.keep = -1 if encoder.left_chunks < 0 else encoder.left_chunks * chunk_size

    @property
    def stride(self) -> int:
        """Feature frames between the starts of consecutive chunks."""
        return 4 * self.reduction * self.chunk_size

    @property
    def frames_per_chunk(self) -> int:
        """Feature frames of a (not last) chunk."""
        return self.stride + SUBSAMPLING_OVERLAP

    def subsample(self, feats: torch.Tensor) -> torch.Tensor:
        """A chunk's features [B, T, idim] normalised, subsampled and scaled: the first
        block's input [B, T', D]."""
        encoder = self.encoder
        if encoder.normalizer is not None:
            feats = encoder.normalizer(feats)
        lengths = torch.full((feats.size(0),), feats.size(1), dtype=torch.long,
                             device=feats.device)
        x, lengths = encoder.subsampling(feats, lengths)
        x = x * encoder.positional.scale
        if encoder.time_reduction is not None:
            x, _ = encoder.time_reduction(x, lengths)
        return x

    def initial_state(self, batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty attention caches and zero convolution caches."""
        cells = self.encoder.cells
        dim = self.encoder.output_dim
        kernel = cells[0].conv.depthwise.kernel_size[0]
        return (torch.zeros(len(cells), batch_size, 0, dim),
                torch.zeros(len(cells), batch_size, dim, kernel - 1))

    def forward(self, feats: torch.Tensor, attn_cache: torch.Tensor, conv_cache: torch.Tensor,
                cache_valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`feats` [B, T, idim] (T >= 7) -> (output [B, T', D], attn_cache, conv_cache).

        `cache_valid` [B, L] bool batches streams at different points: the cached frames
        that exist (a stream's own are the last ones of the cache; the rows before them pad
        it and are never attended to; None: all exist). Relative positions count from the
        chunk, so each stream's output is that of its own cache alone."""
        encoder = self.encoder
        x = self.subsample(feats)
        pos_emb = encoder.positional.position_embeddings(attn_cache.size(2) + x.size(1),
                                                         x.device, x.dtype)
        valid = None
        if cache_valid is not None:
            valid = torch.cat([cache_valid, cache_valid.new_ones(x.size(0), x.size(1))], dim=1)
        attn_states, conv_states = [], []
        for index, cell in enumerate(encoder.cells):
            x, attn, conv = _block_step(cell, x, pos_emb, attn_cache[index], conv_cache[index],
                                        self.keep, valid)
            attn_states.append(attn)
            conv_states.append(conv)
        return x, torch.stack(attn_states), torch.stack(conv_states)


class KeyValueStreamingEncoder(nn.Module):
    """`StreamingEncoder` with WeNet's state layout, what sherpa-onnx's online `wenet_ctc`
    model type feeds (batch 1): a fixed-size attention cache of each block's projected keys
    and values and a mask of its valid frames.

    `forward(feats [1, T, idim], attn_cache [layers, H, R, 2 d], conv_cache [layers, 1, D,
    K - 1], attn_mask [1, 1, R + chunk] bool)` -> (output [1, chunk, D], next attn_cache,
    next conv_cache): `R` (the runtime's `chunk_size x num_left_chunks`) cached frames, the
    last `R - valid` of which are the most recent frames before the chunk (`attn_mask`
    True for them and the chunk's frames); each block's keys and values stacked on the
    last axis. The next cache holds the last `R` frames of the cache and the chunk. Frames
    the mask leaves out are never attended to, so while every earlier frame fits in `R`,
    the output is `StreamingEncoder`'s.
    """

    def __init__(self, encoder: ConformerNet, chunk_size: int) -> None:
        super().__init__()
        self.streaming = StreamingEncoder(encoder, chunk_size)

    def initial_state(self, cache_frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero caches of `cache_frames` frames (none valid) and zero convolution caches."""
        cells = self.streaming.encoder.cells
        attn = cells[0].attn
        _, conv_cache = self.streaming.initial_state()
        return (torch.zeros(len(cells), attn.num_heads, cache_frames, 2 * attn.head_dim),
                conv_cache)

    def forward(self, feats: torch.Tensor, attn_cache: torch.Tensor, conv_cache: torch.Tensor,
                attn_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        encoder = self.streaming.encoder
        x = self.streaming.subsample(feats)
        cached = attn_cache.size(2)
        pos_emb = encoder.positional.position_embeddings(cached + x.size(1), x.device, x.dtype)
        valid = attn_mask[:, 0, :cached + x.size(1)]
        attn_states, conv_states = [], []
        for index, cell in enumerate(encoder.cells):
            attn = cell.attn
            x = x + 0.5 * cell.ffn_in(cell.norm_ffn_in(x))
            attn_in = cell.norm_attn(x)
            key = attn._split_heads(attn.linear_k(attn_in)).transpose(1, 2)  # [1, H, C, d]
            value = attn._split_heads(attn.linear_v(attn_in)).transpose(1, 2)
            old_key, old_value = attn_cache[index][None].chunk(2, dim=-1)
            key = torch.cat([old_key, key], dim=2)
            value = torch.cat([old_value, value], dim=2)
            x = x + _attend_projected(attn, attn_in, key, value, pos_emb, valid)
            attn_states.append(torch.cat([key, value], dim=-1)[0, :, key.size(2) - cached:])
            x, conv = _conv_and_ffn_step(cell, x, conv_cache[index])
            conv_states.append(conv)
        return x, torch.stack(attn_states), torch.stack(conv_states)

