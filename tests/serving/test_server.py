"""`python -m cat.serve` with a Python client: partial results grow, the final is `python
-m cat.stream`'s, clients at once get their own texts (batched), a pause splits
utterances; faults: bad messages, a client that leaves mid-utterance, one that sends
faster than real time, the connection and audio limits; the others are served meanwhile
(asserted each time)."""

from __future__ import annotations

import asyncio
import json
import time
from itertools import pairwise

import numpy as np
import pytest
import soundfile
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from cat.testing.serving import (
    CHUNK_SIZE,
    NOISE_FLOOR,
    SAMPLE_RATE,
    ServerProcess,
    stream_audio,
)

pytestmark = pytest.mark.slow

LIMITS = ["--max-connections", "4", "--max-audio-seconds", "30", "--max-message-bytes",
          "65536", "--max-backlog-seconds", "2"]


@pytest.fixture(scope="module")
def server(tone):
    experiment, checkpoint = tone
    with ServerProcess([experiment.name, "--chunk-size", str(CHUNK_SIZE), "--checkpoint",
                        str(checkpoint), *LIMITS], cwd=experiment.root) as process:
        yield process
        assert process.process.poll() is None, process.output()


@pytest.fixture(scope="module")
def audio(tone):
    """{utterance: samples} of the test set."""
    experiment, _ = tone
    return {key: soundfile.read(str(path), dtype="float32")[0]
            for key, path in sorted(experiment.test_audio().items())}


