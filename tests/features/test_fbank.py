"""Fbank in bounded windows of frames, and `wav.scp` commands under a time limit."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from cat.audio.codec import AudioDecodeError, decode, encode, ogg_pages
from cat.features import fbank
from cat.features.extract import utterance_features
from cat.features.fbank import (
    COMMAND_TIMEOUT_VARIABLE,
    AudioError,
    FbankOptions,
    PipeCommandError,
    command_timeout,
    compute_fbank,
    read_audio,
)
from cat.testing.audio import make_audio_file, synth_waveform


def whole_recording_fbank(waveform: np.ndarray) -> np.ndarray:
    """The fbank of every frame computed at once, as `compute_fbank` did before windows."""
    samples = torch.from_numpy(np.asarray(waveform, np.float32)) * fbank.INT16_SCALE
    return fbank._fbank(samples, FbankOptions()).numpy()


# ----------------------------------------------------------------------------- batches

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("front_end", sorted(fbank.FRONT_ENDS))
@pytest.mark.parametrize("dtype", [np.int16, np.float32])
@pytest.mark.parametrize("batched", [True, None])
def test_batch_fbank_equals_each_rows_compute_fbank(front_end, dtype, device, batched):
    """Padded rows of very different lengths (none, one and 1,000+ frames), int16 samples
    or floats: each row's frames are `compute_fbank`'s, the padding frames zero; the
    whole batch at once (a GPU's way, here also on the CPU) and the device's own way."""
    options = fbank.front_end(front_end)
    lengths = [400, 401, 16000, 23456, 560, 7999, 100, 0]
    rows = [synth_waveform(max(n, 1) / 16000 + 0.01, seed=n)[:n] for n in lengths]
    if dtype == np.int16:
        rows = [np.round(r * 32767).astype(np.int16) for r in rows]
    padded = np.zeros((len(rows), max(lengths)), dtype)
    for row, samples in zip(padded, rows, strict=True):
        row[:len(samples)] = samples
    features = fbank.batch_fbank(torch.from_numpy(padded).to(device), torch.tensor(lengths),
                                 options, batched=batched)
    assert features.shape == (len(rows), fbank.num_frames(max(lengths), options), 80)
    frames = fbank.batch_num_frames(torch.tensor(lengths), options).tolist()
    assert frames == [fbank.num_frames(n, options) for n in lengths]
    for row, (samples, count) in enumerate(zip(rows, frames, strict=True)):
        got = features[row].cpu().numpy()
        assert not got[count:].any()
        if count:
            np.testing.assert_allclose(got[:count], compute_fbank(samples, 16000, options),
                                       rtol=0, atol=1e-4)


def test_batch_fbank_refuses_dither():
    with pytest.raises(ValueError, match="without dither"):
        fbank.batch_fbank(torch.zeros(1, 800, dtype=torch.int16), torch.tensor([800]),
                          FbankOptions(dither=1.0))


# ----------------------------------------------------------------------------- windows


def test_fbank_in_windows_equals_the_whole_recordings_frames():
    # 368 frames and 77 samples more than they need: no window below divides them.
    waveform = synth_waveform(3.7, seed=11)[:400 + 367 * 160 + 77]
    expected = whole_recording_fbank(waveform)
    assert len(expected) == fbank.num_frames(len(waveform)) == 368
    for window in (1, 7, 100, 367, 368, 10_000):
        got = compute_fbank(waveform, 16000, window_frames=window)
        assert got.shape == expected.shape and got.dtype == np.float32
        # Frames either side of each window boundary, then all of them.
        for boundary in range(window, len(expected), window):
            np.testing.assert_allclose(got[boundary - 1:boundary + 1],
                                       expected[boundary - 1:boundary + 1], rtol=0, atol=1e-5,
                                       err_msg=f"window {window}, boundary {boundary}")
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=str(window))
    # int16 samples and audio at another rate are windowed the same way.
    int16 = (waveform * 32768).astype(np.int16)
    np.testing.assert_allclose(compute_fbank(int16, 16000, window_frames=13),
                               whole_recording_fbank(int16 / np.float32(32768)), atol=1e-5)
    at_8k = synth_waveform(2.05, sample_rate=8000, seed=12)
    np.testing.assert_allclose(compute_fbank(at_8k, 8000, window_frames=17),
                               compute_fbank(at_8k, 8000, window_frames=10_000), atol=1e-5)
    with pytest.raises(ValueError, match="window_frames must be at least 1, got -1"):
        compute_fbank(waveform, 16000, window_frames=-1)


_PEAK_SCRIPT = """
import resource, sys
import numpy as np
from cat.features.fbank import compute_fbank
samples = np.random.default_rng(0).integers(-3000, 3000, 16000 * {seconds}, dtype=np.int16)
compute_fbank(samples[:16000], 16000)  # tables, FFT plans, thread pools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
features = compute_fbank(samples, 16000)
assert features.shape == ({seconds} * 100 - 2, 80), features.shape
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.slow
def test_fbank_memory_is_bounded_by_the_window_not_the_recording():
    """10 minutes of int16 audio (19 MB) give 19 MB of features; the frames of one window
    take 9 MB more (before: about 600 MB of intermediate tensors at once)."""
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT.format(seconds=600)],
                            capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    growth_mb = float(result.stdout.split()[-1])
    assert growth_mb < 80, f"peak RSS grew by {growth_mb:.0f} MB"


