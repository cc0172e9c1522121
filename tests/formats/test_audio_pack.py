"""Audio shards: round trip, third-party readers, length groups, segments, drops, re-runs."""

from __future__ import annotations

import json
import os
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile
import webdataset as wds

from cat.audio import codec
from cat.core.config import ConfigError
from cat.core.io import TableError, read_table, write_table
from cat.features.fbank import num_frames
from cat.formats import audio_pack, audio_writer, prep_wds, shard_check, shard_format
from cat.testing.audio import (
    make_audio_file,
    make_corrupt_file,
    make_data_dir,
    make_segmented_data_dir,
    write_kaldi_data_dir,
)

RATE = 16000


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three data dirs: whole 22.05 kHz FLAC files; long 16 kHz Opus recordings with
    segments; a stereo WAV whose id has dots."""
    root = tmp_path_factory.mktemp("audio-corpus")
    whole = make_data_dir(root / "whole", durations=(1.0, 1.3, 0.8, 1.6, 2.2),
                          sample_rate=22050, extension=".flac")
    segmented = make_segmented_data_dir(root / "long")
    stereo = make_audio_file(root / "stereo" / "s.wav", 1.1, channels=2, seed=9)
    dotted = write_kaldi_data_dir(root / "dotted", {"sp0.9-A/B.1": str(stereo)},
                                  {"sp0.9-A/B.1": "点 和 斜线"})
    return [whole, segmented, dotted]


def _source_audio(data_dirs: list[Path]) -> dict[str, np.ndarray]:
    """Each utterance's expected 16 kHz samples, cut from its source as Kaldi would."""
    expected = {}
    for data_dir in data_dirs:
        wav_scp = read_table(data_dir / "wav.scp")
        recordings = {}
        for recording, path in wav_scp.items():
            samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
            recordings[recording] = codec.resample(samples[:, 0], rate, RATE)
        if (data_dir / "segments").is_file():
            for utt, value in read_table(data_dir / "segments").items():
                recording, start, end = value.split()
                audio = recordings[recording]
                expected[utt] = audio[int(float(start) * RATE):
                                      min(int(float(end) * RATE), len(audio))]
        else:
            expected.update(recordings)
    return expected


def _texts(data_dirs: list[Path]) -> dict[str, str]:
    return {k: v for d in data_dirs for k, v in read_table(d / "text").items()}


