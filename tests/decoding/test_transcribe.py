"""Transcribing audio directly (`python -m cat.<family>.decode --audio/--wav-scp/--data-list`)
against stage 4's decoding of stage 1's features, on a tiny trained model whose features
are the fbank of real audio files."""

from __future__ import annotations

import itertools
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from cat.core.io import read_table, write_table
from cat.core.process import process_pool
from cat.decoding.audio import from_wav_scp
from cat.decoding.inference import DecodeOptions, decode_set, main
from cat.decoding.transcribe import _features, _pooled_features, transcribe
from cat.features.extract import extract
from cat.features.fbank import FbankOptions
from cat.stages import driver
from cat.testing.audio import make_corrupt_file, write_kaldi_data_dir
from cat.testing.audio_experiment import write_audio_experiment
from cat.testing.training import write_tiny_experiment
from cat.testing.uio import UioUtterance, write_raw_list, write_shard_list, write_uio_shard
from cat.training.cli import train
from tests.decoding.test_results import parse_srt

EXP = "exp/tiny"
CHECKPOINT = "exp/tiny/check/avg-best-2.pt"


@pytest.fixture(scope="module", params=["ctc", "rnnt"])
def trained(request, tmp_path_factory):
    """(kind, experiment, stage 4's hypotheses of the test set)."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("OMP_NUM_THREADS", "1")
        experiment = write_audio_experiment(root, kind=kind)
        train(EXP, f"cat.{kind}.train")
        driver.decode(EXP, nj=1)
    hyps = read_table(root / EXP / "decode/test/hyp", allow_empty_value=True)
    # Hypotheses that differ from each other: a wrong feature would show.
    assert len(hyps) == 6 and all(hyps.values()) and len(set(hyps.values())) >= 4, hyps
    return kind, experiment, hyps


@pytest.fixture
def recipe(trained, monkeypatch):
    """`trained`, run from its recipe directory."""
    monkeypatch.chdir(trained[1].root)
    return trained


def stage4_hyp(experiment) -> str:
    return (experiment.root / EXP / "decode/test/hyp").read_text(encoding="utf-8")


def test_audio_files_give_stage_4_hypotheses(recipe, tmp_path, capsys):
    _, experiment, hyps = recipe
    audio = experiment.test_audio()
    wavs = [str(audio[utt]) for utt in sorted(audio)]
    assert main("cat.decode", [EXP, "--audio", *wavs, "--out", str(tmp_path / "wav")]) == 0
    assert (tmp_path / "wav/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    log = json.loads((tmp_path / "wav/decode.log").read_text(encoding="utf-8"))
    # What stage 4 decodes with: the checkpoint and hyper-p.json's options.
    assert log["checkpoint"] == CHECKPOINT and log["beam_size"] == 4
    assert log["max_frames"] == 300 and log["device"] == "cpu"
    assert (log["num_utts"], log["num_skipped"]) == (6, 0)
    frames = read_table(experiment.test_features / "utt2num_frames")
    assert log["audio_seconds"] == pytest.approx(sum(map(int, frames.values())) / 100, abs=0.01)
    assert (tmp_path / "wav/skipped.txt").read_text(encoding="utf-8") == ""

    # FLAC is lossless: the same hypotheses; on standard output, in argument order.
    flacs = []
    for wav in reversed(wavs):
        flacs.append(str(tmp_path / Path(wav).with_suffix(".flac").name))
        samples, rate = soundfile.read(wav, dtype="int16")
        soundfile.write(flacs[-1], samples, rate)
    capsys.readouterr()
    assert main("cat.decode", [EXP, "--audio", *flacs]) == 0
    out, err = capsys.readouterr()
    keys = [Path(flac).stem for flac in flacs]
    assert out.splitlines() == [f"{key} {hyps[key]}" for key in keys]
    assert "RTF" in err and "6 utterances" in err


@pytest.mark.slow
def test_wav_scp_and_data_lists_give_stage_4_hypotheses(recipe, tmp_path):
    kind, experiment, hyps = recipe
    audio = experiment.test_audio()
    utts = sorted(audio)
    # wav.scp with Kaldi pipe entries, decoded by 2 processes.
    wav_scp = {utt: (f"cat {path} |" if i % 2 else str(path))
               for i, (utt, path) in enumerate(audio.items())}
    write_table(tmp_path / "wav.scp", wav_scp.items())
    assert main(f"cat.{kind}.decode", [EXP, "--wav-scp", str(tmp_path / "wav.scp"), "--nj", "2",
                       "--out", str(tmp_path / "scp")]) == 0
    assert (tmp_path / "scp/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    assert json.loads((tmp_path / "scp/decode.log").read_text())["workers"] == 2

    # WeNet keys may hold dots and a path prefix.
    keys = {utt: (f"spk{i}/{utt}.v1" if i % 2 else utt) for i, utt in enumerate(utts)}
    expected = {keys[utt]: hyps[utt] for utt in utts}
    write_raw_list(tmp_path / "raw.list", [(keys[utt], audio[utt], "") for utt in utts])
    shards = [write_uio_shard(tmp_path / f"shards/shard-{n}.tar",
                              [UioUtterance(keys[utt], audio[utt].read_bytes(), "")
                               for utt in utts[n::2]]) for n in range(2)]
    write_shard_list(tmp_path / "shard.list", shards)
    for name in ("raw.list", "shard.list"):
        out_dir = tmp_path / f"out-{name}"
        assert main(f"cat.{kind}.decode", [EXP, "--data-list", str(tmp_path / name),
                           "--out", str(out_dir)]) == 0
        assert read_table(out_dir / "hyp", allow_empty_value=True) == expected, name


def check_times(record: dict, seconds: float) -> None:
    """Token times of a JSON record: one per token, none ending before it starts (tokens a
    transducer emits on one frame share its 80 ms, to the millisecond), monotonic, inside
    the utterance."""
    times = record["timestamps"]
    assert len(times) == len(record["tokens"]), record
    assert all(0 <= start <= end <= seconds + 0.08 for start, end in times), (record, seconds)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(times)), record


def test_results_as_json_ctm_and_srt(recipe, tmp_path, capsys, caplog):
    """Every format holds the text format's hypotheses; the text output is unchanged."""
    _kind, experiment, hyps = recipe
    audio = experiment.test_audio()
    wavs = [str(audio[utt]) for utt in sorted(audio)]
    durations = {utt: soundfile.info(path).duration for utt, path in audio.items()}
    assert main("cat.decode", [EXP, "--audio", *wavs, "--format", "json", "--out",
                               str(tmp_path / "json")]) == 0
    assert (tmp_path / "json/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    records = [json.loads(line) for line in
               (tmp_path / "json/hyp.jsonl").read_text(encoding="utf-8").splitlines()]
    assert {record["key"]: record["text"] for record in records} == hyps
    for record in records:
        check_times(record, durations[record["key"]])
        assert record["nbest"][0]["text"] == record["text"]
        scores = [entry["score"] for entry in record["nbest"]]
        assert scores == sorted(scores, reverse=True) and len(scores) <= 4

    capsys.readouterr()
    assert main("cat.decode", [EXP, "--audio", *wavs, "--format", "ctm"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(len(text) for text in hyps.values())  # a word per character
    for line in lines:
        key, channel, start, duration, word, confidence = line.split(" ")
        assert key in hyps and word in hyps[key] and channel == "1"
        assert float(start) >= 0 and float(start) + float(duration) <= durations[key] + 0.08
        assert 0 < float(confidence) <= 1

    utt = sorted(audio)[3]
    assert main("cat.decode", [EXP, "--audio", str(audio[utt]), "--format", "srt"]) == 0
    cues = parse_srt(capsys.readouterr().out)
    assert "".join(text for *_, text in cues) == "".join(hyps[utt].split())
    assert all(0 <= start < end <= durations[utt] + 0.08 for _, start, end, _ in cues)

    # Greedy search: its own hypotheses, timed, without N-best.
    assert main("cat.decode", [EXP, "--audio", *wavs, "--method", "greedy"]) == 0
    greedy = dict(line.partition(" ")[::2] for line in capsys.readouterr().out.splitlines())
    assert main("cat.decode", [EXP, "--audio", *wavs, "--method", "greedy", "--format",
                               "json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {record["key"]: record["text"] for record in records} == greedy
    assert all("nbest" not in record for record in records)
    for record in records:
        check_times(record, durations[record["key"]])

    # Stage 4's decoding of the features: the same hyp, and the records beside it.
    assert main("cat.decode", [EXP, "--data", str(experiment.test_features), "--format",
                               "json", "--out", str(tmp_path / "data")]) == 0
    assert (tmp_path / "data/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    assert [json.loads(line)["key"] for line in (tmp_path / "data/hyp.jsonl").read_text(
        encoding="utf-8").splitlines()] == sorted(hyps)

    caplog.clear()
    assert main("cat.decode", [EXP, "--audio", *wavs[:2], "--format", "srt"]) == 1
    assert "--format srt without --out writes the document of one utterance, command line " \
           "audio files has 2" in caplog.text
    with pytest.raises(SystemExit):
        main("cat.decode", [EXP, "--audio", *wavs, "--format", "xml"])
    assert "--format 'xml': unknown output format; allowed: text, json, ctm, srt" in \
        capsys.readouterr().err


def test_unreadable_audio_is_reported_and_skipped(recipe, tmp_path, caplog):
    kind, experiment, _ = recipe
    audio = experiment.test_audio()
    garbage = make_corrupt_file(tmp_path / "garbage.wav", "garbage")
    rows = [(utt, str(path)) for utt, path in sorted(audio.items())]
    rows[2:2] = [("bad-garbage", str(garbage)), ("bad-missing", str(tmp_path / "none.wav"))]
    write_table(tmp_path / "wav.scp", rows, sort=False)
    assert main(f"cat.{kind}.decode", [EXP, "--wav-scp", str(tmp_path / "wav.scp"),
                       "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out/hyp").read_text(encoding="utf-8") == stage4_hyp(experiment)
    skipped = read_table(tmp_path / "out/skipped.txt")
    assert list(skipped) == ["bad-garbage", "bad-missing"]
    assert skipped["bad-garbage"].startswith(f"{tmp_path / 'wav.scp'}:3: cannot decode")
    assert skipped["bad-missing"] == f"{tmp_path / 'wav.scp'}:4: no such file: " \
                                     f"{tmp_path / 'none.wav'}"
    assert json.loads((tmp_path / "out/decode.log").read_text())["num_skipped"] == 2
    assert "skipped bad-missing" in caplog.text

    write_table(tmp_path / "bad.scp", rows[2:4])
    caplog.clear()
    assert main("cat.decode", [EXP, "--wav-scp", str(tmp_path / "bad.scp")]) == 1
    assert "nothing to transcribe in" in caplog.text and "2 utterance(s), all skipped" \
        in caplog.text


def test_truncated_audio_of_every_format_is_skipped_naming_the_file(recipe, tmp_path, caplog):
    """A truncated Opus, Vorbis or MP3 file (which libsndfile reads as shorter audio) given
    to transcription, as a file or through a wav.scp command, is skipped with its reason,
    never decoded in part."""
    kind, experiment, _ = recipe
    audio = experiment.test_audio()
    utt = sorted(audio)[0]
    samples, rate = soundfile.read(audio[utt], dtype="float32")
    files = []
    for audio_format, (major, subtype) in {"opus": ("OGG", "OPUS"), "ogg": ("OGG", "VORBIS"),
                                           "mp3": ("MP3", "MPEG_LAYER_III")}.items():
        whole = tmp_path / f"whole.{audio_format}"
        soundfile.write(whole, samples, rate, format=major, subtype=subtype)
        cut = tmp_path / f"cut-{audio_format}.{audio_format}"
        cut.write_bytes(whole.read_bytes()[:whole.stat().st_size * 2 // 3])
        files.append(cut)
    out = tmp_path / "out"
    assert main(f"cat.{kind}.decode", [EXP, "--audio", str(audio[utt]), *map(str, files),
                                       "--out", str(out)]) == 0
    assert list(read_table(out / "hyp", allow_empty_value=True)) == [utt]
    skipped = read_table(out / "skipped.txt")
    assert sorted(skipped) == ["cut-mp3", "cut-ogg", "cut-opus"]
    for path in files:
        assert f": truncated audio {path}: " in skipped[path.stem], skipped[path.stem]
    write_table(tmp_path / "wav.scp", [(path.stem, f"cat {path} |") for path in files])
    caplog.clear()
    assert main("cat.decode", [EXP, "--wav-scp", str(tmp_path / "wav.scp")]) == 1
    assert f"3 utterance(s), all skipped; first: cut-mp3: {tmp_path / 'wav.scp'}:1: " \
           f"truncated audio command 'cat {files[2]}': its Xing header declares" in caplog.text


def test_segments_and_small_windows_give_stage_4_hypotheses(recipe, tmp_path):
    """Segments of one long recording; features gathered 1.6 s at a time (the longest
    utterance: a longer one would be refused)."""
    _kind, experiment, _ = recipe
    audio = experiment.test_audio()
    pieces, segments, position = [], {}, 0.0
    for utt in sorted(audio):
        samples, rate = soundfile.read(audio[utt], dtype="int16")
        pieces += [samples, np.zeros(rate // 4, np.int16)]
        segments[f"long-{utt}"] = ("long", position, position + len(samples) / rate)
        position += len(samples) / rate + 0.25
    soundfile.write(tmp_path / "long.flac", np.concatenate(pieces), 16000)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(tmp_path / "long.flac")},
                                    segments=segments)
    extract(data_dir, tmp_path / "fbank", progress=False)
    options = DecodeOptions(beam_size=4, max_frames=300, device="cpu")
    decode_set(EXP, tmp_path / "fbank", CHECKPOINT, tmp_path / "stage4", options)
    stage4 = read_table(tmp_path / "stage4/hyp", allow_empty_value=True)
    assert len(stage4) == 6

    assert main("cat.decode", [EXP, "--wav-scp", str(data_dir / "wav.scp"), "--segments",
                       str(data_dir / "segments"), "--out", str(tmp_path / "out")]) == 0
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == stage4
    transcript = transcribe(EXP, from_wav_scp(data_dir / "wav.scp", data_dir / "segments"),
                            CHECKPOINT, options, window_frames=160, segmenting=None)
    assert dict(transcript.hypotheses) == stage4


def test_zero_weight_lm_changes_nothing(recipe, tmp_path):
    pytest.importorskip("kenlm")
    from cat.lm.ngram import estimate, write_arpa
    from cat.lm.rescore import read_nbest

    kind, experiment, hyps = recipe
    texts = [list(text) for text in read_table(experiment.train_data / "text").values()]
    write_arpa(estimate(texts, 2, (0.5, 1.0)), tmp_path / "lm.arpa")
    wavs = [str(path) for path in experiment.test_audio().values()]
    assert main(f"cat.{kind}.decode", [EXP, "--audio", *wavs, "--lm",
                                       str(tmp_path / "lm.arpa"), "--alpha", "0", "--out",
                                       str(tmp_path / "out")]) == 0
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == hyps
    nbest = read_nbest(tmp_path / "out/nbest.jsonl")
    assert {utt: entries[0][0] for utt, entries in nbest.items()} == hyps


def test_a_model_of_other_features_is_refused(tmp_path, monkeypatch, caplog):
    experiment = write_tiny_experiment(tmp_path)  # 8-dim features
    wav = tmp_path / "a.wav"
    soundfile.write(wav, np.zeros(8000, np.int16), 16000)
    monkeypatch.chdir(tmp_path)
    assert main("cat.ctc.decode", [str(experiment.exp_dir), "--audio", str(wav),
                        "--checkpoint", "none.pt"]) == 1
    assert f"{experiment.exp_dir / 'config.json'}: encoder.kwargs.idim is 8, but audio is " \
           "turned into stage 1's 80-dim fbank" in caplog.text


@pytest.mark.slow
def test_a_feature_pool_feeds_the_decoder_in_list_order(recipe):
    """The GPU path: `nj` processes compute features for one decoding process (checked
    here on the CPU: the same utterances, features and order as computed in-process)."""
    _, experiment, _ = recipe
    audio = from_wav_scp(experiment.test_data / "wav.scp")
    keys = list(read_table(experiment.test_data / "wav.scp"))
    fbank = FbankOptions()
    expected = list(_features(enumerate(audio.recordings), fbank))
    with process_pool(2) as pool:
        pooled = list(_pooled_features(pool, audio.recordings, fbank, ahead=2))
    assert [(order, key) for order, key, _ in pooled] == [((i, 0), key)
                                                         for i, key in enumerate(keys)]
    for (_, key, features), (_, _, reference) in zip(pooled, expected, strict=True):
        np.testing.assert_array_equal(features, reference, err_msg=key)


def test_an_utterance_longer_than_the_window_is_refused_naming_file_and_duration(
        recipe, tmp_path, monkeypatch, caplog):
    kind, experiment, hyps = recipe
    audio = experiment.test_audio()  # 0.6, 1.3, 0.9, 1.6, 1.1 and 0.8 s long
    write_table(tmp_path / "wav.scp", [(utt, str(path)) for utt, path in audio.items()])
    wav_scp = read_table(tmp_path / "wav.scp")
    monkeypatch.setenv("CAT_TRANSCRIBE_WINDOW_SECONDS", "1.2")
    assert main(f"cat.{kind}.decode", [EXP, "--wav-scp", str(tmp_path / "wav.scp"),
                                       "--max-segment", "0", "--out", str(tmp_path / "out")]) == 0
    skipped = read_table(tmp_path / "out/skipped.txt")
    long = [utt for utt, path in audio.items() if soundfile.info(path).duration > 1.2]
    assert list(skipped) == long and len(long) == 2
    line = list(wav_scp).index(long[1]) + 1
    assert skipped[long[1]] == (
        f"{tmp_path / 'wav.scp'}:{line}: {audio[long[1]]}: the recording lasts 1.6 s "
        "(0:00:02), longer than the transcription window of 1.2 s: an utterance is decoded "
        "whole, so it is not read; decode it in windows (--max-segment), split it into "
        "shorter utterances (a segments file), or raise $CAT_TRANSCRIBE_WINDOW_SECONDS "
        "(seconds)")
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == {
        utt: text for utt, text in hyps.items() if utt not in long}
    assert json.loads((tmp_path / "out/decode.log").read_text())["num_skipped"] == 2

    # Nothing else to decode: an error naming the file, its duration and the setting.
    caplog.clear()
    assert main(f"cat.{kind}.decode", [EXP, "--audio", str(audio[long[1]]),
                                       "--max-segment", "0"]) == 1
    assert "nothing to transcribe in command line audio files: 1 utterance(s), all " \
           f"skipped; first: {long[1]}: command line audio file 1: {audio[long[1]]}: the " \
           "recording lasts 1.6 s" in caplog.text
    monkeypatch.setenv("CAT_TRANSCRIBE_WINDOW_SECONDS", "-1")
    caplog.clear()
    assert main(f"cat.{kind}.decode", [EXP, "--audio", str(audio[long[0]])]) == 1
    assert "CAT_TRANSCRIBE_WINDOW_SECONDS='-1': expected a positive number of seconds" \
        in caplog.text


def test_a_long_recording_in_windows(recipe, tmp_path, capsys, caplog):
    """The test utterances end to end, in windows of 3 s overlapping by 1 s: one timed
    result over the whole recording; a window longer than the recording changes nothing."""
    _kind, experiment, _ = recipe
    audio = experiment.test_audio()
    pieces = []
    for utt in sorted(audio):
        samples, rate = soundfile.read(audio[utt], dtype="int16")
        pieces += [samples, np.zeros(rate // 4, np.int16)]
    long = tmp_path / "long.wav"
    soundfile.write(long, np.concatenate(pieces), 16000)
    seconds = soundfile.info(long).duration
    assert main("cat.decode", [EXP, "--audio", str(long)]) == 0
    whole = capsys.readouterr().out
    assert main("cat.decode", [EXP, "--audio", str(long), "--max-segment", "60"]) == 0
    assert capsys.readouterr().out == whole

    assert main("cat.decode", [EXP, "--audio", str(long), "--max-segment", "3",
                               "--segment-overlap", "1", "--vad", "none", "--format", "json",
                               "--out", str(tmp_path / "out")]) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "out/hyp.jsonl").read_text(
        encoding="utf-8").splitlines()]
    assert record["key"] == "long" and "nbest" not in record
    check_times(record, seconds)
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == {"long": record["text"]}
    log = json.loads((tmp_path / "out/decode.log").read_text())
    # The overlaps are decoded twice but counted once (each window's fbank has 2 frames
    # fewer than its 10 ms steps: 25 ms frames).
    assert log["audio_seconds"] == pytest.approx(seconds, abs=0.1)

    with pytest.raises(SystemExit):
        main("cat.decode", [EXP, "--audio", str(long), "--max-segment", "2",
                            "--segment-overlap", "1"])
    assert "--segment-overlap 1: expected at least 0 and less than half of --max-segment 2 " \
           "seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main("cat.decode", [EXP, "--data", str(experiment.test_features), "--out",
                            str(tmp_path / "x"), "--max-segment", "10"])
    assert "--max-segment is for audio" in capsys.readouterr().err
    caplog.clear()
    assert main("cat.decode", [EXP, "--audio", str(long), "--max-segment", "3000"]) == 1
    assert "--max-segment 3000 s is longer than the transcription window of 1800 s" \
        in caplog.text


def test_a_last_window_without_a_frame_does_not_lose_the_recording(recipe, tmp_path):
    """`--vad none --max-segment 6 --segment-overlap 0` on a 12.01 s recording: its last
    10 ms hold no frame, and join the window before instead of ending the recording with an
    error."""
    _kind, experiment, _ = recipe
    audio = experiment.test_audio()
    pieces = [soundfile.read(audio[utt], dtype="int16")[0] for utt in sorted(audio)]
    samples = np.resize(np.concatenate(pieces), 192160)  # 12.01 s at 16 kHz
    long = tmp_path / "long.wav"
    soundfile.write(long, samples, 16000)
    out = tmp_path / "out"
    assert main("cat.decode", [EXP, "--audio", str(long), "--max-segment", "6",
                               "--segment-overlap", "0", "--vad", "none", "--format", "json",
                               "--out", str(out)]) == 0
    assert (out / "skipped.txt").read_text(encoding="utf-8") == ""
    (record,) = [json.loads(line) for line in (out / "hyp.jsonl").read_text(
        encoding="utf-8").splitlines()]
    assert record["key"] == "long" and record["text"]
    check_times(record, 12.01)


@pytest.mark.slow
@pytest.mark.parametrize("trained", ["ctc"], indirect=True)  # reading audio is measured
def test_windows_keep_memory_flat_on_an_hour_long_recording(recipe, tmp_path, monkeypatch):
    """An hour in windows of 10 s, features gathered a minute at a time, takes no more
    memory than 5 minutes: 50 MB at most beyond it (the features of the whole hour alone
    are 115 MB)."""
    kind, experiment, _hyps = recipe
    monkeypatch.setenv("CAT_TRANSCRIBE_WINDOW_SECONDS", "60")
    audio = experiment.test_audio()
    inserts = {start: soundfile.read(audio[utt], dtype="int16")[0]
               for start, utt in zip((1.0, 100.0, 250.0), sorted(audio), strict=False)}
    decode = [sys.executable, "-m", f"cat.{kind}.decode", EXP, "--max-segment", "10",
              "--segment-overlap", "2", "--vad", "none", "--format", "ctm"]
    peaks = []
    for seconds in (300, 3600):
        long = tmp_path / f"long-{seconds}.wav"
        write_long_wav(long, seconds, inserts)
        status, peak, errors = peak_rss_mb([*decode, "--audio", str(long)])
        assert status == 0, errors[-2000:]
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 50, peaks


#: A recording of 3 hours and where the test utterances are in it (seconds).
LONG_SECONDS = 3 * 3600
LONG_PLACES = (0.0, 1800.5, 3600.25, 5400.0, 9000.0, 10790.0)


def write_long_wav(path: Path, seconds: float, inserts: dict[float, np.ndarray]) -> None:
    """A 16 kHz 16-bit WAV of `seconds` of silence, sparse on disk (nothing held in
    memory), with `inserts` (int16 samples by start second) written in."""
    num_bytes = 2 * int(seconds * 16000)
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + num_bytes, b"WAVE", b"fmt ", 16,
                         1, 1, 16000, 32000, 2, 16, b"data", num_bytes)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + num_bytes)
        for start, samples in inserts.items():
            f.seek(len(header) + 2 * int(start * 16000))
            f.write(samples.astype("<i2").tobytes())


def peak_rss_mb(argv: list[str]) -> tuple[int, float, str]:
    """Run a command (its address space limited to 6 GB, so that a regression fails
    fast): its exit status, peak RSS in MB and standard error."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors,
                                   preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        return process.returncode, usage.ru_maxrss / 1024, errors.read().decode()


@pytest.mark.slow
@pytest.mark.parametrize("trained", ["ctc"], indirect=True)  # reading audio is measured
def test_a_three_hour_recording_in_bounded_memory(recipe, tmp_path):
    """Whole (--max-segment 0), it is refused unread; by default, the voice-activity
    detector reads it a minute at a time and only its sounds are decoded; cut by a
    segments file, each segment's samples alone are read and decoded as stage 4 decodes
    them; each way under 1 GB (before: past 6 GB within half a minute, the fbank of the
    whole recording)."""
    kind, experiment, hyps = recipe
    audio = experiment.test_audio()
    utts = sorted(audio)
    inserts = {start: soundfile.read(audio[utt], dtype="int16")[0]
               for start, utt in zip(LONG_PLACES, utts, strict=True)}
    long = tmp_path / "long.wav"
    write_long_wav(long, LONG_SECONDS, inserts)
    decode = [sys.executable, "-m", f"cat.{kind}.decode", EXP]

    status, peak, errors = peak_rss_mb([*decode, "--audio", str(long), "--max-segment", "0"])
    assert status == 1 and peak < 1024, (status, peak, errors[-2000:])
    assert f"{long}: the recording lasts 10800.0 s (3:00:00), longer than the transcription " \
           "window of 1800 s" in errors
    status, peak, errors = peak_rss_mb([*decode, "--audio", str(long), "--out",
                                        str(tmp_path / "vad")])
    assert status == 0 and peak < 1024, (status, peak, errors[-2000:])
    log = json.loads((tmp_path / "vad/decode.log").read_text(encoding="utf-8"))
    assert log["audio_seconds"] == pytest.approx(LONG_SECONDS, abs=0.1)
    assert log["segments"] <= 2 * len(LONG_PLACES), log

    segments = {f"long-{utt}": ("long", start, start + len(inserts[start]) / 16000)
                for start, utt in zip(LONG_PLACES, utts, strict=True)}
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"long": str(long)}, segments=segments)
    status, peak, errors = peak_rss_mb([*decode, "--wav-scp", str(data_dir / "wav.scp"),
                                        "--segments", str(data_dir / "segments"),
                                        "--out", str(tmp_path / "out")])
    assert status == 0 and peak < 1024, (status, peak, errors[-2000:])
    assert read_table(tmp_path / "out/hyp", allow_empty_value=True) == {
        f"long-{utt}": hyps[utt] for utt in utts}
