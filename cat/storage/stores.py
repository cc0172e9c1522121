"""One interface to the stores shards live in: `scheme://...` URLs, their errors, their index.

A store URL is `<scheme>://<location>` with a scheme other than `http`/`https` (those,
`pipe:` commands and local paths are read by `cat.loading.sources` directly). `store_for`
gives the `Store` that reads it:

* `s3://`: `cat.storage.s3.S3Store` (boto3, with its retries and timeouts; fsspec's
  s3fs cannot be installed beside the pinned botocore: its aiobotocore pins older
  botocore releases);
* every other scheme fsspec knows (`gs://`, `gcs://`, `az://`, `abfs://`, `hf://`,
  `memory://`, `file://`, `sftp://`, ...): `cat.storage.fsspec_store.FsspecStore`.

The client library of a store (boto3, fsspec and its backend package such as gcsfs,
adlfs or huggingface_hub) is imported only when a URL of that store is used, so reading
local shards imports none of them. A scheme no store supports is a `ValueError` naming
it and the schemes that are supported; a backend package that is not installed is an
`ImportError` naming the package to install.

A `Store` has `expand(pattern) -> [url]` (brace expansion, then `*`, `?` and `[...]`
matched within one path segment, as `glob` does on disk; a pattern matching nothing and
a brace-expanded name that is not there are errors naming them), `open(url) -> binary
stream` (`read`, `readinto`), `read_range(url, offset, length) -> bytes` and
`fetch(url) -> bytes`. The shard index is `index.jsonl` in the folder of the shard
(`index_url`).

Errors are `StoreError`s (`OSError`s) whose message starts with the URL:
`TransientStoreError` (errno EIO, `transient` True) when retrying may help: a timeout,
a refused or reset connection, throttling, a server error; `UnavailableStoreError`
(errno ENOENT, or EACCES for denied access) when it will not: no such object or bucket,
access denied, no credentials. The loader retries the first and skips and counts the
second (`cat.loading.reader`), for every store alike.

Usage:
    store = store_for("gs://bucket/wds/train/data-00000.tar", timeout=60)
    urls = store.expand("gs://bucket/wds/train/data-*.tar")
    with store.open(urls[0]) as stream:
        head = stream.read(512)
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
import re
from collections.abc import Sequence
from typing import Any, BinaryIO, Protocol

#: The shard index's file name, as the stage-2 packer writes it next to the shards.
INDEX_NAME = "index.jsonl"
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
#: Schemes read without a store (`urllib` in `cat.loading.sources`).
_DIRECT_SCHEMES = frozenset({"http", "https"})


class StoreError(OSError):
    """An object could not be listed or read; `url` names it, `transient` says whether a
    retry may help. The message starts with the URL."""

    transient = False
    url = ""

    def __str__(self) -> str:
        return str(self.strerror)


class TransientStoreError(StoreError):
    """A timeout, a refused/reset/closed connection, throttling or a server error."""

    transient = True

    def __init__(self, url: str, message: str) -> None:
        super().__init__(errno.EIO, message)
        self.url = url


class UnavailableStoreError(StoreError):
    """No such object, access denied or no credentials: retrying will not help."""

    def __init__(self, url: str, message: str, error_number: int = errno.ENOENT) -> None:
        super().__init__(error_number, message)
        self.url = url


class Store(Protocol):
    """What the loader and the index readers need of a store (see the module doc)."""

    def expand(self, patterns: str | Sequence[str]) -> list[str]: ...

    def open(self, url: str) -> BinaryIO: ...

    def read_range(self, url: str, offset: int, length: int) -> bytes: ...

    def fetch(self, url: str) -> bytes: ...


def url_scheme(location: str) -> str | None:
    """The scheme of `scheme://...` (lower case), None for paths and `pipe:` commands."""
    match = _SCHEME.match(location)
    return match.group(1).lower() if match else None


def is_store_url(location: str) -> bool:
    """True for URLs a `Store` reads (`s3://`, `gs://`, `memory://`...; not http(s))."""
    scheme = url_scheme(location)
    return scheme is not None and scheme not in _DIRECT_SCHEMES


def index_url(url: str) -> str:
    """The `index.jsonl` of a shard URL (`gs://b/p/data-00001.tar` -> `gs://b/p/index.jsonl`)."""
    scheme, _, rest = url.partition("://")
    folder = posixpath.dirname(rest)
    return f"{scheme}://{folder}/{INDEX_NAME}" if folder else f"{scheme}://{INDEX_NAME}"


def object_name(url: str) -> str:
    """The last path segment of a store URL (`data-00003.tar`)."""
    return posixpath.basename(url.partition("://")[2])


def store_place(url: str) -> str:
    """Where a store URL points, in words: the bucket (and endpoint) it names."""
    scheme = url_scheme(url) or ""
    if scheme == "s3":
        from cat.storage.s3 import S3Options, split_s3_url
        endpoint = S3Options().endpoint()
        return f"s3://{split_s3_url(url)[0]}" + (f" at {endpoint}" if endpoint else "")
    first = url.partition("://")[2].lstrip("/").split("/", 1)[0]
    return f"{scheme}://{first}"


def store_for(url: str, timeout: float = 60.0, max_attempts: int | None = None) -> Store:
    """The store of `url` in this process, for reads that wait at most `timeout` s.

    `max_attempts` (default: the store's own): 1 where the caller retries itself (the
    shard reader), so that the store's attempts do not multiply its own: on a hung store
    each attempt waits `timeout`."""
    scheme = url_scheme(url)
    if scheme is None or scheme in _DIRECT_SCHEMES:
        raise ValueError(f"{url!r} is not a store URL (scheme://...; http(s) is read "
                         "directly)")
    if scheme == "s3":
        from cat.storage.s3 import default_store
        return default_store(timeout, max_attempts)
    return _fsspec_store(scheme, float(timeout), max_attempts, _environment_key(scheme))


def _environment_key(scheme: str) -> tuple[tuple[str, str], ...]:
    # fsspec reads FSSPEC_<PROTOCOL>... variables: a changed one gets a new store.
    prefix = f"FSSPEC_{scheme.upper()}"
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(prefix)))


@functools.lru_cache(maxsize=16)
def _fsspec_store(scheme: str, timeout: float, max_attempts: int | None,
                  environment: Any) -> Store:
    del environment  # a cache key
    from cat.storage.fsspec_store import FsspecStore, check_scheme
    check_scheme(scheme)
    if max_attempts is None:
        return FsspecStore(scheme, timeout)
    return FsspecStore(scheme, timeout, max_attempts=max_attempts)

