"""Stage 1 feature extraction: fbank values, Kaldi tables, segments, speed, errors, resume."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import kaldiio
import numpy as np
import pytest
import soundfile
import soxr
import torch
import torchaudio.compliance.kaldi

from cat.audio.speed import perturbed_num_samples, speed_perturb
from cat.core.io import TableError, read_table
from cat.features import extract as extraction
from cat.features import fbank
from cat.features.extract import extract, main
from cat.features.fbank import FbankOptions, compute_fbank, read_audio
from cat.testing.audio import (
    make_audio_file,
    make_corrupt_file,
    make_data_dir,
    synth_waveform,
    write_kaldi_data_dir,
)


def kaldi_fbank(waveform: np.ndarray, sample_rate: int = 16000, bins: int = 80) -> np.ndarray:
    """The reference: torchaudio's Kaldi fbank on int16-range samples, everything default."""
    tensor = torch.from_numpy(np.asarray(waveform, dtype=np.float32)).unsqueeze(0) * 32768.0
    return torchaudio.compliance.kaldi.fbank(tensor, num_mel_bins=bins, dither=0.0,
                                             sample_frequency=sample_rate).numpy()


def snip_edges_frames(num_samples: int) -> int:
    """Kaldi's frame count for 25 ms / 10 ms frames at 16 kHz with snip_edges=true."""
    return 1 + (num_samples - 400) // 160 if num_samples >= 400 else 0


def load_feats(feat_dir: Path) -> dict[str, np.ndarray]:
    table = kaldiio.load_scp(str(feat_dir / "feats.scp"))
    return {key: np.asarray(matrix) for key, matrix in table.items()}


def audio_of(path: str) -> np.ndarray:
    data, _ = soundfile.read(path, dtype="float32", always_2d=True)
    return data[:, 0]


def stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_ino, status.st_mtime_ns


# ----------------------------------------------------------------------------------------------
# One waveform


def test_compute_fbank_matches_torchaudio_and_kaldi_native_fbank():
    waveform = synth_waveform(1.3, seed=1)
    ours = compute_fbank(waveform, 16000)
    assert ours.dtype == np.float32
    assert ours.shape == (snip_edges_frames(len(waveform)), 80)
    np.testing.assert_allclose(ours, kaldi_fbank(waveform), rtol=0, atol=1e-5)

    # A development package: without it, this comparison is skipped, not the suite.
    kaldi_native_fbank = pytest.importorskip("kaldi_native_fbank")
    options = kaldi_native_fbank.FbankOptions()
    options.frame_opts.dither = 0.0
    options.frame_opts.snip_edges = True
    options.mel_opts.num_bins = 80
    peer = kaldi_native_fbank.OnlineFbank(options)
    peer.accept_waveform(16000, (waveform * 32768.0).tolist())
    peer.input_finished()
    reference = np.stack([peer.get_frame(i) for i in range(peer.num_frames_ready)])
    np.testing.assert_allclose(ours, reference, rtol=0, atol=2e-3)


