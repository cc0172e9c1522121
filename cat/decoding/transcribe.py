"""Transcribe audio with an experiment's model: features on the fly, decoding by length.

The utterances of an `AudioList` (`cat.decoding.audio`: audio files, a `wav.scp` with
optional `segments`, a WeNet `data.list`) get the 80-dim fbank stage 1 would give them
(`cat.features.extract.utterance_features`), computed as they are read: nothing is
written to disk but the results. The experiment's `config.json` must take those
features (`encoder.kwargs.idim` 80).

On the CPU, the recordings are dealt to `nj` processes balanced by size (bytes of
audio, or seconds of segments); each reads its recordings in order and, every
`window_frames` frames of features (30 minutes of audio by default, about 58 MB), sorts
them by length into batches of at most `max_frames` padded frames and `batch_size`
utterances (`plan_batches`, as stage 4 does) and decodes them; so memory stays bounded
whatever the size of the list. With one process and a list shorter than a window, the
batches are exactly stage 4's. With a GPU, `nj` processes compute features and the GPU
decodes.

Long recordings (`segmenting`, `cat.decoding.audio.Segmenting`, by default its defaults):
an utterance of a file or command longer than `max_segment` (30 s) is never decoded
whole, whatever the model, since full-context attention takes memory in the square of
the length. It is read a stretch at a time: voice-activity segments (`vad` "silero",
`cat.decoding.segments`: cut in pauses, merged up to `segment_target`), or windows of
`max_segment` seconds each overlapping the next by `overlap` (`vad` "none", and speech
without a pause longer than `max_segment`). Each stretch is decoded as an utterance of
its own with token times, batched with the others (`plan_batches`), and the results
joined into the utterance's (`cat.decoding.results.join_parts`: segments follow each
other, the tokens of overlapping windows are merged so that none is repeated or lost),
with the segments' times and text (`Result.segments`); N-best lists are not joined. A
recording without speech gives an empty transcript. Memory holds the features of one
transcription window and the tokens found so far, whatever the length: on the CPU, an
hour of audio in windows of 10 s, features gathered a minute at a time, peaks 12 MB above
five minutes of it (`test_windows_keep_memory_flat_on_an_hour_long_recording`). With a
GPU, a feature process hands over a recording's stretches together, so memory grows with
the recording there. Utterances of tar shards are decoded whole.

With `segmenting` None an utterance is decoded whole (the toolkit's behaviour before
segmentation; `--max-segment 0`); so an utterance longer than the window (a 3-hour
recording given as one file) is refused before its audio is read, skipped with a reason
naming the list line, the file, its duration and `$CAT_TRANSCRIBE_WINDOW_SECONDS`, which
raises the window (seconds, default 1800; a larger window holds that much audio in
memory). Cut a long recording with a `segments` file, and each segment's samples alone
are read (`cat.decoding.audio`), so a recording of hours with segments is transcribed in
the memory of its longest segment.

The progress bar counts seconds of audio (its total when every input is a file whose
header gives its length); without a terminal a log line says how far it got every
minute. The log ends with the real-time factor, the audio seconds decoded per second
and, for long recordings, how many segments were decoded alone and their mean length.

Audio that cannot be used (missing, unreadable, truncated, too short or longer than the
window, a segment outside its recording, a shard member without audio, a `wav.scp` command
that fails or outlives `$CAT_WAV_SCP_TIMEOUT`) is skipped, logged and counted with the
list line it came from; the rest is decoded. Nothing decodable at all is an error.

The options are stage 4's (`DecodeOptions`), hotwords included: each process's `Searcher`
builds their context graph and searches with it. The fbank is the experiment's front end
(`hyper-p.json: data.front_end`, `cat.features.fbank.FRONT_ENDS`) unless `fbank` is given.

Outputs (`write_outputs`, into an output dir): `hyp` (`<key> <text>` lines sorted by
key, as stage 4 writes them), `skipped.txt` (`<key> <reason>`), `decode.log` (inputs,
checkpoint, options, segmenting, counts, audio and wall seconds, real-time factor, audio
seconds per second, segments and their mean length) and, with an LM,
`nbest.jsonl`; for an `output` format other than text, its file (`hyp.jsonl`, `hyp.ctm`,
`srt/<key>.srt`: `cat.decoding.results`), whose results hold pieces, times and N-best.

Usage:
    audio = from_data_list("data.list")
    transcript = transcribe("exp/synth-ctc", audio, "exp/synth-ctc/check/avg-best-5.pt",
                            "ctc", DecodeOptions(nj=2))
    write_outputs(transcript, "exp/synth-ctc/transcribe/data.list")
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from cat.core.config import CONFIG_NAME, HYPER_NAME, load_config, load_hyper
from cat.core.io import PathLike, atomic_write
from cat.core.process import process_pool
from cat.core.progress import WorkerProgress, advance
from cat.decoding.audio import (
    WINDOW_VARIABLE,
    AudioList,
    Recording,
    Segmenting,
    Window,
    recording_features,
)
from cat.decoding.results import (
    Part,
    Result,
    check_format,
    join_parts,
    needs_times,
    write_results,
)
from cat.decoding.searcher import (
    NO_LABEL,
    DecodeOptions,
    DecodeSummary,
    FusionSpec,
    NBest,
    Searcher,
    plan_batches,
    searcher_for,
    write_hyp,
)
from cat.decoding.timestamps import FRAME_SHIFT_SECONDS
from cat.features.fbank import FbankOptions, experiment_front_end
from cat.features.plan import balance_jobs
from cat.lm.rescore import NBEST_NAME, write_nbest
from cat.loading.batch import Utterance

logger = logging.getLogger(__name__)

#: Frames of features a process gathers before sorting and decoding them (30 minutes),
#: and the longest utterance it reads; `$CAT_TRANSCRIBE_WINDOW_SECONDS` overrides it.
WINDOW_FRAMES = 180_000
#: Where an utterance stands in the list: (recording index, position in the recording).
Order = tuple[int, int]
#: How long utterances are cut unless told otherwise (`Segmenting`'s defaults).
DEFAULT_SEGMENTING = Segmenting()


class TranscribeError(RuntimeError):
    """Nothing could be transcribed, or the experiment does not take stage 1's features."""


