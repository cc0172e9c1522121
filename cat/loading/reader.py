"""Stage 1 of the streaming loader: shards read into samples, with retries and checks.

`ShardReader` streams a worker's shards in order from a position (`(list index,
ordinal)`), groups the members of each utterance into a sample and checks the shard
against its index as it goes: each key against the index entry, the utterance count and
the CRC-32 when the shard was read to its end. A transient storage error is retried
with exponential backoff, the read continuing at the utterance where it stopped; a shard
still unreadable is unavailable. Corrupt and unavailable shards are skipped and reported,
counted by a `FailureBudget` that stops the worker (`DataUnavailableError`, naming the
shards and their storage) past `bad_shard_limit` or after 3 unavailable shards in a row;
`strict_shards` makes each of them an error.

Samples are dropped here, counted and named (`StreamEvents.dropped`), when a key cannot
be decoded (`bad_key`), a member is missing (`incomplete_sample`), a member is larger
than the length filter lets its extension be (`too_long`: passed over unread, see
`cat.loading.tar.iter_tar_members`), or a key of a shard without an index entry was
already taken this epoch from another shard (`duplicate_key`): `SeenKeys`, a table that
all loader workers of a rank share, so the second copy is dropped whichever worker
reads it.

`fetch_samples` reads given samples again from their shards (only their members), to
rebuild a worker's buffers on resume.

Usage:
    reader = ShardReader([3, 0, 7], shard_list, StreamEvents(), StreamConfig.with_defaults())
    for sample in reader: ...
"""

from __future__ import annotations

import collections
import http.client
import logging
import multiprocessing
import os
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cat.formats.shard_format import HTTP_TIMEOUT_SECONDS, decode_key
from cat.loading.batch import (
    StreamEvents,
)
from cat.loading.readahead import iter_shard_items
from cat.loading.samples import (
    MEMBER_TYPES,
    StreamConfig,
    key_hash,
    missing_members,
    sample_id,
    split_ids,
)
from cat.loading.shardlist import RAW_LIST, ShardList, raw_list_part
from cat.loading.sources import (
    CORRUPT,
    TRANSIENT,
    UNAVAILABLE,
    classify,
    describe,
    read_shard,
)
from cat.loading.tar import BufferPool, CorruptShardError, OversizedMember
from cat.storage.stores import is_store_url, store_place

logger = logging.getLogger(__name__)


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
    """Where shards live, in words: `http://host:port`, the `pipe:` command, the store's
    bucket (for S3 with its endpoint), the raw data.list, or folders."""
    places = []
    for url in urls:
        if url.startswith(("http://", "https://")):
            parts = urllib.parse.urlsplit(url)
            place = f"{parts.scheme}://{parts.netloc}"
        elif url.startswith("pipe:"):
            place = "pipe: " + (url[len("pipe:"):].split() or [""])[0]
        elif is_store_url(url):
            place = store_place(url)
        elif url.startswith(RAW_LIST):
            place = raw_list_part(url)[2]
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


class SeenKeys:
    """Keys taken in an epoch from shards without an index entry, shared by every loader
    worker of a rank: the first sample of a key is kept, each later one, whichever worker
    reads it, is a duplicate (it would train the utterance twice).

    An open-addressing table of 64-bit key hashes (`key_hash`) in shared memory, made in
    the training process before the DataLoader starts its workers (which inherit it);
    each slot is tagged with its epoch, so an epoch starts empty without clearing, and a
    process lock makes look-up-and-insert one step across processes. `capacity` keys fill
    it at most half; past 3/4 full, keys not yet in it are no longer added (`claim`
    answers None). Memory: 16 bytes of shared memory a slot, at most 64 per key of
    `capacity` (at least 4096 slots).
    """

    def __init__(self, capacity: int) -> None:
        slots = 1 << max(12, (2 * max(capacity, 1) - 1).bit_length())
        self.hashes = torch.zeros(slots, dtype=torch.int64).share_memory_()
        # (epoch << 32) | shard of the key's first sample
        self.places = torch.zeros(slots, dtype=torch.int64).share_memory_()
        self.counts = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, keys
        self.lock = multiprocessing.Lock()

    def claim(self, key: str, shard: int, epoch: int) -> int | None:
        """The shard whose sample of `key` was taken first in `epoch`: `shard` itself for
        a new key (now recorded); None for a new key the full table cannot take."""
        hashes, places, counts = self.hashes.numpy(), self.places.numpy(), self.counts.numpy()
        value, mask = key_hash(key), len(hashes) - 1
        with self.lock:
            if counts[0] != epoch:
                if counts[0] > epoch:
                    return shard  # a worker still reading an epoch that was cut short
                counts[:] = (epoch, 0)
            slot = value & mask
            while places[slot] >> 32 == epoch:
                if hashes[slot] == value:
                    return int(places[slot] & 0xFFFFFFFF)
                slot = (slot + 1) & mask
            if counts[1] >= len(hashes) * 3 // 4:
                return None
            hashes[slot], places[slot] = value, (epoch << 32) | shard
            counts[1] += 1
            return shard


#: The note of a kept sample whose key `SeenKeys` could not take (it was full): compared
#: only with the keys its own worker read.
UNCHECKED_KEY = "key checked against its loader worker's keys only (seen-key table full)"