@pytest.mark.parametrize("window_frames", [None, 7])
def test_sherpa_onnx_front_end_matches_torchaudio_and_kaldi_native_fbank(window_frames):
    """sherpa-onnx's front end (`FRONT_ENDS`): mel banks to 7,600 Hz, frames centred with
    the edges reflected; the same frames computed a window at a time; samples kept in
    [-1, 1) (`normalize_samples`) shift every bin by 2 ln 32768."""
    from cat.features.fbank import FRONT_ENDS, num_frames

    waveform = synth_waveform(1.3, seed=1)[:20_837]
    options = FRONT_ENDS["sherpa-onnx"]
    ours = compute_fbank(waveform, 16000, options, window_frames=window_frames)
    assert ours.shape == (num_frames(len(waveform), options), 80) == (130, 80)
    reference = torchaudio.compliance.kaldi.fbank(
        torch.from_numpy(waveform)[None] * 32768.0, num_mel_bins=80, dither=0.0,
        high_freq=-400.0, snip_edges=False).numpy()
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
    # Samples in [-1, 1): every bin 2 ln 32768 lower, but where the energy floor (float32's
    # epsilon) holds it, in this audio's quiet stretch.
    unscaled = dataclasses.replace(options, normalize_samples=True)
    lower = compute_fbank(waveform, 16000, unscaled)
    floor = np.log(np.finfo(np.float32).eps)
    above = lower > floor + 1.0
    assert 0.5 < above.mean() < 1.0
    np.testing.assert_allclose(lower[above], (ours - 2 * np.log(32768.0))[above], rtol=0,
                               atol=1e-4)
    # The int16 samples of the same audio give the same features.
    samples = np.round(waveform * 32768).astype(np.int16)
    for each in (options, unscaled):
        np.testing.assert_allclose(compute_fbank(samples, 16000, each),
                                   compute_fbank(samples.astype(np.float32) / 32768, 16000,
                                                 each), rtol=0, atol=1e-5)
    kaldi_native_fbank = pytest.importorskip("kaldi_native_fbank")
    native = kaldi_native_fbank.FbankOptions()
    native.frame_opts.dither = 0.0
    native.frame_opts.snip_edges = False
    native.mel_opts.num_bins = 80
    native.mel_opts.high_freq = -400.0
    peer = kaldi_native_fbank.OnlineFbank(native)
    peer.accept_waveform(16000, (waveform * 32768.0).tolist())
    peer.input_finished()
    frames = np.stack([peer.get_frame(i) for i in range(peer.num_frames_ready)])
    np.testing.assert_allclose(ours, frames, rtol=0, atol=2e-3)


def test_compute_fbank_options_dither_seed_and_short_input():
    waveform = synth_waveform(0.5, seed=2)
    assert compute_fbank(waveform, 16000, FbankOptions(num_mel_bins=40)).shape == (48, 40)
    dithered = FbankOptions(dither=1.0)
    first = compute_fbank(waveform, 16000, dithered, seed=7)
    np.testing.assert_array_equal(first, compute_fbank(waveform, 16000, dithered, seed=7))
    assert not np.array_equal(first, compute_fbank(waveform, 16000))
    with pytest.raises(fbank.AudioError, match="too short for one frame"):
        compute_fbank(waveform[:399], 16000)


def test_read_audio_formats_channels_and_pipe(tmp_path):
    reference = synth_waveform(0.7, seed=3)
    for extension in (".wav", ".flac", ".opus"):
        path = make_audio_file(tmp_path / f"a{extension}", 0.7, seed=3)
        waveform, rate = read_audio(str(path))
        assert rate == 16000 and waveform.dtype == np.float32 and waveform.ndim == 1
        if extension != ".opus":  # lossy: compared through features in the segments test
            np.testing.assert_allclose(waveform, reference, atol=1 / 32768 + 1e-7)
    stereo = make_audio_file(tmp_path / "stereo.wav", 0.5, seed=4, channels=2)
    waveform, _ = read_audio(str(stereo))
    np.testing.assert_array_equal(waveform, audio_of(str(stereo)))
    assert not np.array_equal(waveform, soundfile.read(stereo, dtype="float32")[0][:, 1])
    piped, rate = read_audio(f"cat {tmp_path / 'a.flac'} |")
    np.testing.assert_array_equal(piped, read_audio(str(tmp_path / "a.flac"))[0])
    with pytest.raises(fbank.AudioError, match="exited with status"):
        read_audio("false |")


def test_read_channel_reads_any_span_in_any_order(tmp_path):
    """A recording read again from its start after a later span (as transcription reads
    a long recording: its voice activity first, then its segments) gives its samples."""
    path = make_audio_file(tmp_path / "a.flac", 1.0, seed=5)
    whole = read_audio(str(path))[0]
    with fbank.open_audio(str(path)) as (audio, name):
        for start, stop in [(8000, 16000), (0, 4000), (100, 200), (0, None)]:
            np.testing.assert_array_equal(fbank.read_channel(audio, name, start, stop),
                                          whole[start:stop])


# ----------------------------------------------------------------------------------------------
# Whole data dirs