@dataclasses.dataclass
class Transcript:
    """What `transcribe` produced; `hypotheses`, `nbest` and `skipped` in list order."""

    name: str
    checkpoint: str
    device: str
    workers: int
    options: DecodeOptions
    fusion: FusionSpec | None
    results: list[Result]
    skipped: list[tuple[str, str]]
    summary: DecodeSummary
    output: str = "text"
    segmenting: Segmenting | None = None
    segments: Segments = dataclasses.field(default_factory=lambda: Segments(0, 0.0))

    @property
    def hypotheses(self) -> list[tuple[str, str]]:
        """(key, text) of each utterance."""
        return [(result.key, result.text) for result in self.results]

    @property
    def nbest(self) -> list[tuple[str, NBest]] | None:
        """(key, N-best list) of each utterance with an LM, else None."""
        if self.fusion is None:
            return None
        return [(result.key, list(result.nbest or ())) for result in self.results]


@dataclasses.dataclass(frozen=True)
class Segments:
    """The stretches of long recordings decoded alone: how many, their seconds in all."""

    count: int
    seconds: float

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    def describe(self) -> str:
        return (f", {self.count} segments of {self.mean_seconds:.1f} s on average"
                if self.count else "")


@dataclasses.dataclass
class _Decoded:
    """One process's results."""

    hypotheses: list[tuple[Order, Result]] = dataclasses.field(default_factory=list)
    skipped: list[tuple[Order, str, str]] = dataclasses.field(default_factory=list)
    frames: int = 0  # of audio decoded (a long recording's whole length)
    segments: int = 0  # stretches of long recordings decoded alone
    segment_frames: int = 0  # their frames


