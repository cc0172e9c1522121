"""Utterances of Kaldi data directories for audio shards: audio, segment and transcript.

`load_audio_utterances(data_dirs, drops)` reads each directory's `wav.scp`, optional
`segments` and `text`, joins utterances with transcripts by id (several directories are
joined too; an utterance id in two of them is an error naming both files), and decides
each utterance's length in 16 kHz fbank frames before any audio is decoded, so that
length groups and shard contents can be planned up front:

* with `segments`: the segment's samples as stage 1 cuts them
  (`cat.features.extract.segment_span`: an end up to `max_overshoot` seconds past the
  recording is clipped), the recording's length read from its audio header;
* without: the whole file's samples, from its audio header (`soundfile.info`);
* lengths at another sample rate are converted as the resampler gives them
  (`cat.audio.codec.resample`: `floor(n * 16000 / rate + 0.5)` samples);
* a `wav.scp` command (`... |`) has no header to read: with `segments` its segments
  count as `end - start` (checked again when the recording is decoded); without
  `segments`, or with a segment that runs to the end (`-1`), it is an error naming the
  line, since its duration cannot be known without decoding.

Utterances left out go to `drops` with a reason: `no_label` (audio, no transcript),
`no_audio` (transcript, no audio), `empty_label`, `bad_audio` (missing or unreadable
file), `bad_segment` (a segment outside its recording, or empty), `too_short` (shorter
than one 25 ms frame).

Usage:
    drops = DropLog()
    table = load_audio_utterances(["data/train_l"], drops, num_jobs=4)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile

from cat.core.io import PathLike, TableError, iter_table
from cat.core.process import process_pool
from cat.features.extract import segment_span
from cat.features.fbank import FbankOptions, num_frames
from cat.features.plan import DEFAULT_MAX_OVERSHOOT, read_segments
from cat.formats.tables import DropLog, as_path_list, join_labels, read_labels

logger = logging.getLogger(__name__)

#: The sample rate of audio in shards, and of the fbank the loader computes from it.
SAMPLE_RATE = FbankOptions().sample_rate
# Recording headers read per task when they are read in parallel.
_PROBE_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Recording:
    """One `wav.scp` entry: its value, and the size and mtime of its file (None: a pipe)."""

    spec: str
    stat: tuple[int, int] | None


@dataclasses.dataclass
class AudioTable:
    """Utterances sorted by id; where each one's audio is, and its planned frame count.

    `starts`/`ends` are segment times in seconds (0 and -1 for a whole recording);
    `recording` indexes `recordings`.
    """

    keys: list[str]
    texts: list[str]
    recordings: list[Recording]
    recording: np.ndarray  # int32
    starts: np.ndarray  # float64
    ends: np.ndarray  # float64
    num_frames: np.ndarray  # int32

    def __len__(self) -> int:
        return len(self.keys)

    def select(self, indices: Sequence[int] | np.ndarray) -> AudioTable:
        """A table of the given rows, in the given order."""
        indices = np.asarray(indices, dtype=np.int64)
        return AudioTable([self.keys[i] for i in indices], [self.texts[i] for i in indices],
                          self.recordings, self.recording[indices], self.starts[indices],
                          self.ends[indices], self.num_frames[indices])


def is_pipe(spec: str) -> bool:
    """A `wav.scp` value that is a command writing audio to stdout (`... |`)."""
    return spec.rstrip().endswith("|")


def resampled_length(num_samples: int, orig_rate: int, new_rate: int = SAMPLE_RATE) -> int:
    """Samples of `num_samples` resampled from `orig_rate` to `new_rate` (as soxr gives)."""
    if orig_rate == new_rate:
        return num_samples
    return math.floor(num_samples * new_rate / orig_rate + 0.5)


def probe_audio(spec: str) -> tuple[int, int, int] | str:
    """`(samples, sample rate, channels)` from the header of the file `spec`, or why not."""
    if not os.path.isfile(spec):
        return f"no such file: {spec}"
    try:
        info = soundfile.info(spec)
    except (soundfile.SoundFileError, RuntimeError) as error:
        return f"cannot decode {spec}: {error}"
    return info.frames, info.samplerate, info.channels


def _probe_many(specs: list[str]) -> list[tuple[int, int, int] | str]:
    return [probe_audio(spec) for spec in specs]


def probe_recordings(specs: list[str], num_jobs: int = 1) -> list[tuple[int, int, int] | str]:
    """`probe_audio` of each file, in `num_jobs` processes when there are many."""
    if num_jobs == 1 or len(specs) <= _PROBE_CHUNK:
        return _probe_many(specs)
    chunks = [specs[i:i + _PROBE_CHUNK] for i in range(0, len(specs), _PROBE_CHUNK)]
    with process_pool(num_jobs) as pool:
        return [result for chunk in pool.map(_probe_many, chunks) for result in chunk]


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass
class _Entries:
    """Utterances read so far: id -> (recording number, start, end), and where from."""

    recordings: list[Recording] = dataclasses.field(default_factory=list)
    pieces: dict[str, tuple[int, float, float]] = dataclasses.field(default_factory=dict)
    origin: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, utt: str, recording: int, start: float, end: float, where: str) -> None:
        if utt in self.pieces:
            raise TableError(f"{where}: duplicate utterance {utt!r} (also in "
                             f"{self.origin[utt]})")
        self.pieces[utt] = (recording, start, end)
        self.origin[utt] = where.rsplit(":", 1)[0]


def _read_wav_scp(path: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Recordings of one `wav.scp` and their line numbers; a repeated id is an error."""
    table: dict[str, str] = {}
    lines: dict[str, int] = {}
    for lineno, (recording, spec) in enumerate(iter_table(path), 1):
        if recording in table:
            raise TableError(f"{path}:{lineno}: duplicate key {recording!r} (first on line "
                             f"{lines[recording]})")
        table[recording] = spec
        lines[recording] = lineno
    if not table:
        raise TableError(f"{path}: no recordings")
    return table, lines


