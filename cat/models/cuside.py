"""CUSIDE: chunks with simulated future context, CAT's streaming method (An et al.,
"CUSIDE: Chunking, Simulating Future Context and Decoding for Streaming ASR", 2022).

A CUSIDE model keeps a full-context encoder (no causal convolution, no attention mask) and
runs it on context-sensitive chunks: the features are cut into chunks of `chunk_size`
frames, and each chunk is encoded on its own, in a window of the `context_size_left`
frames before it, the chunk, and `context_size_right` frames after it; the window's output
frames that start inside the chunk are the chunk's encoder output. The right context is

* `real`: the frames that follow (a chunk waits for them: their duration is latency);
* `none`: nothing;
* `simulated`: predicted from the past by the simulation network (`SimulationNet`: stacked
  unidirectional GRUs over the normalised features, a linear layer from each chunk's last
  hidden state to the `context_size_right` frames after it), which costs no waiting.

Unified training (`ContextChunking.training_pass`, from `AsrModel.forward`): every batch
trains the heads on the full-context forward and on the chunked forward (the same weights),
plus `simu_loss_weight` x the L1 distance between the simulated and the real right context
(normalised features). The chunked forward of a batch draws one chunk size from
`chunk_size` +- `jitter_range` encoder frames (the left context grows with it by
`context_size_left // chunk_size` times the change) and one right context: simulated, none
or real with probabilities 1/2, 1/4, 1/4 (without `simu`: none or real, 1/2 each), as CAT's
`train_unified` does. Outside training the chunked forward uses the trained chunk size and
the simulated context (real without `simu`).

Frames that do not exist (before the start and after the end of an utterance) are the pad
frame: the global CMVN's mean when the encoder holds one (0 once normalised), else zeros.
Training, chunked decoding (`encode_chunks`) and streaming (`CusideStreamingEncoder`) fill
them the same way, so they see the same windows. The chunked forward gives
`ceil(T / frame_rate)` output frames for `T` feature frames: each output frame whose first
feature frame lies in the utterance (the full-context forward may give a frame less).

Chunk sizes on the command line (`--chunk-size`) are encoder output frames, as for U2
models; the config's are CAT's, feature frames (`chunk_size` 40 at 4x subsampling is
10 encoder frames).

As the encoder's streaming strategy (`CusideStreaming`, `cat.models.streaming`): the
PyTorch chunk encoder is `CusideStreamingEncoder`, the step `streaming.onnx` traces
`CusideStep` (its inputs by right context `CUSIDE_INPUTS`), and onnxruntime runs it as
`OnnxCusideEncoder`; both chunk encoders are `CusideChunks` over their step.

Usage:
    chunking = ContextChunking(80, frame_rate=8, chunk_size=96, context_size_left=64,
                               context_size_right=32, jitter_range=4, simu=True)
    hidden, lengths, simu_losses = chunking.training_pass(encoder, augmented, feats, lens)
    chunking.set_decode(chunk_size=12)              # 12 encoder frames: 96 feature frames
    hidden, lengths, _ = chunking.encode_chunks(encoder, feats, lens)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cat.core.config import cuside_keys
from cat.core.io import PathLike
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

RIGHT_CONTEXTS = ("simulated", "real", "none")
#: The inputs of a CUSIDE `streaming.onnx` besides the chunk, by right context.
CUSIDE_INPUTS = {"simulated": ("simu_state",), "real": ("right", "right_valid"), "none": ()}


class SimulationNet(nn.Module):
    """CAT's simulation network (`simu_net.py`): `num_layers` unidirectional GRUs of `hidden`
    units (dropout between them, a residual connection where sizes match), then a linear
    layer from a hidden state to the `frames` feature frames that follow it."""

    def __init__(self, feature_dim: int, frames: int, hidden: int, num_layers: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        if frames < 1 or hidden < 1 or num_layers < 1:
            raise ValueError(f"the simulation network needs frames ({frames}), hidden units "
                             f"({hidden}) and layers ({num_layers}) >= 1")
        sizes = [feature_dim] + [hidden] * num_layers
        self.rnns = nn.ModuleList(nn.GRU(inputs, outputs, batch_first=True)
                                  for inputs, outputs in itertools.pairwise(sizes))
        self.dropout = nn.Dropout(dropout)
        self.postnet = nn.Linear(hidden, frames * feature_dim)
        self.frames, self.feature_dim, self.hidden = frames, feature_dim, hidden

    def initial_state(self, batch_size: int = 1) -> torch.Tensor:
        """Zero GRU states [layers, B, hidden]."""
        return torch.zeros(len(self.rnns), batch_size, self.hidden)

    def forward(self, feats: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`feats` [B, T, D] (normalised) from `state` [layers, B, H] (None: zeros) ->
        (last layer's hidden states [B, T, H], the state after the last frame)."""
        x, states = feats, []
        for index, rnn in enumerate(self.rnns):
            y, last = rnn(x, None if state is None else state[index:index + 1].contiguous())
            if index + 1 < len(self.rnns):
                y = self.dropout(y)
            if y.size(-1) == x.size(-1):
                y = y + x
            x = y
            states.append(last)
        return x, torch.cat(states)

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] -> the frames after each [..., frames, D]."""
        return self.postnet(hidden).unflatten(-1, (self.frames, self.feature_dim))


#: The defaults of the chunking settings: the config.json schema's (`x-cuside`).
_DEFAULTS = cuside_keys("chunking")


class ContextChunking(nn.Module):
    """The chunked forward of a CUSIDE model and its settings (see the module docstring).

    Args:
        feature_dim: input feature dimension (CAT's `mel_dim`).
        frame_rate: the encoder's frame-rate reduction (CAT's `downsampling_ratio`).
        chunk_size, context_size_left, context_size_right: feature frames; the chunk and the
            left context multiples of `frame_rate`.
        jitter_range: training chunk sizes vary by up to this many encoder frames.
        simu: train a simulation network and decode with simulated right context.
        simu_loss_weight: weight of the simulation's L1 loss.
        simu_hdim, simu_layers: the simulation network's GRUs (CAT: 256 units, 3 layers).

    The defaults are those of the config.json schema (`cuside_keys`), as `build_chunking`
    gives them for a key `trainer` does not set.
    """

    def __init__(self, feature_dim: int, frame_rate: int, chunk_size: int,
                 context_size_left: int = _DEFAULTS["context_size_left"],
                 context_size_right: int = _DEFAULTS["context_size_right"],
                 jitter_range: int = _DEFAULTS["jitter_range"],
                 simu: bool = _DEFAULTS["simu"],
                 simu_loss_weight: float = _DEFAULTS["simu_loss_weight"],
                 simu_hdim: int = _DEFAULTS["simu_hdim"],
                 simu_layers: int = _DEFAULTS["simu_layers"]) -> None:
        super().__init__()
        if chunk_size < frame_rate or chunk_size % frame_rate or context_size_left % frame_rate:
            raise ValueError(f"chunk_size ({chunk_size}) and context_size_left "
                             f"({context_size_left}) must be multiples of the encoder's frame "
                             f"rate reduction ({frame_rate}), the chunk at least one")
        if context_size_left < 0 or context_size_right < 0 or jitter_range < 0:
            raise ValueError("context_size_left, context_size_right and jitter_range must be "
                             ">= 0")
        if jitter_range >= chunk_size // frame_rate:
            raise ValueError(f"jitter_range ({jitter_range} encoder frames) must be below the "
                             f"chunk's {chunk_size // frame_rate} encoder frames")
        if simu and not context_size_right:
            raise ValueError("simu needs context_size_right > 0 (the frames it simulates)")
        if simu_loss_weight < 0:
            raise ValueError(f"simu_loss_weight must be >= 0, got {simu_loss_weight}")
        self.feature_dim, self.frame_rate = feature_dim, frame_rate
        self.chunk_size, self.jitter_range = chunk_size, jitter_range
        self.context_size_left, self.context_size_right = context_size_left, context_size_right
        self.simu_loss_weight = simu_loss_weight
        self.simulation = (SimulationNet(feature_dim, context_size_right, simu_hdim, simu_layers)
                           if simu else None)
        self.decode_chunk_size = 0
        self.right_context = self.default_right_context
        self._tails: dict[tuple[int, int], int] = {}

    @property
    def default_right_context(self) -> str:
        """What decoding uses unless told: simulated with a simulation network, else real."""
        return "simulated" if self.simulation is not None else "real" \
            if self.context_size_right else "none"

    @property
    def chunk_sizes(self) -> range:
        """The chunk sizes trained, in encoder output frames."""
        middle = self.chunk_size // self.frame_rate
        return range(middle - self.jitter_range, middle + self.jitter_range + 1)

    def left_frames(self, chunk_frames: int) -> int:
        """Left context (feature frames) of chunks of `chunk_frames` feature frames."""
        return self.context_size_left + (chunk_frames - self.chunk_size) * (
            self.context_size_left // self.chunk_size)

    def check_chunk_size(self, chunk_size: int) -> None:
        """ValueError unless chunks of `chunk_size` encoder frames were trained (0: full
        context)."""
        sizes = self.chunk_sizes
        if chunk_size and chunk_size not in sizes:
            raise ValueError(f"chunk size {chunk_size}: this CUSIDE model was trained on chunks "
                             f"of {sizes.start} to {sizes.stop - 1} encoder frames "
                             f"(trainer.chunk_size {self.chunk_size} feature frames, "
                             f"jitter_range {self.jitter_range})")

    def check_right_context(self, right_context: str) -> None:
        """ValueError for a right context the model cannot decode with."""
        if right_context not in RIGHT_CONTEXTS:
            raise ValueError(f"right context must be one of {', '.join(RIGHT_CONTEXTS)}, got "
                             f"{right_context!r}")
        if right_context == "simulated" and self.simulation is None:
            raise ValueError("right context 'simulated': this CUSIDE model has no simulation "
                             "network (trainer.simu false)")

    def set_decode(self, chunk_size: int, right_context: str | None = None) -> None:
        """Decode in chunks of `chunk_size` encoder frames (0: full context) with
        `right_context` (None: `default_right_context`)."""
        self.check_chunk_size(chunk_size)
        right_context = right_context or self.default_right_context
        self.check_right_context(right_context)
        self.decode_chunk_size, self.right_context = chunk_size, right_context

    def pad_frame(self, encoder: nn.Module, like: torch.Tensor) -> torch.Tensor:
        """The frame [D] that stands for frames that do not exist."""
        normalizer = encoder.normalizer
        if normalizer is None:
            return like.new_zeros(like.size(-1))
        return normalizer.mean.to(like.dtype)

    def normalize(self, encoder: nn.Module, feats: torch.Tensor) -> torch.Tensor:
        return feats if encoder.normalizer is None else encoder.normalizer(feats)

    def denormalize(self, encoder: nn.Module, feats: torch.Tensor) -> torch.Tensor:
        normalizer = encoder.normalizer
        return feats if normalizer is None else feats / normalizer.inv_std + normalizer.mean

    def tail_frames(self, encoder: nn.Module, width: int, covered: int) -> int:
        """Pad frames a window of `width` frames needs at its end for the encoder to give
        an output frame at each of the first `covered // frame_rate` positions."""
        if (width, covered) not in self._tails:  # a few sizes per model, asked every batch
            wanted = covered // self.frame_rate
            extra = next((extra for extra in range(4 * self.frame_rate + 8)
                          if int(encoder.output_lengths(torch.tensor([width + extra]))[0])
                          >= wanted), None)
            if extra is None:
                raise ValueError(f"windows of {width} frames: the encoder gives too few "
                                 "output frames")
            self._tails[width, covered] = extra
        return self._tails[width, covered]

    def simulate(self, encoder: nn.Module, feats: torch.Tensor, chunk: int) -> torch.Tensor:
        """Normalised right context [B, N, R, D] predicted at the end of each chunk of
        `feats` [B, N x chunk, D] (raw features, pad frames filled in)."""
        hidden, _ = self.simulation(self.normalize(encoder, feats))
        return self.simulation.predict(hidden[:, chunk - 1::chunk])

    def encode_chunks(self, encoder: nn.Module, feats: torch.Tensor, feat_lens: torch.Tensor,
                      chunk: int | None = None, right_context: str | None = None,
                      clean: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The chunked forward of `feats` [B, T, D] (lengths `feat_lens`) in chunks of `chunk`
        feature frames (default: the decoding chunk size, else the trained one) with
        `right_context` (default: decoding's) -> (hidden [B, T', H], lengths [B]
        = ceil(T / frame_rate), per-utterance L1 simulation losses [B] in training mode with
        a simulation network, else None). The simulation reads `clean` (the features
        before SpecAugment; default `feats`)."""
        rate = self.frame_rate
        if chunk is None:
            chunk = (self.decode_chunk_size or self.chunk_size // rate) * rate
        right_context = right_context or self.right_context
        left, right = self.left_frames(chunk), self.context_size_right
        batch, frames, dim = feats.shape
        feat_lens = feat_lens.to(feats.device)
        num_chunks = max(1, math.ceil(frames / chunk))
        total = num_chunks * chunk
        pad = self.pad_frame(encoder, feats)
        exists = (torch.arange(total, device=feats.device)[None, :] < feat_lens[:, None])

        def padded(x: torch.Tensor) -> torch.Tensor:
            x = nn.functional.pad(x, (0, 0, 0, total - frames))
            return torch.where(exists[..., None], x, pad)

        def windows_of(x: torch.Tensor) -> torch.Tensor:  # [B, N, left + chunk + right, D]
            extended = torch.cat([pad.expand(batch, left, dim), x, pad.expand(batch, right, dim)],
                                 dim=1)
            return extended.unfold(1, left + chunk + right, chunk).transpose(2, 3)

        windows = windows_of(padded(feats))
        simulate = self.simulation is not None and (self.training or right_context == "simulated")
        losses = None
        if simulate:
            source = padded(feats if clean is None else clean)
            predicted = self.simulate(encoder, source, chunk)
            if self.training:
                target = self.normalize(encoder, windows_of(source)[:, :, left + chunk:])
                losses = self._simulation_losses(predicted, target.detach(), feat_lens, chunk)
        if right_context == "simulated":
            windows = torch.cat([windows[:, :, :left + chunk],
                                 self.denormalize(encoder, predicted)], dim=2)
        elif right_context == "none":
            windows = windows[:, :, :left + chunk]
        tail = self.tail_frames(encoder, windows.size(2), left + chunk)
        if tail:
            windows = torch.cat([windows, pad.expand(batch, num_chunks, tail, dim)], dim=2)
        used = torch.arange(num_chunks, device=feats.device)[None, :] * chunk < feat_lens[:, None]
        selected = windows[used]
        out, _ = encoder(selected, torch.full((selected.size(0),), selected.size(1),
                                              dtype=torch.long, device=feats.device))
        out = out[:, left // rate:(left + chunk) // rate]
        hidden = out.new_zeros(batch, num_chunks, chunk // rate, out.size(-1))
        hidden[used] = out
        lengths = torch.div(feat_lens + rate - 1, rate, rounding_mode="floor")
        hidden = hidden.flatten(1, 2)[:, :int(lengths.max()) if batch else 0]
        valid = torch.arange(hidden.size(1), device=feats.device)[None, :] < lengths[:, None]
        return hidden.masked_fill(~valid[..., None], 0.0), lengths, losses

    def _simulation_losses(self, predicted: torch.Tensor, target: torch.Tensor,
                           feat_lens: torch.Tensor, chunk: int) -> torch.Tensor:
        """Per utterance, the mean L1 distance over the chunks that start inside it."""
        per_chunk = (predicted - target).abs().mean(dim=(2, 3))  # [B, N]
        starts = torch.arange(per_chunk.size(1), device=per_chunk.device)[None, :] * chunk
        used = (starts < feat_lens[:, None]).to(per_chunk.dtype)
        return (per_chunk * used).sum(dim=1) / used.sum(dim=1).clamp(min=1.0)

    def training_pass(self, encoder: nn.Module, feats: torch.Tensor, clean: torch.Tensor,
                      feat_lens: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The chunked forward of a batch: in training mode with a drawn chunk size and
        right context (see the module docstring), else the trained chunk size and the
        default right context; returns `encode_chunks`' triple, the simulation losses times
        `simu_loss_weight`."""
        chunk = self.chunk_size
        right_context = self.default_right_context
        if self.training:
            chunk = self._draw_chunk()
            right_context = self._draw_right_context()
        hidden, lengths, losses = self.encode_chunks(encoder, feats, feat_lens, chunk,
                                                     right_context, clean)
        if losses is not None:
            losses = self.simu_loss_weight * losses
        return hidden, lengths, losses

    # The draws use torch's generator, which training seeds (`train.option.seed`, per rank),
    # as U2's chunk sizes do.
    def _draw_chunk(self) -> int:
        """A training chunk size in feature frames: `chunk_size` jittered."""
        jitter = int(torch.randint(-self.jitter_range, self.jitter_range + 1, ()))
        return self.chunk_size + self.frame_rate * jitter

    def _draw_right_context(self) -> str:
        if not self.context_size_right:
            return "none"
        draw = float(torch.rand(()))
        if self.simulation is None:
            return "none" if draw < 0.5 else "real"
        return "simulated" if draw < 0.5 else "none" if draw < 0.75 else "real"


def build_chunking(trainer: dict[str, Any], encoder: nn.Module,
                   feature_dim: int) -> ContextChunking | None:
    """The `ContextChunking` of `config.json`'s `trainer` keys (None without `chunk_size`);
    ValueError naming the key for settings that do not fit the encoder."""
    if "chunk_size" not in trainer:
        return None
    if encoder.max_chunk_size:
        raise ValueError("trainer.chunk_size (CUSIDE) and encoder.kwargs.max_chunk_size (U2 "
                         "chunk training) exclude each other: CUSIDE encodes chunks with a "
                         "full-context encoder")
    rate = encoder.frame_rate_factor
    if trainer.get("downsampling_ratio", rate) != rate:
        raise ValueError(f"trainer.downsampling_ratio {trainer['downsampling_ratio']}: the "
                         f"encoder reduces the frame rate {rate}x")
    if trainer.get("mel_dim", feature_dim) != feature_dim:
        raise ValueError(f"trainer.mel_dim {trainer['mel_dim']}: the encoder takes "
                         f"{feature_dim}-dim features")
    # The settings and their defaults are the schema's (`x-cuside`: 'chunking').
    settings = {key: trainer.get(key, default) for key, default in cuside_keys("chunking").items()}
    try:
        return ContextChunking(feature_dim, rate, **settings)
    except ValueError as error:
        raise ValueError(f"trainer (CUSIDE): {error}") from None


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
