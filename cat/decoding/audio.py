"""Audio to decode, and its features as stage 1 computes them.

Three kinds of list name the utterances; each becomes `Recording`s (what is read at once)
holding `Piece`s (its utterances), with the list line each came from:

* audio files (WAV, FLAC, Ogg Opus: what soundfile reads), one utterance per file, keyed
  by the file name without its extension (`audio/BAC009S0764W0121.wav` ->
  `BAC009S0764W0121`);
* a Kaldi `wav.scp` (`<recording> <path>`, or `<recording> <command> |` whose standard
  output is audio), each recording one utterance; or, with a `segments` file
  (`<utterance> <recording> <start> <end>`, seconds, end -1 for the recording's end), its
  segments, each recording read once for all of its segments;
* a WeNet `data.list`: raw mode, a JSON object per line (`{"key", "wav", "txt"}`, and
  optionally `"start"` and `"end"` in seconds; `txt` is not used), or shard mode, a tar
  shard per line (a path, an `http(s)://` URL or a `pipe:` command, as the training
  loader reads them) holding `<key>.<audio extension>` members (`wav`, `flac`, `opus`, ...)
  next to `<key>.txt`; a member name is split at its LAST dot, so keys may hold dots and
  `/` (`A/B/utt.1.wav` is key `A/B/utt.1`).

`recording_features` reads one recording (file, command or shard) and yields each
utterance's 80-dim fbank exactly as stage 1 does (`cat.features.extract.utterance_features`:
resampled to 16 kHz with libsoxr, segments cut as Kaldi's extract-segments cuts them), or
why it has none: unreadable, truncated or missing audio, a segment outside its recording,
a shard member without audio, an utterance longer than the transcription window (refused
from the file's header, before its samples are read). Of 16 kHz audio only each
utterance's samples are read, a block at a time. Every reason starts with the list line
(`wav.scp:3: no such file: ...`) or the shard and member it concerns.

Usage:
    audio = from_wav_scp("data/test/wav.scp", "data/test/segments")
    for recording in audio.recordings:
        for key, features in recording_features(recording, FbankOptions()): ...
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import soundfile

from cat.audio.codec import READ_EXTENSIONS, AudioDecodeError, decode, resample
from cat.audio.vad import SAMPLE_RATE as VAD_RATE
from cat.audio.vad import SileroVad
from cat.core.io import PathLike, TableError, iter_table
from cat.decoding.segments import RELEASE, VADS, plan_cuts
from cat.features.extract import cut_features, segment_span, utterance_features
from cat.features.fbank import AudioError, FbankOptions, num_frames, open_audio, read_channel
from cat.features.plan import DEFAULT_MAX_OVERSHOOT, scan_segments
from cat.formats.data_list import URL_PREFIXES, DataListError, read_data_list
from cat.loading.sources import describe, read_shard
from cat.loading.tar import CorruptShardError

#: Member extensions of audio in WeNet shards (`<key>.<extension>`).
AUDIO_EXTENSIONS = frozenset(READ_EXTENSIONS)


class AudioListError(ValueError):
    """A list of audio is malformed; the message names the file and line."""


#: The longest stretch decoded at once by default (seconds): `Segmenting.max_segment`.
MAX_SEGMENT_SECONDS = 30.0
#: Seconds voice-activity segments are merged up to by default (at most `max_segment`):
#: of 5 to 25 s, 5 s gave the lowest error rate on the synthetic test set end to end
#: (bench/README.md), nearly that of its utterances decoded one by one.
SEGMENT_TARGET_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class Segmenting:
    """Long utterances decoded a stretch at a time: an utterance longer than `max_segment`
    seconds is cut into segments of at most that length, each read and decoded alone.

    With `vad` "silero", voice-activity segments (`cat.decoding.segments`: cuts in pauses,
    segments merged up to `segment_target` seconds; speech from a probability of
    `vad_threshold`, pauses of `vad_min_silence` seconds or more); with "none", and for
    speech without a pause longer than `max_segment`, windows of `max_segment` seconds,
    each starting `max_segment - overlap` seconds after the one before (the last one
    shorter). `overlap` must be less than half of `max_segment`, so that only
    neighbouring windows overlap. A value out of range is a ValueError naming its flag."""

    max_segment: float = MAX_SEGMENT_SECONDS
    overlap: float = 2.0
    vad: str = "silero"
    vad_threshold: float = 0.5
    vad_min_silence: float = 0.2
    segment_target: float | None = None  # None: SEGMENT_TARGET_SECONDS, or max_segment

    def __post_init__(self) -> None:
        if not self.max_segment > 0:
            raise ValueError(f"--max-segment {self.max_segment:g}: expected a positive number "
                             "of seconds")
        if not 0 <= self.overlap < self.max_segment / 2:
            raise ValueError(f"--segment-overlap {self.overlap:g}: expected at least 0 and "
                             f"less than half of --max-segment {self.max_segment:g} seconds")
        if self.vad not in VADS:
            raise ValueError(f"--vad {self.vad!r}: expected one of {', '.join(VADS)}")
        if not RELEASE < self.vad_threshold < 1:
            raise ValueError(f"--vad-threshold {self.vad_threshold:g}: expected a speech "
                             f"probability above {RELEASE:g} and below 1")
        if not 0 < self.vad_min_silence <= self.max_segment / 4:
            raise ValueError(f"--vad-min-silence {self.vad_min_silence:g}: expected more than "
                             f"0 and at most a quarter of --max-segment {self.max_segment:g} "
                             "seconds")
        if self.segment_target is not None and not 1 <= self.segment_target <= self.max_segment:
            raise ValueError(f"--segment-target {self.segment_target:g}: expected at least 1 "
                             f"and at most --max-segment {self.max_segment:g} seconds")

    @property
    def target(self) -> float:
        """Seconds voice-activity segments are merged up to."""
        if self.segment_target is not None:
            return self.segment_target
        return min(SEGMENT_TARGET_SECONDS, self.max_segment)

    def starts(self, num_samples: int, rate: int, min_samples: int = 1
               ) -> list[tuple[int, int]]:
        """(first, end) samples of each window of an utterance of `num_samples` samples. A
        last window shorter than `min_samples` (one frame) joins the one before, which
        then reaches the end: a window with no frame would lose the utterance."""
        size = round(self.max_segment * rate)
        hop = size - round(self.overlap * rate)
        windows = []
        start = 0
        while True:
            windows.append((start, min(start + size, num_samples)))
            if start + size >= num_samples:
                break
            start += hop
        if len(windows) > 1 and windows[-1][1] - windows[-1][0] < min_samples:
            windows[-2:] = [(windows[-2][0], num_samples)]
        return windows


@dataclasses.dataclass(frozen=True)
class Window:
    """Features of one stretch of a long utterance (`Segmenting`): `start` is where it
    begins in the utterance (seconds), `index` its place among the utterance's stretches,
    `overlap` the seconds it shares with the one before (0 after a pause), `duration` the
    utterance's seconds. A voice-activity segment's stretches carry its number (`segment`)
    and where its speech lies (`speech`, seconds); a recording without speech gives one
    window of no frames."""

    features: np.ndarray
    start: float
    index: int
    overlap: float = 0.0
    duration: float = 0.0
    segment: int | None = None
    speech: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Piece:
    """One utterance of a recording: seconds `start` to `end` (-1: the recording's end)."""

    key: str
    start: float
    end: float
    where: str


@dataclasses.dataclass(frozen=True)
class Recording:
    """Audio read at once: a file or Kaldi pipe command with its pieces, or a tar shard
    (`shard`: its members are the utterances). `where` is the list line naming it;
    `weight` its size for dealing recordings to processes (None: unknown)."""

    source: str
    where: str
    pieces: tuple[Piece, ...] = ()
    shard: bool = False
    weight: float | None = None


@dataclasses.dataclass(frozen=True)
class AudioList:
    """The recordings of a list, in its order; `name` says what the list was."""

    name: str
    recordings: list[Recording]

    def weights(self) -> dict[str, float] | None:
        """Each recording's weight by its index (as a string), or None when some are
        unknown (`cat.features.plan.balance_jobs` deals them)."""
        weights = {}
        for index, recording in enumerate(self.recordings):
            if recording.weight is None:
                return None
            weights[str(index)] = recording.weight
        return weights


def _check_key(key: str, where: str) -> str:
    if not key or any(char.isspace() for char in key):
        raise AudioListError(f"{where}: key {key!r} is empty or holds whitespace, which a "
                             "`<key> <text>` line cannot hold")
    return key


def _file_weight(spec: str) -> float | None:
    if spec.rstrip().endswith("|"):
        return None
    try:
        return float(os.path.getsize(spec))
    except OSError:
        return 0.0  # missing: reported when read, quickly


def from_files(paths: Sequence[PathLike]) -> AudioList:
    """One utterance per audio file, keyed by its name without the extension."""
    recordings = []
    first: dict[str, int] = {}
    for number, path in enumerate(map(str, paths), 1):
        where = f"command line audio file {number}"
        key = _check_key(Path(path).stem, f"{where} ({path})")
        if key in first:
            raise AudioListError(f"{where} ({path}): key {key!r} again (audio file "
                                 f"{first[key]} has it); name the files in a wav.scp")
        first[key] = number
        recordings.append(Recording(path, where, (Piece(key, 0.0, -1.0, where),),
                                    weight=_file_weight(path)))
    if not recordings:
        raise AudioListError("no audio files given")
    return AudioList("command line audio files", recordings)


def _read_wav_scp(path: Path) -> dict[str, tuple[str, str]]:
    """recording -> (audio spec, `path:line`)."""
    table: dict[str, tuple[str, str]] = {}
    for lineno, (recording, spec) in enumerate(iter_table(path), 1):
        if recording in table:
            raise AudioListError(f"{path}:{lineno}: recording {recording!r} again (first at "
                                 f"{table[recording][1]})")
        table[recording] = (spec, f"{path}:{lineno}")
    if not table:
        raise AudioListError(f"{path}: no recordings")
    return table


def from_wav_scp(wav_scp: PathLike, segments: PathLike | None = None) -> AudioList:
    """The recordings of a Kaldi `wav.scp`, each one utterance, or cut by `segments`."""
    wav_scp = Path(wav_scp)
    try:
        table = _read_wav_scp(wav_scp)
    except TableError as error:
        raise AudioListError(str(error)) from None
    if segments is None:
        return AudioList(str(wav_scp), [
            Recording(spec, where, (Piece(recording, 0.0, -1.0, where),),
                      weight=_file_weight(spec))
            for recording, (spec, where) in table.items()])
    segments = Path(segments)
    try:
        durations, _ = scan_segments(segments, {key: spec for key, (spec, _) in table.items()})
    except TableError as error:
        raise AudioListError(str(error)) from None
    pieces: dict[str, list[Piece]] = collections.defaultdict(list)
    for lineno, (utt, value) in enumerate(iter_table(segments), 1):
        recording, start, end = value.split()
        pieces[recording].append(Piece(utt, float(start), float(end), f"{segments}:{lineno}"))
    return AudioList(f"{wav_scp} with {segments}", [
        Recording(table[recording][0], table[recording][1], tuple(pieces[recording]),
                  weight=durations[recording])
        for recording in table if recording in pieces])


def from_data_list(path: PathLike) -> AudioList:
    """A WeNet `data.list` (`cat.formats.data_list`), raw mode (JSON lines) or shard mode
    (a shard per line)."""
    try:
        listing = read_data_list(path)
    except DataListError as error:
        raise AudioListError(str(error)) from None
    if not listing.raw:
        return AudioList(str(path), [
            Recording(line.location, line.where, shard=True,
                      weight=None if line.location.startswith(URL_PREFIXES)
                      else _file_weight(line.location))
            for line in listing.shards])
    audio: dict[str, list[Piece]] = {}
    wheres: dict[str, str] = {}
    for entry in listing.entries:
        audio.setdefault(entry.wav, []).append(Piece(entry.key, entry.start, entry.end,
                                                     entry.where))
        wheres.setdefault(entry.wav, entry.where)
    return AudioList(str(path), [Recording(wav, wheres[wav], tuple(pieces),
                                           weight=_file_weight(wav))
                                 for wav, pieces in audio.items()])


# ----------------------------------------------------------------------------- features


#: The environment variable holding the seconds of the longest utterance transcription
#: reads (`cat.decoding.transcribe`; default 1800).
WINDOW_VARIABLE = "CAT_TRANSCRIBE_WINDOW_SECONDS"


def recording_features(recording: Recording, options: FbankOptions,
                       max_frames: int | None = None, segmenting: Segmenting | None = None
                       ) -> Iterator[tuple[str, np.ndarray | Window | str]]:
    """`(key, features or why there are none)` of each utterance of `recording`, in order.

    A file or command is opened once (`open_audio`); at `options.sample_rate`, only each
    utterance's samples are read (`read_channel`), so a long recording cut by segments
    takes the memory of its longest segment; at another rate it is read whole and
    resampled, as stage 1 does. An utterance of more than `max_frames` frames (None: no
    limit) is not read: its reason names it, its duration and `WINDOW_VARIABLE`.

    With `segmenting`, an utterance of a file or command longer than its `max_segment` is
    read a stretch at a time instead (at any rate: each stretch's samples alone are read
    and resampled), giving a `Window` per stretch, in order: with `vad` "silero" the
    voice-activity detector first reads it a minute at a time (`VAD_BLOCK_SECONDS`) and
    the stretches are its segments (`cat.decoding.segments.plan_cuts`), else windows. A
    stretch that cannot be read ends the utterance with its reason (`(key, reason)` after
    the stretches read before it). Utterances of tar shards are decoded whole.
    """
    if recording.shard:
        yield from _shard_features(recording, options, max_frames)
        return
    with contextlib.ExitStack() as stack:
        try:
            audio, name = stack.enter_context(open_audio(recording.source))
        except AudioError as error:
            for piece in recording.pieces:
                yield piece.key, f"{recording.where}: {error}"
            return
        yield from _pieces_features(recording.pieces, audio, name, options, max_frames,
                                    segmenting)


def _pieces_features(pieces: Sequence[Piece], audio: soundfile.SoundFile, name: str,
                     options: FbankOptions, max_frames: int | None,
                     segmenting: Segmenting | None = None
                     ) -> Iterator[tuple[str, np.ndarray | Window | str]]:
    rate, target = audio.samplerate, options.sample_rate
    # At another rate, an estimate of the resampled length: enough to refuse by length.
    length = audio.frames if rate == target else round(audio.frames * target / rate)
    spans = [segment_span(piece.start, piece.end, length, target, DEFAULT_MAX_OVERSHOOT)
             for piece in pieces]
    reasons: dict[int, str] = {}
    windowed: dict[int, tuple[int, int]] = {}
    for index, (piece, span) in enumerate(zip(pieces, spans, strict=True)):
        if isinstance(span, str):
            if rate == target:  # else stage 1's code finds it, with the exact length
                reasons[index] = span
        elif segmenting is not None and span[1] - span[0] > segmenting.max_segment * target:
            windowed[index] = span
            reasons[index] = ""  # read below, a window at a time
        elif max_frames is not None and num_frames(span[1] - span[0], options) > max_frames:
            reasons[index] = _too_long(piece, name, (span[1] - span[0]) / target,
                                       max_frames, options)
    if rate == target:
        results: Iterable[np.ndarray | str] = (
            reasons[index] if index in reasons else _span_features(piece, span, audio, name,
                                                                    options)
            for index, (piece, span) in enumerate(zip(pieces, spans, strict=True)))
    else:
        results = _resampled_features(pieces, reasons, audio, name, options)
    for index, (piece, result) in enumerate(zip(pieces, results, strict=True)):
        if index in windowed:
            stretches = _vad_features if segmenting.vad == "silero" else _window_features
            yield from stretches(piece, windowed[index], audio, name, options, segmenting)
        else:
            yield piece.key, f"{piece.where}: {result}" if isinstance(result, str) else result


def _window_features(piece: Piece, span: tuple[int, int], audio: soundfile.SoundFile,
                     name: str, options: FbankOptions, segmenting: Segmenting
                     ) -> Iterator[tuple[str, Window | str]]:
    """The windows of one long utterance (`span`: its samples at the target rate), each
    read alone and resampled when the audio has another rate."""
    begin, end = span
    duration = (end - begin) / options.sample_rate
    windows = segmenting.starts(end - begin, options.sample_rate, options.window_size)
    for index, (first, last) in enumerate(windows):
        features = _stretch_features(piece, audio, name, options, begin + first, begin + last)
        if isinstance(features, str):
            yield piece.key, features
            return
        yield piece.key, Window(features, first / options.sample_rate, index,
                                segmenting.overlap if index else 0.0, duration)


def _stretch_features(piece: Piece, audio: soundfile.SoundFile, name: str,
                      options: FbankOptions, first: int, last: int) -> np.ndarray | str:
    """Stage 1's features of samples `first` to `last` (at the target rate) of an
    utterance, read alone (and resampled at another rate), or why there are none."""
    target = options.sample_rate
    try:
        samples = _read_stretch(audio, name, first, last, target, target)
    except AudioError as error:
        return f"{piece.where}: {error}"
    features = cut_features(samples, piece.key, options)
    if isinstance(features, str):
        return f"{piece.where}: {name}: the stretch at {first / target:g} s: {features}"
    return features


def _read_stretch(audio: soundfile.SoundFile, name: str, first: int, last: int, target: int,
                  out_rate: int) -> np.ndarray:
    """Samples `first` to `last` (counted at `target` Hz) of a recording, read alone and
    resampled to `out_rate` when the file has another rate."""
    rate = audio.samplerate
    samples = read_channel(audio, name, round(first * rate / target), round(last * rate / target))
    return samples if rate == out_rate else resample(samples, rate, out_rate)


#: Seconds of audio the voice-activity detector is given at once.
VAD_BLOCK_SECONDS = 60.0


def _speech_probabilities(piece: Piece, span: tuple[int, int], audio: soundfile.SoundFile,
                          name: str, target: int) -> np.ndarray | str:
    """The VAD's probabilities of an utterance, read a block at a time, or why not."""
    vad = SileroVad()
    probabilities = []
    block = round(VAD_BLOCK_SECONDS * target)
    for first in range(span[0], span[1], block):
        last = min(span[1], first + block)
        try:
            samples = _read_stretch(audio, name, first, last, target, VAD_RATE)
        except AudioError as error:
            return f"{piece.where}: {error}"
        probabilities.append(vad.accept(samples))
    probabilities.append(vad.finish())
    return np.concatenate(probabilities)


def _vad_features(piece: Piece, span: tuple[int, int], audio: soundfile.SoundFile,
                  name: str, options: FbankOptions, segmenting: Segmenting
                  ) -> Iterator[tuple[str, Window | str]]:
    """The voice-activity segments of one long utterance (`cat.decoding.segments`), each
    read alone; speech without a pause longer than `max_segment`, in windows."""
    target = options.sample_rate
    begin, end = span
    duration = (end - begin) / target
    probabilities = _speech_probabilities(piece, span, audio, name, target)
    if isinstance(probabilities, str):
        yield piece.key, probabilities
        return
    cuts = plan_cuts(probabilities, round((end - begin) * VAD_RATE / target),
                     segmenting.max_segment, segmenting.vad_threshold,
                     segmenting.vad_min_silence, segmenting.target)
    if not cuts:
        yield piece.key, Window(np.zeros((0, options.num_mel_bins), np.float32), 0.0, 0,
                                duration=duration, segment=0)
        return
    index = 0
    for number, cut in enumerate(cuts):
        first, last = (round(sample * target / VAD_RATE) for sample in (cut.first, cut.end))
        speech = (cut.speech_first / VAD_RATE, cut.speech_end / VAD_RATE)
        windows = segmenting.starts(last - first, target, options.window_size) \
            if cut.windowed else \
            [(0, last - first)]
        for offset, (start, stop) in enumerate(windows):
            features = _stretch_features(piece, audio, name, options, begin + first + start,
                                         begin + first + stop)
            if isinstance(features, str):
                yield piece.key, features
                return
            yield piece.key, Window(features, (first + start) / target, index,
                                    segmenting.overlap if offset else 0.0, duration, number,
                                    speech)
            index += 1


def _span_features(piece: Piece, span: tuple[int, int], audio: soundfile.SoundFile,
                   name: str, options: FbankOptions) -> np.ndarray | str:
    """Stage 1's features of one utterance, only its samples read."""
    try:
        samples = read_channel(audio, name, *span)
    except AudioError as error:
        return str(error)
    return cut_features(samples, piece.key, options)


def _resampled_features(pieces: Sequence[Piece], reasons: dict[int, str],
                        audio: soundfile.SoundFile, name: str, options: FbankOptions
                        ) -> Iterator[np.ndarray | str]:
    """Audio at another rate: read whole, resampled and cut by stage 1's own code."""
    wanted = [(piece.key, piece.start, piece.end) for index, piece in enumerate(pieces)
              if index not in reasons]
    features: Iterator[tuple[str, np.ndarray | str]] = iter(())
    if wanted:
        try:
            features = utterance_features(read_channel(audio, name), audio.samplerate,
                                          wanted, options)
        except AudioError as error:
            reasons.update((index, str(error)) for index in range(len(pieces))
                           if index not in reasons)
    for index in range(len(pieces)):
        yield reasons[index] if index in reasons else next(features)[1]


def _too_long(piece: Piece, name: str, seconds: float, max_frames: int,
              options: FbankOptions) -> str:
    what = "the recording" if (piece.start, piece.end) == (0.0, -1.0) else \
        f"the segment {piece.start:g} s to {piece.end:g} s of it"
    window = max_frames * options.frame_shift_ms / 1000
    return (f"{name}: {what} lasts {seconds:.1f} s ({_clock(seconds)}), longer than the "
            f"transcription window of {window:g} s: an utterance is decoded whole, so it is "
            "not read; decode it in windows (--max-segment), split it into shorter "
            f"utterances (a segments file), or raise ${WINDOW_VARIABLE} (seconds)")


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def _shard_features(recording: Recording, options: FbankOptions, max_frames: int | None
                    ) -> Iterator[tuple[str, np.ndarray | str]]:
    """Utterances of a WeNet shard: consecutive members with the same key form one."""
    where = f"{recording.where}: {recording.source}"
    key: str | None = None
    members: dict[str, bytes] = {}
    try:
        for name, data in read_shard(recording.source):
            member_key, dot, extension = name.rpartition(".")
            if not dot or "/" in extension:
                yield name, f"{where}: member {name!r} has no extension"
                continue
            if member_key != key:
                if key is not None:
                    yield from _member_features(key, members, where, options, max_frames)
                key, members = member_key, {}
            members[extension] = bytes(data)
    except (CorruptShardError, OSError) as error:
        # What follows in the shard is lost, unnamed; the utterance being read is named.
        if key is None:
            yield recording.source, f"{where}: {describe(error)}"
        else:
            yield key, f"{where}: the shard breaks off at key {key!r}: {describe(error)}"
        return
    if key is not None:
        yield from _member_features(key, members, where, options, max_frames)


def _member_features(key: str, members: dict[str, bytes], where: str,
                     options: FbankOptions, max_frames: int | None
                     ) -> Iterator[tuple[str, np.ndarray | str]]:
    if not key or any(char.isspace() for char in key):
        yield key, f"{where}: key {key!r} is empty or holds whitespace"
        return
    audio = sorted(extension for extension in members if extension in AUDIO_EXTENSIONS)
    if len(audio) != 1:
        found = ", ".join(f"{key}.{extension}" for extension in sorted(members))
        yield key, (f"{where}: {'no' if not audio else 'more than one'} audio member for "
                    f"key {key!r} (members: {found})")
        return
    name = f"{where}:{key}.{audio[0]}"
    try:
        waveform, rate = decode(members[audio[0]], name)
    except AudioDecodeError as error:
        yield key, str(error)
        return
    seconds = len(waveform) / rate
    if max_frames is not None and num_frames(round(seconds * options.sample_rate),
                                             options) > max_frames:
        yield key, _too_long(Piece(key, 0.0, -1.0, where), name, seconds, max_frames, options)
        return
    for utterance, result in utterance_features(waveform, rate, [(key, 0.0, -1.0)], options):
        yield utterance, f"{name}: {result}" if isinstance(result, str) else result
