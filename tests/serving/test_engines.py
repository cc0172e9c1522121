"""The server's engines: streams at different points batched as each alone (PyTorch), an
export folder served by sherpa-onnx, a full-context model segment by segment, hotwords
per connection."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import soundfile
import torch

from cat.ctc.stream import CtcChunkSearch
from cat.decoding.export import export_main
from cat.decoding.inference import main as decode_main
from cat.decoding.searcher import load_model
from cat.features.fbank import FbankOptions
from cat.models.chunked import CachedChunkEncoder
from cat.serving.endpoint import EndpointRules
from cat.serving.protocol import Start
from cat.serving.streaming import StreamingEngine
from cat.testing import serving
from cat.testing.serving import CHUNK_SIZE, SAMPLE_RATE, ServerProcess, stream_audio

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def audio(tone):
    experiment, _ = tone
    return {key: soundfile.read(str(path), dtype="float32")[0]
            for key, path in sorted(experiment.test_audio().items())}


class RecordingSearch(CtcChunkSearch):
    """Greedy CTC search that keeps the encoder output of every chunk it searched."""

    def __init__(self, model, chunk_size: int = 0) -> None:
        super().__init__(model, chunk_size)
        self.outputs: list[torch.Tensor] = []

    def step(self, encoder_out: torch.Tensor) -> None:
        self.outputs.append(encoder_out)
        super().step(encoder_out)


def _run(engine: StreamingEngine, samples: list[np.ndarray], head_start: float
         ) -> tuple[list, list[torch.Tensor]]:
    """Each stream's final results and encoder output: the first stream is fed
    `head_start` seconds before the others (its attention cache is longer), then all go
    in shared steps."""
    states = [engine.open(Start(SAMPLE_RATE)) for _ in samples]
    searches = [state.search for state in states]  # no endpoint: one utterance each
    results: list[list] = [[] for _ in samples]
    ahead = int(head_start * SAMPLE_RATE)
    engine.accept(states[0], samples[0][:ahead])
    while engine.ready(states[0]):
        results[0].extend(engine.step([states[0]])[0])
    for index, (state, audio) in enumerate(zip(states, samples, strict=True)):
        engine.accept(state, audio[ahead:] if index == 0 else audio)
    while True:
        ready = [index for index, state in enumerate(states) if engine.ready(state)]
        if not ready:
            break
        for index, found in zip(ready, engine.step([states[i] for i in ready]), strict=True):
            results[index].extend(found)
    for index, state in enumerate(states):
        results[index].extend(engine.finish(state))
    return ([[r for r in found if r.final] for found in results],
            [torch.cat(search.outputs) for search in searches])


def test_streams_at_different_points_batch_as_each_alone(tone, audio):
    experiment, checkpoint = tone
    with contextlib.chdir(experiment.root):
        model, tokenizer = load_model(experiment.name, checkpoint, torch.device("cpu"))
    engine = StreamingEngine(model, tokenizer, RecordingSearch, CHUNK_SIZE, FbankOptions(),
                             EndpointRules())
    # a U2 model's chunks batch: one encoder call for the ready streams
    assert engine.encode_batch == CachedChunkEncoder.encode_batch
    samples = list(audio.values())[:3]
    finals, outputs = _run(engine, samples, head_start=1.0)
    for index, one in enumerate(samples):
        alone_finals, alone_outputs = _run(engine, [one], head_start=0.0)
        assert finals[index] == alone_finals[0]
        assert len(alone_finals[0]) == 1 and alone_finals[0][0].text
        torch.testing.assert_close(outputs[index], alone_outputs[0], atol=1e-5, rtol=1e-5)


def test_an_export_folder_is_served_by_sherpa_onnx(tone, audio, reference, tmp_path):
    experiment, checkpoint = tone
    with contextlib.chdir(experiment.root):
        assert export_main("cat.export", [
            experiment.name, "--chunk-size", str(CHUNK_SIZE), "--checkpoint", str(checkpoint),
            "--out", str(tmp_path / "export")]) == 0
    first, second = list(audio)[:2]
    pause = np.zeros(2 * SAMPLE_RATE, np.float32) + serving.NOISE_FLOOR
    with ServerProcess([str(tmp_path / "export")]) as server:
        transcripts = {key: asyncio.run(stream_audio(server.ws_url, samples, realtime=0))
                       for key, samples in audio.items()}
        split = asyncio.run(stream_audio(server.ws_url, np.concatenate(
            [audio[first], pause, audio[second]]), realtime=0))
        server.wait_for(lambda s: s["streams"] == 0, 30, "every stream freed")
    for key, transcript in transcripts.items():
        assert transcript.code == 1000
        assert [final["text"] for final in transcript.finals] == [reference[key]]
    assert [final["text"] for final in split.finals] == [reference[first], reference[second]]
    assert split.finals[1]["tokens"][0]["start"] > len(audio[first]) / SAMPLE_RATE + 1.5


def test_a_full_context_model_is_served_segment_by_segment(tone, audio, tmp_path):
    experiment, checkpoint = tone
    key = next(iter(audio))
    with contextlib.chdir(experiment.root):
        assert decode_main("cat.decode", [
            experiment.name, "--audio", str(experiment.test_audio()[key]), "--checkpoint",
            str(checkpoint), "--out", str(tmp_path / "decode")]) == 0
    expected = (tmp_path / "decode/hyp").read_text(encoding="utf-8").split()[1]
    assert len(audio[key]) < 4 * SAMPLE_RATE
    with ServerProcess([experiment.name, "--checkpoint", str(checkpoint),
                        "--max-segment-seconds", "4"], cwd=experiment.root) as server:
        whole = asyncio.run(stream_audio(server.ws_url, audio[key]))
        cut = asyncio.run(stream_audio(server.ws_url, np.tile(audio[key], 3), realtime=0))
    assert whole.messages[0]["streaming"] is False
    assert whole.code == 1000 and not whole.partials
    assert [final["text"] for final in whole.finals] == [expected]
    # Longer audio in segments of four seconds, their times from the stream's start.
    starts = [final["start"] for final in cut.finals]
    assert len(starts) >= 2 and starts == sorted(starts) and set(starts) <= {0.0, 4.0, 8.0}
    for final in cut.finals:
        assert all(final["start"] <= t["start"] <= final["start"] + 4 for t in final["tokens"])


def test_hotwords_bias_their_own_connection(tone, monkeypatch):
    experiment, checkpoint = tone
    # A middle character between 天 (300 Hz) and 地 (520 Hz): the model hesitates.
    monkeypatch.setitem(serving.TONES, "X", 360.0)
    samples = serving.tone_audio("山X水", np.random.default_rng(1))

    async def three():
        return await asyncio.gather(*(
            stream_audio(server.ws_url, samples, start={
                "sample_rate": SAMPLE_RATE, "hotwords": hotwords, "hotwords_score": 3.0})
            for hotwords in (["山天水"], ["山地水"], [])))

    with ServerProcess([experiment.name, "--chunk-size", str(CHUNK_SIZE), "--checkpoint",
                        str(checkpoint)], cwd=experiment.root) as server:
        heaven, earth, plain = asyncio.run(three())
    assert (heaven.text, earth.text) == ("山天水", "山地水")
    assert plain.text in ("山天水", "山地水", "山水")


def _held(state) -> tuple[int, int, int, int]:
    """What a stream's state holds: feature frames not yet encoded, samples kept for the
    fbank's next windows, the utterance's encoder frames, its attention cache's frames."""
    return (len(state.pending), len(state.features.samples),
            sum(out.size(0) for out in state.hidden), state.encoder.attn_cache.size(2))