def _read_data_dir(data_dir: Path, entries: _Entries) -> None:
    wav_scp_path, segments_path = data_dir / "wav.scp", data_dir / "segments"
    wav_scp, lines = _read_wav_scp(wav_scp_path)
    numbers: dict[str, int] = {}

    def number(recording: str) -> int:
        if recording not in numbers:
            spec = wav_scp[recording]
            stat = None
            if not is_pipe(spec):
                try:
                    result = os.stat(spec)
                    stat = (result.st_size, result.st_mtime_ns)
                except OSError:
                    stat = (-1, -1)  # missing: dropped as bad_audio when probed
            numbers[recording] = len(entries.recordings)
            entries.recordings.append(Recording(spec, stat))
        return numbers[recording]

    if segments_path.is_file():
        for lineno, (utt, recording, start, end) in enumerate(
                read_segments(segments_path, wav_scp), 1):
            if end == -1 and is_pipe(wav_scp[recording]):
                raise TableError(
                    f"{segments_path}:{lineno}: segment {utt!r} runs to the end (-1) of "
                    f"{recording!r}, a command ({wav_scp_path}:{lines[recording]}): its "
                    "duration cannot be known without decoding; give its end time")
            entries.add(utt, number(recording), start, end, f"{segments_path}:{lineno}")
        return
    for recording, spec in wav_scp.items():
        if is_pipe(spec):
            raise TableError(
                f"{wav_scp_path}:{lines[recording]}: recording {recording!r} is a command "
                f"({spec!r}) and {data_dir} has no segments file: its duration cannot be "
                "known without decoding; write the audio to files, or give segments")
        entries.add(recording, number(recording), 0.0, -1.0,
                    f"{wav_scp_path}:{lines[recording]}")


def load_audio_utterances(data_dirs: PathLike | Sequence[PathLike], drops: DropLog,
                          num_jobs: int = 1,
                          max_overshoot: float = DEFAULT_MAX_OVERSHOOT) -> AudioTable:
    """Utterances of the data dirs joined with their transcripts (see the module doc)."""
    entries = _Entries()
    text_files = []
    for data_dir in as_path_list(data_dirs):
        for name in ("wav.scp", "text"):
            if not (data_dir / name).is_file():
                raise FileNotFoundError(f"{data_dir / name} does not exist")
        _read_data_dir(data_dir, entries)
        text_files.append(data_dir / "text")
    labels = read_labels(text_files)

    ordered = sorted(entries.pieces)
    keys = [ordered[i] for i in join_labels(ordered, labels, drops, unmatched="no_audio")]

    lengths = _recording_lengths(entries, keys, num_jobs)
    kept, frames = [], []
    for utt in keys:
        recording, start, end = entries.pieces[utt]
        verdict = _utterance_frames(start, end, lengths.get(recording), max_overshoot)
        if isinstance(verdict, tuple):
            drops.add(utt, *verdict)
        else:
            kept.append(utt)
            frames.append(verdict)
    pieces = [entries.pieces[utt] for utt in kept]
    return AudioTable(
        keys=kept, texts=[labels[utt] for utt in kept], recordings=entries.recordings,
        recording=np.array([p[0] for p in pieces], np.int32),
        starts=np.array([p[1] for p in pieces], np.float64),
        ends=np.array([p[2] for p in pieces], np.float64),
        num_frames=np.array(frames, np.int32))


def _recording_lengths(entries: _Entries, keys: list[str], num_jobs: int
                       ) -> dict[int, int | str]:
    """16 kHz samples of every file recording the kept utterances use (or why unreadable)."""
    used = sorted({entries.pieces[utt][0] for utt in keys})
    files = [number for number in used if not is_pipe(entries.recordings[number].spec)]
    if len(files) > _PROBE_CHUNK:
        logger.info("reading the audio headers of %d recordings", len(files))
    probes = probe_recordings([entries.recordings[n].spec for n in files], num_jobs)
    lengths: dict[int, int | str] = {}
    for number, probe in zip(files, probes, strict=True):
        lengths[number] = probe if isinstance(probe, str) else resampled_length(*probe[:2])
    return lengths


def _utterance_frames(start: float, end: float, length: int | str | None,
                      max_overshoot: float) -> int | tuple[str, str]:
    """Frames of one utterance, or its drop reason and detail."""
    if isinstance(length, str):
        return "bad_audio", " ".join(length.split())
    if length == 0:
        return "bad_audio", "empty audio"
    if length is None:  # a command: taken at its word until it is decoded
        begin, stop = int(start * SAMPLE_RATE), int(end * SAMPLE_RATE)
        span: tuple[int, int] | str = (begin, stop) if start >= 0 and begin < stop else \
            f"empty segment or one before the recording ({start} s to {end} s)"
    else:
        span = segment_span(start, end, length, SAMPLE_RATE, max_overshoot)
    if isinstance(span, str):
        return "bad_segment", span
    count = num_frames(span[1] - span[0])
    if count == 0:
        return "too_short", (f"{span[1] - span[0]} samples at {SAMPLE_RATE} Hz, need "
                             f"{FbankOptions().window_size}")
    return count
