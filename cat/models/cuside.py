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
Training, chunked decoding (`encode_chunks`) and streaming (`cat.models.cuside_streaming`) fill
them the same way, so they see the same windows. The chunked forward gives
`ceil(T / frame_rate)` output frames for `T` feature frames: each output frame whose first
feature frame lies in the utterance (the full-context forward may give a frame less).

Chunk sizes on the command line (`--chunk-size`) are encoder output frames, as for U2
models; the config's are CAT's, feature frames (`chunk_size` 40 at 4x subsampling is
10 encoder frames).

Streaming, chunk by chunk as audio comes, is the encoder's streaming strategy
`cat.models.cuside_streaming.CusideStreaming` (`cat.models.streaming`).

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
from typing import Any

import torch
from torch import nn

from cat.core.config import cuside_keys

RIGHT_CONTEXTS = ("simulated", "real", "none")


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
