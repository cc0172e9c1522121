"""Shards on S3-compatible object storage: `s3://` patterns, streaming reads, the index.

A `trset` entry such as `s3://bucket/wds/train/data-{00000..00099}.tar` or
`s3://bucket/wds/train/*/data-*.tar` names objects of one bucket. `S3Store.expand`
brace-expands such patterns and matches them against one listing of the bucket under
their common literal prefix: `*`, `?` and `[...]` match within one path segment, as
`glob` does on disk; a pattern that matches nothing, and a brace-expanded name that is
not in the bucket, are errors naming the pattern and the object. Results keep the
patterns' order, each pattern's matches sorted.

`S3Store.open` streams one object as a binary file (`read`, `readinto`; wrap it in
`io.BufferedReader` for lines) with a read timeout, from a byte `offset`: when a read is
cut short, `reader.position` is where the next byte would have come from and
`S3Store.open(url, offset=reader.position, etag=reader.etag)` continues there (an
`If-Match` on the ETag makes sure the object has not been replaced meanwhile). The shard
index is `index.jsonl` under the same prefix (`index_url`); `S3Store.fetch` reads it
whole and `S3Store.read_range` reads the byte range of one of its lines.

Errors are `S3Error`s (`OSError`s) whose message starts with the URL and the endpoint:

* `S3TransientError` (errno EIO): worth retrying after a pause: throttling (`SlowDown`,
  HTTP 429/503), other HTTP 5xx, a refused or reset connection, a connect or read
  timeout, a connection closed before the end of the object.
* `S3UnavailableError` (errno ENOENT or EACCES): retrying will not help: no such key
  or bucket, access denied, bad or missing credentials, an object replaced during a
  read. The errnos are those a local file would give, so code that tells a missing
  file from a flaky one by errno handles S3 the same way.

Configuration comes from the usual places: credentials from `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`), `AWS_PROFILE` or `~/.aws/credentials`
and `~/.aws/config`; the region from `AWS_DEFAULT_REGION` or the profile; the endpoint
from `S3Options.endpoint_url`, else `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`,
else AWS itself. A self-hosted store (MinIO, SeaweedFS, Ceph) only needs the endpoint
and its keys:

    export AWS_ENDPOINT_URL_S3=http://storage.example.com:8333
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...

botocore itself retries a failed request `S3Options.max_attempts` times in all (its
"standard" mode, with backoff) before an error reaches the caller; a read cut short in
the middle of an object is not retried here: the caller decides, and continues from
`reader.position`.

Shards over SSH
---------------
A host reachable with `ssh` needs no object store: a `pipe:` URL runs a command and
reads its standard output, so

    pipe:ssh data-host cat /data/wds/train/data-00003.tar

streams one shard, and brace patterns work inside it
(`pipe:ssh data-host cat /data/wds/train/data-{00000..00099}.tar`). Use key-based
authentication (`ssh-agent`, or `IdentityFile` in `~/.ssh/config`) and
`BatchMode yes`, so that a missing key fails at once instead of waiting at a password
prompt. Every shard opens its own connection; `ControlMaster auto` with
`ControlPersist 10m` in `~/.ssh/config` lets them share one and saves the handshake.
`ServerAliveInterval 15` and `ServerAliveCountMax 2` make a dead connection end the
command (a transient error) within about 30 s instead of hanging. Nothing is cached
locally and reads cannot resume mid-shard (a failed command restarts the shard).

Usage:
    store = S3Store(S3Options(endpoint_url="http://127.0.0.1:8333", read_timeout=30))
    urls = store.expand("s3://corpus/wds/train/data-{00000..00099}.tar")
    with store.open(urls[0]) as shard:
        head = shard.read(512)
    index = store.fetch(index_url(urls[0]))
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import functools
import http.client
import io
import logging
import os
import posixpath
import re
import threading
from collections.abc import Sequence
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
from botocore import UNSIGNED
from braceexpand import braceexpand

from cat.storage.patterns import expand_each
from cat.storage.stores import StoreError

logger = logging.getLogger(__name__)

S3_SCHEME = "s3://"
# The shard index's file name, as the stage-2 packer writes it next to the shards.
INDEX_NAME = "index.jsonl"
_GLOB_CHARS = re.compile(r"[*?\[]")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
# What a request or a body read may raise: botocore wraps urllib3's errors in its own.
_STORE_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError,
                 http.client.HTTPException)

# Error codes of S3 and compatible stores, by what they mean for a retry.
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled",
    "TooManyRequests", "RequestLimitExceeded", "ServiceUnavailable", "InternalError",
    "RequestTimeout", "RequestTimeoutException", "OperationAborted",
})
_DENIED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
    "AccountProblem", "InvalidToken", "ExpiredToken", "TokenRefreshRequired", "403",
})
_MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})


class S3Error(StoreError):
    """An object could not be listed or read; `url` names it, `transient` says whether a
    retry may help. The message starts with the URL and the endpoint."""

    transient = False

    def __init__(self, url: str, message: str, error_number: int) -> None:
        super().__init__(error_number, message)
        self.url = url

    def __str__(self) -> str:
        return str(self.strerror)


class S3TransientError(S3Error):
    """Throttling, a server error, a refused/reset/closed connection or a timeout."""

    transient = True

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, message, errno.EIO)


class S3UnavailableError(S3Error):
    """No such object or bucket, access denied, no credentials, or the object changed."""

    def __init__(self, url: str, message: str, error_number: int = errno.ENOENT) -> None:
        super().__init__(url, message, error_number)


@dataclasses.dataclass(frozen=True)
class S3Options:
    """How to reach the store. `None` fields come from the environment / AWS config."""

    endpoint_url: str | None = None
    profile: str | None = None
    region: str | None = None
    # Seconds a connection may take to open, and a read may wait for the next bytes.
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    # Attempts of one request in all, by botocore ("standard" retry mode).
    max_attempts: int = 3
    # Unsigned requests, for public buckets (no credentials needed).
    anonymous: bool = False
    # "path" (`endpoint/bucket/key`, what most self-hosted stores want), "virtual" or "auto".
    addressing_style: str = "auto"

    def endpoint(self) -> str | None:
        """The endpoint URL in use: the option, else the environment, else None (AWS)."""
        return (self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or None)


def default_store(read_timeout: float = 60.0, max_attempts: int | None = None) -> S3Store:
    """The `S3Store` of this process for `read_timeout`, configured from the environment:
    one per timeout, endpoint and access key, so a changed environment gets a new one (its
    client is made again in a forked child, so sharing it across forks is safe).

    `max_attempts` (default `S3Options.max_attempts`): 1 where the caller retries itself
    (the shard reader), so that botocore's attempts do not multiply its own: on a hung
    store each attempt waits `read_timeout`."""
    attempts = S3Options.max_attempts if max_attempts is None else max_attempts
    return _store(read_timeout, attempts, S3Options().endpoint(),
                  os.environ.get("AWS_ACCESS_KEY_ID"))


@functools.lru_cache(maxsize=8)
def _store(read_timeout: float, max_attempts: int, endpoint: str | None,
           access_key: str | None) -> S3Store:
    del endpoint, access_key  # cache keys: S3Options reads them from the environment
    return S3Store(S3Options(read_timeout=read_timeout, max_attempts=max_attempts))


def is_s3_url(location: str) -> bool:
    """True for `s3://bucket/key` locations."""
    return location.startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> `("bucket", "some/key")`; the key may be empty."""
    if not is_s3_url(url):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}; expected s3://bucket/key")
    return bucket, key