def _pause(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (NOISE_FLOOR * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)


def _assert_served(transcript, expected: str) -> None:
    """One final, the expected text, its tokens' texts and times in order."""
    assert transcript.code == 1000, (transcript.code, transcript.reason)
    assert [final["text"] for final in transcript.finals] == [expected]
    tokens = transcript.finals[0]["tokens"]
    assert "".join(token["text"] for token in tokens) == expected
    times = [value for token in tokens for value in (token["start"], token["end"])]
    assert times == sorted(times) and times[0] >= 0


def _idle(server) -> dict:
    """The server once every connection is gone: no stream state is held."""
    return server.wait_for(lambda s: s["connections"] == 0 and s["streams"] == 0, 30,
                           "every stream freed")


def test_partial_results_grow_and_the_final_is_cat_streams(server, audio, reference):
    for index, (key, samples) in enumerate(audio.items()):
        transcript = asyncio.run(stream_audio(server.ws_url, samples,
                                              realtime=1.0 if index == 0 else 4.0))
        _assert_served(transcript, reference[key])
        partials = [message["text"] for message in transcript.partials]
        assert len(partials) >= 2, key
        assert all(b.startswith(a) and b != a for a, b in pairwise(partials)), partials
        assert reference[key].startswith(partials[-1])
        decoded = [message["decoded"] for message in transcript.messages[1:]]
        assert decoded == sorted(decoded) and decoded[0] > 0
        assert decoded[-1] == pytest.approx(len(samples) / SAMPLE_RATE, abs=1e-3)
        assert transcript.messages[0]["type"] == "ready"
        assert transcript.messages[0]["chunk_seconds"] == pytest.approx(0.16)
    _idle(server)


def test_clients_at_once_get_their_own_texts_in_shared_batches(server, audio, reference):
    keys = list(audio)[:3]

    async def together():
        return await asyncio.gather(*(stream_audio(server.ws_url, audio[key])
                                      for key in keys))

    before = server.status()["steps"]
    transcripts = asyncio.run(together())
    for key, transcript in zip(keys, transcripts, strict=True):
        _assert_served(transcript, reference[key])
    status = _idle(server)
    assert status["largest_batch"] >= 2  # their chunks went through shared model calls
    assert status["steps"] > before


def test_a_pause_splits_two_utterances(server, audio, reference):
    first, second = list(audio)[1:3]
    samples = np.concatenate([audio[first], _pause(2.0), audio[second]])
    transcript = asyncio.run(stream_audio(server.ws_url, samples, realtime=4.0))
    assert transcript.code == 1000
    finals = transcript.finals
    assert [final["text"] for final in finals] == [reference[first], reference[second]]
    assert [final["segment"] for final in finals] == [0, 1]
    # The second utterance starts in the pause, and its tokens after it.
    length = len(audio[first]) / SAMPLE_RATE
    assert length <= finals[1]["start"] < length + 2.0
    assert finals[1]["tokens"][0]["start"] >= length + 2.0 - 0.05
    assert finals[0]["tokens"][-1]["end"] <= length + 0.2
    # Partials of the second utterance are its own, not the first's text continued.
    second_partials = [m["text"] for m in transcript.partials if m["segment"] == 1]
    assert second_partials and all(reference[second].startswith(t) for t in second_partials)


async def _bad_client(url: str, start: object, then: object | None) -> tuple[int, str]:
    """Connect, send `start` (and `then`), return how the server closed."""
    async with connect(url, max_size=None) as websocket:
        try:
            await websocket.send(start if isinstance(start, str | bytes) else
                                 json.dumps(start))
            if then is not None:
                await websocket.recv()  # ready
                await websocket.send(then)
        except ConnectionClosed:
            pass
        try:
            async with asyncio.timeout(30):
                async for _ in websocket:
                    pass
        except ConnectionClosed:
            pass
    return websocket.close_code, websocket.close_reason


BAD = {
    "wrong sample rate": ({"sample_rate": 8000}, None, 4001,
                          "audio at 8000 Hz: the model takes 16000 Hz audio; resample it first"),
    "audio before the start": (b"\x00" * 400, None, 1003,
                               "audio before the start message: send a JSON start first"),
    "a start that is not JSON": ("16000", None, 1007,
                                 "the start message must be a JSON object"),
    "text where audio is expected": ({"sample_rate": 16000}, "hello", 1003,
                                     'text where audio is expected: send samples as binary '
                                     'messages, or {"type": "end"}'),
    "samples cut short": ({"sample_rate": 16000}, b"\x00" * 6, 1007,
                          "6 bytes: not whole float32 samples (4 bytes each)"),
    "an oversized frame": ({"sample_rate": 16000}, b"\x00" * 70000, 1009, None),
    "hotwords that do not parse": ({"sample_rate": 16000, "hotwords": ["天地 :x"]}, None,
                                   1007, "hotword 1: the score after ':' must be a number, "
                                         "got 'x'"),
}


def test_bad_messages_close_with_their_codes_while_another_client_is_served(server, audio,
                                                                           reference):
    key = next(iter(audio))

    async def run():
        good = asyncio.create_task(stream_audio(server.ws_url, audio[key]))
        closes = {}
        for name, (start, then, _, _) in BAD.items():
            closes[name] = await _bad_client(server.ws_url, start, then)
        return await good, closes

    transcript, closes = asyncio.run(run())
    for name, (_, _, code, reason) in BAD.items():
        assert closes[name][0] == code, (name, closes[name])
        if reason is not None:
            assert closes[name][1] == reason, name
    assert "65536" in closes["an oversized frame"][1]
    _assert_served(transcript, reference[key])
    _idle(server)


def test_a_client_that_leaves_mid_utterance_has_its_stream_freed(server, audio, reference):
    keys = list(audio)

    async def leave(samples: np.ndarray) -> None:
        websocket = await connect(server.ws_url)
        await websocket.send(json.dumps({"sample_rate": SAMPLE_RATE}))
        await websocket.recv()
        for start in range(0, len(samples) // 2, 1600):
            await websocket.send(samples[start:start + 1600].tobytes())
            await asyncio.sleep(0.05)
        websocket.transport.abort()  # gone: no close frame, no end message

    async def run():
        good = asyncio.create_task(stream_audio(server.ws_url, audio[keys[0]]))
        for key in keys[1:4]:
            await leave(audio[key])
        return await good

    _assert_served(asyncio.run(run()), reference[keys[0]])
    status = _idle(server)
    assert status["pending_seconds"] == 0


def test_a_client_sending_faster_than_real_time_waits_its_turn(server, audio, reference):
    fast_key, slow_key = list(audio)[:2]
    repeats = 6
    fast_audio = np.concatenate([np.concatenate([audio[fast_key], _pause(1.5, seed)])
                                 for seed in range(repeats)])
    assert len(fast_audio) / SAMPLE_RATE < 30  # within the audio limit
    pending = []

    async def watch(stop: asyncio.Event) -> None:  # the server's memory of waiting audio
        while not stop.is_set():
            pending.append((await asyncio.to_thread(server.status))["pending_seconds"])
            await asyncio.sleep(0.05)

    async def run():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        fast = asyncio.create_task(stream_audio(server.ws_url, fast_audio, piece_seconds=0.5,
                                                realtime=0))
        await asyncio.sleep(0.2)
        slow_started = time.monotonic()
        slow = await stream_audio(server.ws_url, audio[slow_key])
        slow_done = time.monotonic()
        fast_result = await fast
        stop.set()
        await watcher
        return fast_result, slow, slow_done - slow_started

    fast, slow, slow_seconds = asyncio.run(run())
    _assert_served(slow, reference[slow_key])
    assert [final["text"] for final in fast.finals] == [reference[fast_key]] * repeats
    # The real-time client's audio took its own length to send, and its results came
    # while the fast one was still being decoded (it did not wait for it).
    assert slow_seconds < len(audio[slow_key]) / SAMPLE_RATE + 5
    # The fast client was held back: the server never held much more of its audio than
    # the backlog limit (2 s) and a message.
    assert pending and max(pending) <= 2.0 + 0.5 + 0.2, max(pending)
    _idle(server)


def test_the_connection_limit(server, audio, reference):
    keys = list(audio)[:4]

    async def run():
        held = [await connect(server.ws_url) for _ in keys]
        for websocket in held:
            await websocket.send(json.dumps({"sample_rate": SAMPLE_RATE}))
            assert json.loads(await websocket.recv())["type"] == "ready"
        refused = await _bad_client(server.ws_url, {"sample_rate": SAMPLE_RATE}, None)
        texts = []
        for websocket, key in zip(held, keys, strict=True):
            for start in range(0, len(audio[key]), 1600):
                await websocket.send(audio[key][start:start + 1600].tobytes())
            await websocket.send(json.dumps({"type": "end"}))
        for websocket in held:
            messages = [json.loads(m) async for m in websocket]
            texts.append("".join(m["text"] for m in messages if m["type"] == "final"))
        # Once they are gone, a connection is served again.
        again = await stream_audio(server.ws_url, audio[keys[0]])
        return refused, texts, [w.close_code for w in held], again

    refused, texts, codes, again = asyncio.run(run())
    assert refused == (1013, "the server holds its maximum of 4 connections")
    assert texts == [reference[key] for key in keys] and codes == [1000] * 4
    _assert_served(again, reference[keys[0]])
    _idle(server)


def test_the_audio_limit_per_connection(server, audio, reference):
    key = next(iter(audio))
    utterance = np.concatenate([audio[key], _pause(1.5)])
    repeats = int(31 * SAMPLE_RATE / len(utterance)) + 1
    transcript = asyncio.run(stream_audio(server.ws_url, np.tile(utterance, repeats),
                                          piece_seconds=0.5, realtime=0))
    assert (transcript.code, transcript.reason) == (
        1008, "the audio limit of 30 s per connection")
    # The utterances within the limit were decoded.
    whole = int(30 * SAMPLE_RATE / len(utterance))
    assert [f["text"] for f in transcript.finals][:whole] == [reference[key]] * whole
    _idle(server)
