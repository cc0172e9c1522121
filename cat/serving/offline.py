"""A full-context (offline) model as the server's `Engine`: each connection's audio is cut
into segments, each decoded whole, as `python -m cat.decode --audio` decodes a file (stage
1's fbank, the experiment's `Searcher`, token times), segments of many connections in one
batch.

Where a segment ends is a `Segmenter`'s call: `FixedSegmenter` cuts every
`max_segment_seconds` and at the end of the audio (a client that sends one utterance and
then its end gets that utterance decoded whole). A voice activity detector that cuts at
pauses plugs in through the same two methods.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from cat.decoding.searcher import NO_LABEL, Searcher
from cat.features.fbank import FbankOptions, compute_fbank
from cat.loading.batch import Utterance
from cat.models.encoder import MIN_INPUT_FRAMES
from cat.serving.engine import offset_tokens
from cat.serving.protocol import Result, Start
from cat.serving.streaming import hotword_graph

#: A segment of a stream: the index of its first sample, and its samples.
Segment = tuple[int, np.ndarray]


class Segmenter(Protocol):
    """Cuts a stream's audio into segments as it comes."""

    def accept(self, samples: np.ndarray) -> list[Segment]:
        """Take the next samples; the segments they complete."""

    def flush(self) -> list[Segment]:
        """The audio has ended: the segments left."""

    @property
    def held(self) -> int:
        """Samples taken and not yet in a segment."""


class FixedSegmenter:
    """Segments of `max_samples` (the last one shorter)."""

    def __init__(self, max_samples: int) -> None:
        if max_samples < 1:
            raise ValueError(f"segments must hold a sample, got {max_samples}")
        self.max_samples = max_samples
        self.parts: list[np.ndarray] = []
        self.held = 0
        self.start = 0

    def accept(self, samples: np.ndarray) -> list[Segment]:
        self.parts.append(samples)
        self.held += len(samples)
        segments = []
        while self.held >= self.max_samples:
            audio = np.concatenate(self.parts)
            segments.append((self.start, audio[:self.max_samples]))
            self.start += self.max_samples
            self.parts, self.held = [audio[self.max_samples:]], len(audio) - self.max_samples
        return segments

    def flush(self) -> list[Segment]:
        if not self.held:
            return []
        segment = (self.start, np.concatenate(self.parts))
        self.start += self.held
        self.parts, self.held = [], 0
        return [segment]


class OfflineState:
    """One stream: its segmenter, the segments waiting, its hotwords."""

    def __init__(self, segmenter: Segmenter, graph: Any) -> None:
        self.segmenter, self.graph = segmenter, graph
        self.segments: collections.deque[Segment] = collections.deque()
        self.number = 0


class OfflineEngine:
    """The `Engine` of a full-context model (see the module docstring): `searcher` the
    experiment's `Searcher` (with its options: method, beam), `fbank` its front end,
    segments from `segmenter()` of at most `max_segment_seconds` each, at most `max_batch`
    segments per model call."""

    streaming = False

    def __init__(self, searcher: Searcher, fbank: FbankOptions, max_segment_seconds: float,
                 max_batch: int = 8, segmenter: Callable[[], Segmenter] | None = None) -> None:
        self.searcher, self.fbank, self.max_batch = searcher, fbank, max_batch
        self.sample_rate = fbank.sample_rate
        self.chunk_seconds = max_segment_seconds
        max_samples = int(max_segment_seconds * self.sample_rate)
        self.segmenter = segmenter or (lambda: FixedSegmenter(max_samples))

    def open(self, start: Start) -> OfflineState:
        graph = None
        if start.hotwords:
            if self.searcher.options.method == "greedy":
                raise ValueError("hotwords need a beam search; this server decodes greedily")
            graph = hotword_graph(start.hotwords, self.searcher.tokenizer, start.hotwords_score)
        return OfflineState(self.segmenter(), graph)

    def accept(self, state: OfflineState, samples: np.ndarray) -> None:
        state.segments.extend(state.segmenter.accept(samples))

    def ready(self, state: OfflineState) -> bool:
        return bool(state.segments)

    def backlog(self, state: OfflineState) -> int:
        return state.segmenter.held + sum(len(audio) for _, audio in state.segments)

    def step(self, states: Sequence[OfflineState]) -> list[list[Result]]:
        results: list[list[Result]] = [[] for _ in states]
        groups: dict[int, list[int]] = collections.defaultdict(list)
        for index, state in enumerate(states):  # a batch per set of hotwords
            groups[id(state.graph)].append(index)
        for indices in groups.values():
            segments = [(states[index], states[index].segments.popleft()) for index in indices]
            for index, result in zip(indices, self._decode(segments), strict=True):
                results[index] = result
        return results

    def _decode(self, segments: list[tuple[OfflineState, Segment]]) -> list[list[Result]]:
        features = [compute_fbank(audio, self.sample_rate, self.fbank)
                    for _, (_, audio) in segments]
        # A scrap of audio too short for the encoder's subsampling says nothing.
        decoded = [index for index, feats in enumerate(features) if len(feats) >= MIN_INPUT_FRAMES]
        self.searcher.hotwords = segments[0][0].graph
        found = dict(zip(decoded, self.searcher.results(
            [Utterance(str(index), features[index], NO_LABEL) for index in decoded]),
            strict=True)) if decoded else {}
        results = []
        for index, (state, (first, audio)) in enumerate(segments):
            result = found.get(index)
            if result is None or not result.ids:
                results.append([])
                continue
            start = first / self.sample_rate
            results.append([Result(state.number, True, start, result.text,
                                   offset_tokens(result.times or (), start),
                                   (first + len(audio)) / self.sample_rate)])
            state.number += 1
        return results

    def finish(self, state: OfflineState) -> list[Result]:
        state.segments.extend(state.segmenter.flush())
        results = []
        while state.segments:
            results.extend(self.step([state])[0])
        return results