def index_url(url: str) -> str:
    """The `index.jsonl` of a shard (`s3://b/p/data-00001.tar`) or of a prefix (`s3://b/p/`)."""
    bucket, key = split_s3_url(url)
    folder = key if key.endswith("/") or not key else posixpath.dirname(key) + "/"
    folder = "" if folder == "/" else folder
    return f"{S3_SCHEME}{bucket}/{folder}{INDEX_NAME}"


class S3Reader(io.RawIOBase):
    """One object (or a byte range of it) as a readable binary stream.

    `position` is the object offset of the next byte; `size` the object's size; `end` the
    offset where this reader stops; `etag` the object's ETag. A connection closed before
    `end` raises `S3TransientError`, never a silent end of data.
    """

    def __init__(self, url: str, where: str, body: Any, offset: int, end: int, size: int,
                 etag: str | None) -> None:
        super().__init__()
        self.url = url
        self.where = where
        self.position = offset
        self.end = end
        self.size = size
        self.etag = etag
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.end - self.position)
        if wanted <= 0 or self._body is None:
            return 0
        try:
            data = self._body.read(wanted)
        except _STORE_ERRORS as error:
            raise _classify(error, self.url, self.where,
                            f"reading at byte {self.position} of {self.size}") from None
        if not data:
            raise S3TransientError(self.url, f"{self.where}: the connection closed at byte "
                                             f"{self.position}, before byte {self.end}")
        view[:len(data)] = data
        self.position += len(data)
        return len(data)

    def close(self) -> None:
        if self._body is not None:
            # A body not read to its end cannot go back to the connection pool.
            self._body.close()
            self._body = None
        super().close()


