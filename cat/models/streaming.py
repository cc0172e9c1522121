"""The encoder's streaming strategies: how a model's encoder runs chunk by chunk, what its
`streaming.onnx` traces, and how onnxruntime runs that file. Decoding (`cat.decoding.
online`), serving and export ask the model for its strategy (`AsrModel.streaming`) and
never name one.

A strategy (`StreamingStrategy`) gives
  * `chunk_encoder(chunk_size, right_context)`: the PyTorch `ChunkEncoder` with its state,
    what `cat.decoding.online.StreamingRecognizer` and the server feed with features;
  * `step(chunk_size, right_context)`: the `StreamingStep`, one chunk with state in and
    state out, whose `metadata()` `export.json` records and whose `onnx_graph` (inputs,
    outputs, example) `streaming.onnx` traces;
  * `onnx_chunk_encoder(export_dir)`: the `ChunkEncoder` of an export's `streaming.onnx`
    in onnxruntime;
  * `right_contexts`: the right contexts it streams with (none: the chunk alone);
  * the state layouts of sherpa-onnx's online models, which the families' export writers
    wrap with their heads: one packed state (`StreamingStep.packed_state`, the `lstm`
    transducer type, `cat.rnnt.export`) and WeNet's caches (`wenet_runtime`,
    `wenet_graph`, the `wenet_ctc` type, `cat.ctc.export`).

The strategies are named in `STRATEGIES` by the name `export.json` holds under
`streaming`: U2's chunk-masked encoder with caches (`u2`, `cat.models.chunked`, a
`ConformerNet`'s own, `Encoder.streaming_strategy`, trained with `max_chunk_size`) and
CUSIDE's windows of context (`cuside`, `cat.models.cuside_streaming`, a model trained with
`trainer.chunk_size`, whatever its encoder). A strategy is built over the encoder (CUSIDE's
also over the model's `ContextChunking`); a new one is a class in its own module and a
line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

#: export.json's key naming the streaming strategy of `streaming.onnx`.
STREAMING_KEY = "streaming"
#: Strategy name -> (module, class).
STRATEGIES: Mapping[str, tuple[str, str]] = {
    "u2": ("cat.models.chunked", "U2Streaming"),
    "cuside": ("cat.models.cuside_streaming", "CusideStreaming"),
}
#: The strategy of an export that names none (written before exports named theirs).
UNNAMED_EXPORT_STRATEGY = "u2"


class StreamingError(ValueError):
    """Audio or options a streaming recognizer cannot take; the message says why."""


class ChunkEncoder(Protocol):
    """An encoder of chunks as they come, with its state: each call takes `stride` feature
    frames of a chunk and the `lookahead` frames after it (the next chunk's first ones) and
    returns the chunk's encoder output [1, T', D]; `finish` takes the rest of the
    utterance (fewer frames) at its end. `right_context` is the one it streams with (None:
    a strategy without). `encode_batch` encodes one chunk of each of several encoders of
    its class at once, each output the one it would give alone."""

    stride: int
    lookahead: int
    right_context: str | None

    def __call__(self, feats: torch.Tensor) -> torch.Tensor: ...

    def finish(self, feats: torch.Tensor) -> torch.Tensor: ...

    @classmethod
    def encode_batch(cls, encoders: Sequence[Any], feats: torch.Tensor
                     ) -> list[torch.Tensor]: ...


class ChunkEncoderBase:
    """What chunk encoders share: `encode_batch` one encoder at a time (a strategy whose
    chunks batch overrides it)."""

    right_context: str | None = None

    @classmethod
    def encode_batch(cls, encoders: Sequence[Any], feats: torch.Tensor
                     ) -> list[torch.Tensor]:
        """`feats` [B, T, F]: one chunk of each of `encoders` -> their outputs [T', D]."""
        return [encoder(chunk[None])[0] for encoder, chunk in zip(encoders, feats,
                                                                    strict=True)]


@dataclasses.dataclass(frozen=True)
class OnnxGraph:
    """What `streaming.onnx` traces: `module` on `example`, its input and output names and
    dynamic axes (`cat.models.onnx_export.export_onnx`'s arguments)."""

    module: torch.nn.Module
    example: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: Mapping[str, Mapping[int, str]]


@dataclasses.dataclass(frozen=True)
class PackedStateStep:
    """A strategy's chunk with all its state in tensors of fixed `shapes`, for runtimes that
    hand one state back unread (sherpa-onnx's online `lstm` transducer layout,
    `cat.rnnt.export`): `run(x, state)` takes the `frames` feature frames a chunk reads
    (its `stride`, then what it reads beyond) and the state's tensors (zeros at the start)
    and gives the chunk's encoder output and the next state. `module` is what `run` calls,
    which the traced graph holds."""

    module: torch.nn.Module
    shapes: list[tuple[int, ...]]
    frames: int
    stride: int
    run: Callable[[torch.Tensor, list[torch.Tensor]],
                  tuple[torch.Tensor, list[torch.Tensor]]]


class StreamingStep(Protocol):
    """One chunk of a strategy's streaming, state in and state out (an `nn.Module`)."""

    chunk_size: int
    stride: int
    right_context: str | None

    def metadata(self) -> dict[str, Any]:
        """What a runtime needs to cut features into chunks for `streaming.onnx` (the
        strategy's name under `STREAMING_KEY` first)."""

    def onnx_graph(self, head: torch.nn.Module, output_name: str,
                   feature_dim: int) -> OnnxGraph:
        """The step with `head` on its output (named `output_name`) as ONNX traces it."""

    def packed_state(self, left_chunks: int) -> PackedStateStep:
        """The step with its state of fixed shapes; `left_chunks`: the chunks of left
        context to keep where the model was trained with all of it."""

    def wenet_runtime(self, left_chunks: int) -> dict[str, Any]:
        """The settings (`chunk_size`, `num_left_chunks`, `num_left_chunks_is`: exact or
        minimum) a runtime of sherpa-onnx's online `wenet_ctc` layout (WeNet's
        `forward_chunk`) must use; `left_chunks` as `packed_state`'s."""

    def wenet_graph(self, head: torch.nn.Module, output_name: str, settings: dict[str, Any],
                    feature_dim: int) -> tuple[OnnxGraph, dict[str, int]]:
        """The step with `head` in the `wenet_ctc` layout for a runtime of `settings`
        (`cat.models.onnx_export.WENET_INPUTS`; one that runs with others is refused), and
        the layout's metadata the runtime reads (`head`, `num_blocks`, `output_size`,
        `cnn_module_kernel`, `subsampling_factor`, `right_context`)."""


class StreamingStrategy(Protocol):
    """How a model's encoder streams (see the module docstring)."""

    name: ClassVar[str]
    right_contexts: ClassVar[tuple[str, ...]]

    def chunk_encoder(self, chunk_size: int, right_context: str | None = None
                      ) -> ChunkEncoder: ...

    def step(self, chunk_size: int, right_context: str | None = None) -> StreamingStep: ...

    @staticmethod
    def onnx_chunk_encoder(export_dir: Any, num_threads: int = 1) -> ChunkEncoder: ...

    @staticmethod
    def wenet_runtime_problem(meta: Mapping[str, Any], num_left_chunks: int,
                              runtime_key: str) -> str | None:
        """What is wrong with running the `wenet_ctc` layout of an export (`export.json`,
        `meta`; its runtime settings under `runtime_key`) with `num_left_chunks` (None:
        nothing)."""


def strategy_class(name: str) -> type[StreamingStrategy]:
    """The strategy named `name` (`STRATEGIES`); ValueError for another name."""
    if name not in STRATEGIES:
        raise ValueError(f"streaming strategy {name!r}: not one of {', '.join(STRATEGIES)}")
    module, attribute = STRATEGIES[name]
    return getattr(importlib.import_module(module), attribute)


def export_strategy(meta: Mapping[str, Any]) -> type[StreamingStrategy]:
    """The strategy of an export's `streaming.onnx` (its `export.json`, `meta`)."""
    return strategy_class(meta.get(STREAMING_KEY, UNNAMED_EXPORT_STRATEGY))


def right_context_choices() -> tuple[str, ...]:
    """Every right context some strategy streams with, in `STRATEGIES` order."""
    choices: list[str] = []
    for name in STRATEGIES:
        choices += [c for c in strategy_class(name).right_contexts if c not in choices]
    return tuple(choices)
