"""Streaming recognizers side by side in tests: sherpa-onnx's `OnlineRecognizer` and this
package's `cat.decoding.online.StreamingRecognizer` on the same audio."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def sherpa_tokens(recognizer: Any, ours: Any, samples: np.ndarray, rate: int,
                  rng: np.random.Generator) -> list[str]:
    """Feed `samples` in pieces of random sizes to a sherpa-onnx `OnlineRecognizer`, and to
    `ours` (a `StreamingRecognizer`) all but the last frame's shift; return sherpa-onnx's
    tokens. Whole chunks only on both sides: sherpa-onnx decodes a chunk once a frame
    after it has come (`IsReady`: processed + chunk < frames ready) and drops a partial last
    one, so `ours` is not finished."""
    stream, start = recognizer.create_stream(), 0
    while start < len(samples):
        size = int(rng.integers(200, 6000))
        stream.accept_waveform(rate, samples[start:start + size])
        while recognizer.is_ready(stream):
            recognizer.decode_stream(stream)
        start += size
    ours.accept_waveform(rate, samples[:len(samples) - rate // 100])
    return list(recognizer.get_result_all(stream).tokens)


def assert_sherpa_streams_as_ours(recognizer: Any, ours: Callable[[], Any], audio: dict[str, Any],
                                  tokenizer: Any, pad_seconds: float, seed: int = 0) -> int:
    """For each utterance of `audio` ({key: audio file}), sherpa-onnx's `recognizer` gives the
    tokens of a fresh `ours()` (`sherpa_tokens`, the audio followed by `pad_seconds` of
    zeros); AssertionError naming the first utterance where they differ. Returns the
    number of tokens compared."""
    import soundfile

    rng = np.random.default_rng(seed)
    emitted = 0
    for key, path in sorted(audio.items()):
        samples, rate = soundfile.read(str(path), dtype="float32")
        samples = np.concatenate([samples, np.zeros(int(rate * pad_seconds), np.float32)])
        mine = ours()
        got = sherpa_tokens(recognizer, mine, samples, rate, rng)
        expected = [tokenizer.id_to_piece(token) for token in mine.search.tokens]
        assert got == expected, f"{key}: sherpa-onnx {got}, ours {expected}"
        emitted += len(expected)
    return emitted
