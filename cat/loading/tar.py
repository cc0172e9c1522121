"""A minimal streaming tar reader for shards: one read per member, into recycled buffers.

`iter_tar_members` yields the regular files of a tar stream in order (ustar, pax and
GNU long names; header checksums verified; truncation raises `CorruptShardError`), each
read with one call, into a `BufferPool` buffer when given one. A member whose header
claims more bytes than `limit` (the shard's size from its index, or
`UNINDEXED_MEMBER_LIMIT`), or more than the stream can still hold (`bytes_left`: what is
left of a file, of an in-memory tar, at most 1032 times what is left of a gzip stream),
makes the shard corrupt before anything is allocated: a bit-rotten size field must not
become a `MemoryError` or gigabytes of zeros. Where the stream cannot say (a pipe, an
HTTP body), a member over `PIECE_BYTES` is read in pieces, so memory follows the bytes
that arrive, not the claim. `caps` (the most bytes a member of each extension may take,
from the loader's length filter) passes over a larger member unread and yields it as an
`OversizedMember`, so its sample is dropped without ever being held in memory. `keep`
lets a caller skip members without reading their data (a seek on local files), which is
how an exact resume passes over the utterances of a shard that were already taken.

Usage:
    with open("data/wds/train/data-00000.tar", "rb") as f:
        for name, data in iter_tar_members(f, "data-00000.tar"): ...
"""

from __future__ import annotations

import collections
import io
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import BinaryIO, NamedTuple

TAR_BLOCK = 512
_ZERO_BLOCK = bytes(TAR_BLOCK)
#: The largest member of a shard whose index gives no size: 1 GiB, over two hours of
#: 16 kHz 16-bit audio, or of 80-dim float32 features, in one utterance.
UNINDEXED_MEMBER_LIMIT = 1 << 30
#: Members larger than this are read in pieces from streams whose length is unknown.
PIECE_BYTES = 16 << 20
# Claims up to this are read without asking the stream what it holds (a system call or
# two): a false one costs no more than this.
_UNCHECKED_BYTES = 1 << 20


class CorruptShardError(ValueError):
    """A shard's tar data is truncated or malformed; the message names the shard."""


#: `keep(member name) -> bool`, asked before a member's data is read (see iter_tar_members).
MemberFilter = Callable[[str], bool]


class OversizedMember(NamedTuple):
    """What `iter_tar_members` yields, instead of the data, for a member passed over unread
    because its `size` is over `cap`, the caller's limit for its extension."""

    size: int
    cap: int


def bytes_left(stream: BinaryIO) -> int | None:
    """The most bytes `stream` can still give, or None where it cannot say: its own
    `bytes_left()` (the gzip reader, the checksum wrapper), what is left of an in-memory
    buffer or of a regular file; a pipe, a socket or a store's stream cannot say."""
    method = getattr(stream, "bytes_left", None)
    if method is not None:
        return method()
    if isinstance(stream, io.BytesIO):
        with stream.getbuffer() as view:
            return view.nbytes - stream.tell()
    try:
        info = os.fstat(stream.fileno())
        return info.st_size - stream.tell() if stat.S_ISREG(info.st_mode) else None
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


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


def _read_pieces(stream: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes, read `PIECE_BYTES` at a time (memory follows what arrives)."""
    pieces = []
    while size > 0:
        piece = _read_exact(stream, min(size, PIECE_BYTES))
        if not piece:
            break
        pieces.append(piece)
        size -= len(piece)
    return b"".join(pieces)


def _read_member(stream: BinaryIO, size: int, pool: BufferPool | None, where: str,
                 name: str) -> bytes | memoryview:
    """The `size` bytes of a regular member, checked against what the stream can hold
    before anything is allocated for them."""
    left = bytes_left(stream) if size > _UNCHECKED_BYTES else None
    if left is not None and size > left:
        raise CorruptShardError(f"{where}: member {name!r} truncated: its tar header "
                                f"claims {size} bytes, the shard holds at most {left} more "
                                "(or the header is damaged)")
    if left is None and size > PIECE_BYTES:
        data: bytes | memoryview = _read_pieces(stream, size)
        received = len(data)
    elif pool is not None and size >= pool.min_bytes:
        data = memoryview(pool.take(size))[:size]
        received = _read_into(stream, data)
    else:
        data = _read_exact(stream, size)
        received = len(data)
    if received < size:
        raise CorruptShardError(f"{where}: member {name!r} truncated "
                                f"({received} of {size} bytes)")
    return data


def iter_tar_members(stream: BinaryIO, where: str, pool: BufferPool | None = None,
                     keep: MemberFilter | None = None, limit: int = UNINDEXED_MEMBER_LIMIT,
                     caps: Mapping[str, int] | None = None
                     ) -> Iterator[tuple[str, bytes | memoryview | OversizedMember | None]]:
    """Yield `(name, data)` of the regular files of a tar stream, in order.

    Reads each member with one `read` (the stdlib `tarfile` stream mode copies every
    member through 10 KiB buffers: measured slower on 160 KB feature members).
    Handles ustar, pax and GNU long names; header checksums are verified. Truncation
    raises CorruptShardError. With a `pool`, members of at least `pool.min_bytes` are
    read into its buffers and yielded as memoryviews (`data.obj` is the buffer). A member
    whose name `keep` rejects is passed over unread and yielded with `data` None; one
    larger than `caps[its extension]` is passed over unread and yielded as an
    `OversizedMember`. A header claiming more than `limit` bytes, or more than the
    stream can still hold (`bytes_left`), raises CorruptShardError (nothing is
    allocated for it).
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = _read_exact(stream, TAR_BLOCK)
        if not header or header == _ZERO_BLOCK:
            return
        if len(header) < TAR_BLOCK:
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
            try:
                size = int(pax["size"])
            except ValueError:
                raise CorruptShardError(f"{where}: bad pax size {pax['size']!r}") from None
        kind = header[156:157]
        if size > limit:
            bound = "the limit for a shard without an index" \
                if limit == UNINDEXED_MEMBER_LIMIT else "the whole shard (its index)"
            raise CorruptShardError(f"{where}: member {name!r}: its tar header claims {size} "
                                    f"bytes, more than {bound}: {limit} (a damaged header)")
        padding = -size % TAR_BLOCK
        regular = kind in (b"0", b"\0", b"7")
        if regular:
            name = pax.get("path", long_name or name)
            long_name, pax = None, {}
            if keep is not None and not keep(name):
                _skip(stream, size + padding, where, name)
                yield name, None
                continue
            cap = caps.get(name.rpartition(".")[2]) if caps else None
            if cap is not None and size > cap:
                _skip(stream, size + padding, where, name)
                yield name, OversizedMember(size, cap)
                continue
        data = _read_member(stream, size, pool if regular else None, where, name)
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