def test_extract_writes_kaldi_tables_readable_by_kaldiio(tmp_path):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(1.0, 1.3, 0.8))
    wav_scp = read_table(data_dir / "wav.scp")
    flac = make_audio_file(tmp_path / "corpus/audio/S0002W0004.flac", 0.9, seed=11)
    wav_scp["S0002W0004"] = str(flac)
    # A Kaldi pipe entry: the command's stdout is the audio.
    wav_scp["S0001W0005"] = f"cat {make_audio_file(tmp_path / 'p.wav', 0.6, seed=12)} |"
    text = {**read_table(data_dir / "text"), "S0002W0004": "你好", "S0001W0005": "再见"}
    utt2spk = {utt: utt[:5] for utt in wav_scp}
    write_kaldi_data_dir(data_dir, wav_scp, text, utt2spk)

    summary = extract(data_dir, tmp_path / "fbank", progress=False)

    feat_dir = tmp_path / "fbank"
    feats = load_feats(feat_dir)
    assert summary.num_utterances == 5 and summary.num_skipped == 0
    assert list(feats) == sorted(wav_scp)
    frames = {key: int(value) for key, value in read_table(feat_dir / "utt2num_frames").items()}
    assert list(frames) == sorted(wav_scp)
    for utt, matrix in feats.items():
        spec = wav_scp[utt]
        waveform = audio_of(spec.split()[1] if spec.endswith("|") else spec)
        assert matrix.shape == (frames[utt], 80) == (snip_edges_frames(len(waveform)), 80)
        np.testing.assert_allclose(matrix, kaldi_fbank(waveform), rtol=0, atol=1e-5)
    assert summary.num_frames == sum(frames.values())
    assert read_table(feat_dir / "text") == text
    assert read_table(feat_dir / "utt2spk") == utt2spk
    assert read_table(feat_dir / "spk2utt") == {
        "S0001": "S0001W0001 S0001W0003 S0001W0005", "S0002": "S0002W0002 S0002W0004"}
    assert (feat_dir / "skipped.txt").read_text() == ""
    assert (feat_dir / "log" / "extract.1.log").is_file()


def test_speed_perturbation_ids_and_durations(tmp_path):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(1.0, 1.5))
    extract(data_dir, tmp_path / "fbank", speed_factors=(0.9, 1.1), progress=False)

    feat_dir = tmp_path / "fbank"
    feats = load_feats(feat_dir)
    base = ["S0001W0001", "S0002W0002"]
    expected = sorted(f"{prefix}{utt}" for prefix in ("", "sp0.9-", "sp1.1-") for utt in base)
    assert list(feats) == expected
    assert sorted(read_table(feat_dir / "utt2num_frames")) == expected
    text = read_table(feat_dir / "text")
    assert sorted(text) == expected
    assert text["sp0.9-S0001W0001"] == text["S0001W0001"] == "今天 天气 很好 0"
    utt2spk = read_table(feat_dir / "utt2spk")
    assert utt2spk["sp0.9-S0002W0002"] == "sp0.9-S0002"
    assert utt2spk["sp1.1-S0001W0001"] == "sp1.1-S0001"
    assert read_table(feat_dir / "spk2utt") == {
        "S0001": "S0001W0001", "S0002": "S0002W0002",
        "sp0.9-S0001": "sp0.9-S0001W0001", "sp0.9-S0002": "sp0.9-S0002W0002",
        "sp1.1-S0001": "sp1.1-S0001W0001", "sp1.1-S0002": "sp1.1-S0002W0002"}
    wav_scp = read_table(data_dir / "wav.scp")
    for utt in base:
        original = len(feats[utt])
        for factor in (0.9, 1.1):
            perturbed = feats[f"sp{factor:g}-{utt}"]
            assert abs(len(perturbed) - original / factor) <= 2
            waveform = audio_of(wav_scp[utt])
            changed = speed_perturb(waveform, 16000, factor)
            assert len(changed) == perturbed_num_samples(len(waveform), factor)
            assert len(perturbed) == snip_edges_frames(len(changed))
            np.testing.assert_allclose(perturbed, kaldi_fbank(changed), rtol=0, atol=1e-5)