class S3Store:
    """Lists and reads objects of S3-compatible stores with one botocore client.

    The client is made on first use and again in a forked child (clients must not cross a
    fork), so a store may be created before DataLoader workers start; it pickles without
    its client.
    """

    def __init__(self, options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        self._client: Any = None
        self._client_pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])

    # ------------------------------------------------------------------ client

    @property
    def client(self) -> Any:
        """The botocore S3 client of this process."""
        with self._lock:
            if self._client is None or self._client_pid != os.getpid():
                self._client = self._make_client()
                self._client_pid = os.getpid()
            return self._client

    def _make_client(self) -> Any:
        options = self.options
        config = botocore.config.Config(
            connect_timeout=options.connect_timeout, read_timeout=options.read_timeout,
            # botocore's "max_attempts" counts retries; "total_max_attempts" all attempts.
            retries={"total_max_attempts": max(1, options.max_attempts), "mode": "standard"},
            s3={"addressing_style": options.addressing_style},
            signature_version=UNSIGNED if options.anonymous else None,
        )
        try:
            session = boto3.session.Session(profile_name=options.profile,
                                            region_name=options.region)
        except botocore.exceptions.ProfileNotFound as error:
            raise S3UnavailableError(S3_SCHEME, f"S3 profile not found: {error}") from None
        return session.client("s3", endpoint_url=options.endpoint(), config=config)

    def _where(self, url: str) -> str:
        return f"{url} (endpoint {self.options.endpoint() or 'AWS'})"

    # ------------------------------------------------------------------ listing

    def list_objects(self, prefix_url: str) -> list[str]:
        """URLs of all objects whose key starts with the key of `prefix_url`, sorted."""
        bucket, prefix = split_s3_url(prefix_url)
        keys: list[str] = []
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                keys.extend(item["Key"] for item in page.get("Contents", ()))
        except _STORE_ERRORS as error:
            raise _classify(error, prefix_url, self._where(prefix_url), "listing") from None
        return [f"{S3_SCHEME}{bucket}/{key}" for key in sorted(keys)]

    def expand(self, patterns: str | Sequence[str]) -> list[str]:
        """Brace-expand and glob `s3://` patterns against the bucket (module docstring)."""
        return expand_each(patterns, self._expand_one)

    def _expand_one(self, pattern: str) -> list[str]:
        bucket, _ = split_s3_url(pattern)
        expanded = list(braceexpand(pattern))
        for url in expanded:
            if split_s3_url(url)[0] != bucket or _GLOB_CHARS.search(split_s3_url(url)[0]):
                raise ValueError(f"pattern {pattern!r}: one pattern must name one bucket")
        literal = [_GLOB_CHARS.split(split_s3_url(url)[1], maxsplit=1)[0] for url in expanded]
        # S3 prefixes are strings, not paths: "data-000" lists data-00000 ... data-00099.
        prefix = os.path.commonprefix(literal)  # noqa: RUF071
        try:
            listed = self.list_objects(f"{S3_SCHEME}{bucket}/{prefix}")
        except S3UnavailableError as error:
            if error.errno != errno.EACCES or any(_GLOB_CHARS.search(u) for u in expanded):
                raise
            logger.warning("cannot list %s (%s); using the %d names of %r unchecked",
                           prefix, error, len(expanded), pattern)
            return expanded
        found: list[str] = []
        names = set(listed)
        for url in expanded:
            if not _GLOB_CHARS.search(url):
                if url not in names:
                    where = "" if url == pattern else f" (expanded from {pattern!r})"
                    raise S3UnavailableError(url, f"{self._where(url)}: no such object{where}")
                found.append(url)
                continue
            matches = [name for name in listed if _glob_match(name, url)]
            if not matches:
                raise S3UnavailableError(url, f"{self._where(url)}: pattern {pattern!r} "
                                              "matches no object")
            found.extend(matches)
        return found

    # ------------------------------------------------------------------ reading

    def open(self, url: str, offset: int = 0, length: int | None = None,
             etag: str | None = None) -> S3Reader:
        """Stream object `url` from byte `offset` (`length` bytes, else to its end).

        With `etag`, the read fails (`S3UnavailableError`) if the object was replaced
        since that ETag was seen: pass `reader.etag` when continuing a cut read.
        """
        if offset < 0 or (length is not None and length <= 0):
            raise ValueError(f"{url}: bad byte range: offset {offset}, length {length}")
        bucket, key = split_s3_url(url)
        where = self._where(url)
        arguments: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if offset or length is not None:
            last = "" if length is None else str(offset + length - 1)
            arguments["Range"] = f"bytes={offset}-{last}"
        if etag is not None:
            arguments["IfMatch"] = etag
        try:
            response = self.client.get_object(**arguments)
        except _STORE_ERRORS as error:
            if _error_code(error) == "InvalidRange":
                return self._empty_reader_at_end(url, where, offset)
            raise _classify(error, url, where, f"opening at byte {offset}") from None
        body = response["Body"]
        content_length = int(response["ContentLength"])
        size = offset + content_length
        match = _CONTENT_RANGE.fullmatch(response.get("ContentRange") or "")
        if match is not None:
            if int(match.group(1)) != offset:
                body.close()
                raise S3TransientError(url, f"{where}: asked for byte {offset}, the store "
                                            f"sent {match.group(0)}")
            size = int(match.group(3)) if match.group(3) != "*" else size
        elif offset:  # the store ignored the Range and sends the whole object
            body.close()
            raise S3UnavailableError(url, f"{where}: the store ignored the byte range "
                                          f"request from byte {offset}")
        return S3Reader(url, where, body, offset, offset + content_length, size,
                        response.get("ETag"))

    def _empty_reader_at_end(self, url: str, where: str, offset: int) -> S3Reader:
        info = self.head(url)
        if offset != info["size"]:
            raise S3UnavailableError(url, f"{where}: byte {offset} is past the end of the "
                                          f"object ({info['size']} bytes)")
        return S3Reader(url, where, None, offset, offset, info["size"], info["etag"])

    def head(self, url: str) -> dict[str, Any]:
        """`{"size": bytes, "etag": str}` of object `url`."""
        bucket, key = split_s3_url(url)
        try:
            response = self.client.head_object(Bucket=bucket, Key=key)
        except _STORE_ERRORS as error:
            raise _classify(error, url, self._where(url), "looking it up") from None
        return {"size": int(response["ContentLength"]), "etag": response.get("ETag")}

    def read_range(self, url: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes of `url` from `offset` (e.g. one line of an index)."""
        if length == 0:
            return b""
        with self.open(url, offset, length) as reader:
            data = b""
            while len(data) < length:
                more = reader.read(length - len(data))
                if not more:
                    break
                data += more
        if len(data) != length:
            raise S3UnavailableError(url, f"{self._where(url)}: bytes {offset}.."
                                          f"{offset + length - 1} asked, {len(data)} exist")
        return data

    def fetch(self, url: str) -> bytes:
        """The whole object `url` (an `index.jsonl`; use `open` for shards)."""
        chunks = []
        with self.open(url) as reader:
            while chunk := reader.read(1 << 20):
                chunks.append(chunk)
        return b"".join(chunks)


def _glob_match(url: str, pattern: str) -> bool:
    """`glob`'s rule on keys: wildcards match within one `/`-separated segment."""
    names, parts = url.split("/"), pattern.split("/")
    return len(names) == len(parts) and all(
        fnmatch.fnmatchcase(name, part) for name, part in zip(names, parts, strict=True))


def _error_code(error: BaseException) -> str:
    if isinstance(error, botocore.exceptions.ClientError):
        return str(error.response.get("Error", {}).get("Code", ""))
    return ""


def _classify(error: BaseException, url: str, where: str, doing: str) -> S3Error:
    """The `S3Error` for a botocore/urllib3/socket error met while `doing` something."""
    if isinstance(error, S3Error):
        return error
    if isinstance(error, botocore.exceptions.ClientError):
        code = _error_code(error)
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        message = error.response.get("Error", {}).get("Message") or ""
        detail = f"{where}: {doing}: {code or status}: {message}".rstrip(": ")
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return S3TransientError(url, detail)
        if code in ("PreconditionFailed", "412") or status == 412:
            return S3UnavailableError(url, f"{where}: the object changed since the read "
                                           "began (ETag differs); start it again")
        if code in _DENIED_CODES or status == 403:
            return S3UnavailableError(url, detail, errno.EACCES)
        return S3UnavailableError(url, detail, errno.ENOENT)
    if isinstance(error, (botocore.exceptions.NoCredentialsError,
                          botocore.exceptions.PartialCredentialsError)):
        return S3UnavailableError(url, f"{where}: no usable S3 credentials ({error}); set "
                                       "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or "
                                       "AWS_PROFILE", errno.EACCES)
    if isinstance(error, botocore.exceptions.ParamValidationError):
        return S3UnavailableError(url, f"{where}: {doing}: {error}", errno.ENOENT)
    if isinstance(error, (botocore.exceptions.ReadTimeoutError, TimeoutError)):
        return S3TransientError(url, f"{where}: {doing}: read timed out (no data within the "
                                     f"read timeout; {type(error).__name__})")
    if isinstance(error, botocore.exceptions.ConnectTimeoutError):
        return S3TransientError(url, f"{where}: {doing}: connect timed out")
    # Connection refused/reset/closed, truncated bodies (botocore, urllib3 and socket
    # errors alike): the store may answer again.
    return S3TransientError(url, f"{where}: {doing}: {type(error).__name__}: {error}")