def test_utterance_features_with_segments_and_speed_are_unchanged_by_windows(monkeypatch):
    """Stage 1's features (segments, speed-perturbed copies) do not depend on the window."""
    waveform = synth_waveform(4.3, sample_rate=22050, seed=13)
    pieces = [("a", 0.0, 1.234), ("b", 1.1, 3.05), ("c", 2.5, -1)]
    options = FbankOptions()
    monkeypatch.setattr(fbank, "FBANK_WINDOW_FRAMES", 100_000)
    expected = list(utterance_features(waveform, 22050, pieces, options, (0.9, 1.1)))
    monkeypatch.setattr(fbank, "FBANK_WINDOW_FRAMES", 7)
    got = list(utterance_features(waveform, 22050, pieces, options, (0.9, 1.1)))
    assert [key for key, _ in got] == [key for key, _ in expected] == [
        "a", "b", "c", "sp0.9-a", "sp0.9-b", "sp0.9-c", "sp1.1-a", "sp1.1-b", "sp1.1-c"]
    for (key, matrix), (_, reference) in zip(got, expected, strict=True):
        np.testing.assert_allclose(matrix, reference, rtol=0, atol=1e-5, err_msg=key)


# ----------------------------------------------------------------------------- commands


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, or a pid taken by nothing, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.timeout(60)
def test_a_command_that_never_ends_is_killed_with_its_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv(COMMAND_TIMEOUT_VARIABLE, "1")
    pid_file = tmp_path / "sleep.pid"
    command = f"sleep 100000 & echo $! > {pid_file}; wait"
    start = time.monotonic()
    with pytest.raises(AudioError) as error:
        read_audio(f"{command} |")
    assert str(error.value) == (f"command '{command}' did not finish within 1 s: killed (the "
                                "limit is $CAT_WAV_SCP_TIMEOUT, in seconds)")
    assert time.monotonic() - start < 10
    # The shell's child went with it: the process group was killed, not the shell alone.
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper)

    # Audio written, then a command that does not exit: killed too, not waited for.
    wav = make_audio_file(tmp_path / "a.wav", 0.5, seed=1)
    with pytest.raises(AudioError, match=r"did not finish within 1 s: killed"):
        read_audio(f"cat {wav}; sleep 100000 |")
    # A command within its time: read as before; failures as before.
    np.testing.assert_array_equal(read_audio(f"cat {wav} |")[0], read_audio(str(wav))[0])
    with pytest.raises(AudioError) as error:
        read_audio("exit 3 |")
    assert str(error.value) == "command 'exit 3' exited with status 3"
    with pytest.raises(PipeCommandError, match=r"\(status 127: not found: "):
        read_audio("no-such-program-here |")
    with pytest.raises(AudioError) as error:
        read_audio("echo x |")
    assert str(error.value) == "cannot decode command 'echo x': Format not recognised."


def test_the_command_time_limit_setting(monkeypatch):
    monkeypatch.delenv(COMMAND_TIMEOUT_VARIABLE, raising=False)
    assert command_timeout() == 600
    monkeypatch.setenv(COMMAND_TIMEOUT_VARIABLE, "2.5")
    assert command_timeout() == 2.5
    monkeypatch.setenv(COMMAND_TIMEOUT_VARIABLE, "0")
    assert command_timeout() is None  # no limit
    for wrong in ("-1", "ten", "nan", "inf"):
        monkeypatch.setenv(COMMAND_TIMEOUT_VARIABLE, wrong)
        with pytest.raises(ValueError, match=f"CAT_WAV_SCP_TIMEOUT='{wrong}': expected "
                                             "seconds"):
            command_timeout()


def _encoded(audio_format: str, waveform: np.ndarray) -> bytes:
    """`waveform` (16 kHz) as a file of `audio_format`: the packers' formats, Ogg Vorbis,
    and MP3 as libsndfile writes it (with a Xing header)."""
    if audio_format in ("wav", "flac", "opus"):
        return encode(waveform, 16000, audio_format)
    out = io.BytesIO()
    major, subtype = {"ogg": ("OGG", "VORBIS"), "mp3": ("MP3", "MPEG_LAYER_III")}[audio_format]
    soundfile.write(out, waveform, 16000, format=major, subtype=subtype)
    return out.getvalue()


@pytest.mark.parametrize("audio_format", ["wav", "flac", "opus", "ogg", "mp3"])
def test_truncated_audio_of_every_format_is_an_error_naming_the_file(tmp_path, audio_format):
    """libsndfile reads an Ogg (Opus, Vorbis) or MP3 stream cut short as shorter audio, with
    no error: a file, a command's output and shard bytes are refused by name instead,
    wherever the stream is cut (inside a page, or at a page boundary)."""
    waveform = synth_waveform(3.0, 16000, seed=3)
    data = _encoded(audio_format, waveform)
    whole = tmp_path / f"whole.{audio_format}"
    whole.write_bytes(data)
    assert len(read_audio(str(whole))[0]) == len(waveform)
    assert len(read_audio(f"cat {whole} |")[0]) == len(waveform)
    cuts = [len(data) // 2, len(data) - 3]
    if audio_format in ("opus", "ogg"):
        cuts.append(ogg_pages(data)[-2].end)  # the last page, that ends the stream, lost
    # A FLAC stream cut short does not decode at all (libsndfile: "lost sync").
    what = ("truncated audio|cannot decode( audio)?" if audio_format == "flac"
            else "truncated audio")
    for cut in cuts:
        path = tmp_path / f"cut{cut}.{audio_format}"
        path.write_bytes(data[:cut])
        for spec, name in ((str(path), str(path)), (f"cat {path} |", f"command 'cat {path}'")):
            with pytest.raises(AudioError, match=rf"^({what}) {re.escape(name)}: "):
                read_audio(spec)
        with pytest.raises(AudioDecodeError, match=rf"^({what}) {re.escape(str(path))}: "):
            decode(data[:cut], str(path))
