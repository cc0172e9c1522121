"""Streaming training data from webdataset tar shards (`train.option.large_dataset: true`).

Shards are the stage-2 output of `cat.data.prep_wds`: tar files of `<encoded key>.npy`
(features) and `<encoded key>.txt` (transcript) members, with an `index.jsonl` next to
them giving each shard's utterance and frame counts.

Shard list (`load_shard_list`): every `trset` pattern is brace-expanded, then globbed and
sorted (`data/wds/train/{10_1000,1000_2000}/data-*.tar`, `.../data-0000{0..9}.tar`);
`http://`, `https://` and `pipe:` URLs are brace-expanded only. A pattern that matches
nothing is an error naming it. Counts come from the `index.jsonl` of each shard's folder:
next to a local shard, at the same base URL for http(s) shards, and for `pipe:` commands
next to the command's last argument ending in `.tar` when that is a local file or an
http(s) URL. Shards without an index are an error unless `utts_per_shard_estimate` is set.

Per epoch (`assign_shards`): the shard list is permuted with a generator seeded by
`(seed, epoch)`, identically on every rank, then dealt greedily to the rank with the least
work so far (work = frames when batches are bounded by frames, else utterances), then each
rank's shards go round-robin to its DataLoader workers. The epoch number and the shards to
skip (already consumed before a resume) travel to the workers through a shared-memory
tensor, so `set_epoch` works with persistent and non-persistent workers alike.

Each worker runs a flat list of generator stages, assembled in `ShardStream.pipeline`:

    read_samples     stream each tar in order (own minimal tar reader: one read per member,
                     header checksums verified) with read-ahead across shard boundaries
                     (`read_ahead_mb`): for local shards a helper thread has the kernel
                     read the next shard into the page cache (`prefetch_file`), for
                     http(s)/pipe: shards a background thread streams the bytes and opens
                     each shard while the previous one is read; members are read into
                     recycled buffers (`BufferPool`) and grouped into samples by key
                     (`decode_key`)
    prepare_samples  as each sample is read: .npy header parsed once, features are
                     `np.frombuffer` views; transcript -> ids with the experiment's
                     tokenizer; `LengthFilter` (frame range, what the model can emit).
                     Verdicts ride with the sample; doing this before the shuffle buffer
                     overlaps it with reading
    shuffle_samples  in-memory shuffle buffer (`shuffle_buffer` utterances)
    settle_samples   the verdicts are acted on as samples leave the shuffle buffer: drops
                     reported, errors raised, so both keep their place in the stream
    batch_by_frames  sort buffer (`sort_buffer`) cut into batches by padded frames
    collate_batches  padding collate into `cat.shared.data.Batch` (or, in a DataLoader
                     worker, into a shared-memory slot: `cat.shared.transport`); the
                     samples' buffers go back to the pool

Nothing is dropped silently: every utterance left out is reported as a
`StreamEvents.dropped` entry (reasons `out_of_range`, `no_encoder_frames`,
`label_too_long`, `no_tokens`, `incomplete_sample`, `bad_key`, `corrupt_features`,
`bad_text`), and shards whose tar breaks off or ends early are reported as `corrupt`
(skipped with a warning; `strict_shards` raises). An empty transcript or features whose
dimension differs from the model's are errors naming the shard and the utterance.

`StreamProgress` runs in the training process and turns the events and trained batches
into per-shard accounting: a shard is consumed when all utterances read from it were
trained or dropped. Checkpoints store the consumed shards of each rank, so `--resume`
restarts every rank at its next unconsumed shard; a partially consumed shard is read
again from its start (its utterances already trained are counted as re-trained).

Usage:
    shards = load_shard_list(["data/wds/train/10_1000/data-*.tar"])
    stream = ShardStream(shards, "exp/asr/tokenizer.tknz", StreamConfig(), length_filter,
                         feat_dim=80, rank=0, world_size=1, num_workers=2)
    stream.set_epoch(1)
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2): ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import glob
import hashlib
import io
import json
import logging
import os
import queue
import random
import re
import shlex
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
import torch
from braceexpand import braceexpand

from cat.data.prep_wds import INDEX_FORMAT, INDEX_NAME, decode_key
from cat.shared.data import (
    Batch,
    LengthFilter,
    StreamEvents,
    Utterance,
    collate,
    empty_batch,
    form_batches,
)
from cat.shared.tokenizer import load as load_tokenizer

logger = logging.getLogger(__name__)

URL_PREFIXES = ("http://", "https://", "pipe:")
HTTP_TIMEOUT_SECONDS = 60.0
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_NPY_MAGIC = b"\x93NUMPY"
# numpy writes this exact layout; anything else goes through numpy's own parser.
_NPY_HEADER = re.compile(
    rb"\{'descr': '([<|]f[248])', 'fortran_order': False, 'shape': \((\d+), (\d+)\), \} *\n")
_NPY_DTYPES = {b"<f4": np.dtype("<f4"), b"<f2": np.dtype("<f2"), b"<f8": np.dtype("<f8")}


class CorruptShardError(ValueError):
    """A shard's tar data is truncated or malformed; the message names the shard."""


# --------------------------------------------------------------------------- shard list


def is_url(location: str) -> bool:
    """True for `http://`, `https://` and `pipe:` locations."""
    return location.startswith(URL_PREFIXES)


