"""An export folder as the server's `Engine`: its streaming model in sherpa-onnx's
`OnlineRecognizer` (built by the family's `sherpa_online_recognizer` from `export.json`:
CTC's `streaming_wenet_ctc.onnx`, a stateless transducer's `streaming_encoder_lstm.onnx`),
so the model runs in onnxruntime, as a deployment without PyTorch runs it.

The recognizer is the family's with sherpa-onnx's own endpointing turned on, with the
server's rules (`cat.serving.endpoint`, the same three rules), and its streams are decoded
with `decode_streams`, one call for all ready streams (which sherpa-onnx batches where the
model type allows it). sherpa-onnx decodes whole chunks only: at the end of a stream's
audio, `TAIL_SECONDS` of silence past a chunk complete its last chunk, as its own examples
do. Its greedy search takes no hotwords. Token times are its `timestamps` (the frame each
token is emitted on) as `cat.decoding.timestamps.token_times` spreads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cat.core.io import PathLike
from cat.decoding.export import load_export_metadata, sherpa_wrap
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS, token_times
from cat.models.registry import family
from cat.serving.endpoint import EndpointRules
from cat.serving.engine import offset_tokens
from cat.serving.protocol import Result, Start

#: Silence after a stream's audio, past a chunk, to complete its last chunk.
TAIL_SECONDS = 0.3


class SherpaState:
    """One stream: sherpa-onnx's stream, the client's samples given to it, those decoded
    (whole chunks, the tail's too)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.accepted = self.decoded = 0
        self.segment = 0
        self.last_text = ""


class SherpaEngine:
    """The `Engine` of an export folder's streaming model in sherpa-onnx (see the module
    docstring), endpoints by `rules`, at most `max_batch` streams per `decode_streams`."""

    streaming = True

    def __init__(self, export_dir: PathLike, rules: EndpointRules, num_threads: int = 1,
                 max_batch: int = 32) -> None:
        import sherpa_onnx
        from sherpa_onnx.lib import _sherpa_onnx as native

        export_dir = Path(export_dir)
        meta = load_export_metadata(export_dir)
        if "chunk_size" not in meta:
            raise ValueError(f"{export_dir}: no streaming model (export with --chunk-size)")
        base = family(meta["family"], "export").sherpa_online_recognizer(
            export_dir, num_threads=num_threads)
        config = base.config
        config.enable_endpoint = True
        config.endpoint_config = native.EndpointConfig(*(
            native.EndpointRule(rule.must_contain_nonsilence, rule.min_trailing_silence,
                                rule.min_utterance_length)
            for rule in (rules.rule1, rules.rule2, rules.rule3)))
        self.recognizer = sherpa_wrap(sherpa_onnx.OnlineRecognizer, native.OnlineRecognizer,
                                      config)
        self.max_batch = max_batch
        self.sample_rate = int(meta["sample_rate"])
        self.frame_rate = int(meta["subsampling_factor"])
        shift = float(meta["frame_shift_ms"]) / 1000
        self.chunk_seconds = int(meta["stride"]) * shift
        self.chunk_samples = round(self.chunk_seconds * self.sample_rate)
        # A chunk is decoded once a frame after it exists: its window's samples too.
        self.window_samples = round(float(meta["frame_length_ms"]) / 1000 * self.sample_rate)

    def open(self, start: Start) -> SherpaState:
        if start.hotwords:
            raise ValueError("hotwords: sherpa-onnx's greedy search of this export takes none")
        return SherpaState(self.recognizer.create_stream())

    def accept(self, state: SherpaState, samples: np.ndarray) -> None:
        state.stream.accept_waveform(self.sample_rate, samples)
        state.accepted += len(samples)

    def ready(self, state: SherpaState) -> bool:
        return self.recognizer.is_ready(state.stream)

    def backlog(self, state: SherpaState) -> int:
        return max(0, state.accepted - state.decoded)

    def step(self, states: Sequence[SherpaState]) -> list[list[Result]]:
        self.recognizer.decode_streams([state.stream for state in states])
        results = []
        for state in states:
            state.decoded += self.chunk_samples
            results.append(self._results(state, final=False))
        return results

    def _results(self, state: SherpaState, final: bool) -> list[Result]:
        recognizer, stream = self.recognizer, state.stream
        endpoint = final or recognizer.is_endpoint(stream)
        found = recognizer.recognizer.get_result(stream)
        text = found.text
        if not endpoint and text == state.last_text:
            return []
        results = []
        if text or not endpoint:
            start = found.start_time
            frame = self.frame_rate * FRAME_SHIFT_SECONDS
            spans = [(round(t / frame), round(t / frame), 0.0) for t in found.timestamps]
            times = token_times(spans, self.frame_rate, list(found.tokens))
            results.append(Result(state.segment, endpoint, start, text,
                                  offset_tokens(times, start),
                                  min(state.accepted, state.decoded + self.window_samples)
                                  / self.sample_rate))
        state.last_text = "" if endpoint else text
        if endpoint:
            state.segment += bool(text)
            recognizer.reset(stream)
        return results

    def finish(self, state: SherpaState) -> list[Result]:
        stream = state.stream
        stream.accept_waveform(self.sample_rate, np.zeros(
            self.chunk_samples + int(TAIL_SECONDS * self.sample_rate), np.float32))
        stream.input_finished()
        results = []
        while self.recognizer.is_ready(stream):
            results.extend(self.step([state])[0])
        results.extend(self._results(state, final=True))
        return results