def _files(directory: Path) -> dict[str, bytes]:
    """Every file's bytes; in `data.list` (absolute shard paths) the folder reads `<out>`."""
    return {str(p.relative_to(directory)):
            p.read_bytes().replace(str(directory.resolve()).encode(), b"<out>")
            if p.name == "data.list" else p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _decoded_members(shards: list[Path], audio_format: str) -> dict[str, tuple[np.ndarray, str]]:
    """Every utterance of the shards as plain webdataset reads it: (samples, transcript)."""
    members = {}
    for sample in wds.WebDataset([str(s) for s in shards], shardshuffle=False):
        key = shard_format.decode_key(sample["__key__"])
        assert {name for name in sample if not name.startswith("__")} == {audio_format, "txt"}
        waveform, rate = codec.decode(sample[audio_format], name=key)
        assert rate == RATE and key not in members
        members[key] = (waveform, sample["txt"].decode("utf-8"))
    return members


@pytest.mark.parametrize("audio_format", ["wav", "flac", "opus"])
def test_round_trip_through_plain_readers(corpus, tmp_path, audio_format):
    out = tmp_path / "shards"
    summary = audio_pack.pack_audio(corpus, out, audio_format, utts_per_file=4)
    expected, texts = _source_audio(corpus), _texts(corpus)
    assert summary.dropped == {} and summary.num_utts == {".": len(expected)}
    index = shard_format.read_index(out)
    assert index.header["content"] == "audio" and index.header["audio_format"] == audio_format
    assert index.header["sample_rate"] == RATE and index.header["feat_dim"] is None
    assert index.header["bitrate"] == (codec.DEFAULT_OPUS_BITRATE if audio_format == "opus"
                                       else None)
    for record, path in zip(index.shards, index.paths(), strict=True):
        with tarfile.open(path) as tar:
            assert tar.getnames() == [f"{shard_format.encode_key(k)}.{ext}"
                                      for k in record["keys"] for ext in (audio_format, "txt")]
    members = _decoded_members(index.paths(), audio_format)
    assert sorted(members) == sorted(expected)
    frames = {k: f for r in index.shards for k, f in zip(r["keys"], r["frames"], strict=True)}
    for key, (waveform, text) in members.items():
        assert text == texts[key]
        assert len(waveform) == len(expected[key])
        assert frames[key] == num_frames(len(expected[key])) > 0
        if audio_format == "opus":
            error = waveform - expected[key]
            snr = 10 * np.log10(np.sum(expected[key] ** 2) / np.sum(error ** 2))
            assert snr > 10, (key, snr)
        else:
            assert np.array_equal(codec.to_int16(waveform), codec.to_int16(expected[key]))
    assert shard_check.validate(out) == []


def test_length_groups_by_duration_and_recordings_in_time_order(corpus, tmp_path):
    out = tmp_path / "shards"
    groups = ["0:90", "90:140", "200:"]
    summary = audio_pack.pack_audio(corpus, out, "flac", filter_group=groups, utts_per_file=3,
                                    seed=5)
    frames = {key: num_frames(len(audio)) for key, audio in _source_audio(corpus).items()}
    expected = {"0_90": {k for k, f in frames.items() if f < 90},
                "90_140": {k for k, f in frames.items() if 90 <= f < 140},
                "200_": {k for k, f in frames.items() if f >= 200}}
    gap = {k for k, f in frames.items() if 140 <= f < 200}
    assert all(expected.values()) and gap
    assert summary.dropped == {"out_of_range": len(gap)}
    dropped = read_table(out / "dropped.txt")
    assert set(dropped) == gap and all(v.startswith("out_of_range") for v in dropped.values())
    segments = read_table(corpus[1] / "segments")
    for name, keys in expected.items():
        index = shard_format.read_index(out / name)
        listed = [k for r in index.shards for k in r["keys"]]
        assert set(listed) == keys and len(listed) == len(keys)
        assert index.num_frames == sum(frames[k] for k in keys)
        assert [f for r in index.shards for f in r["frames"]] == [frames[k] for k in listed]
        # A recording's segments are consecutive, in time order; recordings are shuffled.
        runs = [segments[k].split()[0] for k in listed if k in segments]
        starts = [float(segments[k].split()[1]) for k in listed if k in segments]
        seen = []
        for position, recording in enumerate(runs):
            if not seen or seen[-1] != recording:
                assert recording not in seen
                seen.append(recording)
            elif position:
                assert starts[position] > starts[position - 1]
        sizes = [r["num_utts"] for r in index.shards]
        assert max(sizes) <= 3 and max(sizes) - min(sizes) <= 1
        assert shard_check.validate(out / name) == []
        # WeNet's data.list next to the index: the folder's shards, absolute, in order.
        assert (out / name / "data.list").read_text().splitlines() == \
            [str((out / name / r["shard"]).resolve()) for r in index.shards]
    other = tmp_path / "other"
    audio_pack.pack_audio(corpus, other, "flac", filter_group=groups, utts_per_file=3, seed=6)
    order = [k for r in shard_format.read_index(out / "0_90").shards for k in r["keys"]]
    assert order != [k for r in shard_format.read_index(other / "0_90").shards
                     for k in r["keys"]]


def test_each_recording_is_decoded_once_per_shard(corpus, tmp_path, monkeypatch):
    reads = []
    original = audio_writer.read_audio_with_channels

    def counting_read(spec):
        reads.append(spec)
        return original(spec)

    monkeypatch.setattr(audio_writer, "read_audio_with_channels", counting_read)
    out = tmp_path / "shards"
    audio_pack.pack_audio([corpus[1]], out, "wav", utts_per_file=5)
    wav_scp = read_table(corpus[1] / "wav.scp")
    recording_of = {utt: wav_scp[value.split()[0]]
                    for utt, value in read_table(corpus[1] / "segments").items()}
    index = shard_format.read_index(out)
    per_shard = [{recording_of[k] for k in record["keys"]} for record in index.shards]
    assert sorted(reads) == sorted(r for shard in per_shard for r in shard)
    assert len(reads) < len(recording_of)
    assert len(reads) <= len(wav_scp) + len(index.shards) - 1


def test_drops_are_counted_and_listed(tmp_path):
    good = make_audio_file(tmp_path / "audio" / "good.wav", 1.0)
    truncated = make_corrupt_file(tmp_path / "audio" / "truncated.wav", "truncated",
                                  make_audio_file(tmp_path / "audio" / "full.wav", 1.0))
    wav_scp = {"good": str(good), "missing": str(tmp_path / "audio" / "missing.wav"),
               "garbage": str(make_corrupt_file(tmp_path / "audio" / "garbage.wav", "garbage")),
               "truncated": str(truncated),
               "tiny": str(make_audio_file(tmp_path / "audio" / "tiny.wav", 0.02)),
               "unlabelled": str(good), "empty": str(good)}
    text = {utt: "有 文本" for utt in wav_scp if utt != "unlabelled"}
    text.update(empty="", orphan="没有 音频")
    whole = write_kaldi_data_dir(tmp_path / "whole", wav_scp, text)
    long = make_audio_file(tmp_path / "audio" / "long.wav", 3.0)
    segments = {"L-ok": ("long", 0.0, 1.0), "L-clipped": ("long", 2.5, 3.03),
                "L-past": ("long", 2.5, 3.6), "L-empty": ("long", 1.0, 1.0),
                "L-after": ("long", 3.5, 4.0)}
    cut = write_kaldi_data_dir(tmp_path / "cut", {"long": str(long)},
                               {utt: "一 段" for utt in segments}, segments=segments)
    out = tmp_path / "shards"
    summary = audio_pack.pack_audio([whole, cut], out, "wav")

    assert summary.dropped == {"bad_audio": 3, "too_short": 1, "no_label": 1, "no_audio": 1,
                               "empty_label": 1, "bad_segment": 3}
    dropped = read_table(out / "dropped.txt")
    assert dropped["missing"] == f"bad_audio no such file: {wav_scp['missing']}"
    assert dropped["garbage"].startswith(f"bad_audio cannot decode {wav_scp['garbage']}")
    # The header of a truncated WAV reads fine: decoding it finds it short.
    assert dropped["truncated"].startswith(f"bad_audio truncated audio {truncated}")
    assert dropped["tiny"] == "too_short 320 samples at 16000 Hz, need 400"
    assert (dropped["unlabelled"], dropped["orphan"], dropped["empty"]) == \
        ("no_label", "no_audio", "empty_label")
    assert "more than 0.05 s after the recording end" in dropped["L-past"]
    assert "empty segment" in dropped["L-empty"] and "after the recording end" in \
        dropped["L-after"]
    index = shard_format.read_index(out)
    frames = dict(zip(index.shards[0]["keys"], index.shards[0]["frames"], strict=True))
    assert frames == {"good": 98, "L-ok": 98, "L-clipped": num_frames(8000)}
    assert summary.num_input == 3 + len(dropped) == len(wav_scp) + 1 + len(segments)
    assert shard_check.validate(out) == []

    again = audio_pack.pack_audio([whole, cut], out, "wav")
    assert again.shards_written == 0 and again.dropped == summary.dropped
    assert read_table(out / "dropped.txt") == dropped


def test_commands_in_wav_scp(tmp_path):
    source = make_audio_file(tmp_path / "audio" / "r.wav", 2.0, seed=3)
    command = f"cat {source} |"
    no_segments = write_kaldi_data_dir(tmp_path / "plain", {"a": str(source), "r": command},
                                       {"a": "一", "r": "二"})
    with pytest.raises(TableError, match=r"plain/wav.scp:2: recording 'r' is a command .* "
                                         "duration cannot be known without decoding"):
        audio_pack.pack_audio(no_segments, tmp_path / "out", "wav")
    to_end = write_kaldi_data_dir(tmp_path / "to-end", {"r": command}, {"s1": "一", "s2": "二"},
                                  segments={"s1": ("r", 0.0, 1.0), "s2": ("r", 1.0, -1)})
    with pytest.raises(TableError, match=r"to-end/segments:2: segment 's2' runs to the end"):
        audio_pack.pack_audio(to_end, tmp_path / "out", "wav")
    cut = write_kaldi_data_dir(tmp_path / "cut", {"r": command}, {"s1": "一", "s2": "二"},
                               segments={"s1": ("r", 0.0, 1.0), "s2": ("r", 1.5, 2.5)})
    summary = audio_pack.pack_audio(cut, tmp_path / "out", "wav")
    # s2 ends past the recording (2.0 s): known only once the command ran.
    assert summary.num_utts == {".": 1} and summary.dropped == {"bad_segment": 1}
    members = _decoded_members([tmp_path / "out" / "data-00000.tar"], "wav")
    assert np.array_equal(members["s1"][0], soundfile.read(source, dtype="float32")[0][:RATE])


@pytest.mark.slow
def test_rerun_keeps_shards_and_rewrites_only_changed_ones(corpus, tmp_path):
    data = make_segmented_data_dir(tmp_path / "long", durations=(6.0, 4.5, 3.2, 5.0),
                                   extension=".wav")
    out = tmp_path / "shards"
    first = audio_pack.pack_audio(data, out, "flac", utts_per_file=3, num_jobs=2)
    before = _files(out)
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    again = audio_pack.pack_audio(data, out, "flac", utts_per_file=3)
    assert again.shards_written == 0 and again.shards_kept == first.num_shards["."]
    assert _files(out) == before
    single = tmp_path / "single"  # one process writes the same bytes as two
    audio_pack.pack_audio(data, single, "flac", utts_per_file=3, num_jobs=1)
    assert _files(single) == before

    wav_scp = read_table(data / "wav.scp")
    make_audio_file(wav_scp["R0002"], 3.2, seed=77)  # new audio, same length
    texts = read_table(data / "text")
    texts["R0000-S0001"] = "改过 的 文本"
    write_table(data / "text", texts.items())
    index = shard_format.read_index(out)
    changed = {r["shard"] for r in index.shards
               if any(k.startswith("R0002-") or k == "R0000-S0001" for k in r["keys"])}
    assert 0 < len(changed) < len(index.shards)
    summary = audio_pack.pack_audio(data, out, "flac", utts_per_file=3)
    assert summary.shards_written == len(changed)
    after = _files(out)
    for name, mtime in mtimes.items():
        if name in changed:
            assert after[name] != before[name]
        else:
            assert after[name] == before[name]
            assert (out / name).stat().st_mtime_ns == mtime
    assert shard_check.validate(out) == []
    # Other options are another packing: the same names are rewritten, leftovers refused.
    with pytest.raises(FileExistsError, match=r"data-00001\.tar"):
        audio_pack.pack_audio(data, out, "flac", utts_per_file=100)


def test_interrupted_pack_resumes_to_identical_shards(corpus, tmp_path, monkeypatch):
    reference = tmp_path / "reference"
    audio_pack.pack_audio(corpus, reference, "opus", utts_per_file=4)
    calls = []
    original = codec.encode

    def failing_encode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # the 3rd shard's 2nd utterance
            raise RuntimeError("disk full")
        return original(*args, **kwargs)

    monkeypatch.setattr(codec, "encode", failing_encode)
    out = tmp_path / "shards"
    with pytest.raises(RuntimeError, match="disk full"):
        audio_pack.pack_audio(corpus, out, "opus", utts_per_file=4)
    left = sorted(p.name for p in out.iterdir())
    assert left == [".parts", "data-00000.tar", "data-00001.tar"]
    monkeypatch.setattr(codec, "encode", original)
    summary = audio_pack.pack_audio(corpus, out, "opus", utts_per_file=4)
    assert summary.shards_kept == 2
    assert _files(out) == _files(reference)


def test_options_are_checked(corpus, tmp_path):
    with pytest.raises(ValueError, match="audio format must be one of"):
        audio_pack.pack_audio(corpus, tmp_path / "out", "mp3")
    with pytest.raises(ValueError, match="Opus bitrate must be in"):
        audio_pack.pack_audio(corpus, tmp_path / "out", "opus", opus_bitrate=1000)
    with pytest.raises(ValueError, match="a bitrate is for opus"):
        audio_pack.pack_audio(corpus, tmp_path / "out", "flac", opus_bitrate=32000)
    with pytest.raises(ValueError, match="no utterances left to pack"):
        audio_pack.pack_audio(corpus, tmp_path / "out", "flac", filter_group=["100000:"])
    duplicate = write_kaldi_data_dir(tmp_path / "again", read_table(corpus[2] / "wav.scp"),
                                     read_table(corpus[2] / "text"))
    with pytest.raises(TableError, match=r"again/wav.scp:1: duplicate utterance 'sp0.9-A/B.1' "
                                         r"\(also in .*dotted/wav.scp\)"):
        audio_pack.pack_audio([corpus[2], duplicate], tmp_path / "out", "flac")


def test_pack_exp_packs_audio_when_data_shards_says_so(corpus, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp" / "audio"
    exp.mkdir(parents=True)
    hyper = {"data": {"train": [str(d) for d in corpus],
                      "shards": {"dir": "data/wds_audio/train", "filter_group": ["0:150", "150:"],
                                 "utts_per_file": 5, "audio": {"format": "opus",
                                                               "bitrate": 48000}}},
             "train": {"bin": "cat.ctc.train", "option": {"large_dataset": True}}}
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    prep_wds.main(["pack-exp", str(exp)])
    out = tmp_path / "data/wds_audio/train"
    indexes = [shard_format.read_index(out / name) for name in ("0_150", "150_")]
    assert sum(index.num_utts for index in indexes) == len(_source_audio(corpus))
    for index in indexes:
        assert index.header["audio_format"] == "opus" and index.header["bitrate"] == 48000
        assert index.header["utts_per_file"] == 5
        assert shard_check.validate(index.directory) == []
    prep_wds.main(["pack-exp", str(exp)])
    assert "shards in data/wds_audio/train are up to date" in caplog.text

    hyper["data"]["shards"]["audio"]["format"] = "mp3"
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"data.shards.audio.format: 'mp3' is not one of"):
        prep_wds.pack_experiment(exp)
    hyper["data"]["shards"]["audio"] = {"format": "flac"}
    hyper["data"]["shards"]["dtype"] = "float16"
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(ValueError, match="dtype is the dtype of feature shards"):
        prep_wds.pack_experiment(exp)
    del hyper["data"]["shards"]["dtype"]
    hyper["data"]["train"] = str(tmp_path / "nowhere")
    (exp / "hyper-p.json").write_text(json.dumps(hyper), encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"nowhere/wav.scp does not exist"):
        prep_wds.pack_experiment(exp)


@pytest.mark.slow
def test_cli_packs_audio(corpus, tmp_path):
    out = tmp_path / "cli"
    prep_wds.main(["pack-audio", "--data", *map(str, corpus), "--out", str(out), "--format",
                   "opus", "--bitrate", "24000", "--filter-group", "0:150", "150:",
                   "--utts-per-file", "4", "--nj", "2", "--seed", "1"])
    headers = [shard_format.read_index(out / g).header for g in ("0_150", "150_")]
    assert [h["bitrate"] for h in headers] == [24000, 24000]
    assert sum(h["num_utts"] for h in headers) == len(_source_audio(corpus))
    assert headers[0]["seed"] == 1


def test_validate_decodes_every_audio_member(corpus, tmp_path):
    out = tmp_path / "shards"
    audio_pack.pack_audio(corpus, out, "flac", utts_per_file=100)
    shard = out / "data-00000.tar"
    index_path = out / shard_format.INDEX_NAME
    original, original_index = shard.read_bytes(), index_path.read_text(encoding="utf-8")
    with tarfile.open(shard) as tar:
        member = tar.getmembers()[2]  # the second utterance's audio
    key = shard_format.decode_key(member.name.rsplit(".", 1)[0])
    damaged = bytearray(original)
    damaged[member.offset_data:member.offset_data + 64] = bytes(64)  # the FLAC header
    shard.write_bytes(bytes(damaged))
    problems = shard_check.validate(out)
    assert f"{shard}: crc32 differs from the index" in problems
    assert any(p.startswith(f"cannot decode audio {shard}:{member.name}") for p in problems)
    # With the index made to agree with the bytes, decoding alone finds the damage.
    lines = original_index.splitlines()
    record = json.loads(lines[1])
    record["crc32"] = f"{zlib.crc32(bytes(damaged)):08x}"
    index_path.write_text("\n".join([lines[0], json.dumps(record, ensure_ascii=False)]) + "\n",
                          encoding="utf-8")
    assert len(shard_check.validate(out)) == 1

    shard.write_bytes(original)
    record = json.loads(lines[1])
    header = json.loads(lines[0])
    record["frames"][1] += 1
    record["num_frames"] += 1
    record["longest"] = max(record["frames"])
    header["num_frames"] += 1
    index_path.write_text("\n".join([json.dumps(header), json.dumps(record, ensure_ascii=False)])
                          + "\n", encoding="utf-8")
    samples = len(_source_audio(corpus)[key])
    assert shard_check.validate(out) == [
        f"{shard}: {key}: {samples} samples at 16000 Hz are {num_frames(samples)} frames, "
        f"index says {num_frames(samples) + 1}"]
    index_path.write_text(original_index, encoding="utf-8")
    assert shard_check.validate(out) == []
    os.remove(shard)
    assert shard_check.validate(out) == [f"{shard}: missing"]
