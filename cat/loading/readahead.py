"""Reading a worker's shards in order, with read-ahead across shard boundaries.

`iter_shard_items` streams the members of a list of shards: for local shards a helper
thread has the kernel read the next shard into the page cache (`prefetch_file`); for
http(s)/pipe: shards a background thread (`ReadAhead`) streams the bytes and opens each
shard while the previous one is read. A shard read to its end comes with the CRC-32 of
its bytes (`zlib-ng`), which the loader compares with the index; a shard
that breaks off comes with the cause of the error (`cat.loading.sources.classify`).

Usage:
    for kind, shard, *rest in iter_shard_items([(0, "data/wds/train/data-00000.tar")]):
        ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import http.client
import os
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO

from zlib_ng.zlib_ng import crc32

from cat.formats.shard_format import HTTP_TIMEOUT_SECONDS
from cat.loading.gunzip import tar_stream
from cat.loading.shardlist import is_url
from cat.loading.sources import CORRUPT, ChecksumReader, classify, describe, open_shard
from cat.loading.tar import (
    TAR_BLOCK,
    UNINDEXED_MEMBER_LIMIT,
    BufferPool,
    CorruptShardError,
    MemberFilter,
    iter_tar_members,
)


class _Abandoned(Exception):
    """Leaves a pre-opened shard stream unread (a `pipe:` command is killed)."""


class _OpenedShard:
    """A shard stream opened ahead of its turn, or the error opening it raised."""

    def __init__(self, url: str, timeout: float) -> None:
        self.stack = contextlib.ExitStack()
        self.stream: BinaryIO | None = None
        self.error: BaseException | None = None
        try:
            self.stream = self.stack.enter_context(open_shard(url, timeout))
        except (OSError, http.client.HTTPException) as error:
            self.error = error

    def abandon(self) -> None:
        """Close the stream without reading it."""
        self.stack.__exit__(_Abandoned, _Abandoned(), None)


def _open_in_background(url: str, timeout: float) -> concurrent.futures.Future:
    """`_OpenedShard(url, timeout)`, made in a daemon thread of its own.

    Not in a thread pool: the interpreter joins pool threads at exit, and an open blocked
    on a hung store (botocore retrying, a socket waiting for its timeout) would hold the
    process that long after its error was reported.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(_OpenedShard(url, timeout))
        except BaseException as error:  # handed to the reader, which re-raises it
            future.set_exception(error)

    threading.Thread(target=run, name="shard-open", daemon=True).start()
    return future