def check_feature_dim(exp_dir: PathLike, options: FbankOptions) -> None:
    """The experiment's model must take `options.num_mel_bins`-dim features."""
    path = Path(exp_dir) / CONFIG_NAME
    idim = load_config(path).get("encoder", {}).get("kwargs", {}).get("idim")
    if idim != options.num_mel_bins:
        raise TranscribeError(f"{path}: encoder.kwargs.idim is {idim}, but audio is turned "
                              f"into stage 1's {options.num_mel_bins}-dim fbank; decode this "
                              "experiment's own features with --data")


# ----------------------------------------------------------------------------- in a process


def window_frames_setting() -> int:
    """The window in frames: `$CAT_TRANSCRIBE_WINDOW_SECONDS`, else `WINDOW_FRAMES`."""
    text = os.environ.get(WINDOW_VARIABLE, "").strip()
    if not text:
        return WINDOW_FRAMES
    try:
        frames = round(float(text) / FRAME_SHIFT_SECONDS)
    except (ValueError, OverflowError):
        frames = 0
    if frames < 1:
        raise TranscribeError(f"{WINDOW_VARIABLE}={text!r}: expected a positive number of "
                              "seconds")
    return frames


Features = np.ndarray | Window | str


def _features(recordings: Iterable[tuple[int, Recording]], fbank: FbankOptions,
              window_frames: int = WINDOW_FRAMES, segmenting: Segmenting | None = None
              ) -> Iterator[tuple[Order, str, Features]]:
    for index, recording in recordings:
        position, in_windows = -1, None  # the key whose windows are being read
        for key, result in recording_features(recording, fbank, window_frames, segmenting):
            # The windows of an utterance, and why it ends early, share its place.
            continuing = (isinstance(result, Window) and result.index > 0) or (
                isinstance(result, str) and key == in_windows)
            if not continuing:
                position += 1
            in_windows = key if isinstance(result, Window) else None
            yield (index, position), key, result


def _recording_features(index: int, recording: Recording, fbank: FbankOptions,
                        window_frames: int, segmenting: Segmenting | None = None
                        ) -> list[tuple[Order, str, Features]]:
    """All utterances of one recording (a feature process's task when a GPU decodes)."""
    return list(_features([(index, recording)], fbank, window_frames, segmenting))


def _pooled_features(pool: Executor, recordings: list[Recording], fbank: FbankOptions,
                     ahead: int, window_frames: int = WINDOW_FRAMES,
                     segmenting: Segmenting | None = None
                     ) -> Iterator[tuple[Order, str, Features]]:
    """Features computed by the pool, in list order, at most `ahead` recordings ahead."""
    tasks = iter(enumerate(recordings))

    def submit(index: int, recording: Recording) -> Future:
        return pool.submit(_recording_features, index, recording, fbank, window_frames,
                           segmenting)

    pending = collections.deque(submit(*task) for task in itertools.islice(tasks, ahead))
    while pending:
        items = pending.popleft().result()
        for task in itertools.islice(tasks, 1):
            pending.append(submit(*task))
        yield from items


def _window_results(searcher: Searcher, utterances: list[Utterance],
                    output: str, timed: bool = False) -> list[Result]:
    """The results of a batch: with times unless `output` is text and not `timed`."""
    if needs_times(output) or timed:
        return searcher.results(utterances)
    if searcher.fusions:
        return [Result(key, hyps[0][0] if hyps else "", nbest=tuple(hyps))
                for key, hyps in searcher.nbest(utterances)[0]]
    return [Result(key, text) for key, text in searcher.best(utterances)]


@dataclasses.dataclass
class _Pending:
    """Features waiting in a process's window: an utterance's, or one window's of a long
    utterance (`part`)."""

    order: Order
    key: str
    features: np.ndarray
    part: Window | None = None


