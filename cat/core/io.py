"""Small I/O helpers shared by every stage: atomic writes and Kaldi text tables.

A Kaldi "table" is a UTF-8 text file with one `<key> <value>` line per entry
(`wav.scp`, `text`, `utt2spk`, `segments`, `utt2num_frames`, `feats.scp` ...).
Readers here fail with the file name and line number on malformed input;
writers never leave a partial file under the final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from cat.core.process import pid_alive

PathLike = str | os.PathLike


BYTE_ORDER_MARK = "\ufeff"


class TableError(ValueError):
    """A Kaldi table is malformed; the message names the file and line."""


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp\.(?P<pid>\d+)")


def _writer_alive(pid: int) -> bool:
    return pid == os.getpid() or pid_alive(pid)


def _locked(path: Path) -> bool:
    """Whether a writer holds `path` open (locked; see atomic_write), e.g. on another
    machine sharing the folder, where its process id means nothing."""
    try:
        with open(path, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def remove_stale_temporaries(directory: PathLike, name: str | None = None) -> list[Path]:
    """Remove the temporary files `.<name>.tmp.<pid>` that `atomic_write` left in
    `directory` when its process was killed (SIGKILL, OOM): those whose process is no
    longer alive and which no writer holds locked. Only those of final name `name` when
    given. Returns the paths removed (each logged)."""
    directory = Path(directory)
    pattern = f".{name}.tmp.*" if name is not None else ".*.tmp.*"
    removed = []
    for path in directory.glob(pattern):
        match = _TEMPORARY.fullmatch(path.name)
        if match is None or _writer_alive(int(match["pid"])) or _locked(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            logging.getLogger(__name__).warning(
                "removed %s, left by a writer (process %s) that was killed", path,
                match["pid"])
    return removed


@functools.cache
def _sync_file_range() -> Any:
    """libc's `sync_file_range` (Linux), or None; looked up on first use."""
    import ctypes

    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return function


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing `length` bytes of `fd` from `offset` to disk, and
    return at once (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`; nothing elsewhere).
    A writer of large files that calls it as it goes overlaps the disk's work with its
    own, so the `fsync` before its rename (`atomic_write`) finds little left to wait for;
    durability still comes from that `fsync`."""
    function = _sync_file_range() if length > 0 else None
    if function is not None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open `.path.tmp.<pid>` for writing and rename it to `path` only if the block
    succeeds.

    The temporary file is locked while written, and those of earlier writers of `path`
    that were killed are removed first (`remove_stale_temporaries`).

    Usage::

        with atomic_write("data/train/text") as f:
            f.write("utt1 你好\\n")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, path.name)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    if "b" in mode:
        encoding = None
    try:
        with open(tmp, mode, encoding=encoding) as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # while still locked
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def iter_table(path: PathLike, allow_empty_value: bool = False) -> Iterator[tuple[str, str]]:
    """Yield `(key, value)` for each line of a Kaldi table.

    The key is the first whitespace-delimited field and the value the rest of
    the line (stripped). Blank lines are errors, as in Kaldi. An empty value is
    an error unless `allow_empty_value` (e.g. `text` with empty transcripts,
    which the caller then reports). Bytes that are not UTF-8 are an error naming
    the line. A UTF-8 byte-order mark at the start of the file (Windows editors write
    one) is left out, with a warning: it would otherwise be part of the first key.
    """
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if lineno == 1 and line.startswith(BYTE_ORDER_MARK):
                    logging.getLogger(__name__).warning(
                        "%s: starts with a UTF-8 byte-order mark (BOM); it is ignored", path)
                    line = line[len(BYTE_ORDER_MARK):]
                parts = line.split(maxsplit=1)
                if not parts:
                    raise TableError(f"{path}:{lineno}: empty line")
                if line[0].isspace():
                    raise TableError(f"{path}:{lineno}: line starts with whitespace: {line!r}")
                value = parts[1].strip() if len(parts) > 1 else ""
                if not value and not allow_empty_value:
                    raise TableError(f"{path}:{lineno}: key {parts[0]!r} has no value")
                yield parts[0], value
    except UnicodeDecodeError as error:
        raise TableError(not_utf8_message(path, error)) from None


def not_utf8_message(path: PathLike, error: UnicodeDecodeError) -> str:
    """`<path>:<line>: not valid UTF-8 ...` for a file that failed to decode.

    Text files are decoded in blocks, so the error itself knows no line: the file is
    scanned again, as bytes, for the first line that does not decode.
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as line_error:
                return (f"{path}:{lineno}: not valid UTF-8 ({line_error.reason} at byte "
                        f"{line_error.start + 1} of the line){_encoding_hint(raw)}")
    return f"{path}: not valid UTF-8 ({error.reason})"


def _encoding_hint(raw: bytes) -> str:
    try:
        text = raw.decode("gb18030").rstrip("\r\n")
    except UnicodeDecodeError:
        return "; convert the file to UTF-8"
    return (f"; it may be GBK/GB18030, which reads {text[:40]!r}: convert it with "
            "'iconv -f GB18030 -t UTF-8'")


def read_table(path: PathLike, allow_empty_value: bool = False) -> dict[str, str]:
    """Read a Kaldi table into a dict; duplicate keys are an error naming both lines."""
    table: dict[str, str] = {}
    lines: dict[str, int] = {}
    for lineno, (key, value) in enumerate(iter_table(path, allow_empty_value), 1):
        if key in table:
            raise TableError(f"{path}:{lineno}: duplicate key {key!r} (first on line {lines[key]})")
        table[key] = value
        lines[key] = lineno
    return table


def write_table(path: PathLike, items: Iterable[tuple[str, object]], sort: bool = True) -> int:
    """Write `(key, value)` pairs as a Kaldi table, atomically; returns the line count.

    Keys are sorted in byte order (Kaldi's `LC_ALL=C sort`) unless `sort=False`.
    """
    rows = [(str(k), str(v)) for k, v in items]
    if sort:
        rows.sort(key=lambda kv: kv[0].encode("utf-8"))
    for key, _ in rows:
        if not key or any(c.isspace() for c in key):
            raise TableError(f"{path}: invalid key {key!r} (empty or containing whitespace)")
    with atomic_write(path) as f:
        for key, value in rows:
            f.write(f"{key} {value}\n" if value != "" else f"{key}\n")
    return len(rows)


# The query string of an http(s) URL: presigned URLs carry their signature and
# credentials there (`?X-Amz-Signature=...`, `?sig=...`, tokens).
# (Up to a character that cannot be part of it unencoded, as `: ` after a URL in a log.)
_URL_QUERY = re.compile(r"(?P<url>https?://[^\s?#'\"]+)\?[^\s'\"#)\]},;:]*")
REDACTED = "<redacted>"


def redact_urls(text: str) -> str:
    """`text` with the query string of every http(s) URL in it replaced by `<redacted>`:
    logs and errors are shared, the signatures of presigned URLs must not be."""
    return _URL_QUERY.sub(rf"\g<url>?{REDACTED}", text)


class _RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(super().format(record))


def _redacting_excepthook(kind: type[BaseException], error: BaseException,
                          trace: Any) -> None:
    sys.stderr.write(redact_urls("".join(traceback.format_exception(kind, error, trace))))


def setup_logging(verbose: bool = False) -> None:
    """Log to stderr with a timestamp and the module name (idempotent). URL query strings
    are redacted in every line logged, and in the traceback of an uncaught error."""
    root = logging.getLogger()
    sys.excepthook = _redacting_excepthook
    if root.handlers:
        root.setLevel(logging.DEBUG if verbose else logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _RedactingFormatter("%(asctime)s (%(module)s:%(lineno)d) %(levelname)s: %(message)s",
                            "%Y-%m-%d %H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