class ReadAhead:
    """Reads the raw bytes of a list of shards in a background thread, `max_bytes` ahead.

    Iterating yields `("data", shard, chunk)`, then `("end", shard, crc32)` after a
    complete shard or `("error", shard, message, cause)` (`classify`) when it cannot be
    read to its end. The thread
    only reads (in chunks of up to `max_bytes / 4`, at most 4 MiB), so it holds the GIL
    once per chunk; tar parsing stays in the consuming thread (a thread that parsed
    members measured slower than no thread at all, from GIL hand-overs). Each shard
    is opened (its request sent, or its command started) while the previous one is read,
    so a request's latency overlaps a transfer instead of adding to it.
    Closing the iterator stops the thread at its next chunk.
    """

    def __init__(self, shards: Sequence[tuple[int, str]], max_bytes: int,
                 timeout: float = HTTP_TIMEOUT_SECONDS) -> None:
        self.shards = list(shards)
        self.max_bytes = max(1, max_bytes)
        self.chunk_bytes = max(TAR_BLOCK, min(4 << 20, self.max_bytes // 4))
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
            return self._put(("error", shard, describe(error), classify(error)))
        checksum = 0
        try:
            with opened.stack:
                while chunk := opened.stream.read(self.chunk_bytes):
                    checksum = crc32(chunk, checksum)
                    if not self._put(("data", shard, chunk), len(chunk)):
                        return False
        except (OSError, http.client.HTTPException) as error:
            return self._put(("error", shard, describe(error), classify(error)))
        return self._put(("end", shard, checksum))

    def _run(self) -> None:
        pending: concurrent.futures.Future | None = None
        try:
            if self.shards:
                pending = _open_in_background(self.shards[0][1], self.timeout)
            for position, (shard, _) in enumerate(self.shards):
                opened = pending.result()
                pending = None
                if position + 1 < len(self.shards):
                    pending = _open_in_background(self.shards[position + 1][1], self.timeout)
                if not self._read(shard, opened):
                    return
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._failure = error
        finally:
            if pending is not None:
                pending.add_done_callback(lambda future: future.result().abandon())
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
        self.error: tuple[str, str] | None = None  # (message, cause)
        self.checksum: int | None = None

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
            self.error = (item[2], item[3])
        else:
            self.checksum = item[2]
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
                       timeout: float, pool: BufferPool | None,
                       keep: Mapping[int, MemberFilter], limits: Mapping[int, int],
                       caps: Mapping[str, int] | None) -> Iterator[tuple]:
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
                with open_shard(url, timeout) as raw:
                    stream = ChecksumReader(raw)
                    for name, data in iter_tar_members(
                            tar_stream(stream, url), url, pool, keep.get(shard),
                            limits.get(shard, UNINDEXED_MEMBER_LIMIT), caps):
                        yield ("member", shard, name, data)
                    checksum = stream.finish()
            except (OSError, http.client.HTTPException, CorruptShardError) as error:
                yield ("error", shard, describe(error), classify(error))
                continue
            yield ("end", shard, checksum)
    finally:
        if prefetcher is not None:
            prefetcher.close()


def iter_shard_items(shards: Sequence[tuple[int, str]], read_ahead_bytes: int = 0,
                     timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None,
                     keep: Mapping[int, MemberFilter] | None = None,
                     limits: Mapping[int, int] | None = None,
                     caps: Mapping[str, int] | None = None) -> Iterator[tuple]:
    """`("member", shard, name, data)` of each shard in order, then `("end", shard,
    crc32)` (None when members were passed over by seeking), or `("error", shard,
    message, cause)` (`classify`) when a shard breaks off (its members so far are kept).

    Read-ahead (`read_ahead_bytes` > 0): local shards are read in this thread while a
    helper thread reads the next shard into the page cache (`prefetch_file`: the kernel
    alone copies, so the GIL is not contended); when any shard is an http(s) or pipe:
    URL, a `ReadAhead` thread streams the bytes. Measured in page cache: a reading thread
    costs one extra copy per byte, which made it slower, so it is kept for remote streams,
    where waiting dominates. `pool`, and `keep` (a member filter per shard): see
    `iter_tar_members`; `limits`: the most bytes a member of each shard may claim (its
    size from the index; `UNINDEXED_MEMBER_LIMIT` for shards not given); `caps`: the most
    bytes a member of each extension may take, larger ones passed over unread and given
    as an `OversizedMember` (see `iter_tar_members`).
    """
    keep = keep or {}
    limits = limits or {}
    if read_ahead_bytes <= 0 or not any(is_url(url) for _, url in shards):
        yield from _local_shard_items(shards, read_ahead_bytes, timeout, pool, keep, limits,
                                      caps)
        return
    chunks = iter(ReadAhead(shards, read_ahead_bytes, timeout))
    try:
        for shard, url in shards:
            stream = _ChunkStream(chunks, shard)
            try:
                for name, data in iter_tar_members(tar_stream(stream, url), url, pool,
                                                   keep.get(shard),
                                                   limits.get(shard, UNINDEXED_MEMBER_LIMIT),
                                                   caps):
                    yield ("member", shard, name, data)
            except CorruptShardError as error:
                stream.skip_rest()
                yield ("error", shard, *(stream.error or (describe(error), CORRUPT)))
                continue
            stream.skip_rest()
            yield ("error", shard, *stream.error) if stream.error else \
                ("end", shard, stream.checksum)
    finally:
        chunks.close()
