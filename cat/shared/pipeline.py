"""Streaming training data from webdataset tar shards (`train.option.large_dataset: true`).

Shards are the stage-2 output of `cat.data.prep_wds`: tar files of `<encoded key>.npy`
(features) and `<encoded key>.txt` (transcript) members, with an `index.jsonl` next to
them giving each shard's counts. `cat.shared.shardlist` expands `trset` into a
`ShardList` and deals its shards to the ranks every epoch (`assign_shards`); each rank's
shards go round-robin to its DataLoader workers.

Each worker runs a flat list of generator stages, assembled in `ShardStream.pipeline`:

    ShardReader      stream each tar in order (`cat.shared.tario`: one read per member,
                     read-ahead across shard boundaries) and group members into samples
                     by key (`decode_key`); every sample gets an id, `(shard << 32) |
                     ordinal`, its shard and its position in that shard
    prepare_samples  as each sample is read: .npy decoded (a view on the bytes),
                     transcript tokenized with the experiment's tokenizer, then the
                     verdict: `transcript_verdict` (shared with the map-style packer) and
                     `LengthFilter`. Verdicts ride with the sample; doing this before the
                     shuffle buffer overlaps it with reading
    ShuffleBuffer    in-memory shuffle buffer (`shuffle_buffer` utterances)
    settle_samples   verdicts are acted on as samples leave the shuffle buffer: drops
                     reported, errors raised, so both keep their place in the stream
    SortBatcher      sort buffer (`sort_buffer`) cut into batches by padded frames
    collate_batches  padding collate into `cat.shared.data.Batch` (or, in a DataLoader
                     worker, into a shared-memory slot: `cat.shared.transport`)

Exact resume: every batch carries, in `batch.events.position`, a `WorkerPosition`: where
its worker's stream stands once that batch is out (the shard being read and how many of
its samples were taken, the ids in the shuffle and sort buffers and in the batches cut
but not yet sent, and the random generator's state). The training process keeps the
position of the last batch it took from each worker; a checkpoint stores them, and
`set_epoch(epoch, positions)` rebuilds each worker's stages exactly there: the buffered
samples are read again from their shards (`fetch_samples`, only those members), the
shard being read continues after its taken samples (passed over with a seek on local
files). The epoch then trains the same utterances, each once, and with up to one worker
per rank the same batches in the same order, as an uninterrupted run. The work is
proportional to the shards the buffers hold, not to the corpus.

Nothing is dropped silently: every utterance left out is reported as a
`StreamEvents.dropped` entry (reasons `empty_label`, `no_tokens`, `all_unk`,
`out_of_range`, `no_encoder_frames`, `label_too_long`, `incomplete_sample`, `bad_key`,
`corrupt_features`, `bad_text`), and shards whose tar breaks off or ends early are
reported as `corrupt` (skipped with a warning). `strict_shards` turns all of these
shard and member faults into errors. Features whose dimension differs from the model's
are always an error naming the shard and the utterance.

Every sort buffer leaves whole: its last, partial batch (its longest utterances) is sent
too instead of waiting for the next buffer. Carried from buffer to buffer, the longest
utterances gathered at the end of each worker's stream, exactly where the epoch's end
cuts (`bench/epoch_cut.py`: the longest 10 % were 17.6 % of the cut utterances when
carried every time, 13-15 % when carried once, 8.6-10.9 % never carried). Never carrying
costs 1-3 % more, smaller batches and no more padded frames.

Usage:
    shards = load_shard_list(["data/wds/train/10_1000/data-*.tar"])
    stream = ShardStream(shards, "exp/asr/tokenizer.tknz", StreamConfig(), length_filter,
                         feat_dim=80, rank=0, world_size=1, num_workers=2)
    stream.set_epoch(1)
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2): ...
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import logging
import os
import random
import re
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cat.data.pack import transcript_verdict
from cat.data.prep_wds import decode_key
from cat.shared.data import (
    Batch,
    LengthFilter,
    StreamEvents,
    Utterance,
    collate,
    empty_batch,
    form_batches,
)
from cat.shared.shardlist import HTTP_TIMEOUT_SECONDS, ShardList, assign_shards
from cat.shared.tario import (
    CORRUPT,
    TRANSIENT,
    UNAVAILABLE,
    BufferPool,
    CorruptShardError,
    iter_shard_items,
    read_shard,
)
from cat.shared.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)

ORDINAL_BITS = 32
_ORDINAL_MASK = (1 << ORDINAL_BITS) - 1
#: Members a sample needs: features and transcript.
MEMBER_TYPES = ("npy", "txt")
_NPY_MAGIC = b"\x93NUMPY"
# numpy writes this exact layout; anything else goes through numpy's own parser.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<|]f[248])', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n")
_NPY_DTYPES = {b"<f4": np.dtype("<f4"), b"<f2": np.dtype("<f2"), b"<f8": np.dtype("<f8")}


def sample_id(shard: int, ordinal: int) -> int:
    """The id of the `ordinal`-th sample (0-based, tar order) of shard `shard`."""
    return (shard << ORDINAL_BITS) | ordinal


def split_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(shards, ordinals)` of sample ids."""
    ids = np.asarray(ids, np.int64)
    return ids >> ORDINAL_BITS, ids & _ORDINAL_MASK