def test_unreadable_audio_is_skipped_listed_and_counted(tmp_path, caplog):
    audio = tmp_path / "audio"
    good = [make_audio_file(audio / f"good{i}.wav", 0.5, seed=i) for i in range(2)]
    wav_scp = {
        "S1U1": str(good[0]),
        "S1U2": str(good[1]),
        "S1U3": str(make_corrupt_file(audio / "garbage.wav", "garbage")),
        "S1U4": str(audio / "missing.wav"),
        "S1U5": str(make_corrupt_file(audio / "truncated.wav", "truncated", source=good[0])),
        "S1U6": f"cat {audio / 'missing.flac'} |",
        "S1U7": str(make_audio_file(audio / "short.wav", 0.02)),
    }
    data_dir = write_kaldi_data_dir(tmp_path / "data", wav_scp, {u: "好" for u in wav_scp},
                                    {u: "S1" for u in wav_scp})
    feat_dir = tmp_path / "fbank"
    with caplog.at_level(logging.INFO):
        status = main([str(data_dir), str(feat_dir), "--no-progress"])

    assert status == 0
    assert list(load_feats(feat_dir)) == ["S1U1", "S1U2"]
    skipped = read_table(feat_dir / "skipped.txt")
    assert sorted(skipped) == ["S1U3", "S1U4", "S1U5", "S1U6", "S1U7"]
    assert "cannot decode" in skipped["S1U3"]
    assert "no such file" in skipped["S1U4"]
    assert "truncated" in skipped["S1U5"]
    assert "exited with status" in skipped["S1U6"]
    assert "too short for one frame" in skipped["S1U7"]
    assert "5 utterance(s) skipped" in caplog.text
    assert sorted(read_table(feat_dir / "text")) == ["S1U1", "S1U2"]
    assert read_table(feat_dir / "spk2utt") == {"S1": "S1U1 S1U2"}


@pytest.mark.timeout(120)
def test_a_wav_scp_command_that_never_ends_is_killed_and_a_counted_skip(tmp_path, caplog,
                                                                        monkeypatch):
    monkeypatch.setenv("CAT_WAV_SCP_TIMEOUT", "1")
    good = make_audio_file(tmp_path / "audio/good.wav", 0.5, seed=1)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"S1U1": str(good),
                                                        "S1U2": "sleep 100000 |"})
    feat_dir = tmp_path / "fbank"
    with caplog.at_level(logging.INFO):
        assert main([str(data_dir), str(feat_dir), "--no-progress"]) == 0
    assert list(load_feats(feat_dir)) == ["S1U1"]
    assert read_table(feat_dir / "skipped.txt") == {
        "S1U2": "command 'sleep 100000' did not finish within 1 s: killed (the limit is "
                "$CAT_WAV_SCP_TIMEOUT, in seconds)"}
    assert "1 utterance(s) skipped" in caplog.text


def test_every_utterance_failing_is_an_error(tmp_path, caplog):
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"u1": str(tmp_path / "none.wav")})
    assert main([str(data_dir), str(tmp_path / "fbank"), "--no-progress"]) == 1
    assert "no utterance got features" in caplog.text
    assert list(read_table(tmp_path / "fbank" / "skipped.txt")) == ["u1"]


