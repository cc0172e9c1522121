"""An experiment's streaming model as the server's `Engine`: `python -m cat.stream`'s
decoding (`cat.decoding.online`: stage 1's fbank as the audio comes, `FeatureStream`; the
model's `ChunkEncoder`, `streaming_encoder`; the family's chunk search) for many streams,
with endpoints and token times.

Batching: the chunks of all ready streams go to their chunk encoder's `encode_batch`
(`cat.models.streaming.ChunkEncoder`), each stream's output its own, so a stream alone
gives `python -m cat.stream`'s hypothesis: U2's chunks go through one encoder call per
step, their attention caches padded to the longest and masked; CUSIDE's windows are
encoded a stream at a time.

Endpoints (`cat.serving.endpoint`): after each chunk the hypothesis is aligned to the
utterance's encoder frames (the first head's `token_frames`, as `--format json` times
are): the frames after its last token are the trailing silence. At an endpoint the
segment's final result is sent and the stream starts a new utterance from the next chunk:
a fresh encoder state and search (the fbank goes on), so what a stream holds is bounded by
the longest utterance (rule 3).

Hotwords (frame-posterior models: CTC, CTC-CRF, U2): a connection's phrases make a context
graph (`cat.decoding.context_graph`) and its search a CTC prefix beam search with it over
the utterance's frames so far, searched again after each chunk (`HotwordChunkSearch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from cat.decoding.context_graph import ContextGraph, parse_hotword_line
from cat.decoding.online import ChunkSearch, FeatureStream, streaming_encoder
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS, TokenAligner, token_times
from cat.features.fbank import FbankOptions
from cat.serving.endpoint import EndpointRules
from cat.serving.engine import offset_tokens
from cat.serving.protocol import Result, Start
from cat.text.tokenizer import UNK_ID


class HotwordChunkSearch:
    """CTC prefix beam search over the frames so far with a connection's hotwords (the
    model's first head gives frame posteriors): after each chunk the utterance's
    log-probabilities are searched again, so the hypothesis is that of
    the head's prefix beam search of them (`search_log_probs`), with the context graph as
    its fusion."""

    def __init__(self, model: Any, graph: ContextGraph, beam_size: int) -> None:
        self.head, self.graph, self.beam_size = model.first_head, graph, beam_size
        self.log_probs: list[torch.Tensor] = []
        self.tokens: list[int] = []

    def step(self, encoder_out: torch.Tensor) -> None:
        self.log_probs.append(self.head.log_probs(encoder_out[None])[0])
        frames = torch.cat(self.log_probs)
        nbest = self.head.search_log_probs(frames[None], torch.tensor([frames.size(0)]),
                                           self.beam_size, self.graph)[0]
        self.tokens = list(nbest[0][0]) if nbest else []

    def finish(self) -> None:
        """The tokens are those of the last search."""

    def text(self, tokenizer: Any) -> str:
        return tokenizer.decode(self.tokens)


def hotword_graph(lines: Sequence[str], tokenizer: Any, default_score: float
                  ) -> ContextGraph | None:
    """The context graph of a connection's hotword lines (sherpa-onnx's format, as a
    hotwords file's); None without a phrase the tokenizer can spell. ValueError for a
    bad line."""
    phrases = []
    for number, line in enumerate(lines, start=1):
        parsed = parse_hotword_line(line, default_score, f"hotword {number}")
        if parsed is None:
            continue
        tokens = tokenizer.encode(parsed[0])
        if tokens and UNK_ID not in tokens:
            phrases.append((tokens, parsed[1]))
    return ContextGraph(phrases) if phrases else None


class StreamState:
    """One stream: its fbank, the frames not yet encoded, and its utterance's encoder
    state, search and encoder output."""

    def __init__(self, features: FeatureStream, search: Callable[[], ChunkSearch],
                 encoder: Callable[[], Any]) -> None:
        self.features = features
        self.pending = np.zeros((0, features.options.num_mel_bins), np.float32)
        self.consumed = 0  # the stream's feature frames before `pending`
        self.segment = 0
        self._search, self._encoder = search, encoder
        self.new_utterance()

    def new_utterance(self) -> None:
        """Start an utterance at the next chunk: a fresh encoder state and search."""
        self.encoder, self.search = self._encoder(), self._search()
        self.hidden: list[torch.Tensor] = []
        self.start_frame = self.consumed
        self.last_text = ""


class StreamingEngine:
    """The `Engine` of an experiment's streaming model (see the module docstring): `model`
    and `tokenizer` as `cat.decoding.searcher.load_model` gives them, `chunk_search` the
    family's `ChunkSearch` class, chunks of `chunk_size` encoder frames (a CUSIDE model's
    with `right_context`), the experiment's front end `fbank`, endpoint `rules`, at most
    `max_batch` streams per encoder call, hotwords searched with `beam_size`."""

    streaming = True

    def __init__(self, model: Any, tokenizer: Any, chunk_search: type, chunk_size: int,
                 fbank: FbankOptions, rules: EndpointRules, right_context: str | None = None,
                 max_batch: int = 32, beam_size: int = 10) -> None:
        probe = streaming_encoder(model, chunk_size, right_context)  # checks the chunk size
        if not isinstance(model.first_head, TokenAligner):
            raise ValueError(f"{type(model.first_head).__name__} heads give no token times")
        self.model, self.tokenizer, self.chunk_search = model, tokenizer, chunk_search
        self.chunk_size, self.right_context = chunk_size, right_context
        self.fbank, self.rules = fbank, rules
        self.max_batch, self.beam_size = max_batch, beam_size
        self.stride, self.lookahead = probe.stride, probe.lookahead
        self.encode_batch = type(probe).encode_batch
        self.sample_rate = fbank.sample_rate
        self.frame_seconds = fbank.frame_shift_ms / 1000
        self.chunk_seconds = self.stride * self.frame_seconds
        self.frame_rate = int(model.encoder.frame_rate_factor)

    # -- streams ------------------------------------------------------------------------
    def open(self, start: Start) -> StreamState:
        graph = None
        if start.hotwords:
            if not self.model.frame_posteriors:
                raise ValueError("hotwords: this model's first head gives no frame "
                                 "posteriors for a prefix beam search")
            graph = hotword_graph(start.hotwords, self.tokenizer, start.hotwords_score)

        def search() -> ChunkSearch:
            if graph is not None:
                return HotwordChunkSearch(self.model, graph, self.beam_size)
            return self.chunk_search(self.model, self.chunk_size)

        def encoder() -> Any:
            return streaming_encoder(self.model, self.chunk_size, self.right_context)

        return StreamState(FeatureStream(self.fbank), search, encoder)

    def accept(self, state: StreamState, samples: np.ndarray) -> None:
        frames = state.features.accept(self.sample_rate, samples)
        state.pending = np.concatenate([state.pending, frames])

    def ready(self, state: StreamState) -> bool:
        return len(state.pending) >= self.stride + self.lookahead

    def backlog(self, state: StreamState) -> int:
        shift = state.features.options.window_shift
        return max(0, state.features.total - state.consumed * shift)

    # -- decoding -----------------------------------------------------------------------
    def step(self, states: Sequence[StreamState]) -> list[list[Result]]:
        size = self.stride + self.lookahead
        chunks = [torch.from_numpy(state.pending[:size]) for state in states]
        with torch.inference_mode():
            if len(states) > 1:
                outputs = self.encode_batch([state.encoder for state in states],
                                            torch.stack(chunks))
            else:
                outputs = [state.encoder(chunk[None])[0] for state, chunk in
                           zip(states, chunks, strict=True)]
            results = []
            for state, out in zip(states, outputs, strict=True):
                state.pending = state.pending[self.stride:]
                state.consumed += self.stride
                results.append(self._advance(state, out))
        return results

    def _advance(self, state: StreamState, out: torch.Tensor) -> list[Result]:
        """Search a chunk's encoder output; the partial result, or the final one at an
        endpoint (then a new utterance)."""
        if out.size(0):
            state.search.step(out)
            state.hidden.append(out)
        return self._results(state, final=False)

    def _results(self, state: StreamState, final: bool) -> list[Result]:
        tokens = [int(token) for token in state.search.tokens]
        frames = sum(out.size(0) for out in state.hidden)
        spans = []
        if tokens:
            hidden = torch.cat(state.hidden)[None]
            spans = self.model.first_head.token_frames(hidden, torch.tensor([frames]),
                                                       [tokens])[0]
        frame = self.frame_rate * FRAME_SHIFT_SECONDS
        silence = (frames - 1 - spans[-1][1] if spans else frames) * frame
        if not final and not self.rules.detect(silence, frames * frame, bool(tokens)):
            text = state.search.text(self.tokenizer)
            if text == state.last_text:
                return []
            state.last_text = text
            return [self._result(state, tokens, spans, frames, final=False)]
        results = [self._result(state, tokens, spans, frames, final=True)] if tokens else []
        state.segment += bool(tokens)
        state.new_utterance()
        return results

    def _result(self, state: StreamState, tokens: list[int], spans: list, frames: int,
                final: bool) -> Result:
        pieces = [self.tokenizer.id_to_piece(token) for token in tokens]
        times = token_times(spans, self.frame_rate, pieces,
                            frames * self.frame_rate * FRAME_SHIFT_SECONDS)
        start = state.start_frame * self.frame_seconds
        return Result(state.segment, final, start, state.search.text(self.tokenizer),
                      offset_tokens(times, start), self._decoded(state))

    def _decoded(self, state: StreamState) -> float:
        """Seconds of the stream's audio the chunks so far needed: the windows of the
        frames encoded and of the `lookahead` frames after them."""
        options = state.features.options
        needed = ((state.consumed + self.lookahead - 1) * options.window_shift
                  + options.window_size + options.first_sample)
        return min(state.features.total, needed) / self.sample_rate

    def finish(self, state: StreamState) -> list[Result]:
        """Encode the rest of the stream's audio (`StreamingRecognizer.finish`'s way);
        the results of its last chunks and the final one."""
        last = state.features.flush()
        state.pending = np.concatenate([state.pending, last])
        results = []
        while self.ready(state):
            results.extend(self.step([state])[0])
        with torch.inference_mode():
            if len(state.pending):
                out = state.encoder.finish(torch.from_numpy(state.pending)[None])[0]
                if out.size(0):
                    state.search.step(out)
                    state.hidden.append(out)
            state.consumed += len(state.pending)
            state.pending = state.pending[:0]
            state.search.finish()
            results.extend(self._results(state, final=True))
        return results