def expand_shard_patterns(patterns: Sequence[str] | str) -> list[str]:
    """Brace-expand, glob and sort shard patterns (see the module docstring)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    shards: list[str] = []
    origin: dict[str, str] = {}
    for pattern in patterns:
        for expanded in braceexpand(pattern):
            found = [expanded] if is_url(expanded) else sorted(glob.glob(expanded))
            if not found:
                where = "" if expanded == pattern else f" (expanded: {expanded!r})"
                raise FileNotFoundError(f"trset pattern {pattern!r} matches no shard{where}")
            for shard in found:
                if shard in origin:
                    raise ValueError(f"shard {shard} is listed twice (patterns "
                                     f"{origin[shard]!r} and {pattern!r})")
                origin[shard] = pattern
                shards.append(shard)
    return shards


def index_location(shard: str) -> str | None:
    """Where the `index.jsonl` describing `shard` lives, or None when it cannot be told."""
    if shard.startswith(("http://", "https://")):
        return shard.rsplit("/", 1)[0] + "/" + INDEX_NAME
    if shard.startswith("pipe:"):
        try:
            words = shlex.split(shard[len("pipe:"):])
        except ValueError:
            return None
        tars = [w for w in words if w.endswith(".tar")]
        if not tars:
            return None
        last = tars[-1]
        if last.startswith(("http://", "https://")) or os.path.isfile(last):
            return index_location(last)
        return None
    return os.path.join(os.path.dirname(shard), INDEX_NAME)


def _open_text_lines(location: str, timeout: float) -> Iterator[str]:
    if location.startswith(("http://", "https://")):
        with urllib.request.urlopen(location, timeout=timeout) as response:
            for line in response:
                yield line.decode("utf-8")
        return
    with open(location, encoding="utf-8") as f:
        yield from f


def read_index_counts(location: str, timeout: float = HTTP_TIMEOUT_SECONDS
                      ) -> tuple[dict[str, Any], dict[str, tuple[int, int, int]]]:
    """Header and `{shard name: (utterances, frames, longest)}` of one `index.jsonl`.

    Only counts are kept (not the keys), so the shard list stays small for any corpus.
    """
    header: dict[str, Any] | None = None
    counts: dict[str, tuple[int, int, int]] = {}
    for lineno, line in enumerate(_open_text_lines(location, timeout), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{location}:{lineno}: not JSON: {error}") from None
        if header is None:
            if not isinstance(record, dict) or record.get("format") != INDEX_FORMAT:
                raise ValueError(f"{location}:1: not a {INDEX_FORMAT} header")
            header = record
            continue
        try:
            counts[record["shard"]] = (int(record["num_utts"]), int(record["num_frames"]),
                                       max(record["frames"], default=0))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{location}:{lineno}: bad shard record: {error!r}") from None
    if header is None:
        raise ValueError(f"{location}: empty index")
    return header, counts


@dataclasses.dataclass
class ShardList:
    """Shards of a set with their counts (numpy arrays: one entry per shard)."""

    urls: list[str]
    num_utts: np.ndarray  # int64
    num_frames: np.ndarray  # int64; 0 where unknown
    estimated: np.ndarray  # bool: counts are `utts_per_shard_estimate`
    feat_dim: int | None  # from the index headers, when known
    longest: int  # longest utterance in frames according to the indexes (0 if unknown)

    def __len__(self) -> int:
        return len(self.urls)

    def fingerprint(self) -> str:
        """Identifies the list (recorded in checkpoints to detect a changed trset)."""
        return hashlib.sha256("\n".join(self.urls).encode("utf-8")).hexdigest()[:16]


def load_shard_list(patterns: Sequence[str] | str, utts_per_shard_estimate: int = 0,
                    timeout: float = HTTP_TIMEOUT_SECONDS) -> ShardList:
    """Expand `patterns` and attach per-shard counts from the index files."""
    urls = expand_shard_patterns(patterns)
    indexes: dict[str, tuple[dict[str, Any], dict[str, tuple[int, int, int]]] | None] = {}
    num_utts = np.zeros(len(urls), np.int64)
    num_frames = np.zeros(len(urls), np.int64)
    estimated = np.zeros(len(urls), bool)
    feat_dims: dict[int, str] = {}
    longest = 0
    for position, url in enumerate(urls):
        location = index_location(url)
        if location is not None and location not in indexes:
            indexes[location] = _try_read_index(location, timeout)
        index = indexes.get(location) if location is not None else None
        name = url.rsplit("/", 1)[-1].split()[0] if not url.startswith("pipe:") \
            else _pipe_tar_name(url)
        if index is not None and name in index[1]:
            num_utts[position], num_frames[position], shard_longest = index[1][name]
            longest = max(longest, shard_longest)
            if index[0].get("feat_dim") is not None:
                feat_dims.setdefault(int(index[0]["feat_dim"]), location)
            continue
        if not utts_per_shard_estimate:
            why = (f"{location} does not list it" if index is not None
                   else f"no index found at {location}" if location is not None
                   else "its index.jsonl cannot be located")
            raise FileNotFoundError(f"shard {url}: no utterance count ({why}); give the "
                                    "stage-2 index.jsonl next to the shards or set "
                                    "train.option.utts_per_shard_estimate")
        num_utts[position] = utts_per_shard_estimate
        estimated[position] = True
    if len(feat_dims) > 1:
        detail = ", ".join(f"{dim} in {where}" for dim, where in feat_dims.items())
        raise ValueError(f"shards have different feature dimensions: {detail}")
    if estimated.any():
        logger.warning("%d of %d shards have no index entry; assuming %d utterances each",
                       int(estimated.sum()), len(urls), utts_per_shard_estimate)
    return ShardList(urls, num_utts, num_frames, estimated,
                     next(iter(feat_dims)) if feat_dims else None, longest)


def _pipe_tar_name(url: str) -> str:
    try:
        words = shlex.split(url[len("pipe:"):])
    except ValueError:
        return ""
    tars = [w for w in words if w.endswith(".tar")]
    return tars[-1].rsplit("/", 1)[-1] if tars else ""


def _try_read_index(location: str, timeout: float
                    ) -> tuple[dict[str, Any], dict[str, tuple[int, int, int]]] | None:
    try:
        return read_index_counts(location, timeout)
    except FileNotFoundError:
        return None
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise OSError(f"cannot fetch {location}: {error}") from None
    except urllib.error.URLError as error:
        raise OSError(f"cannot fetch {location}: {error.reason}") from None


def assign_shards(weights: np.ndarray, seed: int, epoch: int, world_size: int,
                  shuffle: bool = True) -> list[np.ndarray]:
    """Shard indices of every rank for `epoch`, in reading order (see the module doc).

    Without `shuffle` (evaluation) shards keep their order and go round-robin.
    """
    if not shuffle:
        return [np.arange(rank, len(weights), world_size) for rank in range(world_size)]
    order = np.random.default_rng([seed, epoch]).permutation(len(weights))
    loads = np.zeros(world_size, np.float64)
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for shard in order:
        rank = int(np.argmin(loads))
        assigned[rank].append(int(shard))
        loads[rank] += max(float(weights[shard]), 1.0)
    return [np.asarray(a, np.int64) for a in assigned]


# --------------------------------------------------------------------------- tar reading


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None:
        data = b""
    if len(data) == size or not data:
        return data
    parts = [data]
    remaining = size - len(data)
    while remaining:
        more = stream.read(remaining)
        if not more:
            break
        parts.append(more)
        remaining -= len(more)
    return b"".join(parts)


def _octal(field: bytes, where: str) -> int:
    if field and field[0] & 0x80:
        # GNU base-256 encoding of large numbers.
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.rstrip(b"\0 ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise CorruptShardError(f"{where}: bad number {field!r} in a tar header") from None


def _pax_records(payload: bytes, where: str) -> dict[str, str]:
    records = {}
    position = 0
    while position < len(payload) and payload[position:position + 1] not in (b"", b"\0"):
        space = payload.find(b" ", position)
        try:
            length = int(payload[position:space])
        except ValueError:
            raise CorruptShardError(f"{where}: bad pax header") from None
        record = payload[space + 1:position + length - 1]
        key, _, value = record.partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        position += length
    return records


class BufferPool:
    """Byte buffers for tar members, handed out again once their sample is collated.

    A shuffle buffer keeps thousands of feature members alive; reading each into fresh
    memory costs the kernel a page fault per 4 KiB whenever the buffer fills anew (every
    epoch when a worker's shards fit in it): measured at a quarter of a worker's time.
    Recycled buffers are already mapped. Sizes are rounded up to one of 16 classes per
    power of two (at most 1/16 wasted), so a freed buffer serves any member of its
    class. Members under `min_bytes` (transcripts) are not pooled. One per thread.
    """

    def __init__(self, min_bytes: int = 1024) -> None:
        self.min_bytes = min_bytes
        self._free: dict[int, list[bytearray]] = collections.defaultdict(list)

    @staticmethod
    def _capacity(size: int) -> int:
        step = 1 << max(0, size.bit_length() - 5)
        return -(-size // step) * step

    def take(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes (its contents are stale)."""
        capacity = self._capacity(size)
        free = self._free.get(capacity)
        return free.pop() if free else bytearray(capacity)

    def give_back(self, buffer: bytearray) -> None:
        """Return a buffer from `take`; nothing may read it any more."""
        self._free[len(buffer)].append(buffer)


def _read_into(stream: BinaryIO, view: memoryview) -> int:
    readinto = getattr(stream, "readinto", None)
    if readinto is None:
        data = _read_exact(stream, len(view))
        view[:len(data)] = data
        return len(data)
    filled = 0
    while filled < len(view):
        count = readinto(view[filled:])
        if not count:
            break
        filled += count
    return filled


def iter_tar_members(stream: BinaryIO, where: str, pool: BufferPool | None = None
                     ) -> Iterator[tuple[str, bytes | memoryview]]:
    """Yield `(name, data)` of the regular files of a tar stream, in order.

    Reads each member with one `read` (the stdlib `tarfile` stream mode copies every
    member through 10 KiB buffers: measured 3.5x slower on 160 KB feature members).
    Handles ustar, pax and GNU long names; header checksums are verified. Truncation
    raises CorruptShardError. With a `pool`, members of at least `pool.min_bytes` are
    read into its buffers and yielded as memoryviews (`data.obj` is the buffer).
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = _read_exact(stream, _BLOCK)
        if not header or header == _ZERO_BLOCK:
            return
        if len(header) < _BLOCK:
            raise CorruptShardError(f"{where}: truncated tar header")
        checksum = _octal(header[148:156], where)
        if checksum != sum(header) - sum(header[148:156]) + 256:
            raise CorruptShardError(f"{where}: tar header checksum mismatch")
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        if header[257:262] == b"ustar" and header[345] != 0:
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
            name = f"{prefix}/{name}"
        size = _octal(header[124:136], where)
        if "size" in pax:
            size = int(pax["size"])
        kind = header[156:157]
        if pool is not None and size >= pool.min_bytes and kind in (b"0", b"\0", b"7"):
            data = memoryview(pool.take(size))[:size]
            received = _read_into(stream, data)
        else:
            data = _read_exact(stream, size)
            received = len(data)
        if received < size:
            raise CorruptShardError(f"{where}: member {name!r} truncated "
                                    f"({received} of {size} bytes)")
        padding = -size % _BLOCK
        if padding and len(_read_exact(stream, padding)) < padding:
            raise CorruptShardError(f"{where}: member {name!r} truncated (padding)")
        if kind == b"x":
            pax = _pax_records(data, where)
            continue
        if kind == b"L":
            long_name = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        if kind in (b"0", b"\0", b"7"):
            yield pax.get("path", long_name or name), data
        # Directories, links and global headers carry no sample data.
        long_name, pax = None, {}


@contextlib.contextmanager
def open_shard(url: str, timeout: float = HTTP_TIMEOUT_SECONDS) -> Iterator[BinaryIO]:
    """A binary stream of a local file, an http(s) URL or a `pipe:` command's stdout.

    A `pipe:` command that exits with an error after its output was read raises OSError.
    """
    if url.startswith(("http://", "https://")):
        try:
            response = urllib.request.urlopen(url, timeout=timeout)
        except urllib.error.URLError as error:
            raise OSError(f"cannot fetch {url}: {getattr(error, 'reason', error)}") from None
        with response:
            yield response
        return
    if url.startswith("pipe:"):
        process = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE,
                                   bufsize=1 << 20)
        finished = False
        try:
            yield process.stdout
            finished = True
        finally:
            if not finished:
                process.kill()
            process.stdout.close()
            status = process.wait()
        if finished and status != 0:
            raise OSError(f"{url}: command exited with status {status}")
        return
    with open(url, "rb") as f:
        yield f


def read_shard(url: str, timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None
               ) -> Iterator[tuple[str, bytes | memoryview]]:
    """Members of one shard, streamed (errors name the shard; `pool`: see iter_tar_members)."""
    with open_shard(url, timeout) as stream:
        yield from iter_tar_members(stream, url, pool)
        if not isinstance(stream, (io.BufferedReader, io.FileIO)):
            # Let pipe commands and servers finish writing the archive's trailing blocks.
            while stream.read(1 << 16):
                pass


class _Abandoned(Exception):
    """Leaves a pre-opened shard stream unread (a `pipe:` command is killed)."""


class _OpenedShard:
    """A shard stream opened ahead of its turn, or the error opening it raised."""

    def __init__(self, url: str, timeout: float) -> None:
        self.stack = contextlib.ExitStack()
        self.stream: BinaryIO | None = None
        self.error: OSError | None = None
        try:
            self.stream = self.stack.enter_context(open_shard(url, timeout))
        except OSError as error:
            self.error = error

    def abandon(self) -> None:
        """Close the stream without reading it."""
        self.stack.__exit__(_Abandoned, _Abandoned(), None)


class ReadAhead:
    """Reads the raw bytes of a list of shards in a background thread, `max_bytes` ahead.

    Iterating yields `("data", shard, chunk)`, then `("end", shard)` after a complete
    shard or `("error", shard, message)` when it cannot be read to its end. The thread
    only reads (in chunks of up to `max_bytes / 4`, at most 4 MiB), so it holds the GIL
    once per chunk; tar parsing stays in the consuming thread (a thread that parsed
    members measured 1.7x slower than no thread at all, from GIL hand-overs). Each shard
    is opened (its request sent, or its command started) while the previous one is read,
    so a request's latency overlaps a transfer instead of adding to it.
    Closing the iterator stops the thread at its next chunk.
    """

    def __init__(self, shards: Sequence[tuple[int, str]], max_bytes: int,
                 timeout: float = HTTP_TIMEOUT_SECONDS) -> None:
        self.shards = list(shards)
        self.max_bytes = max(1, max_bytes)
        self.chunk_bytes = max(_BLOCK, min(4 << 20, self.max_bytes // 4))
        self.timeout = timeout
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._condition = threading.Condition()
        self._stopped = False
        self._done = False
        self._failure: BaseException | None = None

    def _put(self, item: tuple, size: int = 0) -> bool:
        with self._condition:
            while self._bytes >= self.max_bytes and not self._stopped:
                self._condition.wait()
            if self._stopped:
                return False
            self._items.append((item, size))
            self._bytes += size
            self._condition.notify_all()
            return True

    def _read(self, shard: int, opened: _OpenedShard) -> bool:
        if opened.error is not None:
            error = opened.error
            return self._put(("error", shard, f"{type(error).__name__}: {error}"))
        try:
            with opened.stack:
                while chunk := opened.stream.read(self.chunk_bytes):
                    if not self._put(("data", shard, chunk), len(chunk)):
                        return False
        except OSError as error:
            return self._put(("error", shard, f"{type(error).__name__}: {error}"))
        return self._put(("end", shard))

    def _run(self) -> None:
        pending: concurrent.futures.Future | None = None
        opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-open")
        try:
            if self.shards:
                pending = opener.submit(_OpenedShard, self.shards[0][1], self.timeout)
            for position, (shard, _) in enumerate(self.shards):
                opened = pending.result()
                pending = None
                if position + 1 < len(self.shards):
                    pending = opener.submit(_OpenedShard, self.shards[position + 1][1],
                                            self.timeout)
                if not self._read(shard, opened):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._failure = error
        finally:
            if pending is not None:
                pending.add_done_callback(lambda future: future.result().abandon())
            opener.shutdown(wait=False)
            with self._condition:
                self._done = True
                self._condition.notify_all()

    def __iter__(self) -> Iterator[tuple]:
        thread = threading.Thread(target=self._run, name="shard-read-ahead", daemon=True)
        thread.start()
        try:
            while True:
                with self._condition:
                    while not self._items and not self._done:
                        self._condition.wait()
                    if not self._items:
                        break
                    item, size = self._items.popleft()
                    self._bytes -= size
                    self._condition.notify_all()
                yield item
            if self._failure is not None:
                raise self._failure
        finally:
            with self._condition:
                self._stopped = True
                self._items.clear()
                self._condition.notify_all()


class _ChunkStream:
    """File-like reader of one shard's chunks from a `ReadAhead` iterator."""

    def __init__(self, chunks: Iterator[tuple], shard: int) -> None:
        self.chunks = chunks
        self.shard = shard
        self.view = memoryview(b"")
        self.position = 0
        self.finished = False
        self.error: str | None = None

    def _next_chunk(self) -> bool:
        if self.finished:
            return False
        item = next(self.chunks, None)
        if item is None or item[1] != self.shard:
            raise RuntimeError(f"read-ahead out of step at shard {self.shard}: {item!r:.80}")
        if item[0] == "data":
            self.view, self.position = memoryview(item[2]), 0
            return True
        self.finished = True
        if item[0] == "error":
            self.error = item[2]
        return False

    def read(self, size: int) -> bytes:
        parts = []
        while size > 0:
            if self.position >= len(self.view) and not self._next_chunk():
                break
            take = min(size, len(self.view) - self.position)
            parts.append(self.view[self.position:self.position + take])
            self.position += take
            size -= take
        # Copy out of the chunk, so a kept member does not pin a whole chunk in memory.
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    def readinto(self, view: memoryview) -> int:
        filled = 0
        while filled < len(view):
            if self.position >= len(self.view) and not self._next_chunk():
                break
            take = min(len(view) - filled, len(self.view) - self.position)
            view[filled:filled + take] = self.view[self.position:self.position + take]
            self.position += take
            filled += take
        return filled

    def skip_rest(self) -> None:
        while self._next_chunk():
            pass


def advise_read_ahead(path: str, num_bytes: int) -> None:
    """Ask the kernel to read the first `num_bytes` of a local file into the page cache.

    Only a hint, and asynchronous; Linux reads at most the device's read-ahead size per
    call (measured: 8 MB of a 32 MB shard; `read_ahead_kb` is often 128 KB), so the
    pipeline uses `prefetch_file`.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # reported when the shard itself is opened
    try:
        os.posix_fadvise(fd, 0, num_bytes, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):
        pass  # only a hint
    finally:
        os.close(fd)


def prefetch_file(path: str, num_bytes: int) -> None:
    """Read the first `num_bytes` of a local file into the page cache; returns when done.

    The kernel hands the pages to /dev/null (`sendfile`), so nothing is copied into this
    process and the GIL is released for the whole read. Where that is not supported,
    falls back to the `advise_read_ahead` hint.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # reported when the shard itself is opened
    try:
        with open(os.devnull, "wb", buffering=0) as sink:
            offset = 0
            while offset < num_bytes:
                sent = os.sendfile(sink.fileno(), fd, offset, num_bytes - offset)
                if sent <= 0:
                    break
                offset += sent
    except (OSError, AttributeError):
        advise_read_ahead(path, num_bytes)
    finally:
        os.close(fd)


class _Prefetcher:
    """A daemon thread that runs `prefetch_file` on local shards, in the order given."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self._paths: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, path: str) -> None:
        """Queue `path` (its first `num_bytes`) for reading into the page cache."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shard-prefetch",
                                            daemon=True)
            self._thread.start()
        self._paths.put(path)

    def _run(self) -> None:
        while (path := self._paths.get()) is not None and not self._stopped.is_set():
            prefetch_file(path, self.num_bytes)

    def close(self) -> None:
        """Stop after the file being read (queued ones are dropped)."""
        self._stopped.set()
        self._paths.put(None)


