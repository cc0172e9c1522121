"""CUSIDE's streaming strategy (`CusideStreaming`, `cat.models.streaming`): a CUSIDE model
(`cat.models.cuside`) chunk by chunk as audio comes, each chunk in its window of left
context and simulated (or real, or no) right context.

`CusideStep` is one chunk with state in and state out (the history of left-context frames,
the simulation network's state): what the PyTorch chunk encoder `CusideStreamingEncoder`
runs, what `streaming.onnx` traces (its inputs by right context, `CUSIDE_INPUTS`), and what
sherpa-onnx's online layouts keep in their states (`packed_state`; `WenetLayoutStep`).
onnxruntime runs the export's step as `OnnxCusideEncoder`; both chunk encoders are
`CusideChunks` over their step. Over an utterance the outputs are those of
`ContextChunking.encode_chunks` of the whole of it with the same chunk size and right
context.

Usage:
    encoder = model.streaming.chunk_encoder(12, "simulated")  # a CusideStreamingEncoder
    out = encoder(feats[:, :encoder.stride + encoder.lookahead])  # [1, 12, D]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cat.core.io import PathLike
from cat.models.cuside import RIGHT_CONTEXTS, ContextChunking
from cat.models.onnx_export import (
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
from cat.models.streaming import ChunkEncoderBase, OnnxGraph, PackedStateStep

#: The inputs of a CUSIDE `streaming.onnx` besides the chunk, by right context.
CUSIDE_INPUTS = {"simulated": ("simu_state",), "real": ("right", "right_valid"), "none": ()}


class CusideStep(nn.Module):
    """One chunk of a CUSIDE model's streaming (eval mode), state in and state out, what
    `CusideStreamingEncoder` runs and the ONNX export traces:

    `forward(x [1, stride, D], valid [1] int64, history [1, left, D], history_valid [1]
    int64, state [layers, 1, H] (simulated right context), right [1, R, D] and right_valid
    [1] int64 (real right context))` -> (the chunk's encoder output [1, stride /
    frame_rate, H'], the next history, the next state): frames of `x` from `valid` on, of
    `right` from `right_valid` on and the history's but its last `history_valid` do not
    exist (the pad frame takes their place); the simulation network reads the chunk from
    `state`. The history starts as zeros with `history_valid` 0 and holds the last `left`
    frames; `history_valid` grows by `stride` per chunk up to `left`.
    """

    def __init__(self, encoder: nn.Module, chunking: ContextChunking, chunk_size: int,
                 right_context: str | None = None) -> None:
        super().__init__()
        if chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        chunking.check_chunk_size(chunk_size)
        self.right_context = right_context or chunking.default_right_context
        chunking.check_right_context(self.right_context)
        self.encoder, self.chunking = encoder.eval(), chunking.eval()
        self.chunk_size = chunk_size
        self.stride = chunk_size * chunking.frame_rate
        self.left = chunking.left_frames(self.stride)
        width = self.left + self.stride + (chunking.context_size_right
                                           if self.right_context != "none" else 0)
        self.tail = chunking.tail_frames(encoder, width, self.left + self.stride)

    def initial_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(an empty history: zeros [1, left, D], the simulation's zero state or None)."""
        simulation = self.chunking.simulation
        return (torch.zeros(1, self.left, self.chunking.feature_dim),
                simulation.initial_state() if self.right_context == "simulated" else None)

    def forward(self, x: torch.Tensor, valid: torch.Tensor, history: torch.Tensor,
                history_valid: torch.Tensor, state: torch.Tensor | None = None,
                right: torch.Tensor | None = None, right_valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        chunking, encoder = self.chunking, self.encoder
        pad = chunking.pad_frame(encoder, x)

        def filled(frames: torch.Tensor, exists: torch.Tensor) -> torch.Tensor:
            return torch.where(exists[None, :, None], frames, pad)

        def first(frames: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
            return filled(frames, torch.arange(frames.size(1), device=frames.device) < count)

        x = first(x, valid)
        history = filled(history, torch.arange(history.size(1), device=x.device)
                         >= history.size(1) - history_valid)
        parts = [history, x]
        if self.right_context == "simulated":
            hidden, state = chunking.simulation(chunking.normalize(encoder, x), state)
            parts.append(chunking.denormalize(encoder, chunking.simulation.predict(
                hidden[:, -1])))
        elif self.right_context == "real":
            parts.append(first(right, right_valid))
        if self.tail:
            parts.append(pad.expand(1, self.tail, -1))
        window = torch.cat(parts, dim=1)
        out, _ = encoder(window, torch.full((1,), window.size(1), dtype=torch.long))
        start = self.left // chunking.frame_rate
        next_history = torch.cat([history, x], dim=1)[:, x.size(1):]
        return out[:, start:start + self.chunk_size], next_history, state

    def metadata(self) -> dict[str, Any]:
        """What a runtime needs to cut features into chunks and size the state."""
        chunking = self.chunking
        simulation = chunking.simulation
        return {"streaming": CusideStreaming.name, "chunk_size": self.chunk_size,
                "stride": self.stride, "right_context": self.right_context,
                "left_frames": self.left, "right_frames": chunking.context_size_right,
                "simu_layers": len(simulation.rnns) if simulation is not None else 0,
                "simu_hdim": simulation.hidden if simulation is not None else 0}

    def onnx_graph(self, head: nn.Module, output_name: str, feature_dim: int) -> OnnxGraph:
        """`streaming.onnx`: `x` [1, stride, F], `valid` int64 [1] (frames of `x` that
        exist), `history` [1, left, F] and `history_valid` int64 [1], then by right context
        (`CUSIDE_INPUTS`) `simu_state` [layers, 1, H] (simulated) or `right` [1, R, F] and
        `right_valid` (real) -> `head`'s output of the chunk's encoder frames
        (`output_name`), `history_out`, and `simu_state_out` (simulated)."""
        if not self.left:
            raise ExportError("a CUSIDE model without left context (trainer.context_size_left "
                              "0) has no history to stream with")
        mode = self.right_context
        history, state = self.initial_state()
        right = self.chunking.context_size_right
        extra = {"simulated": (state,), "none": (),
                 "real": (torch.randn(1, right, feature_dim), torch.tensor([right]))}[mode]
        example = (torch.randn(1, self.stride, feature_dim), torch.tensor([self.stride]),
                   history, torch.tensor([0]), *extra)
        outputs = [output_name, "history_out"] + (["simu_state_out"] if mode == "simulated"
                                                  else [])
        return OnnxGraph(_HeadStep(self, head), example,
                         ["x", "valid", "history", "history_valid", *CUSIDE_INPUTS[mode]],
                         outputs, {})

    def packed_state(self, left_chunks: int) -> PackedStateStep:
        """The chunk with a fixed-size state: the history, how many of its frames exist and
        the simulation's GRU states (simulated right context); a chunk reads its stride
        and the real right context. `left_chunks` does not apply: the model's left
        context is its own."""
        history, state = self.initial_state()
        stride, keep = self.stride, self.left

        def run(x: torch.Tensor, parts: list[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
            history, valid = parts[0], parts[1]
            state = parts[2] if len(parts) > 2 else None
            right = x[:, stride:]
            out, history, state = self(
                x[:, :stride], torch.full((1,), stride, dtype=torch.int64), history,
                valid.to(torch.int64), state, right,
                torch.full((1,), right.size(1), dtype=torch.int64))
            valid = torch.clamp(valid + stride, max=keep)
            return out, [history, valid] + ([state] if state is not None else [])

        lookahead = self.chunking.context_size_right if self.right_context == "real" else 0
        return PackedStateStep(self, [tuple(history.shape), (1,)] + (
            [tuple(state.shape)] if state is not None else []), stride + lookahead, stride, run)

    def wenet_runtime(self, left_chunks: int) -> dict[str, Any]:
        """The settings a runtime of the `wenet_ctc` layout must use: the chunk size, and
        at least the `num_left_chunks` that hold the model's left context (`left_chunks`,
        for a model trained with all left context, does not apply)."""
        return {"chunk_size": self.chunk_size,
                "num_left_chunks": max(1, -(-self.left // self.chunk_size)),
                "num_left_chunks_is": "minimum"}

    def wenet_graph(self, head: nn.Module, output_name: str, settings: dict[str, Any],
                    feature_dim: int) -> tuple[OnnxGraph, dict[str, int]]:
        """The chunk in the `wenet_ctc` layout (`WenetLayoutStep`: its state in the
        runtime's caches) for a runtime of `settings` (`wenet_runtime`), and the metadata
        the runtime reads of it (`wenet_layout`)."""
        chunk_size = self.chunk_size
        layout = wenet_layout(self)
        cache = -(-self.left // chunk_size) * chunk_size
        mask = torch.ones(1, 1, cache + chunk_size, dtype=torch.bool)
        mask[:, :, :cache] = False
        frames = (chunk_size - 1) * layout["subsampling_factor"] + layout["right_context"] + 1
        example = (torch.randn(1, frames, feature_dim), torch.tensor([cache], dtype=torch.int64),
                   torch.tensor([cache], dtype=torch.int64),
                   torch.zeros(1, 1, cache, feature_dim),
                   torch.zeros(1, 1, layout["output_size"], layout["cnn_module_kernel"] - 1), mask)
        return OnnxGraph(WenetLayoutStep(self, head, settings), example, WENET_INPUTS,
                         [output_name, *WENET_OUTPUTS],
                         {"attn_cache": {2: "R"}, "attn_mask": {2: "M"},
                          "next_att_cache": {2: "R_out"}}), layout


class _HeadStep(nn.Module):
    """`CusideStep` with a head on its output, inputs by right context: what
    `streaming.onnx` traces."""

    def __init__(self, step: CusideStep, head: nn.Module) -> None:
        super().__init__()
        self.step, self.head = step, head

    def forward(self, x: torch.Tensor, valid: torch.Tensor, history: torch.Tensor,
                history_valid: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mode = self.step.right_context
        state = rest[0] if mode == "simulated" else None
        right, right_valid = rest if mode == "real" else (None, None)
        out, history, state = self.step(x, valid, history, history_valid, state, right,
                                        right_valid)
        return (self.head(out), history) + ((state,) if state is not None else ())


class WenetLayoutStep(nn.Module):
    """A CUSIDE model's chunk (`CusideStep`) in sherpa-onnx's online `wenet_ctc` layout
    (`WENET_INPUTS`), `head` on its output: the runtime's two caches hold its state, which
    it hands back unread. `attn_cache` [1, 1, R, D] holds the last R >= left feature frames
    (its `attn_mask` says how many exist: while fewer than `num_left_chunks` chunks have
    been decoded, `chunks x chunk_size` rows); `conv_cache` [1, 1, D / 2, K - 1] the
    simulation network's GRU states, flattened."""

    def __init__(self, step: CusideStep, head: nn.Module, settings: dict[str, Any]) -> None:
        super().__init__()
        self.step, self.head = step, head
        simulation = step.chunking.simulation
        self.state_shape = ((len(simulation.rnns), 1, simulation.hidden)
                            if step.right_context == "simulated" else None)
        # The chunk's frames are fixed (its stride), and the cache must hold the left
        # context: a runtime of another chunk size, or too few left chunks, is refused.
        self.refusal_name = refusal_name(settings)
        self.add_module(self.refusal_name, Refusal())

    def forward(self, x: torch.Tensor, offset: torch.Tensor, required_cache_size: torch.Tensor,
                attn_cache: torch.Tensor, conv_cache: torch.Tensor, attn_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        step = self.step
        unused = (offset.sum() + required_cache_size.sum()).to(x.dtype) * 0.0
        runtime_cache, runtime_chunk = runtime_sizes(attn_cache, attn_mask)
        unused = unused + getattr(self, self.refusal_name)(
            (runtime_chunk == step.chunk_size) & (runtime_cache >= step.left))
        rows = attn_cache[0, 0]  # [R, D]
        cached = rows.size(0)
        valid_rows = attn_mask[0, 0, :cached].to(torch.int64).sum()
        history_valid = torch.clamp(valid_rows * step.chunking.frame_rate, max=step.left)
        state = None
        if self.state_shape is not None:
            size = self.state_shape[0] * self.state_shape[2]
            state = conv_cache.flatten()[:size].reshape(self.state_shape)
        chunk = x[:, :step.stride] + unused
        right = x[:, step.stride:]
        out, _, state = step(chunk, torch.full((1,), step.stride, dtype=torch.int64),
                             rows[cached - step.left:][None], history_valid.reshape(1), state,
                             right, torch.full((1,), right.size(1), dtype=torch.int64))
        next_rows = torch.cat([rows, chunk[0]], dim=0)[chunk.size(1):]
        next_conv = conv_cache
        if state is not None:
            flat = state.flatten()
            next_conv = torch.cat([flat, conv_cache.flatten()[flat.numel():]]).reshape(
                conv_cache.shape)
        return self.head(out), next_rows[None, None], next_conv


def wenet_layout(step: CusideStep) -> dict[str, int]:
    """The `wenet_ctc` metadata of a CUSIDE step's state layout (`WenetLayoutStep`):
    one block of one head whose rows are feature frames, a convolution cache large enough
    for the GRU states, and the frames a chunk reads beyond its stride as right context."""
    dim = step.chunking.feature_dim
    if dim % 2:
        raise ExportError(f"{dim}-dim features do not fit sherpa-onnx's wenet_ctc cache rows "
                          "(2 x output_size)")
    simulation = step.chunking.simulation
    state = (len(simulation.rnns) * simulation.hidden
             if step.right_context == "simulated" else 0)
    rate = step.chunking.frame_rate
    lookahead = step.chunking.context_size_right if step.right_context == "real" else 0
    return {"head": 1, "num_blocks": 1, "output_size": dim // 2,
            "cnn_module_kernel": 1 + max(1, -(-state // (dim // 2))),
            "subsampling_factor": rate, "right_context": rate - 1 + lookahead}


class CusideChunks(ChunkEncoderBase):
    """What runs a CUSIDE step chunk by chunk as audio comes, a
    `cat.models.streaming.ChunkEncoder`, whatever runs the step (`CusideStreamingEncoder`:
    PyTorch; `OnnxCusideEncoder`: the export in onnxruntime): each
    call takes one chunk of `stride` feature frames followed by `lookahead` more (the real
    right context; none when simulated), hands the step the chunk and that context padded
    to full size with how many of their frames exist, keeps how many left-context frames
    exist, and returns the chunk's encoder frames; `finish(rest)` encodes what is left at
    the end (fewer than `stride + lookahead` frames), the last chunk's frames that exist.

    A subclass sets `stride`, `left`, `right`, `right_context`, `frame_rate` and gives
    `_step(chunk [1, stride, D], valid, right [1, right, D], right_valid, history_valid) ->
    output [1, stride / frame_rate, H]`, which carries the history and the simulation's
    state itself, and `_reset_state()`.
    """

    stride: int
    left: int
    right: int
    right_context: str
    frame_rate: int

    @property
    def lookahead(self) -> int:
        """Feature frames a chunk reads beyond its stride: the real right context's."""
        return self.right if self.right_context == "real" else 0

    def reset(self) -> None:
        """Start a new utterance."""
        self._reset_state()
        self.history_valid = 0

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        """`feats` [1, stride + lookahead, D] -> the chunk's encoder output [1, chunk, H]."""
        return self._encode(feats[:, :self.stride], feats[:, self.stride:])

    def finish(self, feats: torch.Tensor) -> torch.Tensor:
        """The rest of the utterance, `feats` [1, n, D] (n < stride + lookahead) -> its
        encoder output [1, ceil(n / frame_rate), H]."""
        outputs = [self._encode(feats[:, start:start + self.stride],
                                feats[:, start + self.stride:])
                   for start in range(0, feats.size(1), self.stride)]
        return torch.cat(outputs, dim=1) if outputs else feats.new_zeros(1, 0, 0)

    def _encode(self, chunk: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        frames = chunk.size(1)
        after = after[:, :self.right]
        out = self._step(nn.functional.pad(chunk, (0, 0, 0, self.stride - frames)), frames,
                         nn.functional.pad(after, (0, 0, 0, self.right - after.size(1))),
                         after.size(1), self.history_valid)
        self.history_valid = min(self.left, self.history_valid + self.stride)
        return out[:, :math.ceil(frames / self.frame_rate)]

    def _step(self, chunk: torch.Tensor, valid: int, right: torch.Tensor, right_valid: int,
              history_valid: int) -> torch.Tensor:
        raise NotImplementedError

    def _reset_state(self) -> None:
        raise NotImplementedError


class CusideStreamingEncoder(CusideChunks):
    """Chunk-by-chunk encoding of a CUSIDE model (eval mode) as audio comes (`CusideChunks`
    over `CusideStep`, the left context and the simulation network's state kept between
    calls). Over an utterance the outputs are those of `ContextChunking.encode_chunks` of
    the whole of it with the same chunk size and right context.
    """

    def __init__(self, encoder: nn.Module, chunking: ContextChunking, chunk_size: int,
                 right_context: str | None = None) -> None:
        self.step = CusideStep(encoder, chunking, chunk_size, right_context)
        self.right_context, self.stride = self.step.right_context, self.step.stride
        self.left, self.right = self.step.left, chunking.context_size_right
        self.frame_rate = chunking.frame_rate
        self.reset()

    def _reset_state(self) -> None:
        self.history, self.state = self.step.initial_state()

    def _step(self, chunk: torch.Tensor, valid: int, right: torch.Tensor, right_valid: int,
              history_valid: int) -> torch.Tensor:
        out, self.history, self.state = self.step(
            chunk, torch.tensor([valid]), self.history, torch.tensor([history_valid]),
            self.state, right, torch.tensor([right_valid]))
        return out


class OnnxCusideEncoder(CusideChunks):
    """A CUSIDE export's `streaming.onnx` in onnxruntime as a chunk encoder (`CusideChunks`
    over the export's step), what `CusideStreamingEncoder` is in PyTorch."""

    def __init__(self, export_dir: PathLike, num_threads: int = 1) -> None:
        meta = load_export_metadata(export_dir)
        self.session = onnx_session(Path(export_dir) / STREAMING_NAME, num_threads)
        self.stride, self.left = int(meta["stride"]), int(meta["left_frames"])
        self.right_context, self.right = meta["right_context"], int(meta["right_frames"])
        self.frame_rate, self.dim = int(meta["subsampling_factor"]), int(meta["feature_dim"])
        self.state_shape = (int(meta["simu_layers"]), 1, int(meta["simu_hdim"]))
        self.reset()

    def _reset_state(self) -> None:
        """A new utterance (the session is kept)."""
        self.history = np.zeros((1, self.left, self.dim), np.float32)
        self.state = np.zeros(self.state_shape, np.float32)

    def _step(self, chunk: torch.Tensor, valid: int, right: torch.Tensor, right_valid: int,
              history_valid: int) -> torch.Tensor:
        inputs = {"x": chunk.numpy(), "valid": np.array([valid]), "history": self.history,
                  "history_valid": np.array([history_valid])}
        if self.right_context == "simulated":
            inputs["simu_state"] = self.state
        elif self.right_context == "real":
            inputs["right"], inputs["right_valid"] = right.numpy(), np.array([right_valid])
        outputs = self.session.run(None, inputs)
        self.history = outputs[1]
        if self.right_context == "simulated":
            self.state = outputs[2]
        return torch.from_numpy(outputs[0])


class CusideStreaming:
    """CUSIDE's streaming strategy (`cat.models.streaming.StreamingStrategy`): the model's
    chunks encoded in windows of context (`ContextChunking`), with a right context of
    `RIGHT_CONTEXTS` (None: the model's default)."""

    name = "cuside"
    right_contexts = RIGHT_CONTEXTS

    def __init__(self, encoder: nn.Module, chunking: ContextChunking) -> None:
        self.encoder, self.chunking = encoder, chunking

    def chunk_encoder(self, chunk_size: int, right_context: str | None = None
                      ) -> CusideStreamingEncoder:
        return CusideStreamingEncoder(self.encoder, self.chunking, chunk_size, right_context)

    def step(self, chunk_size: int, right_context: str | None = None) -> CusideStep:
        return CusideStep(self.encoder, self.chunking, chunk_size, right_context)

    @staticmethod
    def onnx_chunk_encoder(export_dir: PathLike, num_threads: int = 1) -> OnnxCusideEncoder:
        return OnnxCusideEncoder(export_dir, num_threads)

    @staticmethod
    def wenet_runtime_problem(meta: Mapping[str, Any], num_left_chunks: int,
                              runtime_key: str) -> str | None:
        """What is wrong with running an export's `wenet_ctc` layout with `num_left_chunks`
        (None: nothing): too few chunks to hold the model's left context."""
        needed = -(-int(meta["left_frames"]) // int(meta["chunk_size"]))
        if num_left_chunks < needed:
            return (f"the CUSIDE model keeps {meta['left_frames']} frames of left context in "
                    f"the runtime's cache: num_left_chunks must be at least {needed}")
        return None