def test_a_streams_state_is_bounded_by_its_utterance(tone, audio, reference):
    """Utterances one after another on one stream, each ended by a pause: at each endpoint
    the utterance's state is dropped, so the fifth utterance holds no more than the second
    (without the endpoint's fresh start the encoder frames and the cache grow with the
    stream), and the fbank's samples and the frames waiting are bounded throughout."""
    experiment, checkpoint = tone
    with contextlib.chdir(experiment.root):
        model, tokenizer = load_model(experiment.name, checkpoint, torch.device("cpu"))
    engine = StreamingEngine(model, tokenizer, CtcChunkSearch, CHUNK_SIZE, FbankOptions(),
                             EndpointRules())
    key = next(iter(audio))
    rng = np.random.default_rng(0)
    pause = (serving.NOISE_FLOOR * rng.standard_normal(2 * SAMPLE_RATE)).astype(np.float32)
    period = np.concatenate([audio[key], pause])
    repeats, piece = 5, SAMPLE_RATE // 10
    stream = np.tile(period, repeats)
    state = engine.open(Start(SAMPLE_RATE))
    finals, held = [], [[] for _ in range(repeats)]
    for first in range(0, len(stream), piece):
        engine.accept(state, stream[first:first + piece])
        while engine.ready(state):
            for result in engine.step([state])[0]:
                if result.final:
                    finals.append(result)
                    assert _held(state)[2:] == (0, 0)  # a fresh utterance
            held[min(first // len(period), repeats - 1)].append(_held(state))
    finals.extend(result for result in engine.finish(state) if result.final)
    assert [final.text for final in finals] == [reference[key]] * repeats
    assert [final.segment for final in finals] == list(range(repeats))
    peaks = [np.max(found, axis=0) for found in held]
    assert peaks[0][2] > 0 and peaks[0][3] > 0
    # From the second on, an utterance's state also holds the rest of the pause before it;
    # the later ones hold no more (give or take a chunk), whatever went before them.
    slack = np.array([0, 0, CHUNK_SIZE, CHUNK_SIZE])
    for later in peaks[2:]:
        assert np.all(later <= peaks[1] + slack), peaks
    frames = engine.frame_rate * engine.frame_seconds  # seconds per encoder frame
    assert peaks[1][2] * frames < EndpointRules().rule3.min_utterance_length
    assert all(peak[0] < engine.stride + engine.lookahead for peak in peaks)
    assert all(peak[1] <= engine.fbank.window_size + piece for peak in peaks)