def _local_shard_items(shards: Sequence[tuple[int, str]], read_ahead_bytes: int,
                       timeout: float, pool: BufferPool | None) -> Iterator[tuple]:
    # The disk reads the next shard (the first one: alongside) while this one is decoded.
    prefetcher = _Prefetcher(read_ahead_bytes) if read_ahead_bytes > 0 else None
    try:
        for position, (shard, url) in enumerate(shards):
            if prefetcher is not None:
                ahead = shards[position:position + 2] if position == 0 else \
                    shards[position + 1:position + 2]
                for _, path in ahead:
                    if not is_url(path):
                        prefetcher.add(path)
            try:
                for name, data in read_shard(url, timeout, pool):
                    yield ("member", shard, name, data)
            except (OSError, CorruptShardError) as error:
                yield ("error", shard, f"{type(error).__name__}: {error}")
                continue
            yield ("end", shard)
    finally:
        if prefetcher is not None:
            prefetcher.close()


def iter_shard_items(shards: Sequence[tuple[int, str]], read_ahead_bytes: int = 0,
                     timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None
                     ) -> Iterator[tuple]:
    """`("member", shard, name, data)` of each shard in order, then `("end", shard)`, or
    `("error", shard, message)` when a shard breaks off (its members so far are kept).

    Read-ahead (`read_ahead_bytes` > 0): local shards are read in this thread while a
    helper thread reads the next shard into the page cache (`prefetch_file`: the kernel
    alone copies, so the GIL is not contended); when any shard is an http(s) or pipe:
    URL, a `ReadAhead` thread streams the bytes. Measured in page cache: a reading thread
    costs one extra copy per byte (~1.4x slower), so it is kept for remote streams, where
    waiting dominates. `pool`: see `iter_tar_members`.
    """
    if read_ahead_bytes <= 0 or not any(is_url(url) for _, url in shards):
        yield from _local_shard_items(shards, read_ahead_bytes, timeout, pool)
        return
    chunks = iter(ReadAhead(shards, read_ahead_bytes, timeout))
    try:
        for shard, url in shards:
            stream = _ChunkStream(chunks, shard)
            try:
                for name, data in iter_tar_members(stream, url, pool):
                    yield ("member", shard, name, data)
            except CorruptShardError as error:
                stream.skip_rest()
                yield ("error", shard, stream.error or f"CorruptShardError: {error}")
                continue
            stream.skip_rest()
            yield ("error", shard, stream.error) if stream.error else ("end", shard)
    finally:
        chunks.close()


