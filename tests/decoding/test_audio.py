"""Audio to decode: the lists that name it, and features equal to stage 1's."""

from __future__ import annotations

import json
from pathlib import Path

import kaldiio
import numpy as np
import pytest

from cat.core.io import write_table
from cat.decoding import audio as decoding_audio
from cat.decoding.audio import (
    AudioListError,
    Segmenting,
    from_data_list,
    from_files,
    from_wav_scp,
    recording_features,
)
from cat.features.extract import extract
from cat.features.fbank import FbankOptions, read_channel
from cat.testing.audio import make_audio_file, make_corrupt_file, write_kaldi_data_dir
from cat.testing.uio import UioUtterance, write_raw_list, write_shard_list, write_uio_shard


def stage1(data_dir: Path, feat_dir: Path) -> dict[str, np.ndarray]:
    extract(data_dir, feat_dir, progress=False)
    return {key: np.asarray(matrix)
            for key, matrix in kaldiio.load_scp(str(feat_dir / "feats.scp")).items()}


def features_of(audio) -> dict[str, np.ndarray | str]:
    return {key: result for recording in audio.recordings
            for key, result in recording_features(recording, FbankOptions())}


@pytest.fixture
def recordings(tmp_path) -> dict[str, str]:
    audio = tmp_path / "audio"
    wav = make_audio_file(audio / "a.wav", 1.1, seed=1)
    return {"a": str(wav),
            "b": str(make_audio_file(audio / "b.flac", 0.9, sample_rate=22050, seed=2)),
            "c": str(make_audio_file(audio / "c.opus", 1.0, seed=3)),
            "d": str(make_audio_file(audio / "d.wav", 0.7, sample_rate=8000, seed=4)),
            "p": f"cat {wav} |"}


def test_wav_scp_features_are_stage_ones(tmp_path, recordings):
    data_dir = write_kaldi_data_dir(tmp_path / "data", recordings)
    expected = stage1(data_dir, tmp_path / "fbank")
    audio = from_wav_scp(data_dir / "wav.scp")
    assert [r.where for r in audio.recordings] == [f"{data_dir / 'wav.scp'}:{n}"
                                                   for n in range(1, 6)]
    got = features_of(audio)
    assert list(got) == list(expected) == ["a", "b", "c", "d", "p"]
    for key, matrix in expected.items():
        np.testing.assert_array_equal(got[key], matrix, err_msg=key)


def test_segments_are_cut_as_stage_one_cuts_them(tmp_path, recordings):
    long = make_audio_file(tmp_path / "audio/long.flac", 3.0, seed=5)
    segments = {"L-1": ("long", 0.0, 1.2), "L-2": ("long", 1.1, 2.0),
                "L-3": ("long", 2.5, 3.02),  # ends 20 ms past the recording: clipped
                "L-4": ("long", 3.5, 4.0),   # after the end
                "A-1": ("a", 0.2, -1)}       # to the end of the recording
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(long),
                                                        "a": recordings["a"]},
                                    segments=segments)
    expected = stage1(data_dir, tmp_path / "fbank")
    audio = from_wav_scp(data_dir / "wav.scp", data_dir / "segments")
    assert [len(r.pieces) for r in audio.recordings] == [1, 4]  # wav.scp order: a, long
    got = features_of(audio)
    assert sorted(expected) == ["A-1", "L-1", "L-2", "L-3"]
    for key, matrix in expected.items():
        np.testing.assert_array_equal(got[key], matrix, err_msg=key)
    # segments lines in byte order: A-1, L-1, L-2, L-3, L-4
    assert got["L-4"].startswith(f"{data_dir / 'segments'}:5: segment starts at 3.5 s, "
                                 "after the recording end")


def test_unreadable_audio_is_named_by_its_line(tmp_path, recordings):
    good = recordings["a"]
    wav_scp = tmp_path / "wav.scp"
    write_table(wav_scp, [("u1", good), ("u2", str(tmp_path / "missing.wav")),
                          ("u3", str(make_corrupt_file(tmp_path / "garbage.wav", "garbage"))),
                          ("u4", str(make_corrupt_file(tmp_path / "half.wav", "truncated",
                                                       source=good))),
                          ("u5", "false |")], sort=False)
    got = features_of(from_wav_scp(wav_scp))
    assert isinstance(got["u1"], np.ndarray)
    assert got["u2"] == f"{wav_scp}:2: no such file: {tmp_path / 'missing.wav'}"
    assert got["u3"].startswith(f"{wav_scp}:3: cannot decode {tmp_path / 'garbage.wav'}")
    assert got["u4"].startswith(f"{wav_scp}:4: truncated audio")
    assert got["u5"].startswith(f"{wav_scp}:5: command 'false' exited with status 1")


