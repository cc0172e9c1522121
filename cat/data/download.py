"""Resumable HTTP(S) downloads with md5 verification, using only urllib and tqdm.

Bytes are appended to `<name>.part` and resumed with a Range request after a lost
connection (restarting from byte 0 when the server ignores Range). The file gets its
final name only once complete and, when an md5 is given, verified; a file that fails
verification is deleted. A verified final file is never downloaded again.

Usage:
    python -m cat.data.download https://www.openslr.org/resources/33/resource_aishell.tgz \
        downloads/ --md5 957d480a0fcac85fc18e550756f624e5
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from cat.core.io import PathLike, setup_logging

logger = logging.getLogger(__name__)

# HTTP statuses worth retrying: timeouts, rate limits and transient server errors.
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHUNK_SIZE = 1 << 20


class DownloadError(RuntimeError):
    """A download failed for good; the message names the URL."""


class ChecksumError(DownloadError):
    """A file's md5 differs from the expected one; the message names file and both sums."""


class _TransientError(Exception):
    """A failure worth retrying (the connection dropped before the announced size)."""


def md5sum(path: PathLike, chunk_size: int = _CHUNK_SIZE) -> str:
    """Hex md5 digest of a file, read in chunks."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def _normalize_md5(md5: str | None) -> str | None:
    if md5 is None:
        return None
    value = md5.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", value):
        raise ValueError(f"not an md5 hex digest: {md5!r}")
    return value


def _verify(path: Path, expected: str, what: str) -> None:
    logger.info("%s: verifying md5", path)
    actual = md5sum(path)
    if actual != expected:
        raise ChecksumError(f"{what}: md5 mismatch: expected {expected}, got {actual}")


def _parse_content_range(value: str | None) -> tuple[int | None, int | None]:
    """`(start, total)` from `bytes START-END/TOTAL` or `bytes */TOTAL`; None where absent."""
    match = re.fullmatch(r"bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)", (value or "").strip())
    if not match:
        return None, None
    start = int(match.group(1)) if match.group(1) is not None else None
    total = int(match.group(2)) if match.group(2) != "*" else None
    return start, total


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _fetch(url: str, part: Path, timeout: float, progress: bool) -> int:
    """Fetch the rest of `url` into `part`; returns the number of bytes written.

    Raises `_TransientError` (or a connection error) when the transfer stops early,
    and `DownloadError` on a permanent HTTP error.
    """
    offset = _size(part)
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and offset:
            _, total = _parse_content_range(error.headers.get("Content-Range"))
            if total == offset:
                return 0  # the partial file already holds every byte
            logger.warning("%s: server rejected resuming at byte %d; restarting", url, offset)
            part.unlink()
            raise _TransientError("range not satisfiable") from error
        if error.code in RETRYABLE_STATUS:
            raise _TransientError(f"HTTP {error.code} {error.reason}") from error
        raise DownloadError(f"{url}: HTTP {error.code} {error.reason}") from error
    with response:
        if response.status == 206:
            start, total = _parse_content_range(response.headers.get("Content-Range"))
            if start != offset:
                part.unlink()
                raise _TransientError(f"server resumed at byte {start}, asked for {offset}")
            mode = "ab"
        else:
            if offset:
                logger.warning("%s: server ignored the Range request; restarting from byte 0",
                               url)
            offset, mode = 0, "wb"
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        received = 0
        with open(part, mode) as f, tqdm(total=total, initial=offset, unit="B", unit_scale=True,
                                         unit_divisor=1024, desc=part.name[:-len(".part")],
                                         disable=not progress, leave=False) as bar:
            while chunk := response.read(_CHUNK_SIZE):
                f.write(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    size = offset + received
    if total is not None and size < total:
        raise _TransientError(f"connection closed after {size} of {total} bytes")
    if total is not None and size > total:
        part.unlink()
        raise DownloadError(f"{url}: received {size} bytes, more than the announced {total}")
    return received


def download(
    url: str,
    path: PathLike,
    md5: str | None = None,
    retries: int = 5,
    retry_wait: float = 2.0,
    timeout: float = 60.0,
    progress: bool = True,
) -> Path:
    """Download `url` to the file `path` (resuming `path.part`), verify `md5`, return `path`.

    An existing `path` is verified (when `md5` is given) and returned without any HTTP
    request. Connection errors, early connection closes and transient HTTP statuses are
    retried up to `retries` times in a row; an attempt that fetched bytes is resumed at
    once, one that fetched nothing waits `retry_wait` times the failure count (seconds).
    On an md5 mismatch the downloaded bytes are deleted and `ChecksumError` names the
    file, the expected and the actual sum.
    """
    path = Path(path)
    expected = _normalize_md5(md5)
    if path.exists():
        if expected is None:
            logger.info("%s exists (no md5 given to verify it); not downloading", path)
            return path
        _verify(path, expected, f"{path} (existing file; delete it to download again)")
        logger.info("%s exists and is verified; not downloading", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    logger.info("downloading %s to %s", url, path)
    failures = 0
    while True:
        size_before = _size(part)
        try:
            _fetch(url, part, timeout, progress)
            break
        except (_TransientError, urllib.error.URLError, http.client.HTTPException,
                ConnectionError, TimeoutError) as error:
            progressed = _size(part) > size_before
            # Count only failures in a row that fetched nothing; resume at once after progress.
            failures = 1 if progressed else failures + 1
            if failures > retries:
                raise DownloadError(f"{url}: giving up after {retries} retries: {error}") from error
            logger.warning("%s: %s; retrying (%d/%d)", url, error, failures, retries)
            if not progressed:
                time.sleep(retry_wait * failures)
    if expected is not None:
        try:
            _verify(part, expected, f"{path} (downloaded from {url})")
        except ChecksumError:
            part.unlink()
            raise
    os.replace(part, path)
    logger.info("downloaded %s", path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m cat.data.download", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="HTTP(S) URL to fetch")
    parser.add_argument("dest", help="target file, or an existing directory to put it in")
    parser.add_argument("--md5", help="expected md5 hex digest")
    parser.add_argument("--retries", type=int, default=5, help="retries without progress")
    args = parser.parse_args(argv)
    setup_logging()
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / Path(urllib.parse.urlparse(args.url).path).name
    try:
        download(args.url, dest, args.md5, retries=args.retries)
    except (DownloadError, ValueError) as error:
        logger.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