# --------------------------------------------------------------------------- stages


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


def read_samples(shards: Sequence[tuple[int, str]], events: StreamEvents, strict: bool,
                 read_ahead_bytes: int, expected: dict[int, int] | None = None,
                 timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None
                 ) -> Iterator[dict[str, Any]]:
    """Stage 1: `{"key", "shard", "npy", "txt"}` samples of `shards`, read in order.

    `expected` gives the utterances a shard should hold (from the index); a shard that
    ends with fewer is reported corrupt (it was cut at a member boundary). With a `pool`,
    large members are memoryviews on its buffers (see `iter_tar_members`).
    """
    items = iter_shard_items(shards, read_ahead_bytes, timeout, pool)
    urls = dict(shards)
    current: dict[str, Any] = {}
    count = collections.Counter()

    def flush() -> Iterator[dict[str, Any]]:
        if not current:
            return
        sample = dict(current)
        current.clear()
        count[sample["shard"]] += 1
        if sample["key"] is None:
            events.dropped.append((sample["name"], "bad_key", sample["shard"]))
        elif "npy" in sample and "txt" in sample:
            yield sample
        else:
            missing = ".npy" if "npy" not in sample else ".txt"
            events.dropped.append((sample["key"], f"incomplete_sample missing {missing}",
                                   sample["shard"]))

    for item in items:
        kind, shard = item[0], item[1]
        if kind == "member":
            base, _, extension = item[2].rpartition(".")
            if current and (current["name"] != base or current["shard"] != shard):
                yield from flush()
            if not current:
                try:
                    key = decode_key(base)
                except ValueError:
                    key = None
                current.update(name=base, key=key, shard=shard)
            if extension in ("npy", "txt"):
                current[extension] = item[3]
            continue
        yield from flush()
        message = item[2] if kind == "error" else None
        if message is None and expected is not None and count[shard] < expected.get(shard, 0):
            message = (f"ends after {count[shard]} of {expected[shard]} utterances "
                       "listed in its index (truncated?)")
        if message is not None:
            if strict:
                raise CorruptShardError(f"shard {urls[shard]}: {message} "
                                        "(strict_shards is set)")
            logger.warning("skipping the rest of shard %s: %s", urls[shard], message)
            events.corrupt.append((shard, message))
        events.finished.append((shard, count.pop(shard, 0)))