def test_audio_files_are_keyed_by_name(tmp_path, recordings):
    audio = from_files([recordings["a"], recordings["b"]])
    assert [r.pieces[0].key for r in audio.recordings] == ["a", "b"]
    with pytest.raises(AudioListError, match=r"audio file 2 \(.*a.flac\): key 'a' again "
                                             r"\(audio file 1 has it\)"):
        from_files([recordings["a"], str(make_audio_file(tmp_path / "x/a.flac", 0.5))])
    with pytest.raises(AudioListError, match="holds whitespace"):
        from_files([str(make_audio_file(tmp_path / "my file.wav", 0.5))])


def test_raw_data_list(tmp_path, recordings):
    path = write_raw_list(tmp_path / "raw.list", [("A/B/utt.1", recordings["a"], "今天"),
                                                  ("x.y", recordings["c"], "好")])
    with open(path, "a", encoding="utf-8") as f:  # a WeNet segment: seconds of a file
        f.write(json.dumps({"key": "A/B/utt.2", "wav": recordings["a"], "txt": "天",
                            "start": 0.1, "end": 0.8}) + "\n")
    audio = from_data_list(path)
    assert [[p.key for p in r.pieces] for r in audio.recordings] == [
        ["A/B/utt.1", "A/B/utt.2"], ["x.y"]]  # file a is read once
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"a": recordings["a"],
                                                        "c": recordings["c"]},
                                    segments={"s": ("a", 0.1, 0.8)})
    expected = stage1(data_dir, tmp_path / "fbank")
    whole = stage1(write_kaldi_data_dir(tmp_path / "whole", {"a": recordings["a"],
                                                             "c": recordings["c"]}),
                   tmp_path / "whole_fbank")
    got = features_of(audio)
    np.testing.assert_array_equal(got["A/B/utt.1"], whole["a"])
    np.testing.assert_array_equal(got["A/B/utt.2"], expected["s"])
    np.testing.assert_array_equal(got["x.y"], whole["c"])


def test_malformed_data_lists_are_audio_list_errors_naming_the_line(tmp_path):
    # The checks themselves: tests/formats/test_data_list.py.
    path = tmp_path / "raw.list"
    path.write_text('{"key": "a", "wav": "a.wav"}\n\n{"key": "a", "wav": "b.wav"}\n',
                    encoding="utf-8")
    with pytest.raises(AudioListError, match=r"raw.list:3: key 'a' again \(first at "
                                             r".*raw.list:1\)"):
        from_data_list(path)


def test_duplicate_wav_scp_recording_names_both_lines(tmp_path):
    path = tmp_path / "wav.scp"
    path.write_text("a x.wav\nb y.wav\na z.wav\n", encoding="utf-8")
    with pytest.raises(AudioListError, match=r"wav.scp:3: recording 'a' again "
                                             r"\(first at .*wav.scp:1\)"):
        from_wav_scp(path)


