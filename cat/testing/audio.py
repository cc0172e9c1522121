"""Factories for audio files and Kaldi data directories used by tests and benchmarks.

Everything is deterministic for a given seed: a waveform is a sum of sines with a
slow amplitude envelope plus a little noise, written as 16-bit WAV, 16-bit FLAC or
Ogg Opus with soundfile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import soundfile

from cat.core.io import PathLike, write_table

# soundfile (format, subtype) per file extension.
AUDIO_FORMATS = {
    ".wav": ("WAV", "PCM_16"),
    ".flac": ("FLAC", "PCM_16"),
    ".opus": ("OGG", "OPUS"),
}


def synth_waveform(duration: float, sample_rate: int = 16000, seed: int = 0,
                   channels: int = 1) -> np.ndarray:
    """A float32 waveform in [-1, 1]: sines between 100 Hz and 3 kHz, an envelope and noise.

    Returns shape `[samples]` for one channel, else `[samples, channels]` (soundfile layout).
    """
    rng = np.random.default_rng(seed)
    num_samples = round(duration * sample_rate)
    time = np.arange(num_samples) / sample_rate
    columns = []
    for _ in range(channels):
        frequencies = rng.uniform(100.0, min(3000.0, sample_rate / 2 - 200), size=4)
        phases = rng.uniform(0, 2 * np.pi, size=4)
        signal = sum(np.sin(2 * np.pi * f * time + phase)
                     for f, phase in zip(frequencies, phases, strict=True))
        envelope = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(0.5, 3.0) * time)
        noise = 0.05 * rng.standard_normal(num_samples)
        columns.append(0.15 * signal * envelope + noise)
    waveform = np.clip(np.stack(columns, axis=1), -1.0, 1.0).astype(np.float32)
    return waveform[:, 0] if channels == 1 else waveform


def write_audio(path: PathLike, waveform: np.ndarray, sample_rate: int) -> Path:
    """Write `waveform` with the format implied by the extension (.wav, .flac, .opus)."""
    path = Path(path)
    if path.suffix not in AUDIO_FORMATS:
        raise ValueError(f"{path}: unknown audio extension; expected one of "
                         f"{sorted(AUDIO_FORMATS)}")
    audio_format, subtype = AUDIO_FORMATS[path.suffix]
    path.parent.mkdir(parents=True, exist_ok=True)
    soundfile.write(path, waveform, sample_rate, format=audio_format, subtype=subtype)
    return path


def make_audio_file(path: PathLike, duration: float, sample_rate: int = 16000, seed: int = 0,
                    channels: int = 1) -> Path:
    """Write a synthetic recording of `duration` seconds to `path`; returns the path."""
    return write_audio(path, synth_waveform(duration, sample_rate, seed, channels), sample_rate)


def make_corrupt_file(path: PathLike, kind: str, source: PathLike | None = None,
                      seed: int = 0) -> Path:
    """Write an unreadable audio file: `garbage` random bytes, or `truncated` half of `source`.

    A truncated WAV keeps its header, which still declares the full data length.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        path.write_bytes(np.random.default_rng(seed).bytes(4000))
    elif kind == "truncated":
        if source is None:
            raise ValueError("a truncated file needs a source file")
        data = Path(source).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    else:
        raise ValueError(f"unknown corruption kind {kind!r}; expected 'garbage' or 'truncated'")
    return path


def write_kaldi_data_dir(
    data_dir: PathLike,
    wav_scp: Mapping[str, str],
    text: Mapping[str, str] | None = None,
    utt2spk: Mapping[str, str] | None = None,
    segments: Mapping[str, tuple[str, float, float]] | None = None,
) -> Path:
    """Write the given tables (sorted) into `data_dir`; `spk2utt` is derived from `utt2spk`.

    Nothing is validated, so tests can build inconsistent directories on purpose.
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    write_table(data_dir / "wav.scp", wav_scp.items())
    if text is not None:
        write_table(data_dir / "text", text.items())
    if utt2spk is not None:
        write_table(data_dir / "utt2spk", utt2spk.items())
        spk2utt: dict[str, list[str]] = {}
        for utt in sorted(utt2spk):
            spk2utt.setdefault(utt2spk[utt], []).append(utt)
        write_table(data_dir / "spk2utt", ((spk, " ".join(utts)) for spk, utts in spk2utt.items()))
    if segments is not None:
        write_table(data_dir / "segments",
                    ((utt, f"{rec} {start:.3f} {end:.3f}") for utt, (rec, start, end)
                     in segments.items()))
    return data_dir


def make_data_dir(
    root: PathLike,
    durations: Sequence[float] = (1.0, 1.3, 0.8, 1.6),
    sample_rate: int = 16000,
    extension: str = ".wav",
    num_speakers: int = 2,
    seed: int = 0,
) -> Path:
    """Build `root/audio/*<extension>` and a data dir `root/data` with one file per utterance.

    Utterance `i` is `S000<s>W000<i>` (AISHELL style: the speaker id is a prefix), spoken
    by speaker `S000<s>`, with a short Mandarin transcript. Returns the data dir.
    """
    root = Path(root)
    wav_scp, text, utt2spk = {}, {}, {}
    for index, duration in enumerate(durations):
        speaker = f"S{index % num_speakers + 1:04d}"
        utt = f"{speaker}W{index + 1:04d}"
        path = make_audio_file(root / "audio" / f"{utt}{extension}", duration, sample_rate,
                               seed=seed + index)
        wav_scp[utt] = str(path)
        text[utt] = f"今天 天气 很好 {index}"
        utt2spk[utt] = speaker
    return write_kaldi_data_dir(root / "data", wav_scp, text, utt2spk)


def make_segmented_data_dir(
    root: PathLike,
    durations: Sequence[float] = (6.0, 4.5, 3.2),
    segment_seconds: Sequence[float] = (0.6, 0.9, 1.4),
    gap: float = 0.15,
    sample_rate: int = 16000,
    extension: str = ".opus",
    seed: int = 0,
) -> Path:
    """Long recordings cut by a `segments` file, as WenetSpeech's are (Opus by default).

    Recording `i` is `root/audio/R<i><extension>` (id `R<i>`, `durations[i]` seconds);
    its segments `R<i>-S<j>` follow each other `gap` seconds apart, their lengths cycling
    through `segment_seconds`, until the recording ends. Each has a short Mandarin
    transcript. Returns the data dir `root/data` (`wav.scp`, `segments`, `text`,
    `utt2spk` with the recording as speaker).
    """
    root = Path(root)
    wav_scp, segments, text = {}, {}, {}
    for index, duration in enumerate(durations):
        recording = f"R{index:04d}"
        path = make_audio_file(root / "audio" / f"{recording}{extension}", duration,
                               sample_rate, seed=seed + index)
        wav_scp[recording] = str(path)
        start, number = 0.0, 0
        while True:
            length = segment_seconds[(index + number) % len(segment_seconds)]
            if start + length > duration:
                break
            utt = f"{recording}-S{number:04d}"
            segments[utt] = (recording, round(start, 3), round(start + length, 3))
            text[utt] = f"今天 天气 很好 {index} {number}"
            start += length + gap
            number += 1
    return write_kaldi_data_dir(root / "data", wav_scp, text,
                                {utt: segments[utt][0] for utt in segments}, segments)