def test_segments_of_opus_recording_decoded_once(tmp_path, monkeypatch):
    long_path = make_audio_file(tmp_path / "audio" / "long.opus", 4.0, seed=21)
    short_path = make_audio_file(tmp_path / "audio" / "short.wav", 1.0, seed=22)
    segments = {
        "A-1": ("long", 0.0, 1.2),
        "A-2": ("long", 1.5, 2.75),
        "A-3": ("long", 3.0, 4.03),    # 30 ms past the end: clipped
        "A-4": ("long", 3.5, 4.5),     # 500 ms past the end: skipped
        "A-5": ("long", 2.0, 2.0),     # empty: skipped
        "B-1": ("short", 0.25, 0.9),
    }
    wav_scp = {"long": str(long_path), "short": str(short_path),
               "unused": str(tmp_path / "audio" / "unused.wav")}
    data_dir = write_kaldi_data_dir(tmp_path / "data", wav_scp, segments=segments,
                                    utt2spk={utt: utt[0] for utt in segments})
    reads = []
    original = fbank.read_audio_with_channels

    def counting_read_audio(spec):
        reads.append(spec)
        return original(spec)

    monkeypatch.setattr(extraction, "read_audio_with_channels", counting_read_audio)
    summary = extract(data_dir, tmp_path / "fbank", speed_factors=(0.9,), progress=False)

    assert sorted(reads) == sorted([str(long_path), str(short_path)])
    feats = load_feats(tmp_path / "fbank")
    kept = ["A-1", "A-2", "A-3", "B-1"]
    assert list(feats) == sorted(kept + [f"sp0.9-{utt}" for utt in kept])
    skipped = read_table(tmp_path / "fbank" / "skipped.txt")
    assert sorted(skipped) == ["A-4", "A-5", "sp0.9-A-4", "sp0.9-A-5"]
    assert "after the recording end" in skipped["A-4"] and "empty segment" in skipped["A-5"]
    assert summary.num_skipped == 4
    recordings = {"long": audio_of(str(long_path)), "short": audio_of(str(short_path))}
    for utt in kept:
        recording, start, end = segments[utt]
        waveform = recordings[recording]
        span = waveform[int(start * 16000):min(int(end * 16000), len(waveform))]
        np.testing.assert_allclose(feats[utt], kaldi_fbank(span), rtol=0, atol=1e-5)
        changed = speed_perturb(waveform, 16000, 0.9)
        stop = min(int(end * 16000), len(waveform))
        # Times / factor; a segment reaching the recording's end reaches the changed one's.
        stop = len(changed) if stop == len(waveform) else int(stop / 0.9)
        span = changed[int(int(start * 16000) / 0.9):stop]
        np.testing.assert_allclose(feats[f"sp0.9-{utt}"], kaldi_fbank(span), rtol=0, atol=1e-5)
    assert len(feats["A-3"]) == snip_edges_frames(4 * 16000 - 3 * 16000)
    assert read_table(tmp_path / "fbank" / "utt2spk")["sp0.9-B-1"] == "sp0.9-B"


@pytest.mark.parametrize(("rate", "extension"), [(8000, ".wav"), (22050, ".flac")])
def test_other_sample_rates_are_resampled(tmp_path, rate, extension):
    path = make_audio_file(tmp_path / f"a{extension}", 1.2, sample_rate=rate, seed=31)
    data_dir = write_kaldi_data_dir(tmp_path / "data", {"u1": str(path)})
    extract(data_dir, tmp_path / "fbank", progress=False)

    matrix = load_feats(tmp_path / "fbank")["u1"]
    # sox's resampler (libsoxr), as `cat.audio.codec.resample` uses it.
    resampled = soxr.resample(audio_of(str(path)), rate, 16000, quality="HQ")
    assert len(resampled) == round(1.2 * 16000)
    assert matrix.shape == (snip_edges_frames(len(resampled)), 80)
    np.testing.assert_allclose(matrix, kaldi_fbank(resampled), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_parallel_jobs_match_one_job_and_resume_per_job(tmp_path):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(0.6, 0.9, 0.7, 1.1, 0.5))
    extract(data_dir, tmp_path / "one", nj=1, progress=False)
    summary = extract(data_dir, tmp_path / "two", nj=2, progress=False)

    two = tmp_path / "two"
    assert summary.jobs_run == (1, 2) and summary.jobs_reused == ()
    one_feats, two_feats = load_feats(tmp_path / "one"), load_feats(two)
    assert list(one_feats) == list(two_feats)
    for utt, matrix in one_feats.items():
        np.testing.assert_array_equal(matrix, two_feats[utt])
    arks = [two / "arks" / f"feats.{job}.ark" for job in (1, 2)]
    assert all(len(read_table(two / "arks" / f"feats.{job}.scp")) >= 2 for job in (1, 2))
    before = [stamp(ark) for ark in arks]

    again = extract(data_dir, two, nj=2, progress=False)
    assert again.jobs_run == () and again.jobs_reused == (1, 2)
    assert [stamp(ark) for ark in arks] == before

    (two / "arks" / "done.2").unlink()
    redo = extract(data_dir, two, nj=2, progress=False)
    assert redo.jobs_run == (2,) and redo.jobs_reused == (1,)
    assert stamp(arks[0]) == before[0] and stamp(arks[1]) != before[1]
    redone = load_feats(two)
    for utt, matrix in one_feats.items():
        np.testing.assert_array_equal(matrix, redone[utt])
    assert read_table(two / "utt2num_frames") == read_table(tmp_path / "one" / "utt2num_frames")


