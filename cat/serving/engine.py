"""What the server asks of a model: an `Engine`, which decodes the audio of many streams
(one a connection), a batch of them per model call.

The server's decoding thread alone calls an engine (no locking inside): for each stream it
`accept`s the audio that came, then `step`s the streams that are `ready` (a chunk, or a
segment, of audio waits) in batches of at most `max_batch`, one chunk each per call, so a
stream that sends faster than real time gets no more than the others; at the end of a
stream's audio, once it is no longer ready, `finish` gives its last results. A stream's
state is the engine's `open`'s return value; dropping it frees it.

Three engines:

* `cat.serving.streaming.StreamingEngine`: an experiment's chunk-trained model in PyTorch
  (`python -m cat.stream`'s chunks; U2 streams batched into one encoder call per chunk);
* `cat.serving.offline.OfflineEngine`: a full-context model, segment by segment;
* `cat.serving.sherpa.SherpaEngine`: an export folder in sherpa-onnx's `OnlineRecognizer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from cat.serving.protocol import Result, Start, TimedToken


class Engine(Protocol):
    """A model serving streams (see the module docstring)."""

    #: The audio the model takes, in Hz.
    sample_rate: int
    #: Whether partial results come as the audio does (else a segment at a time).
    streaming: bool
    #: The audio a step decodes per stream (a chunk, or the longest segment), in seconds.
    chunk_seconds: float
    #: The most streams one model call takes.
    max_batch: int

    def open(self, start: Start) -> Any:
        """A new stream's state; ValueError (the message for the client) for a start this
        model cannot serve (hotwords it cannot use)."""

    def accept(self, state: Any, samples: np.ndarray) -> None:
        """Audio of the stream, float32 at `sample_rate`."""

    def ready(self, state: Any) -> bool:
        """Whether a chunk or a segment of the stream waits for a step."""

    def backlog(self, state: Any) -> int:
        """Samples accepted and not yet decoded."""

    def step(self, states: Sequence[Any]) -> list[list[Result]]:
        """Decode one chunk (or segment) of each of these ready streams, in one model call
        where the model allows it; the results of each."""

    def finish(self, state: Any) -> list[Result]:
        """The stream's audio has ended: decode the rest; its last results."""


def offset_tokens(tokens: Sequence[Any], offset: float) -> tuple[TimedToken, ...]:
    """`cat.decoding.timestamps.TimedUnit`s of a segment as `TimedToken`s of the connection:
    their times moved by `offset` seconds (the segment's start)."""
    return tuple(TimedToken(unit.text, round(unit.start + offset, 3),
                            round(unit.end + offset, 3)) for unit in tokens)