def shuffle_samples(samples: Iterable[dict[str, Any]], size: int,
                    rng: random.Random) -> Iterator[dict[str, Any]]:
    """Stage 3: a buffer of `size` samples; each new sample replaces a random one."""
    if size <= 1:
        yield from samples
        return
    buffer: list[dict[str, Any]] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        position = rng.randrange(size)
        buffer[position], sample = sample, buffer[position]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def _judge(sample: dict[str, Any], feat_dim: int, feat_dim_source: str,
           urls: Sequence[str], encode: Callable[[str], list[int]],
           length_filter: LengthFilter | None) -> None:
    """Decode, tokenize and filter one sample in place; a verdict goes under `drop` or
    `error`, and the first failed check decides it."""
    data = sample.pop("npy")
    if isinstance(data, memoryview):
        sample["buffer"] = data.obj
    try:
        features = decode_npy(data)
    except (ValueError, KeyError) as error:
        sample["drop"] = f"corrupt_features {error}"
        return
    if features.shape[1] != feat_dim:
        sample["error"] = (f"shard {urls[sample['shard']]}: utterance {sample['key']!r} has "
                           f"{features.shape[1]}-dim features, but {feat_dim_source} is "
                           f"{feat_dim}")
        return
    sample["features"] = features
    try:
        text = str(sample.pop("txt"), "utf-8")
    except UnicodeDecodeError as error:
        sample["drop"] = f"bad_text {error}"
        return
    if not text.strip():
        sample["error"] = (f"shard {urls[sample['shard']]}: utterance {sample['key']!r} has "
                           "an empty transcript")
        return
    ids = encode(text)
    if not ids:
        sample["drop"] = "no_tokens"
        return
    sample["label"] = label = np.asarray(ids, np.int32)
    if length_filter is not None:
        reason = length_filter.reason(len(features), label)
        if reason:
            sample["drop"] = reason