def _decode_window(searcher: Searcher, window: dict[str, _Pending], options: DecodeOptions,
                   out: _Decoded, output: str, parts: dict[Order, list]) -> None:
    """Decode the utterances of `window` (keyed by a name of their own); the results of
    stretches of long utterances go to `parts` (by the utterance's place)."""
    lengths = {name: len(pending.features) for name, pending in window.items()}
    for name in [name for name, length in lengths.items() if not length]:
        # A recording without speech: an empty result, nothing to decode.
        pending = window[name]
        parts.setdefault(pending.order, []).append(
            (_light(pending.part), Result(pending.key, "", (), (), None, ()), 0))
        del lengths[name]
    for names in plan_batches(lengths, options.max_frames, options.batch_size):
        utterances = [Utterance(name, window[name].features, NO_LABEL) for name in names]
        timed = any(window[name].part is not None for name in names)
        for result in _window_results(searcher, utterances, output, timed):
            name, pending = result.key, window[result.key]
            result = dataclasses.replace(result, key=pending.key)
            if pending.part is None:
                out.hypotheses.append((pending.order, result))
                out.frames += lengths[name]
                advance(lengths[name])
            else:
                # New audio: what the stretch does not share with the one before.
                new = max(0, lengths[name] - round(pending.part.overlap / FRAME_SHIFT_SECONDS))
                parts.setdefault(pending.order, []).append((_light(pending.part), result, new))
                out.segments += 1
                out.segment_frames += lengths[name]
                advance(new)


def _light(part: Window) -> Window:
    """`part` without its features, kept until the utterance's stretches are joined."""
    return dataclasses.replace(part, features=np.zeros((0, 0), np.float32))


def _join_parts(searcher: Searcher, parts: dict[Order, list], out: _Decoded) -> None:
    """The results of the long utterances decoded a stretch at a time, each joined into
    one (those whose reading failed part of the way are skipped: `out.skipped` has
    them)."""
    failed = {order for order, _, _ in out.skipped}
    for order, stretches in parts.items():
        if order in failed:
            continue
        stretches.sort(key=lambda item: item[0].index)
        key = stretches[0][1].key
        out.hypotheses.append((order, join_parts(
            key, [Part(window.start, window.overlap, result, window.segment, window.speech)
                  for window, result, _ in stretches], searcher.tokenizer.decode)))
        # The utterance's audio, counted once: overlaps and pauses not decoded alike.
        frames = round(stretches[0][0].duration / FRAME_SHIFT_SECONDS)
        out.frames += frames
        advance(max(0, frames - sum(new for _, _, new in stretches)))


def _decode(searcher: Searcher, items: Iterable[tuple[Order, str, Features]],
            options: DecodeOptions, window_frames: int, output: str = "text") -> _Decoded:
    """Decode utterances as their features arrive, a window of frames at a time."""
    out = _Decoded()
    window: dict[str, _Pending] = {}
    parts: dict[Order, list] = {}
    seen: set[str] = set()
    frames = 0
    for order, key, result in items:
        if isinstance(result, str):
            out.skipped.append((order, key, result))
            continue
        part = result if isinstance(result, Window) else None
        if key in seen and not (part is not None and part.index):
            out.skipped.append((order, key, f"key {key!r} again: only its first utterance "
                                            "is decoded"))
            continue
        seen.add(key)
        features = part.features if part is not None else result
        # A name of its own: the key is shared by the stretches of an utterance.
        name = key if part is None else f"{key} {part.index}"
        window[name] = _Pending(order, key, features, part)
        frames += len(features)
        if frames >= window_frames:
            _decode_window(searcher, window, options, out, output, parts)
            window, frames = {}, 0
    if window:
        _decode_window(searcher, window, options, out, output, parts)
    _join_parts(searcher, parts, out)
    return out


def _decode_share(exp_dir: str, checkpoint: str, options: DecodeOptions,
                  device: str, fusion: FusionSpec | None, share: list[tuple[int, Recording]],
                  fbank: FbankOptions, window_frames: int, output: str = "text",
                  segmenting: Segmenting | None = None) -> _Decoded:
    """Read, featurize and decode `share` in this process."""
    searcher = searcher_for(exp_dir, checkpoint, options, device,
                            [fusion] if fusion is not None else [])
    return _decode(searcher, _features(share, fbank, window_frames, segmenting), options,
                   window_frames, output)


