"""The server's protocol (`cat.serving.protocol`): the start message, audio messages, the
close codes and reasons of what may not be sent, and the results' JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cat.serving.protocol import (
    CloseCode,
    ProtocolError,
    Result,
    TimedToken,
    parse_audio,
    parse_start,
    truncate_reason,
)


def test_a_start_message():
    start = parse_start(json.dumps({"sample_rate": 16000, "format": "int16",
                                    "hotwords": ["天地 :2.5", "山水"], "hotwords_score": 2}),
                        16000)
    assert (start.sample_rate, start.format, start.hotwords, start.hotwords_score) == (
        16000, "int16", ("天地 :2.5", "山水"), 2.0)
    assert parse_start('{"sample_rate": 16000, "hotwords": "a\\nb"}', 16000).hotwords == (
        "a", "b")
    assert parse_start('{"type": "start", "sample_rate": 16000}', 16000).format == "float32"


@pytest.mark.parametrize(("message", "code", "reason"), [
    ('{"sample_rate": 8000}', CloseCode.WRONG_SAMPLE_RATE,
     "audio at 8000 Hz: the model takes 16000 Hz audio; resample it first"),
    (b"\x00\x00\x00\x00", CloseCode.UNSUPPORTED_DATA,
     "audio before the start message: send a JSON start first"),
    ("hello", CloseCode.BAD_MESSAGE, "the start message is not JSON (Expecting value)"),
    ("[16000]", CloseCode.BAD_MESSAGE, "the start message must be a JSON object"),
    ('{"sample_rate": 16000, "rate": 1}', CloseCode.BAD_MESSAGE,
     "unknown start key 'rate'; the keys are type, sample_rate, format, hotwords, "
     "hotwords_score"),
    ('{"sample_rate": "16000"}', CloseCode.BAD_MESSAGE, "sample_rate: an integer is required"),
    ('{"sample_rate": 16000, "format": "mp3"}', CloseCode.BAD_MESSAGE,
     "format 'mp3': one of float32, int16"),
    ('{"sample_rate": 16000, "hotwords": [1]}', CloseCode.BAD_MESSAGE,
     "hotwords: a list of phrases (or one string of lines)"),
    ('{"type": "end"}', CloseCode.BAD_MESSAGE, "the first message must be the start"),
])
def test_bad_start_messages(message, code, reason):
    with pytest.raises(ProtocolError) as caught:
        parse_start(message, 16000)
    assert (caught.value.code, caught.value.reason) == (code, reason)


def test_audio_messages():
    start = parse_start('{"sample_rate": 16000}', 16000)
    samples = np.array([0.5, -0.25, 0.0], np.float32)
    assert parse_audio(samples.astype("<f4").tobytes(), start).tolist() == [0.5, -0.25, 0.0]
    int16 = parse_start('{"sample_rate": 16000, "format": "int16"}', 16000)
    assert parse_audio(np.array([16384, -32768], "<i2").tobytes(), int16).tolist() == [
        0.5, -1.0]
    assert parse_audio('{"type": "end"}', start) is None
    with pytest.raises(ProtocolError) as caught:
        parse_audio("more audio", start)
    assert caught.value.code == CloseCode.UNSUPPORTED_DATA
    assert caught.value.reason.startswith("text where audio is expected")
    with pytest.raises(ProtocolError) as caught:
        parse_audio(b"\x00" * 6, start)
    assert (caught.value.code, caught.value.reason) == (
        CloseCode.BAD_MESSAGE, "6 bytes: not whole float32 samples (4 bytes each)")
    with pytest.raises(ProtocolError, match="not finite"):
        parse_audio(np.array([np.nan], "<f4").tobytes(), start)


def test_close_reasons_fit_a_close_frame():
    long = "音" * 100
    cut = truncate_reason(long)
    assert len(cut.encode("utf-8")) <= 123 and cut.endswith("...")
    assert truncate_reason("short") == "short"
    assert len(ProtocolError(CloseCode.BAD_MESSAGE, long).reason.encode("utf-8")) <= 123


def test_a_result_as_json():
    result = Result(2, True, 3.25, "天地", (TimedToken("天", 3.5, 3.7), TimedToken("地", 3.7,
                                                                                4.0)), 4.5)
    assert json.loads(result.message()) == {
        "type": "final", "final": True, "segment": 2, "start": 3.25, "text": "天地",
        "tokens": [{"text": "天", "start": 3.5, "end": 3.7},
                   {"text": "地", "start": 3.7, "end": 4.0}], "decoded": 4.5}
    assert json.loads(Result(0, False, 0.0, "").message())["type"] == "partial"
