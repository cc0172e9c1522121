"""Building blocks of the Conformer encoder.

Every block takes padded batches `[B, T, D]` together with a boolean padding
mask `[B, T]` (True on padded frames) and keeps the outputs on valid frames
independent of how much padding follows them, so that a batch gives the same
results as its utterances run one by one (in eval mode).

Blocks:
  * `Conv2dSubsampling`: two stride-2 3x3 conv2d layers (time and frequency
    reduced by 4) followed by a linear projection; with `pad_end` each convolution
    first pads one zero frame and bin at the end (CAT's `conv: "conv2d"`).
  * `VGG2LSubsampling`: two VGG blocks (two 3x3 convolutions and a 2x2 max-pool
    each, 64 then 128 channels) followed by a linear projection (CAT's and ESPnet's
    `vgg2l`).
  * `TimeReduction`: stacks `factor` consecutive frames and projects them back, or
    keeps every `factor`-th frame (no parameters).
  * `RelPositionalEncoding` + `RelPositionMultiHeadAttention`: Transformer-XL
    style self-attention with relative positions and the global content and
    position biases (u, v), as in ESPnet's `RelPositionMultiHeadedAttention`;
    its softmax runs in `torch.nn.functional.scaled_dot_product_attention` with
    the position term as an additive bias.
  * `FeedForward`, `ConvolutionModule`, `ConformerBlock` (macaron FFN halves,
    MHSA, convolution module, final LayerNorm).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lengths_to_padding_mask(lengths: torch.Tensor, max_length: int | None = None) -> torch.Tensor:
    """Return a `[B, T]` bool mask that is True on padded positions (index >= length)."""
    if max_length is None:
        max_length = int(lengths.max()) if lengths.numel() else 0
    positions = torch.arange(max_length, device=lengths.device)
    return positions.unsqueeze(0) >= lengths.unsqueeze(1)


def zero_beyond(x: torch.Tensor, lengths: torch.Tensor, time_dim: int) -> torch.Tensor:
    """Zero the positions of `x` at or beyond `lengths` along `time_dim` (batch first)."""
    mask = lengths_to_padding_mask(lengths, x.size(time_dim))
    shape = [mask.size(0)] + [1] * (x.dim() - 1)
    shape[time_dim] = mask.size(1)
    return x.masked_fill(mask.view(shape), 0.0)


class Conv2dSubsampling(nn.Module):
    """Reduce the frame rate by 4 with two 3x3 stride-2 convolutions.

    Without `pad_end` (the default) the convolutions are unpadded: output frame `t`
    only sees input frames `4t .. 4t+6`, so outputs on valid frames do not depend on
    the padding, and `T' = ((T - 1) // 2 - 1) // 2` (an input shorter than 7 frames
    gives no output frame).

    With `pad_end` (CAT's `conv: "conv2d"`), each convolution first appends one zero
    frame and one zero bin: `T' = T // 4` and `idim // 4` bins reach the projection.
    Padded input frames and first-convolution outputs past each utterance's length are
    zeroed, so the last frames see the same zeros as the utterance run alone.
    """

    def __init__(self, idim: int, odim: int, channels: int | None = None,
                 pad_end: bool = False) -> None:
        super().__init__()
        channels = channels or odim
        self.pad_end = pad_end
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.Conv2d(channels, channels, kernel_size=3, stride=2),
            nn.ReLU(),
        )
        freq = idim // 4 if pad_end else ((idim - 1) // 2 - 1) // 2
        if freq < 1:
            raise ValueError(f"feature dimension idim={idim} is too small for 4x conv subsampling")
        self.out = nn.Linear(channels * freq, odim)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Number of output frames for inputs of `lengths` frames."""
        if self.pad_end:
            return torch.div(lengths, 4, rounding_mode="floor").clamp(min=0)
        return torch.div(torch.div(lengths - 1, 2, rounding_mode="floor") - 1, 2,
                         rounding_mode="floor").clamp(min=0)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` [B, T, idim] -> ([B, T', odim], lengths [B])."""
        out_lengths = self.output_lengths(lengths)
        if x.size(1) < (4 if self.pad_end else 7):
            return x.new_zeros(x.size(0), 0, self.out.out_features), out_lengths
        x = x.unsqueeze(1)  # [B, 1, T, F]
        if self.pad_end:
            x = zero_beyond(x, lengths, 2)
            x = torch.relu(self.conv[0](nn.functional.pad(x, (0, 1, 0, 1))))
            x = zero_beyond(x, torch.div(lengths, 2, rounding_mode="floor"), 2)
            x = torch.relu(self.conv[2](nn.functional.pad(x, (0, 1, 0, 1))))
        else:
            x = self.conv(x)
        batch, channels, time, freq = x.shape  # [B, C, T', F']
        x = self.out(x.transpose(1, 2).reshape(batch, time, channels * freq))
        return x, out_lengths


class VGG2LSubsampling(nn.Module):
    """Reduce the frame rate by 4 with two VGG blocks, then project to `odim`.

    Each block is two 3x3 convolutions (stride 1, padding 1) with ReLU and a 2x2
    max-pool that keeps a trailing odd frame (ceil mode); the blocks have 64 and 128
    channels, so `128 * ceil(ceil(idim / 2) / 2)` values per frame reach the projection
    and `T' = ceil(ceil(T / 2) / 2)`. Positions past each utterance's length are zeroed
    after every convolution, so a batch gives the same valid outputs as its utterances
    run alone.
    """

    CHANNELS = (64, 128)

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        first, second = self.CHANNELS
        self.convs = nn.ModuleList([
            nn.Conv2d(1, first, 3, padding=1), nn.Conv2d(first, first, 3, padding=1),
            nn.Conv2d(first, second, 3, padding=1), nn.Conv2d(second, second, 3, padding=1),
        ])
        freq = math.ceil(math.ceil(idim / 2) / 2)
        self.out = nn.Linear(second * freq, odim)

    @staticmethod
    def _halve(lengths: torch.Tensor) -> torch.Tensor:
        return torch.div(lengths + 1, 2, rounding_mode="floor")

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Number of output frames for inputs of `lengths` frames."""
        return self._halve(self._halve(lengths)).clamp(min=0)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` [B, T, idim] -> ([B, ceil(ceil(T/2)/2), odim], lengths [B])."""
        out_lengths = self.output_lengths(lengths)
        if x.size(1) == 0:
            return x.new_zeros(x.size(0), 0, self.out.out_features), out_lengths
        x = zero_beyond(x.unsqueeze(1), lengths, 2)  # [B, 1, T, F]
        for block in range(2):
            for conv in self.convs[2 * block: 2 * block + 2]:
                x = zero_beyond(torch.relu(conv(x)), lengths, 2)
            x = nn.functional.max_pool2d(x, 2, stride=2, ceil_mode=True)
            lengths = self._halve(lengths)
        batch, channels, time, freq = x.shape
        x = self.out(x.transpose(1, 2).reshape(batch, time, channels * freq))
        return x, out_lengths


TIME_REDUCTION_MODES = ("stack", "subsample")


class TimeReduction(nn.Module):
    """Reduce the frame rate by `factor`, `T' = ceil(T / factor)`.

    `mode` "stack": concatenate `factor` consecutive frames and project them back to
    `dim` (a linear layer); a trailing partial group is completed with zeros. Padded
    input frames are zeroed first, which keeps the last valid group of a padded
    utterance equal to the same utterance run alone.
    `mode` "subsample": keep frames 0, factor, 2 * factor, ... (no parameters; CAT's
    time reduction).
    """

    def __init__(self, dim: int, factor: int, mode: str = "stack") -> None:
        super().__init__()
        if factor < 2:
            raise ValueError(f"time reduction factor must be >= 2, got {factor}")
        if mode not in TIME_REDUCTION_MODES:
            raise ValueError(f"time_reduction_mode must be one of {TIME_REDUCTION_MODES}, "
                             f"got {mode!r}")
        self.factor = factor
        self.mode = mode
        self.proj = nn.Linear(dim * factor, dim) if mode == "stack" else None

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """Number of output frames for inputs of `lengths` frames."""
        return torch.div(lengths + self.factor - 1, self.factor, rounding_mode="floor")

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` [B, T, D] -> ([B, ceil(T / factor), D], lengths [B])."""
        if self.proj is None:
            return x[:, ::self.factor], self.output_lengths(lengths)
        batch, time, dim = x.shape
        x = x.masked_fill(lengths_to_padding_mask(lengths, time).unsqueeze(-1), 0.0)
        remainder = (-time) % self.factor
        # Padded unconditionally (by 0 frames when none is missing): a traced ONNX graph
        # then pads whatever length it is given.
        x = nn.functional.pad(x, (0, 0, 0, remainder))
        x = x.reshape(batch, (time + remainder) // self.factor, dim * self.factor)
        return self.proj(x), self.output_lengths(lengths)


class RelPositionalEncoding(nn.Module):
    """Scale the input by sqrt(dim) and build sinusoidal relative position embeddings.

    For a sequence of `T` frames the embeddings cover relative positions
    `T-1, T-2, ..., 0, ..., -(T-1)` (row `T-1-r` holds position `r`), i.e. a
    `[1, 2T-1, dim]` tensor. They are computed on the fly (cheap, no cached state).
    """

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"model dimension must be even for sinusoidal positions, got {dim}")
        self.dim = dim
        self.scale = math.sqrt(dim)
        self.dropout = nn.Dropout(dropout)

    def position_embeddings(self, length: int, device: torch.device,
                            dtype: torch.dtype) -> torch.Tensor:
        """Embeddings of relative positions `length-1 .. -(length-1)`: [1, 2*length-1, dim]."""
        count = max(2 * length - 1, 0)
        positions = (length - 1) - torch.arange(count, device=device, dtype=torch.float32)
        inverse_freq = torch.exp(
            torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
            * (-math.log(10000.0) / self.dim)
        )
        angles = positions.unsqueeze(1) * inverse_freq.unsqueeze(0)
        embeddings = torch.stack([angles.sin(), angles.cos()], dim=-1).reshape(count, self.dim)
        return embeddings.unsqueeze(0).to(dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` [B, T, D] -> (scaled x with dropout, position embeddings [1, 2T-1, D])."""
        pos_emb = self.position_embeddings(x.size(1), x.device, x.dtype)
        return self.dropout(x * self.scale), self.dropout(pos_emb)


class RelPositionMultiHeadAttention(nn.Module):
    """Multi-head self-attention with relative positional encoding (Transformer-XL).

    The score of query `i` and key `j` in head `h` is
    `((q_i + u_h) . k_j + (q_i + v_h) . W_pos p_{i-j}) / sqrt(d_head)`, where
    `u`/`v` are learned global content/position biases and `p_r` the sinusoidal
    embedding of relative position `r`.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden dimension {dim} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(num_heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.empty(num_heads, self.head_dim))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        return x.view(batch, time, self.num_heads, self.head_dim)

    def _terms(self, x: torch.Tensor, pos_emb: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(q + u)` [B, H, T, d], key and value [B, H, T, d], and the position term
        `(q + v) . W_pos p_{i-j}` [B, H, T, T] (not yet divided by sqrt(d))."""
        time = x.size(1)
        query = self._split_heads(self.linear_q(x))  # [B, T, H, d]
        key = self._split_heads(self.linear_k(x)).transpose(1, 2)  # [B, H, T, d]
        value = self._split_heads(self.linear_v(x)).transpose(1, 2)
        position = self._split_heads(self.linear_pos(pos_emb)).transpose(1, 2)  # [1, H, 2T-1, d]
        query_u = (query + self.pos_bias_u).transpose(1, 2)
        query_v = (query + self.pos_bias_v).transpose(1, 2)
        by_position = torch.matmul(query_v, position.transpose(-2, -1))  # [B, H, T, 2T-1]
        # Column j of query row i must read relative position i - j, stored at index T-1-i+j.
        rows = torch.arange(time, device=x.device)
        index = (time - 1) - rows.unsqueeze(1) + rows.unsqueeze(0)
        by_position = by_position.gather(-1, index.expand(*by_position.shape[:2], time, time))
        return query_u, key, value, by_position

    def scores(self, x: torch.Tensor, pos_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-softmax scores [B, H, T, T] and the value tensor [B, H, T, d_head]."""
        query_u, key, value, by_position = self._terms(x, pos_emb)
        content = torch.matmul(query_u, key.transpose(-2, -1))  # [B, H, T, T]
        return (content + by_position) / math.sqrt(self.head_dim), value

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, padding_mask: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`x` [B, T, D], `pos_emb` [1, 2T-1, D], `padding_mask` [B, T] -> [B, T, D];
        `attn_mask` [T, T] (True: query row may not see key column) limits the context,
        e.g. to chunks (`cat.models.chunked.chunk_attention_mask`).

        The content term and the softmax run in `scaled_dot_product_attention` (a fused
        kernel where the device has one), the position term and the masks entering it as
        an additive bias: masked keys get -inf, hence weight 0. A query row without any
        valid key (a padded frame under a chunk mask, an utterance of no frames) would be
        all -inf, which a plain softmax turns into NaN (torch's math and CPU kernels give
        0, not every kernel promises to): such rows attend to every key instead and their
        output is set to 0, so they pass on neither values nor gradients, as before.
        """
        query_u, key, value, by_position = self._terms(x, pos_emb)
        key_mask = padding_mask[:, None, None, :]
        if attn_mask is not None:
            key_mask = key_mask | attn_mask[None, None]
        empty_rows = key_mask.all(dim=-1, keepdim=True)  # [B, 1, T or 1, 1]
        # One dtype for the kernel: under autocast the projections are in its dtype, while
        # adding the float32 biases u (above) promoted the query to float32.
        dtype = key.dtype
        bias = (by_position / math.sqrt(self.head_dim)).to(dtype).masked_fill(
            key_mask & ~empty_rows, float("-inf"))
        context = nn.functional.scaled_dot_product_attention(
            query_u.to(dtype), key, value, attn_mask=bias,
            dropout_p=self.dropout.p if self.training else 0.0,
            scale=1.0 / math.sqrt(self.head_dim))  # [B, H, T, d]
        context = context.masked_fill(empty_rows, 0.0)
        batch, _, time, _ = context.shape
        return self.linear_out(context.transpose(1, 2).reshape(batch, time, -1))


class FeedForward(nn.Module):
    """Linear -> Swish -> Dropout -> Linear -> Dropout."""

    def __init__(self, dim: int, hidden_dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden_dim), nn.SiLU(), nn.Dropout(dropout),
            nn.Linear(hidden_dim, dim), nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        return self.net(x)


class ConvolutionModule(nn.Module):
    """Pointwise conv (2D channels) -> GLU -> depthwise conv -> norm -> Swish -> pointwise conv.

    `norm` is "batchnorm" (the Conformer paper; its training statistics include
    the zeroed padding) or "layernorm" (independent of batch composition).
    """

    def __init__(self, dim: int, kernel_size: int, dropout: float, norm: str = "batchnorm",
                 causal: bool = False) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (symmetric padding), got {kernel_size}")
        if norm not in ("batchnorm", "layernorm"):
            raise ValueError(f"conv norm must be 'batchnorm' or 'layernorm', got {norm!r}")
        self.pointwise_in = nn.Conv1d(dim, 2 * dim, kernel_size=1)
        # A causal convolution sees the current and the `kernel_size - 1` previous frames
        # only, so chunks of a streaming encoder need no future frames.
        self.causal = causal
        self.depthwise = nn.Conv1d(dim, dim, kernel_size, padding=0 if causal else kernel_size // 2,
                                   groups=dim)
        self.norm_type = norm
        self.norm = nn.BatchNorm1d(dim) if norm == "batchnorm" else nn.LayerNorm(dim)
        self.activation = nn.SiLU()
        self.pointwise_out = nn.Conv1d(dim, dim, kernel_size=1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]; padded frames are zeroed before the depthwise conv."""
        x = nn.functional.glu(self.pointwise_in(x.transpose(1, 2)), dim=1)  # [B, D, T]
        x = x.masked_fill(padding_mask.unsqueeze(1), 0.0)
        if self.causal:
            x = nn.functional.pad(x, (self.depthwise.kernel_size[0] - 1, 0))
        x = self.depthwise(x)
        if self.norm_type == "batchnorm":
            x = self.norm(x)
        else:
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        x = self.pointwise_out(self.activation(x))
        return self.dropout(x.transpose(1, 2))


class ConformerBlock(nn.Module):
    """x + FFN/2 -> x + MHSA -> x + Conv -> x + FFN/2 -> LayerNorm (pre-norm residuals)."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, kernel_size: int, dropout: float,
                 dropout_attn: float, conv_norm: str, causal_conv: bool = False) -> None:
        super().__init__()
        self.norm_ffn_in = nn.LayerNorm(dim)
        self.ffn_in = FeedForward(dim, ffn_dim, dropout)
        self.norm_attn = nn.LayerNorm(dim)
        self.attn = RelPositionMultiHeadAttention(dim, num_heads, dropout_attn)
        self.dropout_attn_out = nn.Dropout(dropout)
        self.norm_conv = nn.LayerNorm(dim)
        self.conv = ConvolutionModule(dim, kernel_size, dropout, conv_norm, causal_conv)
        self.norm_ffn_out = nn.LayerNorm(dim)
        self.ffn_out = FeedForward(dim, ffn_dim, dropout)
        self.norm_final = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, padding_mask: torch.Tensor,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, D] -> [B, T, D]."""
        x = x + 0.5 * self.ffn_in(self.norm_ffn_in(x))
        x = x + self.dropout_attn_out(self.attn(self.norm_attn(x), pos_emb, padding_mask,
                                                attn_mask))
        x = x + self.conv(self.norm_conv(x), padding_mask)
        x = x + 0.5 * self.ffn_out(self.norm_ffn_out(x))
        return self.norm_final(x)
