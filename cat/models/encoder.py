"""Acoustic encoders: `ConformerNet` (convolutional subsampling + Conformer blocks).

An encoder maps padded features `[B, T, idim]` with lengths `[B]` to hidden
states `[B, T', output_dim]` with lengths `[B]`. Padded output frames are
zero. `output_lengths(feat_lens)` gives `T'` without running the network, so a
data filter can drop utterances that are too short for their labels (CTC needs
`T'` >= number of labels + number of repeated adjacent labels).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from cat.models.layer import (
    ConformerBlock,
    Conv2dSubsampling,
    RelPositionalEncoding,
    TimeReduction,
    VGG2LSubsampling,
    lengths_to_padding_mask,
)

SUBSAMPLINGS = ("conv2d", "conv2d_padded", "vgg2l")
#: The fewest input frames the 4x subsampling gives an output frame for.
MIN_INPUT_FRAMES = 7


def build_subsampling(kind: str, idim: int, hdim: int,
                      channels: int | None) -> Conv2dSubsampling | VGG2LSubsampling:
    """The x4 subsampling `kind` (see `ConformerNet`) from `idim` features to `hdim`."""
    if kind not in SUBSAMPLINGS:
        raise ValueError(f"subsampling must be one of {SUBSAMPLINGS}, got {kind!r}")
    if kind == "vgg2l":
        if channels is not None:
            raise ValueError("subsampling_channels applies to conv2d subsampling only "
                             "(vgg2l has 64 and 128 channels)")
        return VGG2LSubsampling(idim, hdim)
    return Conv2dSubsampling(idim, hdim, channels, pad_end=kind == "conv2d_padded")


def chunk_attention_mask(num_frames: int, chunk_size: int, left_chunks: int,
                         device: torch.device) -> torch.Tensor:
    """`[T, T]` bool, True where query frame i may not attend to key frame j: j in a later
    chunk than i, or (`left_chunks` >= 0) more than `left_chunks` chunks earlier."""
    chunk = torch.arange(num_frames, device=device) // chunk_size
    later = chunk[None, :] > chunk[:, None]
    if left_chunks < 0:
        return later
    return later | (chunk[None, :] < chunk[:, None] - left_chunks)


class FeatureNormalizer(nn.Module):
    """Global mean and variance normalisation of the input features.

    The statistics are buffers, saved in checkpoints; until `set_stats` is called they
    are the identity (mean 0, scale 1) and `initialized` is False.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("inv_std", torch.ones(dim))
        self.register_buffer("initialized", torch.tensor(False))

    def set_stats(self, mean: torch.Tensor, std: torch.Tensor, floor: float = 1e-3) -> None:
        """Use per-dimension `mean` and `std` (floored at `floor`) from now on."""
        if mean.shape != self.mean.shape or std.shape != self.mean.shape:
            raise ValueError(f"feature statistics of shape {tuple(mean.shape)}/"
                             f"{tuple(std.shape)}, expected {tuple(self.mean.shape)}")
        self.mean.copy_(mean)
        self.inv_std.copy_(1.0 / std.clamp(min=floor))
        self.initialized.fill_(True)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return (feats - self.mean) * self.inv_std


