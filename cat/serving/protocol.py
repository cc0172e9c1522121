"""The server's WebSocket protocol: what a client sends, what it gets back, and the close
codes of what it may not send.

A client opens `ws://HOST:PORT/` and sends, in order:

1. a text message, the start: a JSON object `{"sample_rate": 16000, "format": "float32",
   "hotwords": ["phrase", "other phrase :2.0"], "hotwords_score": 1.5}`: the rate of its
   audio (the model's, 16 kHz: another is refused, close code 4001, as `python -m
   cat.stream` refuses it), the samples' encoding (`float32` in [-1, 1) or `int16`, little
   endian; default `float32`), and optionally hotwords (sherpa-onnx's lines: a phrase, an
   optional ` :score` per token) with their default score;
2. binary messages of samples, of any length (at most the server's `max_message_bytes`:
   a larger one is closed with 1009, by the `websockets` library);
3. optionally a text message `{"type": "end"}`: the audio is over; the server sends the
   last results and closes with 1000.

The server answers the start with `{"type": "ready", "sample_rate": ..., "streaming":
true|false, "chunk_seconds": ...}`, then sends results, each a JSON object:

    {"type": "partial" | "final", "final": false | true, "segment": 0,
     "start": 0.0, "text": "...", "tokens": [{"text": "你", "start": 0.32, "end": 0.48}, ...],
     "decoded": 0.52}

`segment` numbers the utterances of the connection (an endpoint ends one: a pause, or the
longest utterance); `start` and token times are seconds from the connection's first sample,
and `decoded` how much of the audio (seconds from the first sample) the result decodes, so
that a client can tell how long after its audio a result came. Partials of a segment are
followed by its final; a segment without a token has none.

Close codes (`CloseCode`) name what went wrong in their reason.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Sample encodings of the binary messages: numpy dtype and bytes per sample.
SAMPLE_FORMATS = {"float32": np.dtype("<f4"), "int16": np.dtype("<i2")}
#: The text message that ends a connection's audio.
END_MESSAGE = {"type": "end"}
START_KEYS = ("type", "sample_rate", "format", "hotwords", "hotwords_score")
#: A close reason is at most 123 bytes (RFC 6455, 5.5: a control frame's 125 less the code).
MAX_REASON_BYTES = 123


class CloseCode(enum.IntEnum):
    """The codes the server closes a connection with."""

    DONE = 1000              # the audio ended and its results were sent
    GOING_AWAY = 1001        # the server is stopping
    UNSUPPORTED_DATA = 1003  # text where audio is expected, or audio before the start
    BAD_MESSAGE = 1007       # a start that is no JSON object, bad keys or values, or samples cut
    POLICY = 1008            # the connection's audio limit, or no start in time
    TOO_BIG = 1009           # a message over max_message_bytes (the library closes it)
    INTERNAL_ERROR = 1011    # the server failed on this connection's audio
    TRY_AGAIN_LATER = 1013   # the server holds its maximum of connections
    WRONG_SAMPLE_RATE = 4001  # audio at another rate than the model's
    NOT_READING = 4002       # the client does not read its results


class ProtocolError(Exception):
    """A message the protocol does not allow: the connection closes with `code` and
    `reason`."""

    def __init__(self, code: CloseCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = truncate_reason(reason)


def truncate_reason(reason: str) -> str:
    """`reason` cut to what a close frame holds (UTF-8, 123 bytes)."""
    data = reason.encode("utf-8")
    if len(data) <= MAX_REASON_BYTES:
        return reason
    return data[:MAX_REASON_BYTES - 3].decode("utf-8", errors="ignore") + "..."


@dataclasses.dataclass(frozen=True)
class Start:
    """A connection's start message."""

    sample_rate: int
    format: str = "float32"
    hotwords: tuple[str, ...] = ()
    hotwords_score: float = 1.5

    @property
    def dtype(self) -> np.dtype:
        return SAMPLE_FORMATS[self.format]


