"""Gzip-compressed tar shards (`.tar.gz`, `.tgz`, as WeNet's tools can write them), read
with on-the-fly decompression.

`GunzipReader` turns the stream of a compressed shard (a file, an HTTP body, a store
object, read-ahead chunks) into the stream of its tar, which `cat.loading.tar` reads as
it reads plain shards; concatenated gzip members are read one after the other. Damaged
or truncated compressed data raises `CorruptShardError`; errors of the underlying
stream (storage errors) pass through as they are. The CRC-32 the index holds is that of
the compressed file, so the loader checks it on the bytes as stored.

Inflating is bounded: at most `_MAX_OUTPUT` bytes per step, however well the data
compresses, and at most `MAX_EXPANSION` times the compressed bytes read so far once
`EXPANSION_ALLOWANCE` bytes came out: a gzip bomb (a member of zeros inflating 1000
times) is a corrupt shard after `EXPANSION_ALLOWANCE` bytes, not hours of inflating.
Shards of speech barely compress (audio and features: under 2 times; a tar header with
a short transcript: about 15). `bytes_left` bounds what the stream can still give (for
`cat.loading.tar`, which checks a member's size against it before allocating).

A compressed stream cannot seek: passing over members (an exact resume continuing after
the utterances a shard already gave) decompresses them, from the shard's start.

Usage:
    with open("shards/shards_000000000.tar.gz", "rb") as f:
        for name, data in iter_tar_members(tar_stream(f, f.name), f.name): ...
"""

from __future__ import annotations

from typing import BinaryIO

from zlib_ng import zlib_ng

from cat.loading.shardlist import GZIP_SUFFIXES, shard_name
from cat.loading.tar import CorruptShardError, bytes_left

# Compressed bytes read per call: audio barely compresses, so about as much comes out.
_CHUNK = 1 << 18
_GZIP_WINDOW = 16 + zlib_ng.MAX_WBITS
# At most this much decompressed per step, however well the data compresses.
_MAX_OUTPUT = 4 << 20
#: Deflate's own limit: at most 258 bytes from a 2-bit code, about 1032 to 1.
DEFLATE_MAX_RATIO = 1032
#: The most the decompressed bytes may exceed the compressed ones, as a ratio, once
#: `EXPANSION_ALLOWANCE` bytes came out.
MAX_EXPANSION = 100
EXPANSION_ALLOWANCE = 64 << 20


def is_gzip_shard(url: str) -> bool:
    """True for a shard whose name ends in `.tar.gz` or `.tgz` (a path, a URL whose
    path does, or a `pipe:` command whose last shard argument does)."""
    return shard_name(url).lower().endswith(GZIP_SUFFIXES)


def tar_stream(stream: BinaryIO, url: str) -> BinaryIO | GunzipReader:
    """The tar stream of shard `url`: `stream` itself, or decompressed from it."""
    return GunzipReader(stream, url) if is_gzip_shard(url) else stream


class GunzipReader:
    """The decompressed bytes of a gzip stream (`read`, `readinto`), for `iter_tar_members`."""

    def __init__(self, raw: BinaryIO, where: str) -> None:
        self.raw = raw
        self.where = where
        self._inflate = zlib_ng.decompressobj(_GZIP_WINDOW)
        self._in_member = False  # inside a gzip member (its end not yet seen)
        self._buffer = b""
        self._offset = 0
        self._compressed = 0  # bytes taken from `raw`
        self._produced = 0  # bytes inflated

    def _more(self) -> bool:
        """Decompress more into the buffer; False at the end of the data."""
        while True:
            inflate = self._inflate
            data = b""
            if inflate.unconsumed_tail:
                data = inflate.unconsumed_tail
            elif inflate.eof:  # the next member, if any, starts in what is left
                data = inflate.unused_data
                self._inflate = inflate = zlib_ng.decompressobj(_GZIP_WINDOW)
                self._in_member = False
            if not data:
                data = self.raw.read(_CHUNK)
                self._compressed += len(data)
                if not data:
                    if self._in_member:
                        raise CorruptShardError(f"{self.where}: compressed data truncated "
                                                "(the gzip stream ends early)")
                    return False
            if not self._in_member:
                data = data.lstrip(b"\0")  # zeros may pad the end of a gzip file
                if not data:
                    continue
                self._in_member = True
            try:
                output = inflate.decompress(data, _MAX_OUTPUT)
            except zlib_ng.error as error:
                raise CorruptShardError(f"{self.where}: damaged gzip data: {error}") from None
            if output:
                self._check_expansion(len(output))
                self._buffer, self._offset = output, 0
                return True

    def _check_expansion(self, count: int) -> None:
        self._produced += count
        if self._produced > max(EXPANSION_ALLOWANCE, MAX_EXPANSION * self._compressed):
            raise CorruptShardError(f"{self.where}: inflates to more than {MAX_EXPANSION} "
                                    f"times its compressed size ({self._produced} bytes from "
                                    f"{self._compressed}): a gzip bomb, not a shard of speech")

    def bytes_left(self) -> int | None:
        """The most bytes still to come (None where the compressed stream cannot say):
        what is decompressed and not yet read, and `DEFLATE_MAX_RATIO` times the
        compressed bytes left, plus zlib's own state."""
        left = bytes_left(self.raw)
        if left is None:
            return None
        inflate = self._inflate
        compressed = left + len(inflate.unconsumed_tail) + len(inflate.unused_data)
        return len(self._buffer) - self._offset + DEFLATE_MAX_RATIO * compressed + (64 << 10)

    def read(self, size: int = -1) -> bytes:
        parts = []
        while size < 0 or size > 0:
            if self._offset >= len(self._buffer) and not self._more():
                break
            end = len(self._buffer) if size < 0 else min(len(self._buffer),
                                                         self._offset + size)
            parts.append(self._buffer[self._offset:end])
            size -= end - self._offset if size >= 0 else 0
            self._offset = end
        return b"".join(parts)

    def readinto(self, view: memoryview) -> int:
        view = memoryview(view).cast("B")
        filled = 0
        while filled < len(view):
            if self._offset >= len(self._buffer) and not self._more():
                break
            take = min(len(view) - filled, len(self._buffer) - self._offset)
            view[filled:filled + take] = self._buffer[self._offset:self._offset + take]
            self._offset += take
            filled += take
        return filled
