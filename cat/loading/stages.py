"""Stages 2-6 of the streaming loader, each a generator: sample dict in, sample dict out.

    prepare_samples  decode the features, tokenize the transcript, decide the verdict
    ShuffleBuffer    in-memory shuffle buffer
    settle_samples   act on the verdicts as samples leave the shuffle buffer
    SortBatcher      sort buffer cut into batches by padded frames, or
    BucketBatcher    length buckets, each a batch when full
    collate_batches  padding collate, with the worker's events and position

`ShuffleBuffer` and `SortBatcher` keep their whole state in attributes, so that a
`WorkerPosition` can describe it and a resume rebuild it (`cat.loading.stream`).

Usage:
    stream = prepare_samples(reader, judge)
    stream = settle_samples(ShuffleBuffer(3000, rng)(stream), events)
    batches = collate_batches(SortBatcher(500, 64, 20000, rng)(stream), events, 80)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from cat.audio.codec import (
    MAX_BYTES_PER_SECOND,
    AudioDecodeError,
    AudioTooLongError,
    conversion_notes,
    decode,
    to_int16,
)
from cat.audio.speed import choose_factor, perturbed_num_samples, speed_perturb
from cat.features.fbank import FbankOptions, compute_fbank, num_frames
from cat.formats.tables import feature_verdict, transcript_verdict
from cat.loading.batch import (
    LengthFilter,
    StreamEvents,
    Utterance,
    collate,
    empty_batch,
    form_batches,
)
from cat.loading.samples import (
    CONTENT_TYPES,
    TRANSCRIPT,
    AudioConfig,
    WorkerPosition,
    decode_npy,
)
from cat.loading.tar import BufferPool
from cat.text.tokenizer import UNK_ID

logger = logging.getLogger(__name__)

#: The note of a kept utterance whose transcript has `<unk>` tokens (some characters the
#: tokenizer does not know; one of only `<unk>` is dropped: `transcript_verdict`).
PARTLY_UNKNOWN = "transcript with <unk> tokens"
#: Bytes a member may take besides its samples (headers, Ogg tags, the .npy header).
HEADER_BYTES = 1 << 20
#: The most bytes of transcript per frame of the length filter's upper bound (100 frames
#: a second: 6400 bytes a second of speech, some 50 times what anyone says).
TRANSCRIPT_BYTES_PER_FRAME = 64
_NO_LABEL = np.zeros(0, np.int32)


@dataclasses.dataclass
class Judge:
    """Decides each sample's verdict as it is read (stage 2, `__call__`) and finishes the
    kept ones as they leave the shuffle buffer (stage 4, `finish`).

    `__call__` decodes the speech member: `.npy` features into `features` [T, D] (a view
    on the bytes; a pooled buffer under them is kept as `buffer`), or an audio member
    into `waveform` (int16: the audio decoded, resampled and speed-perturbed as `audio`
    says, by a factor drawn from the `seed`, `epoch` and key), and its length in frames
    into `frames`; tokenizes `txt` into `label` ids (int32); then the verdict:
    `feature_verdict` (`non_finite` features), `transcript_verdict`, and the
    `LengthFilter` on the frame count. `finish` turns a waveform into fbank `features`,
    late, so that the shuffle buffer holds 16-bit audio rather than float features, or,
    with `audio.on_device`, leaves it for the training device (`fbank` always computes
    them). The first failed check decides: a sample to leave out carries `drop` (its
    reason), one that is an error carries `error` (its message).

    Audio longer than the filter's upper bound by the length its header claims is
    dropped (`out_of_range`, the frame count it would have had) before it is decoded;
    audio that fails to decode in any way (`AudioDecodeError`, or any other error of the
    decoders or of speed perturbation) is dropped as `bad_audio`, naming the shard and
    member. `member_caps` gives the reader the most bytes a member may take for the
    filter to keep it.
    """

    feat_dim: int
    feat_dim_source: str
    urls: Sequence[str]
    encode: Callable[[str], list[int]]
    length_filter: LengthFilter | None
    strict: bool
    audio: AudioConfig | None = None
    seed: int = 0
    epoch: int = 1
    _sample_limits: dict[float, int] = dataclasses.field(default_factory=dict, init=False,
                                                         repr=False)

    def __call__(self, sample: dict[str, Any]) -> None:
        where = f"shard {self.urls[sample['shard']]}: utterance {sample['key']!r}"
        content = next(t for t in CONTENT_TYPES if t in sample)
        data = sample.pop(content)
        if isinstance(data, memoryview):
            sample["buffer"] = data.obj
        if content == "npy":
            frames = self._features(sample, data, where)
        else:
            frames = self._audio(sample, data, content, where)
        if frames is None:
            return
        try:
            text = str(sample.pop(TRANSCRIPT), "utf-8")
        except UnicodeDecodeError as error:
            self._undecodable(sample, where, "bad_text", error)
            return
        ids = self.encode(text) if text.strip() else []
        reason = transcript_verdict(text, ids)
        if reason:
            sample["drop"] = reason
            return
        if UNK_ID in ids:
            sample.setdefault("notes", []).append(PARTLY_UNKNOWN)
        sample["label"] = label = np.asarray(ids, np.int32)
        if self.length_filter is not None:
            reason = self.length_filter.reason(frames, label)
            if reason:
                sample["drop"] = reason

    def _undecodable(self, sample: dict[str, Any], where: str, reason: str,
                     error: Exception) -> None:
        if self.strict:
            sample["error"] = f"{where}: {reason} {error} (strict_shards is set)"
        else:
            sample["drop"] = f"{reason} {error}"

    def _features(self, sample: dict[str, Any], data: Any, where: str) -> int | None:
        try:
            features = decode_npy(data)
        except (ValueError, KeyError) as error:
            self._undecodable(sample, where, "corrupt_features", error)
            return None
        if features.shape[1] != self.feat_dim:
            sample["error"] = (f"{where} has {features.shape[1]}-dim features, but "
                               f"{self.feat_dim_source} is {self.feat_dim}")
            return None
        reason = feature_verdict(features)
        if reason:  # counted as a drop, never trained (or an error when strict)
            if self.strict:
                sample["error"] = f"{where}: {reason} (strict_shards is set)"
            else:
                sample["drop"] = reason
            return None
        sample["features"] = features
        sample["frames"] = len(features)
        return len(features)

    def _audio(self, sample: dict[str, Any], data: Any, content: str, where: str
               ) -> int | None:
        audio = self.audio
        if audio is None:
            sample["error"] = (f"{where} is {content} audio, but train.option.audio is not "
                               "set (how audio becomes features)")
            return None
        factor = choose_factor(audio.speed_perturb, self.seed, self.epoch, sample["key"]) \
            if audio.speed_perturb else 1.0
        source: dict[str, int] = {}
        name = f"{self.urls[sample['shard']]}:{sample['name']}.{content}"
        waveform = self._waveform(sample, data, name, where, factor, source)
        if waveform is None:
            return None
        notes = conversion_notes(source["rate"], source["channels"], audio.sample_rate)
        if notes:
            sample.setdefault("notes", []).extend(notes)
        sample["waveform"] = waveform
        sample["frames"] = frames = num_frames(len(waveform), audio.fbank)
        return frames

    def _waveform(self, sample: dict[str, Any], data: Any, name: str, where: str,
                  factor: float, source: dict[str, int]) -> np.ndarray | None:
        """The int16 samples of audio member `name`, decoded and perturbed by `factor`;
        None, with the sample's `drop` (or `error`) set, for audio the length filter would
        not keep by its header, and for any failure."""
        rate = self.audio.sample_rate
        try:
            waveform, _ = decode(data, name, rate, source, self._sample_limit(factor))
            if factor != 1.0:
                waveform = speed_perturb(waveform, rate, factor)
            return to_int16(waveform)
        except AudioTooLongError as error:
            frames = num_frames(perturbed_num_samples(error.num_samples, factor),
                                self.audio.fbank)
            sample["drop"] = (f"{self.length_filter.reason(frames, _NO_LABEL)} (the length "
                              "its header claims; not decoded)")
        except Exception as error:  # whatever one member's audio does, it is that member's
            if not isinstance(error, AudioDecodeError):
                error = AudioDecodeError(f"cannot decode audio {where}: "
                                         f"{type(error).__name__}: {error}")
            self._undecodable(sample, where, "bad_audio", error)
        return None

    def _high_frames(self) -> int | None:
        """The length filter's upper bound in frames (None: no length filter or no bound)."""
        frame_range = self.length_filter.frame_range if self.length_filter else None
        return frame_range.high if frame_range is not None else None

    def _sample_limit(self, factor: float) -> int | None:
        """The most samples (at `audio.sample_rate`, before speed perturbation by
        `factor`) whose features the length filter can keep; None without a bound."""
        high = self._high_frames()
        if high is None:
            return None
        limit = self._sample_limits.get(factor)
        if limit is None:
            def frames(count: int) -> int:
                return num_frames(perturbed_num_samples(count, factor), self.audio.fbank)
            low, up = 0, 1  # frames(low) < high <= frames(up): bisect the largest kept
            while frames(up) < high:
                low, up = up, 2 * up
            while up - low > 1:
                middle = (low + up) // 2
                low, up = (middle, up) if frames(middle) < high else (low, middle)
            limit = self._sample_limits[factor] = low
        return limit

    def member_caps(self) -> dict[str, int]:
        """The most bytes a member of each extension may take for the length filter to
        keep its utterance (empty without an upper bound): audio at
        `MAX_BYTES_PER_SECOND` of its format for the longest audio kept (before speed
        perturbation), float64 features of `feat_dim`, transcripts at
        `TRANSCRIPT_BYTES_PER_FRAME`; each with `HEADER_BYTES` to spare."""
        high = self._high_frames()
        if high is None:
            return {}
        caps = {TRANSCRIPT: HEADER_BYTES + TRANSCRIPT_BYTES_PER_FRAME * high}
        if self.audio is None:
            caps["npy"] = HEADER_BYTES + 8 * self.feat_dim * high
            return caps
        samples = max(self._sample_limit(f) for f in self.audio.speed_perturb or (1.0,))
        seconds = samples / self.audio.sample_rate
        for extension, rate in MAX_BYTES_PER_SECOND.items():
            caps[extension] = HEADER_BYTES + math.ceil(seconds * rate)
        return caps

    def finish(self, sample: dict[str, Any]) -> None:
        """Ready a kept sample for batching: the fbank of its `waveform` (`fbank`), unless
        the training device computes it (`audio.on_device`)."""
        if self.audio is None or not self.audio.on_device:
            self.fbank(sample)

    def fbank(self, sample: dict[str, Any]) -> None:
        """Fbank `features` of a kept sample's `waveform` (a no-op for features)."""
        waveform = sample.pop("waveform", None)
        if waveform is None:
            return
        audio = self.audio
        # int16 straight in: the features of to_float32(waveform), without its two passes
        sample["features"] = compute_fbank(waveform, audio.sample_rate, audio.fbank)


