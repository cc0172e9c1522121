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
            pos_emb: torch.Tensor) -> torch.Tensor:
    """Self-attention of the chunk `x` [B, C, D] over `keys_in` [B, L + C, D] (the cached
    frames, then the chunk), `pos_emb` [1, 2(L + C) - 1, D]."""
    chunk, keys = x.size(1), keys_in.size(1)
    query = attn._split_heads(attn.linear_q(x))  # [B, C, H, d]
    key = attn._split_heads(attn.linear_k(keys_in)).transpose(1, 2)  # [B, H, L+C, d]
    value = attn._split_heads(attn.linear_v(keys_in)).transpose(1, 2)
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
    context = torch.matmul(torch.softmax(scores, dim=-1), value)
    batch = context.size(0)
    return attn.linear_out(context.transpose(1, 2).reshape(batch, chunk, -1))


def _block_step(block: ConformerBlock, x: torch.Tensor, pos_emb: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, keep: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Conformer block on a chunk, from and to its caches (`keep` < 0: all frames)."""
    x = x + 0.5 * block.ffn_in(block.norm_ffn_in(x))
    attn_in = block.norm_attn(x)
    keys_in = torch.cat([attn_cache, attn_in], dim=1)
    x = x + _attend(block.attn, attn_in, keys_in, pos_emb)
    new_attn_cache = keys_in if keep < 0 else keys_in[:, keys_in.size(1) - keep:]
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
    return block.norm_final(x), new_attn_cache, new_conv_cache


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

    def initial_state(self, batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty attention caches and zero convolution caches."""
        cells = self.encoder.cells
        dim = self.encoder.output_dim
        kernel = cells[0].conv.depthwise.kernel_size[0]
        return (torch.zeros(len(cells), batch_size, 0, dim),
                torch.zeros(len(cells), batch_size, dim, kernel - 1))

    def forward(self, feats: torch.Tensor, attn_cache: torch.Tensor, conv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`feats` [B, T, idim] (T >= 7) -> (output [B, T', D], attn_cache, conv_cache)."""
        encoder = self.encoder
        if encoder.normalizer is not None:
            feats = encoder.normalizer(feats)
        lengths = torch.full((feats.size(0),), feats.size(1), dtype=torch.long,
                             device=feats.device)
        x, lengths = encoder.subsampling(feats, lengths)
        x = x * encoder.positional.scale
        if encoder.time_reduction is not None:
            x, lengths = encoder.time_reduction(x, lengths)
        pos_emb = encoder.positional.position_embeddings(attn_cache.size(2) + x.size(1),
                                                         x.device, x.dtype)
        attn_states, conv_states = [], []
        for index, cell in enumerate(encoder.cells):
            x, attn, conv = _block_step(cell, x, pos_emb, attn_cache[index], conv_cache[index],
                                        self.keep)
            attn_states.append(attn)
            conv_states.append(conv)
        return x, torch.stack(attn_states), torch.stack(conv_states)