def prepare_samples(samples: Iterable[dict[str, Any]], feat_dim: int, feat_dim_source: str,
                    urls: Sequence[str], encode: Callable[[str], list[int]],
                    length_filter: LengthFilter | None) -> Iterator[dict[str, Any]]:
    """Stage 2: decode `npy` into `features` [T, D] (a view on the bytes; a pooled buffer
    under them is kept as `buffer`), tokenize `txt` into `label` ids (int32), and apply
    `LengthFilter`, as each sample is read.

    Done before the shuffle buffer, this work overlaps reading: while the buffer fills,
    storage is the limit (cold disk, network), and the buffer then empties faster.
    Nothing is reported here: a sample to leave out carries `drop` (its reason), one that
    is an error carries `error` (its message), and `settle_samples` acts on them where
    the sample leaves the shuffle buffer, so events and errors keep their place in the
    stream. Errors: features whose dimension differs from `feat_dim`, an empty transcript.
    """
    for sample in samples:
        _judge(sample, feat_dim, feat_dim_source, urls, encode, length_filter)
        yield sample


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


def batch_by_frames(samples: Iterable[dict[str, Any]], sort_buffer: int, batch_size: int,
                    max_frames: int, rng: random.Random | None
                    ) -> Iterator[list[dict[str, Any]]]:
    """Stage 5: sort `sort_buffer` samples by length and cut them into batches.

    The last (longest, possibly partial) batch of a buffer waits for the next buffer;
    batches of one buffer are emitted in random order when `rng` is given.
    """
    buffer: list[dict[str, Any]] = []

    def cut(final: bool) -> Iterator[list[dict[str, Any]]]:
        buffer.sort(key=lambda s: len(s["features"]))
        lengths = np.fromiter((len(s["features"]) for s in buffer), np.int64, len(buffer))
        batches = form_batches(lengths, np.arange(len(buffer)), batch_size, max_frames)
        keep = [] if final else list(batches.pop())
        if rng is not None:
            rng.shuffle(batches)
        emitted = [[buffer[i] for i in batch] for batch in batches]
        buffer[:] = [buffer[i] for i in keep]
        yield from emitted

    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= sort_buffer:
            yield from cut(final=False)
    if buffer:
        yield from cut(final=True)