# ----------------------------------------------------------------------------- the run


def _shares(audio: AudioList, num_workers: int) -> list[list[tuple[int, Recording]]]:
    """The recordings dealt to processes, balanced by weight, each share in list order."""
    ids = [str(index) for index in range(len(audio.recordings))]
    jobs = balance_jobs(ids, audio.weights(), num_workers)
    return [[(index, audio.recordings[index]) for index in sorted(map(int, job))]
            for job in jobs if job]


def _run(exp_dir: str, audio: AudioList, checkpoint: str, options: DecodeOptions,
         device: str, fusion: FusionSpec | None, fbank: FbankOptions,
         window_frames: int, initializer: tuple, output: str = "text",
         segmenting: Segmenting | None = None) -> tuple[list[_Decoded], int]:
    """Results per process, and the number of processes; `initializer`: of the worker
    processes, that report their progress."""
    workers = max(1, min(options.nj, len(audio.recordings)))
    if device == "cuda":
        searcher = searcher_for(exp_dir, checkpoint, options, device,
                                [fusion] if fusion is not None else [])
        if workers == 1:
            items = _features(enumerate(audio.recordings), fbank, window_frames, segmenting)
            return [_decode(searcher, items, options, window_frames, output)], 1
        with process_pool(workers) as pool:  # feature workers; decoding reports here
            items = _pooled_features(pool, audio.recordings, fbank, 2 * workers,
                                     window_frames, segmenting)
            return [_decode(searcher, items, options, window_frames, output)], workers
    shares = _shares(audio, workers)
    arguments = (exp_dir, checkpoint, options, device, fusion)
    if len(shares) == 1:
        return [_decode_share(*arguments, shares[0], fbank, window_frames, output,
                              segmenting)], 1
    with process_pool(len(shares), *initializer) as pool:
        futures = [pool.submit(_decode_share, *arguments, share, fbank, window_frames,
                               output, segmenting) for share in shares]
        return [future.result() for future in futures], len(shares)


def transcribe(exp_dir: PathLike, audio: AudioList, checkpoint: PathLike,
               options: DecodeOptions, fusion: FusionSpec | None = None,
               fbank: FbankOptions | None = None,
               window_frames: int | None = None, output: str = "text",
               segmenting: Segmenting | None = DEFAULT_SEGMENTING) -> Transcript:
    """Decode every utterance of `audio` (see the module docstring); `window_frames`
    default: `window_frames_setting()`; `output`: the format the results are for
    (`cat.decoding.results`; other than text, they hold pieces, times and N-best);
    `segmenting`: how long utterances are cut (None: decoded whole, up to the window;
    see the module docstring)."""
    check_format(output)
    fbank = fbank or experiment_front_end(load_hyper(Path(exp_dir) / HYPER_NAME))
    window_frames = window_frames or window_frames_setting()
    if segmenting is not None and segmenting.max_segment / FRAME_SHIFT_SECONDS > window_frames:
        raise TranscribeError(f"--max-segment {segmenting.max_segment:g} s is longer than the "
                              f"transcription window of {window_frames * FRAME_SHIFT_SECONDS:g}"
                              f" s (${WINDOW_VARIABLE})")
    check_feature_dim(exp_dir, fbank)
    if fusion is not None and options.method != "beam":
        raise ValueError(f"decoding with language models needs method 'beam', got "
                         f"{options.method!r}")
    device = options.resolved_device()
    start = time.perf_counter()
    with WorkerProgress(_known_frames(audio), f"transcribing {audio.name}", unit="s",
                        scale=FRAME_SHIFT_SECONDS) as progress:
        results, workers = _run(str(exp_dir), audio, str(checkpoint), options, device,
                                fusion, fbank, window_frames, progress.pool_initializer(),
                                output, segmenting)
    seconds = time.perf_counter() - start
    decoded = sorted((item for out in results for item in out.hypotheses),
                     key=lambda item: item[0])
    skipped = sorted(item for out in results for item in out.skipped)
    # Processes catch a key repeated in their own share; this, one repeated across shares.
    first: dict[str, Order] = {}
    kept = []
    for order, result in decoded:
        if result.key in first:
            skipped.append((order, result.key, f"key {result.key!r} again: only its first "
                                               "utterance is decoded"))
        else:
            first[result.key] = order
            kept.append(result)
    skipped.sort()
    frames = sum(out.frames for out in results)  # all that was decoded
    for _, key, reason in skipped:
        logger.warning("skipped %s: %s", key, reason)
    if not kept:
        detail = f"; first: {skipped[0][1]}: {skipped[0][2]}" if skipped else ""
        raise TranscribeError(f"nothing to transcribe in {audio.name}: {len(skipped)} "
                              f"utterance(s), all skipped{detail}")
    summary = DecodeSummary(len(kept), frames * FRAME_SHIFT_SECONDS, seconds, len(skipped))
    segments = Segments(sum(out.segments for out in results),
                        sum(out.segment_frames for out in results) * FRAME_SHIFT_SECONDS)
    logger.info("transcribed %d utterances (%.1f s of audio%s) from %s in %.1f s: RTF %.4f, "
                "%.0f s of audio per second (%s, %d worker%s, batches of %d at most); "
                "%d skipped", summary.num_utts, summary.audio_seconds, segments.describe(),
                audio.name, seconds, summary.rtf, summary.audio_seconds / max(seconds, 1e-9),
                device, workers, "s" * (workers > 1), options.batch_size, len(skipped))
    return Transcript(
        audio.name, str(checkpoint), device, workers, options, fusion, kept,
        [(key, reason) for _, key, reason in skipped], summary, output, segmenting, segments)


