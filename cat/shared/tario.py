"""Reading tar shards: a minimal streaming tar reader, local/http(s)/pipe: sources, read-ahead.

* `iter_tar_members` yields the regular files of a tar stream in order, each read with
  one call into a recycled buffer (`BufferPool`); `keep` lets a caller skip members
  without reading their data (a seek on local files), which is how an exact resume
  passes over the utterances of a shard that were already taken.
* `open_shard` opens a local file, an http(s) URL or a `pipe:` command's stdout.
* `iter_shard_items` streams the members of a list of shards in order with read-ahead
  across shard boundaries: for local shards a helper thread has the kernel read the next
  shard into the page cache (`prefetch_file`); for http(s)/pipe: shards a background
  thread (`ReadAhead`) streams the bytes and opens each shard while the previous one is
  read. A shard read to its end comes with the CRC-32 of its bytes (`zlib-ng`, about
  18 GB/s), which the loader compares with the index.

Storage errors are not corrupt data: `classify` tells a transient storage error (a
refused or reset connection, a timeout, HTTP 5xx or 429, a failed `pipe:` command,
other I/O errors), worth retrying, from a shard that is not there (a missing file,
HTTP 4xx) and from corrupt data (`CorruptShardError`: a malformed or truncated tar).

Usage:
    for kind, shard, *rest in iter_shard_items([(0, "data/wds/train/data-00000.tar")]):
        ...
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import http.client
import io
import os
import queue
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import BinaryIO

from zlib_ng.zlib_ng import crc32

from cat.shared.shardlist import HTTP_TIMEOUT_SECONDS, is_url

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)


class CorruptShardError(ValueError):
    """A shard's tar data is truncated or malformed; the message names the shard."""