def collate_batches(groups: Iterable[list[dict[str, Any]]], events: StreamEvents,
                    feat_dim: int, pool: BufferPool | None = None,
                    collate_fn: Callable[..., Any] = collate) -> Iterator[Any]:
    """Stage 6: padding collate; events so far ride along; a final batch flushes them.

    The batch holds copies, so the samples' pooled buffers go back to `pool` here.
    `collate_fn(utterances, events)` may be a `cat.shared.transport.SharedCollate`.
    """
    for group in groups:
        utterances = [Utterance(s["key"], s["features"], s["label"], s["shard"]) for s in group]
        batch = collate_fn(utterances, events.drain() if events else None)
        if pool is not None:
            for sample in group:
                if "buffer" in sample:
                    pool.give_back(sample["buffer"])
        yield batch
    if events:
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
        # [epoch, skip flag of every shard], shared with worker processes.
        self._control = torch.zeros(1 + len(shards), dtype=torch.int64).share_memory_()
        self._control[0] = 1
        self._tokenizer = None
        self._pool: tuple[int, BufferPool] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        state["_pool"] = None
        return state

    def set_epoch(self, epoch: int, skip: Iterable[int] = ()) -> None:
        """Select the epoch (its shard order) and shards to leave out (already consumed)."""
        self._control.zero_()
        self._control[0] = epoch
        skip = list(skip)
        if skip:
            self._control[1 + np.asarray(skip, np.int64)] = 1

    @property
    def epoch(self) -> int:
        """The epoch `set_epoch` selected."""
        return int(self._control[0])

    def weights(self) -> np.ndarray:
        """Work per shard for rank balancing: frames when batches are frame-bounded."""
        if self.config.max_frames and not self.shards.estimated.any():
            return self.shards.num_frames
        return self.shards.num_utts

    def rank_shards(self, epoch: int, rank: int | None = None) -> np.ndarray:
        """All shards of `rank` (default: this one) in `epoch`, in reading order."""
        plan = assign_shards(self.weights(), self.config.seed, epoch, self.world_size,
                             self.config.train)
        return plan[self.rank if rank is None else rank]

    def worker_shards(self, epoch: int, worker: int, num_workers: int) -> list[int]:
        """Shards a worker reads: its round-robin share, minus the skipped ones."""
        skip = self._control[1:].numpy()
        return [int(s) for s in self.rank_shards(epoch)[worker::num_workers] if not skip[s]]

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
        """The stages of one worker for one epoch."""
        config = self.config
        shards = self.worker_shards(epoch, worker, num_workers)
        rng = random.Random(f"{config.seed}/{epoch}/{self.rank}/{worker}")
        events = StreamEvents()
        urls = self.shards.urls
        expected = {s: int(self.shards.num_utts[s]) for s in shards
                    if not self.shards.estimated[s]}
        pool = self._buffer_pool()
        stream: Iterable[Any] = read_samples([(s, urls[s]) for s in shards], events,
                                             config.strict_shards, config.read_ahead_mb << 20,
                                             expected, config.timeout, pool)
        stream = prepare_samples(stream, self.feat_dim, self.feat_dim_source, urls,
                                 self._encode(), self.length_filter if config.train else None)
        if config.train:
            stream = shuffle_samples(stream, config.shuffle_buffer, rng)
        stream = settle_samples(stream, events, pool)
        stream = batch_by_frames(stream, config.sort_buffer, config.batch_size,
                                 config.max_frames, rng if config.train else None)
        return collate_batches(stream, events, self.feat_dim, pool, self.collate_fn)


