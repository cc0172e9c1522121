"""U2's streaming strategy (`U2Streaming`, `cat.models.streaming`): chunk-by-chunk
inference of a chunk-trained `ConformerNet` with explicit state.

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

As a strategy: the PyTorch chunk encoder is `CachedChunkEncoder` (its chunks of several
streams batch, `encode_batch`), the step `streaming.onnx` traces `StreamingEncoder` (`x`,
`attn_cache`, `conv_cache` in; the head's output, `attn_cache_out`, `conv_cache_out` out),
and onnxruntime runs it as `OnnxChunkEncoder`.

Usage:
    streaming = StreamingEncoder(model.encoder, chunk_size=16)
    attn_cache, conv_cache = streaming.initial_state()
    out, attn_cache, conv_cache = streaming(feats[None, :streaming.frames_per_chunk],
                                            attn_cache, conv_cache)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cat.core.io import PathLike
from cat.models.encoder import MIN_INPUT_FRAMES, ConformerNet
from cat.models.layer import ConformerBlock, RelPositionMultiHeadAttention
from cat.models.onnx_export import (
    METADATA_NAME,
    STREAMING_NAME,
    WENET_INPUTS,
    WENET_OUTPUTS,
    ExportError,
    Refusal,
    load_export_metadata,
    onnx_session,
    refusal_name,
    runtime_sizes,
)
from cat.models.streaming import ChunkEncoderBase, OnnxGraph, PackedStateStep, StreamingError

# Input frames a 4x conv subsampling needs beyond 4 per output frame.
SUBSAMPLING_OVERLAP = 3


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
    see the module docstring, and U2's `StreamingStep`. Raises ValueError for a chunk
    size the model was not trained for."""

    right_context = None

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

    def metadata(self) -> dict[str, Any]:
        """What a runtime needs to cut features into chunks and size the caches."""
        encoder = self.encoder
        return {"streaming": U2Streaming.name, "chunk_size": self.chunk_size,
                "stride": self.stride, "frames_per_chunk": self.frames_per_chunk,
                "left_chunks": encoder.left_chunks, "num_layers": len(encoder.cells),
                "model_dim": encoder.output_dim,
                "conv_cache_frames": encoder.cells[0].conv.depthwise.kernel_size[0] - 1}

    def onnx_graph(self, head: nn.Module, output_name: str, feature_dim: int) -> OnnxGraph:
        """`streaming.onnx`: one chunk `x` [1, T, F] with `attn_cache` [layers, 1, L, D] and
        `conv_cache` [layers, 1, D, K-1] in -> `head`'s output of the chunk (`output_name`),
        `attn_cache_out`, `conv_cache_out`."""
        attn, conv = self.initial_state()
        with torch.no_grad():  # an example with a cache: its length is a dynamic axis
            _, attn, conv = self(torch.randn(1, self.frames_per_chunk, feature_dim), attn, conv)
        example = (torch.randn(1, self.frames_per_chunk, feature_dim), attn, conv)
        return OnnxGraph(_HeadStep(self, head), example, ["x", "attn_cache", "conv_cache"],
                         [output_name, "attn_cache_out", "conv_cache_out"],
                         {"x": {1: "T"}, "attn_cache": {2: "L"}, output_name: {1: "T_out"},
                          "attn_cache_out": {2: "L_out"}})

    def packed_state(self, left_chunks: int) -> PackedStateStep:
        """The chunk with a fixed-size state (`KeyValueStreamingEncoder`'s cache of the last
        `keep` frames' projected keys and values, its convolution frames, and how many
        cached frames exist): `keep` is the model's `left_chunks` chunks, else
        `left_chunks`."""
        chunk = self.chunk_size
        step = KeyValueStreamingEncoder(self.encoder, chunk)
        left = self.encoder.left_chunks
        keep = chunk * (left if left > 0 else left_chunks)
        attn, conv = step.initial_state(keep)

        def run(x: torch.Tensor, parts: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
            attn, conv, valid = parts
            cached = attn.size(2)
            positions = torch.arange(cached + chunk)
            mask = (positions >= cached - valid.to(torch.int64))[None, None]
            out, attn, conv = step(x, attn, conv, mask)
            return out, [attn, conv, torch.clamp(valid + chunk, max=keep)]

        return PackedStateStep(step, [tuple(attn.shape), tuple(conv.shape), (1,)],
                               self.frames_per_chunk, self.stride, run)

    def wenet_runtime(self, left_chunks: int) -> dict[str, Any]:
        """The settings a runtime of the `wenet_ctc` layout must use: the chunk size, and
        `num_left_chunks` exactly the model's `left_chunks`, or at least `left_chunks` for
        a model trained with all left context."""
        if self.encoder.left_chunks > 0:
            return {"chunk_size": self.chunk_size, "num_left_chunks": self.encoder.left_chunks,
                    "num_left_chunks_is": "exact"}
        return {"chunk_size": self.chunk_size, "num_left_chunks": left_chunks,
                "num_left_chunks_is": "minimum"}

    def wenet_graph(self, head: nn.Module, output_name: str, settings: dict[str, Any],
                    feature_dim: int) -> tuple[OnnxGraph, dict[str, int]]:
        """The chunk in the `wenet_ctc` layout (`WenetLayoutStep`, `KeyValueStreamingEncoder`:
        the runtime's cache holds each block's projected keys and values) for a runtime of
        `settings` (`wenet_runtime`), and the metadata the runtime reads of it (`head`,
        `num_blocks`, `output_size`, `cnn_module_kernel`, `subsampling_factor`,
        `right_context`)."""
        chunk_size = self.chunk_size
        streaming = KeyValueStreamingEncoder(self.encoder, chunk_size)
        encoder = self.encoder
        cell = encoder.cells[0]
        stride = streaming.streaming.stride
        wenet = {"head": cell.attn.num_heads, "num_blocks": len(encoder.cells),
                 "output_size": encoder.output_dim,
                 "cnn_module_kernel": cell.conv.depthwise.kernel_size[0],
                 "subsampling_factor": stride // chunk_size,
                 # A chunk's frames: (chunk - 1) x subsampling + right_context + 1.
                 "right_context": streaming.streaming.frames_per_chunk - stride
                 + stride // chunk_size - 1}
        cache = chunk_size * settings["num_left_chunks"]
        attn_cache, conv_cache = streaming.initial_state(cache)
        mask = torch.ones(1, 1, cache + chunk_size, dtype=torch.bool)
        mask[:, :, :chunk_size] = False
        example = (torch.randn(1, streaming.streaming.frames_per_chunk, feature_dim),
                   torch.tensor([cache], dtype=torch.int64),
                   torch.tensor([cache], dtype=torch.int64), attn_cache, conv_cache, mask)
        return OnnxGraph(WenetLayoutStep(streaming, head, settings), example, WENET_INPUTS,
                         [output_name, *WENET_OUTPUTS],
                         {"x": {1: "T"}, "attn_cache": {2: "R"}, "attn_mask": {2: "M"},
                          output_name: {1: "T_out"}, "next_att_cache": {2: "R_out"}}), wenet


class _HeadStep(nn.Module):
    """`StreamingEncoder` with a head on its output: what `streaming.onnx` traces."""

    def __init__(self, streaming: StreamingEncoder, head: nn.Module) -> None:
        super().__init__()
        self.streaming, self.head = streaming, head

    def forward(self, x: torch.Tensor, attn_cache: torch.Tensor,
                conv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, attn_cache, conv_cache = self.streaming(x, attn_cache, conv_cache)
        return self.head(out), attn_cache, conv_cache


class CachedChunkEncoder(ChunkEncoderBase):
    """A `StreamingEncoder` with its caches, as a `cat.models.streaming.ChunkEncoder`: a
    chunk reads the subsampling's 3 frames of overlap beyond its stride; the rest is
    encoded when it is at least the subsampling's 7 frames."""

    lookahead = SUBSAMPLING_OVERLAP

    def __init__(self, encoder: StreamingEncoder) -> None:
        self.encoder, self.stride = encoder, encoder.stride
        self.attn_cache, self.conv_cache = encoder.initial_state()

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        out, self.attn_cache, self.conv_cache = self.encoder(feats, self.attn_cache,
                                                             self.conv_cache)
        return out

    def finish(self, feats: torch.Tensor) -> torch.Tensor:
        if feats.size(1) < MIN_INPUT_FRAMES:
            return feats.new_zeros(1, 0, self.encoder.encoder.output_dim)
        return self(feats)

    @classmethod
    def encode_batch(cls, encoders: Sequence[CachedChunkEncoder], feats: torch.Tensor
                     ) -> list[torch.Tensor]:
        """One encoder call for the chunks `feats` [B, T, F] of `encoders` (of one model and
        chunk size): their attention caches right-aligned in one padded tensor, masked
        (`StreamingEncoder`'s `cache_valid`), so each output is the encoder's own."""
        if len(encoders) < 2:
            return super().encode_batch(encoders, feats)
        streaming = encoders[0].encoder
        caches = [encoder.attn_cache for encoder in encoders]
        lengths = [cache.size(2) for cache in caches]
        longest = max(lengths)
        first = caches[0]
        attn = first.new_zeros(first.size(0), len(encoders), longest, first.size(3))
        valid = torch.zeros(len(encoders), longest, dtype=torch.bool)
        for index, (cache, length) in enumerate(zip(caches, lengths, strict=True)):
            attn[:, index, longest - length:] = cache[:, 0]
            valid[index, longest - length:] = True
        conv = torch.cat([encoder.conv_cache for encoder in encoders], dim=1)
        out, attn, conv = streaming(feats, attn, conv,
                                    None if min(lengths) == longest else valid)
        chunk, keep = out.size(1), streaming.keep
        for index, (encoder, length) in enumerate(zip(encoders, lengths, strict=True)):
            kept = length + chunk if keep < 0 else min(keep, length + chunk)
            encoder.attn_cache = attn[:, index:index + 1, attn.size(2) - kept:]
            encoder.conv_cache = conv[:, index:index + 1]
        return list(out)


class OnnxChunkEncoder(ChunkEncoderBase):
    """A U2 export's `streaming.onnx` in onnxruntime as a `ChunkEncoder` (what
    `CachedChunkEncoder` is in PyTorch): keeps the caches between calls."""

    lookahead = SUBSAMPLING_OVERLAP

    def __init__(self, export_dir: PathLike, num_threads: int = 1) -> None:
        export_dir = Path(export_dir)
        meta = load_export_metadata(export_dir)
        if "chunk_size" not in meta:
            raise ExportError(f"{export_dir}: no {STREAMING_NAME} (export with --chunk-size)")
        self.session = onnx_session(export_dir / STREAMING_NAME, num_threads)
        self.stride = int(meta["stride"])
        self.shapes = ((int(meta["num_layers"]), 1, 0, int(meta["model_dim"])),
                       (int(meta["num_layers"]), 1, int(meta["model_dim"]),
                        int(meta["conv_cache_frames"])))
        self.reset()

    def reset(self) -> None:
        """Start a new utterance (the session is kept)."""
        self.attn_cache = torch.zeros(self.shapes[0]).numpy()
        self.conv_cache = torch.zeros(self.shapes[1]).numpy()

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        out, self.attn_cache, self.conv_cache = self.session.run(
            None, {"x": feats.numpy(), "attn_cache": self.attn_cache,
                   "conv_cache": self.conv_cache})
        return torch.from_numpy(out)

    def finish(self, feats: torch.Tensor) -> torch.Tensor:
        """The rest of the utterance: encoded when it holds the subsampling's 7 frames."""
        if feats.size(1) < MIN_INPUT_FRAMES:
            return torch.zeros(1, 0, 0)
        return self(feats)


class U2Streaming:
    """U2's streaming strategy (`cat.models.streaming.StreamingStrategy`): the encoder's
    chunk-masked forward run chunk by chunk from caches; no right context."""

    name = "u2"
    right_contexts: tuple[str, ...] = ()

    def __init__(self, encoder: ConformerNet) -> None:
        self.encoder = encoder

    def chunk_encoder(self, chunk_size: int, right_context: str | None = None
                      ) -> CachedChunkEncoder:
        if right_context is not None:
            raise StreamingError(f"right context {right_context!r}: {_NO_RIGHT_CONTEXT}")
        return CachedChunkEncoder(StreamingEncoder(self.encoder, chunk_size))

    def step(self, chunk_size: int, right_context: str | None = None) -> StreamingEncoder:
        if right_context is not None:
            raise ExportError(f"right context {right_context!r}: {_NO_RIGHT_CONTEXT}")
        return StreamingEncoder(self.encoder, chunk_size)

    @staticmethod
    def onnx_chunk_encoder(export_dir: PathLike, num_threads: int = 1) -> OnnxChunkEncoder:
        return OnnxChunkEncoder(export_dir, num_threads)

    @staticmethod
    def wenet_runtime_problem(meta: Mapping[str, Any], num_left_chunks: int,
                              runtime_key: str) -> str | None:
        """What is wrong with running an export's `wenet_ctc` layout with `num_left_chunks`
        (None: nothing): other than the model's `left_chunks`, or fewer than the export's
        `runtime_key` settings ask for a model trained with all left context."""
        if int(meta["left_chunks"]) > 0 and num_left_chunks != int(meta["left_chunks"]):
            return (f"the model attends to {meta['left_chunks']} earlier chunks "
                    f"(encoder.kwargs.left_chunks); num_left_chunks must be that, not "
                    f"{num_left_chunks}")
        if int(meta["left_chunks"]) <= 0:
            least = int(meta.get(runtime_key, {}).get("num_left_chunks", 1))
            if num_left_chunks < least:
                return (f"the model was trained with all left context "
                        f"(encoder.kwargs.left_chunks {meta['left_chunks']}); num_left_chunks "
                        f"must be at least {least} ({METADATA_NAME} {runtime_key}), not "
                        f"{num_left_chunks}")
        return None


_NO_RIGHT_CONTEXT = "only CUSIDE models (trainer.chunk_size) stream with a right context"


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


class WenetLayoutStep(nn.Module):
    """One chunk in the state layout of sherpa-onnx's online `wenet_ctc` model type (inputs
    and outputs matched by position, `WENET_INPUTS`; `cat.ctc.export.export_wenet_ctc`),
    `head` on its output. A runtime of another chunk size than the export's, or whose cache
    holds other than `StreamingEncoder.wenet_runtime`'s `num_left_chunks` (the model's
    `left_chunks` exactly; at least `left_chunks` given for a model trained with all left
    context), is refused (`Refusal`): sherpa-onnx's factory defaults (chunk 16, 4 left
    chunks) fit neither unless the export was made for them."""

    def __init__(self, streaming: KeyValueStreamingEncoder, head: nn.Module,
                 settings: dict[str, Any]) -> None:
        super().__init__()
        self.streaming, self.head = streaming, head
        self.chunk_size, self.left_chunks = settings["chunk_size"], settings["num_left_chunks"]
        self.exact = settings["num_left_chunks_is"] == "exact"
        self.refusal_name = refusal_name(settings)
        self.add_module(self.refusal_name, Refusal())

    def forward(self, x: torch.Tensor, offset: torch.Tensor, required_cache_size: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Relative positions need no absolute offset, and the cache's size is its own; both
        # inputs stay in the graph (a runtime feeds them by position), contributing zero.
        unused = (offset.sum() + required_cache_size.sum()).to(x.dtype) * 0.0
        cached, chunk = runtime_sizes(attn_cache, attn_mask)
        least = chunk * self.left_chunks
        left_ok = cached == least if self.exact else cached >= least
        unused = unused + getattr(self, self.refusal_name)((chunk == self.chunk_size) & left_ok)
        out, attn_cache, conv_cache = self.streaming(x + unused, attn_cache, conv_cache,
                                                     attn_mask)
        return self.head(out), attn_cache, conv_cache