def decode_npy(data: bytes) -> np.ndarray:
    """A 2-D float array from .npy bytes (a view on `data` when possible)."""
    if data[:6] != _NPY_MAGIC:
        raise ValueError("not .npy data")
    if data[6] == 1:
        start = 10 + int.from_bytes(data[8:10], "little")
        match = _NPY_HEADER.fullmatch(data, 10, start)
    else:
        start = 12 + int.from_bytes(data[8:12], "little")
        match = _NPY_HEADER.fullmatch(data, 12, start)
    if match is None:
        array = np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)
        if array.ndim != 2 or array.dtype.kind != "f":
            raise ValueError(f"expected a 2-D float matrix, got {array.dtype} {array.shape}")
        return array
    dtype = _NPY_DTYPES[match.group(1).replace(b"|", b"<")]
    rows, cols = int(match.group(2)), int(match.group(3))
    if len(data) - start != rows * cols * dtype.itemsize:
        raise ValueError(f"{len(data) - start} data bytes for shape ({rows}, {cols}) "
                         f"{dtype}: truncated")
    return np.frombuffer(data, dtype, rows * cols, start).reshape(rows, cols)


# --------------------------------------------------------------------------- positions


def _ids(samples: Iterable[dict[str, Any]]) -> np.ndarray:
    return np.fromiter((s["id"] for s in samples), np.int64)