@runtime_checkable
class Encoder(Protocol):
    """What models, the trainer, decoding and export use of an acoustic encoder (the
    registry checks a built encoder against it):

    * `encoder(feats [B, T, idim], feat_lens [B]) -> (hidden [B, T', output_dim], lengths)`;
    * `output_dim`, and `frame_rate_factor` (T / T');
    * `output_lengths(feat_lens)`: T' without running the network (the length filter);
    * `normalizer`: the global CMVN it holds (`FeatureNormalizer`), or None;
    * chunk decoding: `set_decode_chunk_size(n)` (0: full context) and the chunk settings
      it was trained with (`max_chunk_size`, `left_chunks`), which streaming checks;
    * `streaming_strategy`: the name of how it streams chunk by chunk with state
      (`cat.models.streaming.STRATEGIES`; `AsrModel.streaming` builds it over the encoder,
      unless the model streams in CUSIDE's windows);
    * `compile_blocks()`: compile its blocks with `torch.compile` (`train.option.compile`).
    """

    output_dim: int
    normalizer: FeatureNormalizer | None
    max_chunk_size: int
    left_chunks: int
    streaming_strategy: str

    @property
    def frame_rate_factor(self) -> int: ...

    def output_lengths(self, feat_lens: torch.Tensor) -> torch.Tensor: ...

    def set_decode_chunk_size(self, chunk_size: int) -> None: ...

    def compile_blocks(self) -> None: ...

    def __call__(self, feats: torch.Tensor,
                 feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class ConformerNet(nn.Module):
    """Conformer encoder (Gulati et al. 2020) with relative-position self-attention.

    Args:
        idim: input feature dimension (80 for the project's fbank).
        hdim: model (attention) dimension; must be even and divisible by `num_heads`.
        num_cells: number of Conformer blocks.
        num_heads: attention heads.
        kernel_size: depthwise convolution kernel (odd).
        ffn_mult: feed-forward hidden size = `ffn_mult * hdim`.
        dropout: dropout of the residual branches and the subsampled input.
        dropout_attn: dropout on the attention weights.
        conv_norm: "batchnorm" or "layernorm" in the convolution module.
        subsampling: the x4 subsampling before the blocks: "conv2d" (two unpadded 3x3
            stride-2 convolutions), "conv2d_padded" (the same, each padded by one zero
            frame and bin at the end: CAT's `conv: "conv2d"`), "vgg2l" (two VGG blocks,
            64 and 128 channels: CAT's and ESPnet's VGG2L).
        subsampling_channels: channels of the conv2d subsampling (default `hdim`).
        time_reduction_factor: extra frame-rate reduction (1 = none).
        time_reduction_position: number of blocks run before the extra reduction
            (0 = right after the conv subsampling, which makes all blocks cheaper;
            `num_cells` = after the last block, as CAT does by default).
        time_reduction_mode: "stack" (stack frames and project them back) or
            "subsample" (keep every factor-th frame, no parameters: CAT's).
        global_cmvn: normalise the input features with a global mean and standard
            deviation held in the model (see `FeatureNormalizer`), so checkpoints carry
            them to decoding. The trainer sets them from training data before step 0.
        causal_conv: make the convolution modules causal (current and past frames only),
            which streaming needs: a chunk then depends on no future frame.
        max_chunk_size: train for streaming in chunks (U2's dynamic chunk training): per
            training batch, with probability `full_context_prob` full context, else
            self-attention limited to chunks of a size drawn uniformly from
            `min_chunk_size`..`max_chunk_size` encoder output frames (each frame sees its
            own chunk and the earlier ones). 0 (default): full context only. Needs
            `causal_conv`.
        full_context_prob: share of training batches with full context (chunk training).
        min_chunk_size: the smallest chunk drawn in chunk training (and the smallest chunk
            size streaming accepts).
        left_chunks: earlier chunks a frame may attend to (-1: all).

    Frame rate: 4x from the subsampling times `time_reduction_factor`. Streaming: U2's
    chunk-masked forward from caches (`cat.models.chunked`).
    """

    streaming_strategy = "u2"

    def __init__(self, idim: int, hdim: int, num_cells: int, num_heads: int = 4,
                 kernel_size: int = 15, ffn_mult: int = 4, dropout: float = 0.1,
                 dropout_attn: float = 0.0, conv_norm: str = "batchnorm",
                 subsampling: str = "conv2d", subsampling_channels: int | None = None,
                 time_reduction_factor: int = 1, time_reduction_position: int = 0,
                 time_reduction_mode: str = "stack", global_cmvn: bool = False,
                 causal_conv: bool = False, max_chunk_size: int = 0,
                 full_context_prob: float = 0.5, left_chunks: int = -1,
                 min_chunk_size: int = 1) -> None:
        super().__init__()
        if not 0 <= time_reduction_position <= num_cells:
            raise ValueError(f"time_reduction_position={time_reduction_position} must be within "
                             f"[0, num_cells={num_cells}]")
        if max_chunk_size < 0 or not 0.0 <= full_context_prob <= 1.0 or left_chunks < -1:
            raise ValueError(f"max_chunk_size={max_chunk_size} must be >= 0, full_context_prob="
                             f"{full_context_prob} within [0, 1], left_chunks={left_chunks} >= -1")
        if max_chunk_size and not 1 <= min_chunk_size <= max_chunk_size:
            raise ValueError(f"min_chunk_size={min_chunk_size} must be within [1, "
                             f"max_chunk_size={max_chunk_size}]")
        if max_chunk_size and not causal_conv:
            raise ValueError("chunk training (max_chunk_size > 0) needs causal_conv: true, "
                             "else every chunk sees future frames through the convolutions")
        if max_chunk_size and time_reduction_factor > 1 and time_reduction_position:
            raise ValueError("chunk training needs time_reduction_position 0 (every block "
                             "at the output frame rate, where chunks are counted)")
        self.max_chunk_size = max_chunk_size
        self.min_chunk_size = min_chunk_size
        self.full_context_prob = full_context_prob
        self.left_chunks = left_chunks
        # Chunks of decoding (0: full context); see `set_decode_chunk_size`.
        self.decode_chunk_size = 0
        self.output_dim = hdim
        self.normalizer = FeatureNormalizer(idim) if global_cmvn else None
        self.subsampling = build_subsampling(subsampling, idim, hdim, subsampling_channels)
        self.positional = RelPositionalEncoding(hdim, dropout)
        self.cells = nn.ModuleList(
            ConformerBlock(hdim, num_heads, ffn_mult * hdim, kernel_size, dropout, dropout_attn,
                           conv_norm, causal_conv)
            for _ in range(num_cells)
        )
        self.time_reduction = (TimeReduction(hdim, time_reduction_factor, time_reduction_mode)
                               if time_reduction_factor > 1 else None)
        self.time_reduction_position = time_reduction_position

    @property
    def frame_rate_factor(self) -> int:
        """Total frame-rate reduction from input features to encoder output."""
        return 4 * (self.time_reduction.factor if self.time_reduction is not None else 1)

    def output_lengths(self, feat_lens: torch.Tensor) -> torch.Tensor:
        """Encoder output lengths for inputs of `feat_lens` frames."""
        lengths = self.subsampling.output_lengths(feat_lens)
        if self.time_reduction is not None:
            lengths = self.time_reduction.output_lengths(lengths)
        return lengths

    def check_chunk_size(self, chunk_size: int) -> None:
        """Raise ValueError unless the model was trained for chunks of `chunk_size` output
        frames (0: full context, always allowed)."""
        if chunk_size == 0:
            return
        if not self.max_chunk_size:
            raise ValueError(f"chunk size {chunk_size}: this model was trained with full "
                             "context only (encoder.kwargs.max_chunk_size 0)")
        if not self.min_chunk_size <= chunk_size <= self.max_chunk_size:
            raise ValueError(f"chunk size {chunk_size}: this model was trained on chunks of "
                             f"{self.min_chunk_size} to {self.max_chunk_size} frames "
                             "(encoder.kwargs.min_chunk_size, max_chunk_size)")

    def set_decode_chunk_size(self, chunk_size: int) -> None:
        """Limit self-attention to chunks of `chunk_size` output frames outside training
        (0: full context): the hypotheses a streaming decoder gives with that chunk size."""
        self.check_chunk_size(chunk_size)
        self.decode_chunk_size = chunk_size

    def compile_blocks(self) -> None:
        """Compile each Conformer block in place (`nn.Module.compile`: the state dict keeps
        its keys) with dynamic shapes. The blocks hold the model's FLOPs; the whole encoder
        with `dynamic=True` fails to compile on torch 2.11 (an inductor error on a symbolic
        stride order). On that version the compiled backward still fixes the time axis, so
        each new padded length compiles anew (bench/README.md: `train.option.compile`)."""
        for cell in self.cells:
            cell.compile(dynamic=True)

    def _chunk_size(self) -> int:
        if self.training and self.max_chunk_size:
            if float(torch.rand(())) < self.full_context_prob:
                return 0
            return int(torch.randint(self.min_chunk_size, self.max_chunk_size + 1, ()))
        return self.decode_chunk_size

    def _run_cells(self, x: torch.Tensor, lengths: torch.Tensor, cells: nn.ModuleList,
                   scale_input: bool, chunk_size: int = 0) -> torch.Tensor:
        if scale_input:
            x, pos_emb = self.positional(x)
        else:
            pos_emb = self.positional.position_embeddings(x.size(1), x.device, x.dtype)
            pos_emb = self.positional.dropout(pos_emb)
        padding_mask = lengths_to_padding_mask(lengths, x.size(1))
        attn_mask = (chunk_attention_mask(x.size(1), chunk_size, self.left_chunks, x.device)
                     if chunk_size else None)
        for cell in cells:
            x = cell(x, pos_emb, padding_mask, attn_mask)
        return x

    def forward(self, feats: torch.Tensor,
                feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`feats` [B, T, idim] float, `feat_lens` [B] long -> ([B, T', hdim], lengths [B])."""
        if self.normalizer is not None:
            feats = self.normalizer(feats)
        x, lengths = self.subsampling(feats, feat_lens.to(feats.device))
        if x.size(1) == 0:
            # Every utterance is shorter than the subsampling window: nothing to encode.
            return x.new_zeros(x.size(0), 0, self.output_dim), self.output_lengths(feat_lens)
        chunk_size = self._chunk_size()
        if self.time_reduction is None:
            x = self._run_cells(x, lengths, self.cells, scale_input=True, chunk_size=chunk_size)
        else:
            split = self.time_reduction_position
            x = self._run_cells(x, lengths, self.cells[:split], scale_input=True)
            x, lengths = self.time_reduction(x, lengths)
            x = self._run_cells(x, lengths, self.cells[split:], scale_input=False,
                                chunk_size=chunk_size)
        x = x.masked_fill(lengths_to_padding_mask(lengths, x.size(1)).unsqueeze(-1), 0.0)
        return x, lengths
