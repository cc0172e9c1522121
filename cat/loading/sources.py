"""Where shards come from: local files, http(s) URLs, stores (`s3://`, `gs://`, ...:
`cat.storage.stores`), `pipe:` commands; storage errors.

`open_shard` opens a shard as a binary stream; `read_shard` streams its members. An
HTTP body that ends early raises `StorageError` instead of looking like a truncated tar.

Storage errors are not corrupt data: `classify` tells a transient storage error (a
refused or reset connection, a timeout, HTTP 5xx or 429, a failed `pipe:` command,
other I/O errors), worth retrying, from a shard that is not there (a missing file,
HTTP 4xx) and from corrupt data (`CorruptShardError`: a malformed or truncated tar).

Usage:
    for name, data in read_shard("https://host/wds/data-00000.tar", timeout=30): ...
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import io
import logging
import subprocess
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import BinaryIO

from zlib_ng.zlib_ng import crc32

from cat.audio.codec import AudioDecodeError, decode, encode
from cat.features.extract import segment_span
from cat.features.plan import DEFAULT_MAX_OVERSHOOT
from cat.formats.data_list import DataListError, RawEntry, read_raw_entries
from cat.formats.shard_format import HTTP_TIMEOUT_SECONDS, encode_key
from cat.loading.gunzip import tar_stream
from cat.loading.shardlist import RAW_LIST, raw_list_part
from cat.loading.tar import (
    BufferPool,
    CorruptShardError,
    MemberFilter,
    bytes_left,
    iter_tar_members,
)
from cat.storage.stores import StoreError, is_store_url, store_for

logger = logging.getLogger(__name__)


class StorageError(OSError):
    """A shard could not be read from its storage; `transient` when worth retrying."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient
#: Causes of a shard that could not be read to its end (`classify`).
TRANSIENT, UNAVAILABLE, CORRUPT = "transient", "unavailable", "corrupt"
_PERMANENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR}


def classify(error: BaseException) -> str:
    """`TRANSIENT`, `UNAVAILABLE` or `CORRUPT` (see the module docstring)."""
    if isinstance(error, CorruptShardError):
        return CORRUPT
    if isinstance(error, (StorageError, StoreError)):
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


@contextlib.contextmanager
def open_shard(url: str, timeout: float = HTTP_TIMEOUT_SECONDS) -> Iterator[BinaryIO]:
    """A binary stream of a local file, an http(s) URL, a store object (`s3://`, `gs://`,
    `memory://`...: `cat.storage.stores`), a `pipe:` command's stdout, or the entries of
    a raw `data.list` as a tar (`raw_list_tar`). Compressed shards come as they are
    stored (`read_shard` decompresses them).

    A `pipe:` command that exits with an error after its output was read raises OSError.
    """
    if is_store_url(url):
        # One attempt: the reader retries (cat.loading.reader), the store must not as well.
        with io.BufferedReader(store_for(url, timeout, 1).open(url), 1 << 20) as stream:
            yield stream
        return
    if url.startswith(RAW_LIST):
        yield raw_list_tar(url)
        return
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
        # A shell command line, as webdataset runs it: trset is trusted input (README).
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


def raw_list_tar(url: str) -> io.BytesIO:
    """The entries of a raw `data.list` part (`cat.loading.shardlist.read_data_list`) as
    an in-memory tar of `<key>.<ext>` audio and `<key>.txt` members, keys escaped like the
    packer's: a whole file's bytes as they are, or an entry's `start`-`end` piece cut as
    stage 1 cuts segments and stored as 16-bit WAV. An entry whose audio cannot be read
    or cut gets no audio member (a warning says why), so the loader counts it as
    incomplete."""
    offset, count, path = raw_list_part(url)
    try:
        entries = read_raw_entries(path, offset, count)
    except (DataListError, OSError) as error:
        raise StorageError(str(error), False) from None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for entry in entries:
            name = encode_key(entry.key)
            try:
                extension, data = _raw_audio(entry)
            except (OSError, AudioDecodeError, ValueError) as error:
                logger.warning("%s: %s: cannot read %s: %s", entry.where, entry.key,
                               entry.wav, error)
            else:
                _add_bytes(tar, f"{name}.{extension}", data)
            _add_bytes(tar, f"{name}.txt", (entry.txt or "").encode("utf-8"))
    buffer.seek(0)
    return buffer


def _raw_audio(entry: RawEntry) -> tuple[str, bytes]:
    """(extension, bytes) of a raw entry's audio: the file, or its piece as WAV."""
    with open(entry.wav, "rb") as f:
        data = f.read()
    if entry.start == 0.0 and entry.end == -1.0:
        return entry.wav.rpartition(".")[2].lower(), data
    waveform, rate = decode(data, entry.wav)
    span = segment_span(entry.start, entry.end, len(waveform), rate, DEFAULT_MAX_OVERSHOOT)
    if isinstance(span, str):
        raise ValueError(span)
    return "wav", encode(waveform[span[0]:span[1]], rate, "wav")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def read_shard(url: str, timeout: float = HTTP_TIMEOUT_SECONDS, pool: BufferPool | None = None,
               keep: MemberFilter | None = None
               ) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """Members of one shard, streamed (errors name the shard; `pool`, `keep`: see
    iter_tar_members); gzip-compressed shards decompressed (`cat.loading.gunzip`)."""
    with open_shard(url, timeout) as stream:
        yield from iter_tar_members(tar_stream(stream, url), url, pool, keep)
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


class ChecksumReader:
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

    def bytes_left(self) -> int | None:
        """What the wrapped stream can still give (`cat.loading.tar.bytes_left`)."""
        return bytes_left(self.stream)

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