def test_shard_members_are_grouped_by_the_last_dot(tmp_path, recordings):
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"a": recordings["a"]})
    expected = stage1(data_dir, tmp_path / "fbank")["a"]
    wav = Path(recordings["a"]).read_bytes()
    shard = write_uio_shard(tmp_path / "shards/shard-0.tar", [
        UioUtterance("A/B/utt.1", wav, "今天"),
        UioUtterance("C/only.text", b"", "好", audio_format="txt"),  # two .txt members
        UioUtterance("bad.1", b"RIFF garbage", "天"),
        UioUtterance("sp0.9-utt.2", wav, "气", audio_format="wav"),
    ])
    truncated = tmp_path / "shards/shard-1.tar"
    truncated.write_bytes(shard.read_bytes()[:3000])
    list_path = write_shard_list(tmp_path / "data.list",
                                 [shard, truncated, tmp_path / "shards/missing.tar"])
    audio = from_data_list(list_path)
    assert all(r.shard for r in audio.recordings)
    results = [(key, result) for recording in audio.recordings
               for key, result in recording_features(recording, FbankOptions())]
    keys = [key for key, _ in results]
    assert keys == ["A/B/utt.1", "C/only.text", "bad.1", "sp0.9-utt.2", "A/B/utt.1",
                    str(tmp_path / "shards/missing.tar")]
    got = dict(results[:4])
    np.testing.assert_array_equal(got["A/B/utt.1"], expected)
    np.testing.assert_array_equal(got["sp0.9-utt.2"], expected)
    assert got["C/only.text"] == (f"{list_path}:1: {shard}: no audio member for key "
                                  "'C/only.text' (members: C/only.text.txt)")
    assert got["bad.1"].startswith(f"cannot decode audio {list_path}:1: {shard}:bad.1.wav")
    assert results[4][1].startswith(f"{list_path}:2: {truncated}: the shard breaks off at key "
                                    "'A/B/utt.1'")
    assert results[5][1].startswith(f"{list_path}:3: {tmp_path / 'shards/missing.tar'}: "
                                    "FileNotFoundError")


def _recording_reads(monkeypatch) -> list[tuple[str, int, int | None]]:
    """Every `read_channel` call of `recording_features`: (name, start, stop)."""
    reads: list[tuple[str, int, int | None]] = []

    def counting(audio, name, start=0, stop=None):
        reads.append((name, start, stop))
        return read_channel(audio, name, start, stop)

    monkeypatch.setattr(decoding_audio, "read_channel", counting)
    return reads


def test_an_utterance_longer_than_the_window_is_refused_unread(tmp_path, recordings,
                                                               monkeypatch):
    data_dir = write_kaldi_data_dir(tmp_path / "data", recordings)
    expected = stage1(data_dir, tmp_path / "fbank")
    reads = _recording_reads(monkeypatch)
    wav_scp = data_dir / "wav.scp"
    got = {key: result for recording in from_wav_scp(wav_scp).recordings
           for key, result in recording_features(recording, FbankOptions(), max_frames=95)}
    # 0.95 s: a (1.1 s), c (1.0 s) and the command p (a) are refused; b and d fit.
    assert got["a"] == (
        f"{wav_scp}:1: {recordings['a']}: the recording lasts 1.1 s (0:00:01), longer than "
        "the transcription window of 0.95 s: an utterance is decoded whole, so it is not "
        "read; decode it in windows (--max-segment), split it into shorter utterances (a "
        "segments file), or raise $CAT_TRANSCRIBE_WINDOW_SECONDS (seconds)")
    assert got["c"].startswith(f"{wav_scp}:3: {recordings['c']}: the recording lasts 1.0 s")
    assert got["p"].startswith(f"{wav_scp}:5: command '{recordings['p'][:-1].strip()}': the "
                               "recording lasts 1.1 s (0:00:01), longer than the "
                               "transcription window of 0.95 s")
    for key in "bd":
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert reads == [(recordings["b"], 0, None), (recordings["d"], 0, None)]