# --------------------------------------------------------------------------- accounting


@dataclasses.dataclass
class _ShardTally:
    trained: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    read: int | None = None  # utterances read, known once the shard ended

    @property
    def seen(self) -> int:
        return self.trained + sum(self.dropped.values())


class StreamProgress:
    """One rank's accounting of a streaming epoch (runs in the training process).

    `restore(state)` continues from a checkpoint: consumed shards are skipped, their
    totals kept; partially consumed shards start over and are counted as re-read.
    """

    def __init__(self, shards: ShardList, rank_shards: np.ndarray) -> None:
        self.shards = shards
        self.rank_shards = [int(s) for s in rank_shards]
        self.consumed: list[int] = []
        self.active: dict[int, _ShardTally] = {}
        self.done = {"trained": 0, "dropped": collections.Counter(), "corrupt_missing": 0}
        self.corrupt: list[tuple[int, str]] = []
        self.reread_shards = 0
        self.retrained = 0
        self.drop_lines: list[str] = []

    def _tally(self, shard: int) -> _ShardTally:
        tally = self.active.get(shard)
        if tally is None:
            tally = self.active[shard] = _ShardTally()
        return tally

    def update(self, batch: Batch, trained: bool) -> None:
        """Account for a batch: its utterances if `trained`, its events always.

        Drop lines (`<utt> <reason> [detail]`) collect in `drop_lines` for the caller.
        """
        if trained and len(batch):
            for shard, count in zip(*np.unique(batch.shards, return_counts=True), strict=True):
                self._tally(int(shard)).trained += int(count)
        events = batch.events or StreamEvents()
        for key, reason, shard in events.dropped:
            self._tally(shard).dropped[reason.split(" ", 1)[0]] += 1
            self.drop_lines.append(f"{key} {reason}")
        for shard, message in events.corrupt:
            self.corrupt.append((shard, message))
        for shard, count in events.finished:
            self._tally(shard).read = count
        self._fold()

    def _fold(self) -> None:
        for shard in [s for s, t in self.active.items() if t.read is not None
                      and t.seen >= t.read]:
            tally = self.active.pop(shard)
            self.consumed.append(shard)
            self.done["trained"] += tally.trained
            self.done["dropped"].update(tally.dropped)
            if not self.shards.estimated[shard]:
                self.done["corrupt_missing"] += max(0, int(self.shards.num_utts[shard])
                                                    - tally.read)

    def state(self) -> dict[str, Any]:
        """Checkpoint state: consumed shards, their totals and the partial shards."""
        return {"consumed": list(self.consumed), "trained": self.done["trained"],
                "dropped": dict(self.done["dropped"]),
                "corrupt_missing": self.done["corrupt_missing"],
                "corrupt": [[s, m] for s, m in self.corrupt],
                "partial": [[s, t.trained] for s, t in self.active.items() if t.seen]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after `state()`; partial shards will be read again from their start."""
        self.consumed = [int(s) for s in state["consumed"]]
        self.done = {"trained": int(state["trained"]),
                     "dropped": collections.Counter(state["dropped"]),
                     "corrupt_missing": int(state["corrupt_missing"])}
        self.corrupt = [(int(s), str(m)) for s, m in state["corrupt"]]
        self.reread_shards = len(state["partial"])
        self.retrained = sum(int(n) for _, n in state["partial"])

    def summary(self) -> dict[str, Any]:
        """Counts of the epoch so far (per rank)."""
        dropped = collections.Counter(self.done["dropped"])
        trained = self.done["trained"]
        for tally in self.active.values():
            dropped.update(tally.dropped)
            trained += tally.trained
        expected = None
        if not self.shards.estimated[self.rank_shards].any():
            expected = int(self.shards.num_utts[self.rank_shards].sum())
        not_trained = None
        if expected is not None:
            not_trained = max(0, expected - trained - sum(dropped.values())
                              - self.done["corrupt_missing"])
        consumed = set(self.consumed)
        unconsumed = [s for s in self.rank_shards if s not in consumed]
        return {"expected": expected, "trained": trained, "dropped": dict(dropped),
                "corrupt_missing": self.done["corrupt_missing"],
                "corrupt_shards": [self.shards.urls[s] for s, _ in self.corrupt],
                "not_trained": not_trained,
                "unconsumed_shards": len(unconsumed), "shards": len(self.rank_shards),
                "reread_shards": self.reread_shards, "retrained": self.retrained}