def sample_frames(sample: dict[str, Any]) -> int:
    """A sample's length in frames: its `frames` (the judge's), else its features'."""
    frames = sample.get("frames")
    return len(sample["features"]) if frames is None else frames


def prepare_samples(samples: Iterable[dict[str, Any]], judge: Callable[[dict[str, Any]], None]
                    ) -> Iterator[dict[str, Any]]:
    """Stage 2: decode each sample's speech, tokenize its transcript and decide its verdict
    (`judge`, a `Judge`), as each sample is read.

    Done before the shuffle buffer, this work overlaps reading: while the buffer fills,
    storage is the limit (cold disk, network), and the buffer then empties faster.
    Nothing is reported here: a sample to leave out carries `drop` (its reason), one that
    is an error carries `error` (its message), and `settle_samples` acts on them where
    the sample leaves the shuffle buffer, so events and errors keep their place.
    """
    for sample in samples:
        judge(sample)
        yield sample


class ShuffleBuffer:
    """Stage 3: a buffer of `size` samples; each new sample replaces a random one, and
    when the input ends the rest leaves in random order. `samples` and `draining` are
    its whole state (with the shared `rng`): see `WorkerPosition`; `sample_ids` are the
    ids of `samples`, kept alongside so that a position costs a copy, not a pass over
    the buffer's samples (`restore` sets both)."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.rng = rng
        self.samples: list[dict[str, Any]] = []
        self.draining = False
        self._ids = np.zeros(max(size, 0), np.int64)

    def sample_ids(self) -> np.ndarray:
        """The ids of the buffered samples, in buffer order (a copy)."""
        return self._ids[:len(self.samples)].copy()

    def restore(self, samples: list[dict[str, Any]], draining: bool) -> None:
        """Continue from a position's samples (before iterating)."""
        self.samples, self.draining = samples, draining
        self._ids = np.zeros(max(self.size, len(samples)), np.int64)
        self._ids[:len(samples)] = [s["id"] for s in samples]

    def __call__(self, upstream: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        if self.size <= 1:
            yield from upstream
            return
        samples, ids = self.samples, self._ids
        if not self.draining:
            for sample in upstream:
                if len(samples) < self.size:
                    ids[len(samples)] = sample["id"]
                    samples.append(sample)
                    continue
                position = self.rng.randrange(self.size)
                samples[position], sample = sample, samples[position]
                ids[position] = samples[position]["id"]
                yield sample
            self.rng.shuffle(samples)
            ids[:len(samples)] = [s["id"] for s in samples]
            self.draining = True
        while samples:
            yield samples.pop()


def settle_samples(samples: Iterable[dict[str, Any]], events: StreamEvents,
                   pool: BufferPool | None = None,
                   finish: Callable[[dict[str, Any]], None] | None = None
                   ) -> Iterator[dict[str, Any]]:
    """Stage 4: report (`events.dropped`) the samples `prepare_samples` left out and give
    their buffers back to `pool`; raise a sample's error (ValueError naming the shard);
    count the notes of the kept ones (`events.noted`) and `finish` them (`Judge.finish`:
    the fbank of audio)."""
    for sample in samples:
        if "error" in sample:
            raise ValueError(sample["error"])
        reason = sample.get("drop")
        if reason is None:
            for note in sample.pop("notes", ()):
                events.noted[note] = events.noted.get(note, 0) + 1
            if finish is not None:
                finish(sample)
            yield sample
            continue
        events.dropped.append((sample["key"], reason, sample["shard"]))
        if pool is not None and "buffer" in sample:
            pool.give_back(sample["buffer"])


class SortBatcher:
    """Stage 5: sort `sort_buffer` samples by length and cut them into batches within
    `batch_size` utterances and `max_frames` padded frames.

    Each buffer leaves whole, its batches in random order when `rng` is given (see the
    module docstring for why no batch waits for the next buffer). `buffer`, `pending`
    (batches cut, not yet sent) and `upstream_done` are its whole state; `buffer_ids` and
    `pending_ids` are their sample ids, kept alongside (`restore` sets them all).
    """

    def __init__(self, sort_buffer: int, batch_size: int, max_frames: int,
                 rng: random.Random | None) -> None:
        self.sort_buffer = max(1, sort_buffer)
        self.batch_size = batch_size
        self.max_frames = max_frames
        self.rng = rng
        self.buffer: list[dict[str, Any]] = []
        self.pending: list[list[dict[str, Any]]] = []
        self.pending_ids: list[np.ndarray] = []
        self.upstream_done = False
        self._buffer_ids = np.zeros(self.sort_buffer, np.int64)

    def buffer_ids(self) -> np.ndarray:
        """The ids of the buffered samples, in buffer order (a copy)."""
        return self._buffer_ids[:len(self.buffer)].copy()

    def restore(self, buffer: list[dict[str, Any]], pending: list[list[dict[str, Any]]],
                upstream_done: bool) -> None:
        """Continue from a position's samples (before iterating)."""
        self.buffer, self.pending, self.upstream_done = buffer, pending, upstream_done
        self._buffer_ids = np.zeros(max(self.sort_buffer, len(buffer) + 1), np.int64)
        self._buffer_ids[:len(buffer)] = [s["id"] for s in buffer]
        self.pending_ids = [np.array([s["id"] for s in batch], np.int64) for batch in pending]

    def __call__(self, upstream: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield from self._send()
        if not self.upstream_done:
            for sample in upstream:
                self._buffer_ids[len(self.buffer)] = sample["id"]
                self.buffer.append(sample)
                if len(self.buffer) >= self.sort_buffer:
                    self._cut()
                    yield from self._send()
            self.upstream_done = True
            self._cut()
        yield from self._send()

    def _send(self) -> Iterator[list[dict[str, Any]]]:
        while self.pending:
            self.pending_ids.pop(0)
            yield self.pending.pop(0)

    def _cut(self) -> None:
        buffer = self.buffer
        buffer.sort(key=sample_frames)
        lengths = np.fromiter((sample_frames(s) for s in buffer), np.int64, len(buffer))
        batches = form_batches(lengths, np.arange(len(buffer)), self.batch_size,
                               self.max_frames)
        if self.rng is not None:
            self.rng.shuffle(batches)
        ids = np.fromiter((s["id"] for s in buffer), np.int64, len(buffer))
        self.pending += [[buffer[i] for i in batch] for batch in batches]
        self.pending_ids += [ids[batch] for batch in batches]
        self.buffer = []


def bucket_bounds(frames: np.ndarray, buckets: int) -> np.ndarray:
    """Upper frame bounds (exclusive) of the first `buckets - 1` length buckets, so that
    each bucket holds about the same total frames of utterances like `frames` (lhotse's
    `estimate_duration_buckets`): short utterances share a bucket with many others, and
    the longest have buckets of their own. Fewer bounds when lengths repeat."""
    if buckets < 1:
        raise ValueError(f"length buckets must be at least 1, got {buckets}")
    frames = np.sort(np.asarray(frames, np.int64))
    if buckets == 1 or not len(frames):
        return np.zeros(0, np.int64)
    cumulative = np.cumsum(frames)
    targets = cumulative[-1] * np.arange(1, buckets) / buckets
    # The first utterance past each share of the frames opens the next bucket.
    return np.unique(frames[np.minimum(np.searchsorted(cumulative, targets, "right"),
                                       len(frames) - 1)])


class BucketBatcher:
    """Stage 5 with length buckets (lhotse's `DynamicBucketingSampler` is the model): each
    sample joins the bucket of its length (`bounds`, `bucket_bounds`), and a bucket leaves
    as a batch when the next sample would overflow it (`batch_size` utterances,
    `max_frames` padded frames), so that a batch holds utterances of one bucket's lengths
    and pads little. When the input ends, the buckets left leave as they are, in random
    order (`rng`; none for evaluation).

    Memory: at most one batch per bucket. `SortBatcher`'s state and position: `buffer`
    (the buckets' samples, bucket by bucket, each in arrival order: a restore puts them
    back in their buckets by length, so exactly as they were), `pending` and
    `upstream_done`.
    """

    def __init__(self, bounds: np.ndarray, batch_size: int, max_frames: int,
                 rng: random.Random | None) -> None:
        self.bounds = np.asarray(bounds, np.int64)
        self.batch_size = batch_size
        self.max_frames = max_frames
        self.rng = rng
        self.buckets: list[list[dict[str, Any]]] = [[] for _ in range(len(self.bounds) + 1)]
        self._longest = [0] * len(self.buckets)
        self.pending: list[list[dict[str, Any]]] = []
        self.pending_ids: list[np.ndarray] = []
        self.upstream_done = False

    @property
    def buffer(self) -> list[dict[str, Any]]:
        """The buckets' samples, bucket by bucket."""
        return [sample for bucket in self.buckets for sample in bucket]

    def buffer_ids(self) -> np.ndarray:
        """The ids of `buffer` (a copy)."""
        return np.fromiter((s["id"] for bucket in self.buckets for s in bucket), np.int64)

    def restore(self, buffer: list[dict[str, Any]], pending: list[list[dict[str, Any]]],
                upstream_done: bool) -> None:
        """Continue from a position's samples (before iterating)."""
        for sample in buffer:
            self._add(sample)
        self.pending, self.upstream_done = pending, upstream_done
        self.pending_ids = [np.array([s["id"] for s in batch], np.int64) for batch in pending]

    def __call__(self, upstream: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield from self._send()
        if not self.upstream_done:
            for sample in upstream:
                self._add(sample)
                yield from self._send()
            self.upstream_done = True
            left = [number for number, bucket in enumerate(self.buckets) if bucket]
            if self.rng is not None:
                self.rng.shuffle(left)
            for number in left:
                self._cut(number)
        yield from self._send()

    def _add(self, sample: dict[str, Any]) -> None:
        frames = sample_frames(sample)
        number = int(np.searchsorted(self.bounds, frames, "right"))
        longest = max(self._longest[number], frames)
        count = len(self.buckets[number])
        if count and self.max_frames and longest * (count + 1) > self.max_frames:
            self._cut(number)
            longest = frames
        self.buckets[number].append(sample)
        self._longest[number] = longest
        if len(self.buckets[number]) >= self.batch_size:
            self._cut(number)

    def _cut(self, number: int) -> None:
        batch = sorted(self.buckets[number], key=sample_frames)
        self.buckets[number] = []
        self._longest[number] = 0
        self.pending.append(batch)
        self.pending_ids.append(np.array([s["id"] for s in batch], np.int64))

    def _send(self) -> Iterator[list[dict[str, Any]]]:
        while self.pending:
            self.pending_ids.pop(0)
            yield self.pending.pop(0)


def collate_batches(groups: Iterable[list[dict[str, Any]]], events: StreamEvents,
                    feat_dim: int, pool: BufferPool | None = None,
                    collate_fn: Callable[..., Any] = collate,
                    position: Callable[[], WorkerPosition] | None = None,
                    fbank: FbankOptions | None = None) -> Iterator[Any]:
    """Stage 6: padding collate; events so far ride along, with the worker's `position`
    after the batch; a final batch without utterances flushes the last events.

    The batch holds copies, so the samples' pooled buffers go back to `pool` here.
    `collate_fn(utterances, events)` may be a `cat.loading.transport.SharedCollate`.
    With `fbank` (features on the training device) the samples hold 16-bit waveforms,
    padded into the batch's `waves` for the device to compute these options' fbank.
    """
    speech = "features" if fbank is None else "waveform"
    extra = {} if fbank is None else {"fbank": fbank}
    for group in groups:
        utterances = [Utterance(s["key"], s[speech], s["label"], s["id"]) for s in group]
        if position is not None:
            events.position = position()
        batch = collate_fn(utterances, events.drain(), **extra)
        if pool is not None:
            for sample in group:
                if "buffer" in sample:
                    pool.give_back(sample["buffer"])
        yield batch
    if events:
        if position is not None:
            events.position = position()
        yield empty_batch(feat_dim, events.drain())