def test_changed_options_or_unfinished_job_are_redone(tmp_path):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(0.6, 0.8))
    feat_dir = tmp_path / "fbank"
    extract(data_dir, feat_dir, progress=False)
    changed = extract(data_dir, feat_dir, options=FbankOptions(num_mel_bins=40), progress=False)
    assert changed.jobs_run == (1,)
    assert {m.shape[1] for m in load_feats(feat_dir).values()} == {40}

    # An interrupted run: no marker, a partial archive.
    (feat_dir / "arks" / "done.1").unlink()
    (feat_dir / "arks" / "feats.1.ark.tmp").write_bytes(b"partial")
    redo = extract(data_dir, feat_dir, options=FbankOptions(num_mel_bins=40), progress=False)
    assert redo.jobs_run == (1,)
    assert not (feat_dir / "arks" / "feats.1.ark.tmp").exists()
    assert [m.shape[1] for m in load_feats(feat_dir).values()] == [40, 40]

    # Outputs of jobs that no longer exist (an earlier run with more jobs) are removed.
    stale = [feat_dir / "arks" / "feats.3.ark", feat_dir / "arks" / "done.3",
             feat_dir / "log" / "extract.3.log", feat_dir / "split3" / "3" / "wav.scp"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("old")
    extract(data_dir, feat_dir, options=FbankOptions(num_mel_bins=40), progress=False)
    assert not any(path.exists() for path in stale)
    assert sorted(p.name for p in feat_dir.glob("split*")) == ["split1"]


def test_compressed_output_is_readable_and_close(tmp_path):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(1.0, 0.7))
    extract(data_dir, tmp_path / "plain", progress=False)
    assert main([str(data_dir), str(tmp_path / "packed"), "--compress", "true",
                 "--no-progress"]) == 0

    plain, packed = load_feats(tmp_path / "plain"), load_feats(tmp_path / "packed")
    assert list(plain) == list(packed)
    for utt, matrix in plain.items():
        assert packed[utt].shape == matrix.shape
        span = float(matrix.max() - matrix.min())
        np.testing.assert_allclose(packed[utt], matrix, rtol=0, atol=span / 100)
        assert not np.array_equal(packed[utt], matrix)
    size = (tmp_path / "packed" / "arks" / "feats.1.ark").stat().st_size
    assert size < (tmp_path / "plain" / "arks" / "feats.1.ark").stat().st_size / 2


@pytest.mark.parametrize(("line", "message"), [
    ("u2 rec 0.5", r"segments:2: expected"),
    ("u2 rec 0.5 abc", r"segments:2: segment 'u2': start/end are not numbers"),
    ("u2 other 0.5 0.9", r"segments:2: segment 'u2' refers to recording 'other'"),
])
def test_malformed_segments_name_file_and_line(tmp_path, line, message):
    data_dir = write_kaldi_data_dir(
        tmp_path / "data", {"rec": str(make_audio_file(tmp_path / "rec.wav", 1.0))})
    (data_dir / "segments").write_text(f"u1 rec 0.0 0.4\n{line}\n", encoding="utf-8")
    with pytest.raises(TableError, match=message):
        extract(data_dir, tmp_path / "fbank", progress=False)
    assert main([str(data_dir), str(tmp_path / "fbank"), "--no-progress"]) == 1


def test_crashed_job_fails_the_stage_and_is_redone(tmp_path, monkeypatch):
    data_dir = make_data_dir(tmp_path / "corpus", durations=(0.6, 0.8))
    feat_dir = tmp_path / "fbank"

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(extraction, "compute_fbank", broken)
        with pytest.raises(extraction.FeatureExtractionError, match="1 feature job"):
            extract(data_dir, feat_dir, progress=False)
    assert "disk on fire" in (feat_dir / "log" / "extract.1.log").read_text()
    assert sorted(os.listdir(feat_dir / "arks")) == []
    assert not (feat_dir / "feats.scp").exists()

    assert extract(data_dir, feat_dir, progress=False).jobs_run == (1,)
    assert len(load_feats(feat_dir)) == 2