def parse_start(message: str | bytes, sample_rate: int) -> Start:
    """The start message of a connection whose model takes `sample_rate` Hz audio;
    ProtocolError naming what is wrong with it."""
    if isinstance(message, bytes):
        raise ProtocolError(CloseCode.UNSUPPORTED_DATA,
                            "audio before the start message: send a JSON start first")
    try:
        fields = json.loads(message)
    except json.JSONDecodeError as error:
        raise ProtocolError(CloseCode.BAD_MESSAGE,
                            f"the start message is not JSON ({error.msg})") from None
    if not isinstance(fields, dict):
        raise ProtocolError(CloseCode.BAD_MESSAGE, "the start message must be a JSON object")
    unknown = sorted(set(fields) - set(START_KEYS))
    if unknown:
        raise ProtocolError(CloseCode.BAD_MESSAGE, f"unknown start key {unknown[0]!r}; "
                            f"the keys are {', '.join(START_KEYS)}")
    if fields.get("type", "start") != "start":
        raise ProtocolError(CloseCode.BAD_MESSAGE, "the first message must be the start")
    rate = fields.get("sample_rate")
    if not isinstance(rate, int) or isinstance(rate, bool):
        raise ProtocolError(CloseCode.BAD_MESSAGE, "sample_rate: an integer is required")
    if rate != sample_rate:
        raise ProtocolError(CloseCode.WRONG_SAMPLE_RATE,
                            f"audio at {rate} Hz: the model takes {sample_rate} Hz audio; "
                            "resample it first")
    sample_format = fields.get("format", "float32")
    if sample_format not in SAMPLE_FORMATS:
        raise ProtocolError(CloseCode.BAD_MESSAGE, f"format {sample_format!r}: one of "
                            f"{', '.join(SAMPLE_FORMATS)}")
    hotwords = fields.get("hotwords", [])
    if isinstance(hotwords, str):
        hotwords = hotwords.splitlines()
    if not isinstance(hotwords, list) or not all(isinstance(h, str) for h in hotwords):
        raise ProtocolError(CloseCode.BAD_MESSAGE,
                            "hotwords: a list of phrases (or one string of lines)")
    score = fields.get("hotwords_score", 1.5)
    if not isinstance(score, int | float) or isinstance(score, bool):
        raise ProtocolError(CloseCode.BAD_MESSAGE, "hotwords_score: a number is required")
    return Start(rate, sample_format, tuple(hotwords), float(score))


def parse_audio(message: str | bytes, start: Start) -> np.ndarray | None:
    """The float32 samples of a binary message, or None for the end message;
    ProtocolError for anything else."""
    if isinstance(message, str):
        try:
            fields = json.loads(message)
        except json.JSONDecodeError:
            fields = None
        if fields == END_MESSAGE:
            return None
        raise ProtocolError(CloseCode.UNSUPPORTED_DATA,
                            'text where audio is expected: send samples as binary '
                            'messages, or {"type": "end"}')
    dtype = start.dtype
    if len(message) % dtype.itemsize:
        raise ProtocolError(CloseCode.BAD_MESSAGE,
                            f"{len(message)} bytes: not whole {start.format} samples "
                            f"({dtype.itemsize} bytes each)")
    samples = np.frombuffer(message, dtype=dtype)
    if start.format == "int16":
        return samples.astype(np.float32) / 32768.0
    if not np.all(np.isfinite(samples)):
        raise ProtocolError(CloseCode.BAD_MESSAGE, "samples that are not finite numbers")
    return samples.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TimedToken:
    """A token of a result with its times in seconds from the connection's first sample."""

    text: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Result:
    """A partial or final result of one segment (an utterance) of a connection."""

    segment: int
    final: bool
    start: float
    text: str
    tokens: Sequence[TimedToken] = ()
    #: Seconds of the connection's audio this result decodes.
    decoded: float = 0.0

    def message(self) -> str:
        record: dict[str, Any] = {
            "type": "final" if self.final else "partial", "final": self.final,
            "segment": self.segment, "start": round(self.start, 3), "text": self.text,
            "tokens": [{"text": token.text, "start": round(token.start, 3),
                        "end": round(token.end, 3)} for token in self.tokens],
            "decoded": round(self.decoded, 3)}
        return json.dumps(record, ensure_ascii=False)