@dataclasses.dataclass
class WorkerPosition:
    """Where one worker's stream stands after a batch (see the module docstring).

    `shard`, `ordinal`: the reader continues with sample `ordinal` of the `shard`-th shard
    of the worker's list. The id arrays hold the buffered samples in buffer order.
    """

    epoch: int
    worker: int
    num_workers: int
    shard: int
    ordinal: int
    shuffle: np.ndarray
    draining: bool
    sort: np.ndarray
    pending: list[np.ndarray]
    upstream_done: bool
    rng: tuple

    def buffered(self) -> np.ndarray:
        """Ids of every sample held in the buffers."""
        return np.concatenate([self.shuffle, self.sort, *self.pending])

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint (`torch.load(weights_only=True)` reads it)."""
        version, words, gauss = self.rng
        return {"epoch": self.epoch, "worker": self.worker, "num_workers": self.num_workers,
                "shard": self.shard, "ordinal": self.ordinal,
                "shuffle": torch.from_numpy(self.shuffle), "draining": self.draining,
                "sort": torch.from_numpy(self.sort),
                "pending": [torch.from_numpy(b) for b in self.pending],
                "upstream_done": self.upstream_done,
                "rng": {"version": version, "words": torch.tensor(words, dtype=torch.int64),
                        "gauss": gauss}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> WorkerPosition:
        """Inverse of `to_state`."""
        rng = state["rng"]
        return cls(int(state["epoch"]), int(state["worker"]), int(state["num_workers"]),
                   int(state["shard"]), int(state["ordinal"]), state["shuffle"].numpy(),
                   bool(state["draining"]), state["sort"].numpy(),
                   [b.numpy() for b in state["pending"]], bool(state["upstream_done"]),
                   (rng["version"], tuple(rng["words"].tolist()), rng["gauss"]))


# --------------------------------------------------------------------------- stages


class _OrdinalGate:
    """`keep` for `iter_tar_members`: reads the members of the samples (key groups, in tar
    order) whose ordinal `wanted` accepts; `ordinal` is that of the last member asked."""

    def __init__(self, wanted: Callable[[int], bool]) -> None:
        self.wanted = wanted
        self.base: str | None = None
        self.ordinal = -1

    def __call__(self, name: str) -> bool:
        base = name.rpartition(".")[0]
        if base != self.base:
            self.base = base
            self.ordinal += 1
        return self.wanted(self.ordinal)


class DataUnavailableError(RuntimeError):
    """Too many shards of an epoch could not be read (storage down, or corrupt data)."""


def storage_of(urls: Iterable[str]) -> str:
    """Where shards live, in words: `http://host:port`, the `pipe:` command, or folders."""
    places = []
    for url in urls:
        if url.startswith(("http://", "https://")):
            parts = urllib.parse.urlsplit(url)
            place = f"{parts.scheme}://{parts.netloc}"
        elif url.startswith("pipe:"):
            place = "pipe: " + (url[len("pipe:"):].split() or [""])[0]
        else:
            place = os.path.dirname(os.path.abspath(url))
        if place not in places:
            places.append(place)
    return ", ".join(places[:3]) + (", ..." if len(places) > 3 else "")


class FailureBudget:
    """How many shards may fail (be unavailable or corrupt) before a worker stops.

    `counters` (shared memory, one entry per worker of the rank, set by the training
    process) count the rank's failed shards in the epoch; past `limit` x `rank_shards`,
    or after `max_in_a_row` unavailable shards in a row on this worker (its storage is
    down), `fail` raises `DataUnavailableError` naming the shards and their storage. A
    `limit` of 1 never stops.
    """

    def __init__(self, counters: torch.Tensor, worker: int, rank_shards: int, limit: float,
                 max_in_a_row: int = 3) -> None:
        self.counters = counters
        self.worker = worker
        self.rank_shards = rank_shards
        self.limit = limit
        self.max_in_a_row = max_in_a_row
        self.failed: list[tuple[str, str, str]] = []  # (url, cause, message)
        self.in_a_row = 0

    def fail(self, url: str, cause: str, message: str) -> None:
        """Count a failed shard; raise when the budget is spent."""
        self.counters[self.worker] += 1
        self.failed.append((url, cause, message))
        self.in_a_row = self.in_a_row + 1 if cause == UNAVAILABLE else 0
        total = int(self.counters.sum())
        if self.limit >= 1:
            return
        if self.in_a_row >= self.max_in_a_row:
            why = f"{self.in_a_row} shards in a row were unavailable"
        elif total > self.limit * self.rank_shards:
            why = (f"{total} of the rank's {self.rank_shards} shards this epoch failed, more "
                   f"than bad_shard_limit={self.limit:g}")
        else:
            return
        urls = [u for u, _, _ in self.failed]
        shown = "; ".join(f"{u} ({c}: {m})" for u, c, m in self.failed[-5:])
        raise DataUnavailableError(f"{why}; storage: {storage_of(urls)}; last failures: "
                                   f"{shown}")

    def succeed(self) -> None:
        """A shard was read to its end."""
        self.in_a_row = 0


class _SkipShard(Exception):
    """The rest of the shard being read is left out (it does not match its index)."""


class ShardReader:
    """Stage 1: `{"key", "name", "shard", "id", "npy", "txt"}` samples of the shards
    `shards` (indices into `shard_list`), read in order from `position`.

    `position` is `(list index, ordinal)`: the next sample to take; it advances as
    samples are taken. Each sample's key is checked against the shard's index entry, and
    a shard read to its end against the index's utterance count and CRC-32; a shard that
    disagrees is corrupt. A transient storage error is retried (`config.read_retries`
    times, waiting `retry_seconds` x 1, 2, 4...), the read continuing where it stopped; a
    shard still unreadable is unavailable. Corrupt and unavailable shards are skipped and
    reported (counted by `budget`), or raise with `config.strict_shards`.
    """

    def __init__(self, shards: Sequence[int], shard_list: ShardList, events: StreamEvents,
                 config: StreamConfig, pool: BufferPool | None = None,
                 budget: FailureBudget | None = None) -> None:
        self.shards = list(shards)
        self.shard_list = shard_list
        self.events = events
        self.config = config
        self.pool = pool
        self.budget = budget
        self.position = (0, 0)
        self.attempts: collections.Counter = collections.Counter()
        self._keys: tuple[int, list[str] | None] = (-1, None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.position[0] < len(self.shards):
            restart = yield from self._read_from(*self.position)
            if not restart:
                return

    def _read_from(self, first: int, skip: int) -> Iterator[dict[str, Any]]:
        """Read from `(first, skip)`; returns True when reading must start again from
        `self.position` (after a retry wait, or to leave a shard out)."""
        urls = self.shard_list.urls
        todo = [(shard, urls[shard]) for shard in self.shards[first:]]
        gates = {todo[0][0]: _OrdinalGate(skip.__le__)} if skip else {}
        items = iter_shard_items(todo, self.config.read_ahead_mb << 20, self.config.timeout,
                                 self.pool, gates)
        places = {shard: first + offset for offset, (shard, _) in enumerate(todo)}
        current: dict[str, Any] = {}
        ordinals: collections.Counter = collections.Counter()
        try:
            for item in items:
                kind, shard = item[0], item[1]
                if kind == "member":
                    base, _, extension = item[2].rpartition(".")
                    if current and current["name"] != base:
                        yield from self._take(current, ordinals, places)
                    if not current:
                        current.update(name=base, shard=shard, skipped=item[3] is None)
                    if extension in MEMBER_TYPES and item[3] is not None:
                        current[extension] = item[3]
                    continue
                yield from self._take(current, ordinals, places)
                if kind == "error" and item[3] == TRANSIENT and self._retry(shard, item[2]):
                    return True
                if kind == "error":
                    cause = CORRUPT if item[3] == CORRUPT else UNAVAILABLE
                    self._fail(shard, ordinals[shard], item[2], cause)
                else:
                    self._end(shard, ordinals[shard], item[2])
                self.position = (places[shard] + 1, 0)
        except _SkipShard:
            return True
        finally:
            items.close()
        return False

    def _retry(self, shard: int, message: str) -> bool:
        attempt = self.attempts[shard]
        if attempt >= self.config.read_retries:
            return False
        self.attempts[shard] += 1
        wait = min(self.config.retry_seconds * 2 ** attempt, 60.0)
        logger.warning("shard %s: %s; attempt %d of %d in %.1f s, from its utterance %d",
                       self.shard_list.urls[shard], message, attempt + 2,
                       self.config.read_retries + 1, wait, self.position[1])
        time.sleep(wait)
        return True

    def _index_keys(self, shard: int) -> list[str] | None:
        if self._keys[0] != shard:
            entry = None
            if not self.shard_list.estimated[shard]:
                try:
                    entry = self.shard_list.index_entry(shard)
                except (OSError, ValueError) as error:
                    logger.warning("shard %s: its keys cannot be checked: %s",
                                   self.shard_list.urls[shard], error)
            self._keys = (shard, entry.get("keys") if entry else None)
        return self._keys[1]

    def _take(self, current: dict[str, Any], ordinals: collections.Counter,
              places: Mapping[int, int]) -> Iterator[dict[str, Any]]:
        if not current:
            return
        sample = dict(current)
        current.clear()
        shard = sample["shard"]
        ordinal = ordinals[shard]
        ordinals[shard] += 1
        if sample.pop("skipped"):
            return
        try:
            key = decode_key(sample["name"])
        except ValueError:
            key = None
        keys = self._index_keys(shard)
        if keys is not None and (ordinal >= len(keys) or keys[ordinal] != key):
            listed = repr(keys[ordinal]) if ordinal < len(keys) else "nothing more"
            self._fail(shard, ordinal, f"holds {sample['name']!r} as its utterance {ordinal}, "
                       f"where its index lists {listed}: it does not match its index "
                       "(swapped, or repacked without a new index?)", CORRUPT)
            self.position = (places[shard] + 1, 0)
            raise _SkipShard
        self.position = (places[shard], ordinal + 1)
        sample["id"] = sample_id(shard, ordinal)
        if key is None:
            self._drop(sample["name"], "bad_key", shard)
            return
        sample["key"] = key
        missing = [f".{t}" for t in MEMBER_TYPES if t not in sample]
        if missing:
            self._drop(key, f"incomplete_sample missing {','.join(missing)}", shard)
            return
        yield sample

    def _drop(self, key: str, reason: str, shard: int) -> None:
        if self.config.strict_shards:
            raise CorruptShardError(f"shard {self.shard_list.urls[shard]}: sample {key!r}: "
                                    f"{reason} (strict_shards is set)")
        self.events.dropped.append((key, reason, shard))

    def _end(self, shard: int, count: int, checksum: int | None) -> None:
        expected = 0 if self.shard_list.estimated[shard] else int(self.shard_list.num_utts[shard])
        listed = self.shard_list.crc32[shard] if self.shard_list.crc32 else ""
        if count < expected:
            self._fail(shard, count, f"ends after {count} of {expected} utterances listed "
                                     "in its index (truncated?)", CORRUPT)
        elif checksum is not None and listed and f"{checksum:08x}" != listed:
            self._fail(shard, count, f"its bytes differ from its index (crc32 {checksum:08x}, "
                                     f"index {listed}; its {count} utterances were read)",
                       CORRUPT)
        else:
            if self.budget is not None:
                self.budget.succeed()
            self.events.finished.append((shard, count))

    def _fail(self, shard: int, count: int, message: str, cause: str) -> None:
        url = self.shard_list.urls[shard]
        if cause == UNAVAILABLE:
            attempts = self.attempts[shard] + 1
            message = f"unavailable after {attempts} attempt{'s' * (attempts > 1)}: {message}"
        if self.config.strict_shards:
            error = CorruptShardError if cause == CORRUPT else DataUnavailableError
            raise error(f"shard {url}: {message} (strict_shards is set)")
        logger.warning("skipping the rest of shard %s: %s", url, message)
        (self.events.corrupt if cause == CORRUPT else self.events.unavailable).append(
            (shard, message))
        self.events.finished.append((shard, count))
        if self.budget is not None:
            self.budget.fail(url, cause, message)


def fetch_samples(urls: Sequence[str], ids: np.ndarray, timeout: float = HTTP_TIMEOUT_SECONDS,
                  pool: BufferPool | None = None) -> dict[int, dict[str, Any]]:
    """The samples `ids` names, read again from their shards (only their members; each
    shard is read up to its last wanted sample). Raises OSError naming what is missing."""
    wanted: dict[int, set[int]] = collections.defaultdict(set)
    for shard, ordinal in zip(*split_ids(ids), strict=True):
        wanted[int(shard)].add(int(ordinal))
    found: dict[int, dict[str, Any]] = {}
    for shard, ordinals in sorted(wanted.items()):
        gate = _OrdinalGate(ordinals.__contains__)
        last = max(ordinals)
        try:
            for name, data in read_shard(urls[shard], timeout, pool, gate):
                if gate.ordinal > last:
                    break
                if data is None:
                    continue
                base, _, extension = name.rpartition(".")
                key = sample_id(shard, gate.ordinal)
                sample = found.setdefault(key, {"name": base, "key": decode_key(base),
                                                "shard": shard, "id": key})
                if extension in MEMBER_TYPES:
                    sample[extension] = data
        except (OSError, CorruptShardError, ValueError) as error:
            raise OSError(f"cannot read shard {urls[shard]} again: {error}") from None
        incomplete = [s for s in ordinals
                      if not all(t in found.get(sample_id(shard, s), {}) for t in MEMBER_TYPES)]
        if incomplete:
            raise OSError(f"shard {urls[shard]} no longer holds its samples "
                          f"{sorted(incomplete)[:5]} (of {len(ordinals)} wanted)")
    return found


def _judge(sample: dict[str, Any], feat_dim: int, feat_dim_source: str,
           urls: Sequence[str], encode: Callable[[str], list[int]],
           length_filter: LengthFilter | None, strict: bool) -> None:
    """Decode, tokenize and filter one sample in place; a verdict goes under `drop` or
    `error`, and the first failed check decides it."""
    where = f"shard {urls[sample['shard']]}: utterance {sample['key']!r}"

    def undecodable(reason: str, error: Exception) -> None:
        if strict:
            sample["error"] = f"{where}: {reason} {error} (strict_shards is set)"
        else:
            sample["drop"] = f"{reason} {error}"

    data = sample.pop("npy")
    if isinstance(data, memoryview):
        sample["buffer"] = data.obj
    try:
        features = decode_npy(data)
    except (ValueError, KeyError) as error:
        undecodable("corrupt_features", error)
        return
    if features.shape[1] != feat_dim:
        sample["error"] = (f"{where} has {features.shape[1]}-dim features, but "
                           f"{feat_dim_source} is {feat_dim}")
        return
    sample["features"] = features
    try:
        text = str(sample.pop("txt"), "utf-8")
    except UnicodeDecodeError as error:
        undecodable("bad_text", error)
        return
    ids = encode(text) if text.strip() else []
    reason = transcript_verdict(text, ids)
    if reason:
        sample["drop"] = reason
        return
    sample["label"] = label = np.asarray(ids, np.int32)
    if length_filter is not None:
        reason = length_filter.reason(len(features), label)
        if reason:
            sample["drop"] = reason


def prepare_samples(samples: Iterable[dict[str, Any]], judge: Callable[[dict[str, Any]], None]
                    ) -> Iterator[dict[str, Any]]:
    """Stage 2: decode `npy` into `features` [T, D] (a view on the bytes; a pooled buffer
    under them is kept as `buffer`), tokenize `txt` into `label` ids (int32) and decide
    the sample's verdict (`judge`, i.e. `_judge`), as each sample is read.

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
    its whole state (with the shared `rng`): see `WorkerPosition`."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.rng = rng
        self.samples: list[dict[str, Any]] = []
        self.draining = False

    def __call__(self, upstream: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        if self.size <= 1:
            yield from upstream
            return
        samples = self.samples
        if not self.draining:
            for sample in upstream:
                if len(samples) < self.size:
                    samples.append(sample)
                    continue
                position = self.rng.randrange(self.size)
                samples[position], sample = sample, samples[position]
                yield sample
            self.rng.shuffle(samples)
            self.draining = True
        while samples:
            yield samples.pop()


def settle_samples(samples: Iterable[dict[str, Any]], events: StreamEvents,
                   pool: BufferPool | None = None) -> Iterator[dict[str, Any]]:
    """Stage 4: report (`events.dropped`) the samples `prepare_samples` left out and give
    their buffers back to `pool`; raise a sample's error (ValueError naming the shard)."""
    for sample in samples:
        if "error" in sample:
            raise ValueError(sample["error"])
        reason = sample.get("drop")
        if reason is None:
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
    (batches cut, not yet sent) and `upstream_done` are its whole state.
    """

    def __init__(self, sort_buffer: int, batch_size: int, max_frames: int,
                 rng: random.Random | None) -> None:
        self.sort_buffer = max(1, sort_buffer)
        self.batch_size = batch_size
        self.max_frames = max_frames
        self.rng = rng
        self.buffer: list[dict[str, Any]] = []
        self.pending: list[list[dict[str, Any]]] = []
        self.upstream_done = False

    def __call__(self, upstream: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield from self._send()
        if not self.upstream_done:
            for sample in upstream:
                self.buffer.append(sample)
                if len(self.buffer) >= self.sort_buffer:
                    self._cut()
                    yield from self._send()
            self.upstream_done = True
            self._cut()
        yield from self._send()

    def _send(self) -> Iterator[list[dict[str, Any]]]:
        while self.pending:
            yield self.pending.pop(0)

    def _cut(self) -> None:
        buffer = self.buffer
        buffer.sort(key=lambda s: len(s["features"]))
        lengths = np.fromiter((len(s["features"]) for s in buffer), np.int64, len(buffer))
        batches = form_batches(lengths, np.arange(len(buffer)), self.batch_size,
                               self.max_frames)
        if self.rng is not None:
            self.rng.shuffle(batches)
        self.pending += [[buffer[i] for i in batch] for batch in batches]
        self.buffer = []


def collate_batches(groups: Iterable[list[dict[str, Any]]], events: StreamEvents,
                    feat_dim: int, pool: BufferPool | None = None,
                    collate_fn: Callable[..., Any] = collate,
                    position: Callable[[], WorkerPosition] | None = None) -> Iterator[Any]:
    """Stage 6: padding collate; events so far ride along, with the worker's `position`
    after the batch; a final batch without utterances flushes the last events.

    The batch holds copies, so the samples' pooled buffers go back to `pool` here.
    `collate_fn(utterances, events)` may be a `cat.shared.transport.SharedCollate`.
    """
    for group in groups:
        utterances = [Utterance(s["key"], s["features"], s["label"], s["id"]) for s in group]
        if position is not None:
            events.position = position()
        batch = collate_fn(utterances, events.drain())
        if pool is not None:
            for sample in group:
                if "buffer" in sample:
                    pool.give_back(sample["buffer"])
        yield batch
    if events:
        if position is not None:
            events.position = position()
        yield empty_batch(feat_dim, events.drain())


# --------------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Buffer sizes and policies of the streaming pipeline (see `train.option`)."""

    batch_size: int = 64
    max_frames: int = 20000
    shuffle_buffer: int = 3000
    sort_buffer: int = 500
    read_ahead_mb: int = 128
    strict_shards: bool = False
    seed: int = 0
    train: bool = True
    timeout: float = HTTP_TIMEOUT_SECONDS
    read_retries: int = 3
    retry_seconds: float = 1.0
    bad_shard_limit: float = 0.1


class ShardStream(torch.utils.data.IterableDataset):
    """Batches of one rank's shards (see the module docstring).

    `num_workers` must equal the DataLoader's; training needs at least
    `world_size * max(num_workers, 1)` shards. `collate_fn`: `collate`, or a
    `cat.shared.transport.SharedCollate` when a `RingLoader` iterates the DataLoader
    (its workers then yield `SlotBatch`es).
    """

    def __init__(self, shards: ShardList, tokenizer: str, config: StreamConfig,
                 length_filter: LengthFilter | None, feat_dim: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0,
                 feat_dim_source: str = "config.json encoder.kwargs.idim",
                 collate_fn: Callable[..., Any] = collate) -> None:
        super().__init__()
        slots = world_size * max(num_workers, 1)
        if config.train and len(shards) < slots:
            raise ValueError(f"trset has {len(shards)} shards, fewer than ranks x workers = "
                             f"{world_size} x {max(num_workers, 1)}; repack with fewer "
                             "utterances per shard or lower train.option.workers")
        self.shards = shards
        self.tokenizer_path = tokenizer
        self.config = config
        self.length_filter = length_filter
        self.feat_dim = feat_dim
        self.feat_dim_source = feat_dim_source
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        # The epoch, shared with worker processes (persistent workers see set_epoch), and
        # the shards each worker failed to read this epoch (`FailureBudget`).
        self._control = torch.ones(1, dtype=torch.int64).share_memory_()
        self._failures = torch.zeros(max(num_workers, 1), dtype=torch.int64).share_memory_()
        self._resume: dict[int, WorkerPosition] = {}
        self._tokenizer = None
        self._pool: tuple[int, BufferPool] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        state["_pool"] = None
        return state

    def set_epoch(self, epoch: int, positions: Mapping[int, WorkerPosition] | None = None,
                  failed: int = 0) -> None:
        """Select the epoch (its shard order); `positions` (per worker) resume it exactly,
        `failed` shards of the rank already failed in it.

        Positions reach the workers with the dataset, so give them before the DataLoader
        starts its workers (the first epoch of a process, where a resume happens).
        """
        self._control[0] = epoch
        self._failures.zero_()
        self._failures[0] = failed
        self._resume = dict(positions or {})

    @property
    def epoch(self) -> int:
        """The epoch `set_epoch` selected."""
        return int(self._control[0])

    @property
    def weighting(self) -> str:
        """What rank balancing counts: `frames` when batches are frame-bounded, else
        `utterances`."""
        if self.config.max_frames and not self.shards.estimated.any():
            return "frames"
        return "utterances"

    def weights(self) -> np.ndarray:
        """Work per shard for rank balancing (see `weighting`)."""
        return self.shards.num_frames if self.weighting == "frames" else self.shards.num_utts

    def rank_shards(self, epoch: int, rank: int | None = None) -> np.ndarray:
        """All shards of `rank` (default: this one) in `epoch`, in reading order."""
        plan = assign_shards(self.weights(), self.config.seed, epoch, self.world_size,
                             self.config.train)
        return plan[self.rank if rank is None else rank]

    def worker_shards(self, epoch: int, worker: int, num_workers: int) -> list[int]:
        """Shards a worker reads: its round-robin share of the rank's shards."""
        return [int(s) for s in self.rank_shards(epoch)[worker::num_workers]]

    def _encode(self) -> Callable[[str], list[int]]:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer.encode

    def _buffer_pool(self) -> BufferPool:
        # One per process, kept across epochs (persistent workers): its buffers are then
        # already mapped when the next epoch's shuffle buffer fills.
        if self._pool is None or self._pool[0] != os.getpid():
            self._pool = (os.getpid(), BufferPool())
        return self._pool[1]

    def __iter__(self) -> Iterator[Batch]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.pipeline(self.epoch, worker, num_workers)

    def pipeline(self, epoch: int, worker: int, num_workers: int) -> Iterator[Batch]:
        """The stages of one worker for one epoch (continuing at its resume position)."""
        config = self.config
        shards = self.worker_shards(epoch, worker, num_workers)
        rng = random.Random(f"{config.seed}/{epoch}/{self.rank}/{worker}")
        events = StreamEvents()
        urls = self.shards.urls
        pool = self._buffer_pool()
        judge = functools.partial(_judge, feat_dim=self.feat_dim,
                                  feat_dim_source=self.feat_dim_source, urls=urls,
                                  encode=self._encode(),
                                  length_filter=self.length_filter if config.train else None,
                                  strict=config.strict_shards)
        budget = FailureBudget(self._failures, worker, len(self.rank_shards(epoch)),
                               config.bad_shard_limit if config.train else 1.0)
        reader = ShardReader(shards, self.shards, events, config, pool, budget)
        shuffle = ShuffleBuffer(config.shuffle_buffer if config.train else 0, rng)
        batcher = SortBatcher(config.sort_buffer, config.batch_size, config.max_frames,
                              rng if config.train else None)
        resume = self._resume.get(worker)
        if resume is not None and resume.epoch == epoch:
            self._restore(resume, num_workers, reader, shuffle, batcher, judge, pool)

        def position() -> WorkerPosition:
            return WorkerPosition(
                epoch, worker, num_workers, *reader.position, _ids(shuffle.samples),
                shuffle.draining, _ids(batcher.buffer), [_ids(b) for b in batcher.pending],
                batcher.upstream_done, rng.getstate())

        stream: Iterable[Any] = prepare_samples(reader, judge)
        stream = shuffle(stream)
        stream = settle_samples(stream, events, pool)
        return collate_batches(batcher(stream), events, self.feat_dim, pool, self.collate_fn,
                               position)

    def _restore(self, position: WorkerPosition, num_workers: int, reader: ShardReader,
                 shuffle: ShuffleBuffer, batcher: SortBatcher,
                 judge: Callable[[dict[str, Any]], None], pool: BufferPool) -> None:
        if position.num_workers != num_workers:
            raise ValueError(f"the resume position is of a stream with {position.num_workers} "
                             f"workers, this one has {num_workers}")
        samples = fetch_samples(self.shards.urls, position.buffered(), self.config.timeout,
                                pool)
        for sample in samples.values():
            judge(sample)
        settled = [samples[int(i)] for i in np.concatenate([position.sort, *position.pending])]
        for sample in settled:
            if "drop" in sample or "error" in sample:
                raise ValueError(f"cannot resume exactly: utterance {sample['key']!r} of shard "
                                 f"{self.shards.urls[sample['shard']]} was trained before, now "
                                 f"its verdict is {sample.get('drop') or sample.get('error')}")
        reader.position = (position.shard, position.ordinal)
        shuffle.samples = [samples[int(i)] for i in position.shuffle]
        shuffle.draining = position.draining
        batcher.buffer = [samples[int(i)] for i in position.sort]
        batcher.pending = [[samples[int(i)] for i in batch] for batch in position.pending]
        batcher.upstream_done = position.upstream_done
        shuffle.rng.setstate(position.rng)