def test_segments_of_a_long_recording_read_only_their_samples(tmp_path, monkeypatch):
    long = make_audio_file(tmp_path / "audio/long.flac", 6.0, seed=6)
    segments = {"L-1": ("long", 0.5, 1.2), "L-2": ("long", 4.0, 4.6),
                "L-3": ("long", 2.0, 5.9),   # 3.9 s: longer than the window
                "L-4": ("long", 5.5, -1)}    # to the end
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(long)},
                                    segments=segments)
    expected = stage1(data_dir, tmp_path / "fbank")
    reads = _recording_reads(monkeypatch)
    got = {key: result for recording in
           from_wav_scp(data_dir / "wav.scp", data_dir / "segments").recordings
           for key, result in recording_features(recording, FbankOptions(), max_frames=200)}
    for key in ("L-1", "L-2", "L-4"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert got["L-3"] == (
        f"{data_dir / 'segments'}:3: {long}: the segment 2 s to 5.9 s of it lasts 3.9 s "
        "(0:00:04), longer than the transcription window of 2 s: an utterance is decoded "
        "whole, so it is not read; decode it in windows (--max-segment), split it into "
        "shorter utterances (a segments file), or raise $CAT_TRANSCRIBE_WINDOW_SECONDS "
        "(seconds)")
    assert reads == [(str(long), 8000, 19200), (str(long), 64000, 73600),
                     (str(long), 88000, 96000)]


def test_a_long_utterance_is_read_a_window_at_a_time(tmp_path, monkeypatch):
    """Windows of 2 s overlapping by 0.5 s: each window's samples alone are read, and its
    features are stage 1's of that stretch; at another rate too (then resampled)."""
    long = make_audio_file(tmp_path / "audio/long.flac", 6.2, seed=6)
    spans = [(0.0, 2.0), (1.5, 3.5), (3.0, 5.0), (4.5, 6.2)]
    segments = {f"w{index}": ("long", start, end) for index, (start, end) in enumerate(spans)}
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(long)},
                                    segments=segments)
    expected = stage1(data_dir, tmp_path / "fbank")
    reads = _recording_reads(monkeypatch)
    (recording,) = from_wav_scp(data_dir / "wav.scp").recordings
    got = list(recording_features(recording, FbankOptions(), max_frames=300,
                                  segmenting=Segmenting(2.0, 0.5, vad="none")))
    assert [key for key, _ in got] == ["long"] * 4
    assert [(window.index, window.start) for _, window in got] == [
        (index, start) for index, (start, _) in enumerate(spans)]
    for (_, window), key in zip(got, segments, strict=True):
        np.testing.assert_array_equal(window.features, expected[key], err_msg=key)
    assert reads == [(str(long), round(start * 16000), round(end * 16000))
                     for start, end in spans]
    # Shorter than a window: decoded whole, as without windows.
    short = list(recording_features(recording, FbankOptions(),
                                    segmenting=Segmenting(7.0, 1, vad="none")))
    assert len(short) == 1 and isinstance(short[0][1], np.ndarray)

    # 8 kHz audio: each window read at 8 kHz and resampled to 16 kHz.
    low = make_audio_file(tmp_path / "audio/low.wav", 6.2, sample_rate=8000, seed=6)
    (recording,) = from_files([low]).recordings
    reads.clear()
    got = list(recording_features(recording, FbankOptions(),
                                  segmenting=Segmenting(2.0, 0.5, vad="none")))
    assert [window.start for _, window in got] == [start for start, _ in spans]
    assert [len(window.features) for _, window in got] == [198, 198, 198, 168]
    assert reads == [(str(low), round(start * 8000), round(end * 8000)) for start, end in spans]


def test_a_last_window_too_short_for_a_frame_joins_the_one_before(tmp_path):
    """--max-segment 6 --segment-overlap 0 on 12.01 s: the last 10 ms hold no 25 ms frame;
    that window joins the one before (6 s to 12.01 s) instead of losing the recording."""
    assert Segmenting(6.0, 0.0).starts(192160, 16000, min_samples=400) == [
        (0, 96000), (96000, 192160)]
    assert Segmenting(6.0, 0.0).starts(192400, 16000, min_samples=400) == [
        (0, 96000), (96000, 192000), (192000, 192400)]  # one whole frame: its own window
    long = make_audio_file(tmp_path / "audio/long.wav", 12.01, seed=7)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(long)},
                                    segments={"w0": ("long", 0.0, 6.0),
                                              "w1": ("long", 6.0, -1)})
    expected = stage1(data_dir, tmp_path / "fbank")
    (recording,) = from_files([long]).recordings
    got = list(recording_features(recording, FbankOptions(),
                                  segmenting=Segmenting(6.0, 0.0, vad="none")))
    assert [(key, window.index, window.start) for key, window in got] == [
        ("long", 0, 0.0), ("long", 1, 6.0)]
    np.testing.assert_array_equal(got[0][1].features, expected["w0"])
    np.testing.assert_array_equal(got[1][1].features, expected["w1"])


def test_window_settings_are_checked():
    assert Segmenting(20, 4).starts(16000 * 50, 16000) == [
        (0, 320000), (256000, 576000), (512000, 800000)]
    with pytest.raises(ValueError, match="--segment-overlap 10: expected at least 0 and less "
                                         "than half of --max-segment 20 seconds"):
        Segmenting(20, 10)
    with pytest.raises(ValueError, match="--max-segment 0: expected a positive number"):
        Segmenting(0, 0)