class StorageError(OSError):
    """A shard could not be read from its storage; `transient` when worth retrying."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


#: `keep(member name) -> bool`, asked before a member's data is read (see iter_tar_members).
MemberFilter = Callable[[str], bool]
#: Causes of a shard that could not be read to its end (`classify`).
TRANSIENT, UNAVAILABLE, CORRUPT = "transient", "unavailable", "corrupt"
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR}


def classify(error: BaseException) -> str:
    """`TRANSIENT`, `UNAVAILABLE` or `CORRUPT` (see the module docstring)."""
    if isinstance(error, CorruptShardError):
        return CORRUPT
    if isinstance(error, StorageError):
        return TRANSIENT if error.transient else UNAVAILABLE
    if isinstance(error, urllib.error.HTTPError):
        return TRANSIENT if error.code >= 500 or error.code == 429 else UNAVAILABLE
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, BaseException):
        return classify(error.reason)
    if isinstance(error, (http.client.HTTPException, ConnectionError, TimeoutError)):
        return TRANSIENT
    if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS:
        return UNAVAILABLE
    return TRANSIENT


def describe(error: BaseException) -> str:
    """`Type: message` of an error (the reason of a URL error; a StorageError's message)."""
    if isinstance(error, StorageError):
        return str(error)
    if isinstance(error, urllib.error.URLError) and not isinstance(error,
                                                                   urllib.error.HTTPError):
        return f"{type(error.reason).__name__}: {error.reason}"
    return f"{type(error).__name__}: {error}"


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


def _skip(stream: BinaryIO, size: int, where: str, name: str) -> None:
    """Pass over `size` bytes: a seek on files, reads elsewhere (streams cannot seek)."""
    seekable = getattr(stream, "seekable", None)
    if seekable is not None and seekable():
        stream.seek(size, io.SEEK_CUR)  # truncation shows at the next header
        return
    while size > 0:
        chunk = stream.read(min(size, 1 << 20))
        if not chunk:
            raise CorruptShardError(f"{where}: member {name!r} truncated")
        size -= len(chunk)


def iter_tar_members(stream: BinaryIO, where: str, pool: BufferPool | None = None,
                     keep: MemberFilter | None = None
                     ) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """Yield `(name, data)` of the regular files of a tar stream, in order.

    Reads each member with one `read` (the stdlib `tarfile` stream mode copies every
    member through 10 KiB buffers: measured 3.5x slower on 160 KB feature members).
    Handles ustar, pax and GNU long names; header checksums are verified. Truncation
    raises CorruptShardError. With a `pool`, members of at least `pool.min_bytes` are
    read into its buffers and yielded as memoryviews (`data.obj` is the buffer). A member
    whose name `keep` rejects is passed over unread and yielded with `data` None.
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
        padding = -size % _BLOCK
        regular = kind in (b"0", b"\0", b"7")
        if regular:
            name = pax.get("path", long_name or name)
            long_name, pax = None, {}
            if keep is not None and not keep(name):
                _skip(stream, size + padding, where, name)
                yield name, None
                continue
        if pool is not None and size >= pool.min_bytes and regular:
            data = memoryview(pool.take(size))[:size]
            received = _read_into(stream, data)
        else:
            data = _read_exact(stream, size)
            received = len(data)
        if received < size:
            raise CorruptShardError(f"{where}: member {name!r} truncated "
                                    f"({received} of {size} bytes)")
        if padding and len(_read_exact(stream, padding)) < padding:
            raise CorruptShardError(f"{where}: member {name!r} truncated (padding)")
        if kind == b"x":
            pax = _pax_records(data, where)
        elif kind == b"L":
            long_name = data.rstrip(b"\0").decode("utf-8", "replace")
        elif regular:
            yield name, data
        else:
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
        except (urllib.error.URLError, http.client.HTTPException, OSError) as error:
            raise StorageError(f"cannot fetch it: {describe(error)}",
                               classify(error) == TRANSIENT) from None
        with response:
            yield _HttpBody(response)
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
            raise StorageError(f"the command exited with status {status}", True)
        return
    with open(url, "rb") as f:
        yield f


def read_shard(url: str, timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None,
               keep: MemberFilter | None = None
               ) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """Members of one shard, streamed (errors name the shard; `pool`, `keep`: see
    iter_tar_members)."""
    with open_shard(url, timeout) as stream:
        yield from iter_tar_members(stream, url, pool, keep)
        if not isinstance(stream, (io.BufferedReader, io.FileIO)):
            # Let pipe commands and servers finish writing the archive's trailing blocks.
            while stream.read(1 << 16):
                pass


class _HttpBody:
    """An HTTP response body whose early end (a closed connection) raises StorageError
    instead of looking like the end of the data (which would read as a truncated tar)."""

    def __init__(self, response: http.client.HTTPResponse) -> None:
        self.response = response

    def _check(self, count: int, wanted: int) -> None:
        left = getattr(self.response, "length", None)
        if wanted and not count and left:
            raise StorageError(f"the connection closed {left} bytes before the end", True)

    def read(self, size: int = -1) -> bytes:
        data = self.response.read(size)
        self._check(len(data), size)
        return data

    def readinto(self, view: memoryview) -> int:
        count = self.response.readinto(view)
        self._check(count, len(view))
        return count


class _Checksummed:
    """A binary stream that keeps the CRC-32 of the bytes read through it; a seek (members
    passed over) makes it unknown (None)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.checksum: int | None = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        if self.checksum is not None:
            self.checksum = crc32(data, self.checksum)
        return data

    def readinto(self, view: memoryview) -> int:
        readinto = getattr(self.stream, "readinto", None)
        if readinto is None:
            data = self.read(len(view))
            view[:len(data)] = data
            return len(data)
        count = readinto(view)
        if self.checksum is not None and count:
            self.checksum = crc32(view[:count], self.checksum)
        return count

    def seekable(self) -> bool:
        seekable = getattr(self.stream, "seekable", None)
        return bool(seekable and seekable())

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.checksum = None
        return self.stream.seek(offset, whence)

    def finish(self) -> int | None:
        """Read what is left (the archive's trailing blocks); the checksum of it all."""
        while self.read(1 << 16):
            pass
        return self.checksum


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


class ReadAhead:
    """Reads the raw bytes of a list of shards in a background thread, `max_bytes` ahead.

    Iterating yields `("data", shard, chunk)`, then `("end", shard, crc32)` after a
    complete shard or `("error", shard, message, cause)` (`classify`) when it cannot be
    read to its end. The thread
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
                       keep: Mapping[int, MemberFilter]) -> Iterator[tuple]:
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
                    stream = _Checksummed(raw)
                    for name, data in iter_tar_members(stream, url, pool, keep.get(shard)):
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
                     keep: Mapping[int, MemberFilter] | None = None) -> Iterator[tuple]:
    """`("member", shard, name, data)` of each shard in order, then `("end", shard,
    crc32)` (None when members were passed over by seeking), or `("error", shard,
    message, cause)` (`classify`) when a shard breaks off (its members so far are kept).

    Read-ahead (`read_ahead_bytes` > 0): local shards are read in this thread while a
    helper thread reads the next shard into the page cache (`prefetch_file`: the kernel
    alone copies, so the GIL is not contended); when any shard is an http(s) or pipe:
    URL, a `ReadAhead` thread streams the bytes. Measured in page cache: a reading thread
    costs one extra copy per byte (~1.4x slower), so it is kept for remote streams, where
    waiting dominates. `pool`, and `keep` (a member filter per shard): see
    `iter_tar_members`.
    """
    keep = keep or {}
    if read_ahead_bytes <= 0 or not any(is_url(url) for _, url in shards):
        yield from _local_shard_items(shards, read_ahead_bytes, timeout, pool, keep)
        return
    chunks = iter(ReadAhead(shards, read_ahead_bytes, timeout))
    try:
        for shard, url in shards:
            stream = _ChunkStream(chunks, shard)
            try:
                for name, data in iter_tar_members(stream, url, pool, keep.get(shard)):
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