def _known_frames(audio: AudioList) -> int | None:
    """Frames (10 ms) of audio in `audio` when every recording is a file whose header
    says its length (the progress bar's total), else None."""
    seconds = 0.0
    for recording in audio.recordings:
        if recording.shard or recording.source.rstrip().endswith("|"):
            return None
        try:
            length = soundfile.info(recording.source).duration
        except (OSError, RuntimeError, soundfile.LibsndfileError):
            return None
        seconds += sum((length if piece.end < 0 else min(piece.end, length)) - piece.start
                       for piece in recording.pieces)
    return round(seconds / FRAME_SHIFT_SECONDS)


def write_outputs(transcript: Transcript, out_dir: PathLike) -> None:
    """`hyp`, `skipped.txt`, `decode.log` (and `nbest.jsonl` with an LM) in `out_dir`."""
    out_dir = Path(out_dir)
    write_hyp(out_dir / "hyp", transcript.hypotheses)
    with atomic_write(out_dir / "skipped.txt") as f:
        for key, reason in transcript.skipped:
            f.write(f"{key} {' '.join(reason.split())}\n")
    if transcript.nbest is not None:
        write_nbest(out_dir / NBEST_NAME, transcript.nbest)
    write_results(out_dir, transcript.results, transcript.output)
    summary = transcript.summary
    report: dict[str, Any] = {
        "data": transcript.name, "checkpoint": transcript.checkpoint,
        **transcript.options.record(),
        "device": transcript.device, "workers": transcript.workers,
        "format": transcript.output,
        "fusion": dataclasses.asdict(transcript.fusion) if transcript.fusion else None,
        "num_utts": summary.num_utts, "num_skipped": summary.num_skipped,
        "audio_seconds": round(summary.audio_seconds, 2),
        "decode_seconds": round(summary.decode_seconds, 2), "rtf": round(summary.rtf, 4),
        "audio_seconds_per_second": round(summary.audio_seconds
                                          / max(summary.decode_seconds, 1e-9), 1),
        "segmenting": dataclasses.asdict(transcript.segmenting)
        if transcript.segmenting else None,
        "segments": transcript.segments.count,
        "mean_segment_seconds": round(transcript.segments.mean_seconds, 2)}
    with atomic_write(out_dir / "decode.log") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