class _SkipShard(Exception):
    """The rest of the shard being read is left out (it does not match its index)."""


class _IndexUnreadable(Exception):
    """The index entry of a shard could not be read from its storage: a storage error of
    the shard (retried, then unavailable), as when its bytes cannot be read."""

    def __init__(self, shard: int, message: str, cause: str) -> None:
        super().__init__(message)
        self.shard = shard
        self.message = message
        self.cause = cause


class ShardReader:
    """Stage 1: `{"key", "name", "shard", "id", "npy", "txt"}` samples of the shards
    `shards` (indices into `shard_list`), read in order from `position`.

    `position` is `(list index, ordinal)`: the next sample to take; it advances as
    samples are taken. Each sample's key is checked against the shard's index entry, and
    a shard read to its end against the index's utterance count and CRC-32; a shard that
    disagrees is corrupt. A key of a shard without an index entry that an earlier such
    shard of this reader held is dropped (`duplicate_key`: it would be trained twice).
    A transient storage error is retried (`config.read_retries`
    times, waiting `retry_seconds` x 1, 2, 4...), the read continuing where it stopped; a
    shard still unreadable is unavailable. Corrupt and unavailable shards are skipped and
    reported (counted by `budget`), or raise with `config.strict_shards`.

    `seen` (shared by the rank's workers) and `epoch`: where keys of shards without an
    index entry are checked (`duplicate_key`); without it, or once it is full, against
    this reader's own keys. `caps`: the most bytes a member of each extension may take
    (`Judge.member_caps`); a sample with a larger one is dropped unread (`too_long`).
    """

    def __init__(self, shards: Sequence[int], shard_list: ShardList, events: StreamEvents,
                 config: StreamConfig, pool: BufferPool | None = None,
                 budget: FailureBudget | None = None, seen: SeenKeys | None = None,
                 epoch: int = 1, caps: Mapping[str, int] | None = None) -> None:
        self.shards = list(shards)
        self.shard_list = shard_list
        self.events = events
        self.config = config
        self.pool = pool
        self.budget = budget
        self.seen = seen
        self.epoch = epoch
        self.caps = dict(caps or {})
        self.position = (0, 0)
        self.attempts: collections.Counter = collections.Counter()
        self._keys: tuple[int, list[str] | None] = (-1, None)
        # Keys taken from shards without an index entry -> their shard, where `seen` does
        # not take them: an indexed shard's keys are checked by `prep_wds index`.
        self._unindexed_keys: dict[str, int] = {}

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
        limits = {shard: self.shard_list.member_limit(shard) for shard, _ in todo}
        config = self.config
        items = iter_shard_items(todo, config.read_ahead_mb << 20, config.read_timeout,
                                 self.pool, gates, limits, self.caps)
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
        except _IndexUnreadable as error:
            if error.cause == TRANSIENT and self._retry(error.shard, error.message):
                return True
            self._fail(error.shard, self.position[1], error.message, UNAVAILABLE)
            self.position = (places[error.shard] + 1, 0)
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
                except ValueError as error:
                    logger.warning("shard %s: its keys cannot be checked: %s",
                                   self.shard_list.urls[shard], error)
                except (OSError, http.client.HTTPException) as error:
                    # A hung or failing store: training on unchecked keys would only
                    # postpone its error by a timeout per shard.
                    raise _IndexUnreadable(shard, f"cannot read its index entry: "
                                                  f"{describe(error)}", classify(error)
                                           ) from None
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
        if keys is None and self.shard_list.estimated[shard]:
            first = self._first_shard(key, shard)
            if first != shard:
                urls = self.shard_list.urls
                self._drop(key, f"duplicate_key also in shard {urls[first]} (read first; "
                                f"this copy: shard {urls[shard]})", shard)
                return
        missing = missing_members(sample)
        if missing:
            self._drop(key, f"incomplete_sample missing {','.join(missing)}", shard)
            return
        if self.caps and self._oversized(sample, key, shard):
            return
        yield sample

    def _oversized(self, sample: dict[str, Any], key: str, shard: int) -> bool:
        """Drop (`too_long`) a sample with a member passed over for its size."""
        for extension, member in sample.items():
            if isinstance(member, OversizedMember):
                # A length verdict like the filter's, so not an error under strict_shards.
                self.events.dropped.append((key, (
                    f"too_long member {self.shard_list.urls[shard]}:{sample['name']}."
                    f"{extension} of {member.size} bytes, more than the {member.cap} a "
                    f".{extension} member within the length filter may take; not read"), shard))
                return True
        return False

    def _first_shard(self, key: str, shard: int) -> int:
        """The shard whose sample of `key` was taken first this epoch (`shard`: this one)."""
        if self.seen is not None:
            first = self.seen.claim(key, shard, self.epoch)
            if first is not None:
                return first
            self.events.noted[UNCHECKED_KEY] = self.events.noted.get(UNCHECKED_KEY, 0) + 1
        return self._unindexed_keys.setdefault(key, shard)

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
        incomplete = [s for s in ordinals if missing_members(found.get(sample_id(shard, s), {}))]
        if incomplete:
            raise OSError(f"shard {urls[shard]} no longer holds its samples "
                          f"{sorted(incomplete)[:5]} (of {len(ordinals)} wanted)")
    return found
