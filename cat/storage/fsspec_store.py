"""Shards on any store fsspec knows (`gs://`, `az://`, `hf://`, `memory://`, `file://`, ...).

`FsspecStore` gives such stores the semantics `cat.storage.s3.S3Store` gives S3
(`cat.storage.stores` describes them): every call to the store (listing, opening,
each read of a stream) waits at most `timeout` seconds, a hung call becoming a
`TransientStoreError` (the call is left to finish in a daemon thread); listing, opening
and range reads are tried `max_attempts` times in all, 0.5 s, 1 s ... apart, when the
error is transient; errors are classified as transient or unavailable by their type
(`classify`), whatever the backend. A read cut short in the middle of an object is not
retried here: the loader decides, and reads the shard again.

Configuration and credentials are the backend's own (e.g. `GOOGLE_APPLICATION_CREDENTIALS`
for gcsfs, `AZURE_STORAGE_CONNECTION_STRING` for adlfs, `HF_TOKEN` for hf://), and
fsspec reads keyword arguments of a backend from `FSSPEC_<PROTOCOL>_<NAME>` variables
(e.g. `FSSPEC_GS_PROJECT=my-project`) or a JSON object in `FSSPEC_<PROTOCOL>`.

Usage:
    store = FsspecStore("memory", timeout=30)
    urls = store.expand("memory://wds/train/data-{00000..00007}.tar")
    with store.open(urls[0]) as stream:
        head = stream.read(512)
"""

from __future__ import annotations

import errno
import fnmatch
import io
import logging
import os
import posixpath
import queue
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
from braceexpand import braceexpand
from fsspec.registry import known_implementations, registry

from cat.storage.patterns import expand_each
from cat.storage.stores import StoreError, TransientStoreError, UnavailableStoreError

logger = logging.getLogger(__name__)
_GLOB_CHARS = re.compile(r"[*?\[]")
# Errors that are bugs or a missing package, never the store's answer: raised as they are.
_NOT_STORE_ERRORS = (ImportError, TypeError, AttributeError, NameError, NotImplementedError,
                     AssertionError, RecursionError, MemoryError)
_PERMANENT_ERRNOS = {errno.ENOENT: errno.ENOENT, errno.ENOTDIR: errno.ENOENT,
                     errno.EISDIR: errno.ENOENT, errno.EACCES: errno.EACCES,
                     errno.EPERM: errno.EACCES}


def backend_package(scheme: str) -> str | None:
    """The package that implements `scheme` in fsspec (`gcsfs` for gs), None if built in."""
    spec = known_implementations.get(scheme)
    if spec is None:
        return None
    module = spec["class"].split(".", 1)[0]
    return None if module == "fsspec" else module


def check_scheme(scheme: str) -> None:
    """ValueError for a scheme nobody implements; ImportError naming the package to
    install for one whose backend is missing."""
    if scheme not in known_implementations and scheme not in registry:
        supported = sorted({"s3", *known_implementations} - {"http", "https"})
        raise ValueError(f"no store supports {scheme}:// URLs: neither this toolkit (s3://) "
                         f"nor fsspec {fsspec.__version__} knows the scheme; supported: "
                         f"{', '.join(supported)}")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as error:
        package = backend_package(scheme) or "its backend"
        raise ImportError(f"{scheme}:// URLs need the package {package}, which is not "
                          f"installed: pip install {package} ({error})") from None


def classify(error: BaseException, url: str, doing: str) -> StoreError:
    """The `StoreError` for an error a backend raised while `doing` something to `url`."""
    if isinstance(error, StoreError):
        return error
    detail = f"{url}: {doing}: {type(error).__name__}: {error}"
    if isinstance(error, FileNotFoundError):
        return UnavailableStoreError(url, f"{url}: no such object ({doing})")
    if isinstance(error, PermissionError):
        return UnavailableStoreError(url, f"{url}: access denied ({doing}): {error}",
                                     errno.EACCES)
    if isinstance(error, TimeoutError):
        return TransientStoreError(url, f"{url}: {doing}: timed out ({error})")
    if isinstance(error, OSError) and error.errno in _PERMANENT_ERRNOS:
        return UnavailableStoreError(url, detail, _PERMANENT_ERRNOS[error.errno])
    if isinstance(error, (ValueError, KeyError)):
        # A malformed path, an unknown bucket or repository: asking again will not help.
        return UnavailableStoreError(url, detail)
    # Connection errors, server errors, backend-specific exceptions: it may answer again.
    return TransientStoreError(url, detail)


class _BoundedCalls:
    """Runs calls in a daemon thread, waiting at most `timeout` seconds for each.

    A call that does not return in time raises TimeoutError here; its thread is left to
    finish it (it holds nothing of the caller's) and the next call gets a new thread.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._calls: queue.SimpleQueue | None = None

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while (call := calls.get()) is not None:
            function, arguments, box, done = call
            try:
                box["value"] = function(*arguments)
            except BaseException as error:  # handed to the caller, which re-raises it
                box["error"] = error
            done.set()

    def __call__(self, function: Callable[..., Any], *arguments: Any) -> Any:
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._calls,), daemon=True,
                             name="store-call").start()
        box: dict[str, Any] = {}
        done = threading.Event()
        self._calls.put((function, arguments, box, done))
        if not done.wait(self.timeout):
            self._calls.put(None)  # that thread ends once its call returns
            self._calls = None
            raise TimeoutError(f"no answer within {self.timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """End the thread (after its current call)."""
        if self._calls is not None:
            self._calls.put(None)
            self._calls = None


class FsspecReader(io.RawIOBase):
    """One object of an fsspec store as a readable binary stream; every read waits at
    most the store's timeout, and errors are `StoreError`s naming the URL."""

    def __init__(self, url: str, file: Any, calls: _BoundedCalls) -> None:
        super().__init__()
        self.url = url
        self.position = 0
        self._file = file
        self._calls = calls

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if not len(view) or self._file is None:
            return 0
        try:
            data = self._calls(self._file.read, len(view))
        except _NOT_STORE_ERRORS:
            raise
        except Exception as error:
            raise classify(error, self.url, f"reading at byte {self.position}") from None
        view[:len(data)] = data
        self.position += len(data)
        return len(data)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                self._calls(file.close)
            except Exception as error:  # a failed close loses nothing read
                logger.debug("%s: closing: %s", self.url, error)
            self._calls.close()
        super().close()


class FsspecStore:
    """Lists and reads the objects of one fsspec protocol (see the module docstring).

    The filesystem is made on first use and again in a forked child; the store pickles
    without it.
    """

    def __init__(self, protocol: str, timeout: float = 60.0, max_attempts: int = 3,
                 retry_seconds: float = 0.5) -> None:
        self.protocol = protocol
        self.timeout = timeout
        self.max_attempts = max(1, max_attempts)
        self.retry_seconds = retry_seconds
        self._fs: Any = None
        self._fs_pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "timeout": self.timeout,
                "max_attempts": self.max_attempts, "retry_seconds": self.retry_seconds}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of this process."""
        with self._lock:
            if self._fs is None or self._fs_pid != os.getpid():
                self._fs = fsspec.filesystem(self.protocol)
                self._fs_pid = os.getpid()
            return self._fs

    def _call(self, url: str, doing: str, function: Callable[..., Any], *arguments: Any) -> Any:
        """`function(*arguments)` within the timeout, tried `max_attempts` times in all
        while its error is transient."""
        for attempt in range(self.max_attempts):
            calls = _BoundedCalls(self.timeout)
            try:
                return calls(function, *arguments)
            except _NOT_STORE_ERRORS:
                raise
            except Exception as error:
                failure = classify(error, url, doing)
            finally:
                calls.close()
            if not failure.transient or attempt + 1 == self.max_attempts:
                raise failure
            wait = self.retry_seconds * 2 ** attempt
            logger.warning("%s; attempt %d of %d in %.1f s", failure, attempt + 2,
                           self.max_attempts, wait)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _path(self, url: str) -> str:
        return self.fs._strip_protocol(url)

    def _url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    # ------------------------------------------------------------------ listing

    def expand(self, patterns: str | Sequence[str]) -> list[str]:
        """Brace-expand and glob patterns against the store (`cat.storage.stores`)."""
        return expand_each(patterns, self._expand_one)

    def _expand_one(self, pattern: str) -> list[str]:
        found: list[str] = []
        listings: dict[str, set[str]] = {}
        for expanded in braceexpand(pattern):
            path = self._path(expanded)
            if _GLOB_CHARS.search(path):
                matches = sorted(self._call(expanded, "listing", self.fs.glob, path))
                matches = [m for m in matches if _segments_match(m, path)]
                if not matches:
                    raise UnavailableStoreError(expanded, f"{expanded}: pattern {pattern!r} "
                                                          "matches no object")
                found += [self._url(m) for m in matches]
                continue
            folder = posixpath.dirname(path)
            if folder not in listings:
                try:
                    listed = self._call(expanded, "listing", self.fs.ls, folder, False)
                except UnavailableStoreError as error:
                    if error.errno == errno.EACCES:
                        raise
                    listed = []
                listings[folder] = {self._path(name) for name in listed}
            if path not in listings[folder]:
                where = "" if expanded == pattern else f" (expanded from {pattern!r})"
                raise UnavailableStoreError(expanded, f"{expanded}: no such object{where}")
            found.append(self._url(path))
        return found

    # ------------------------------------------------------------------ reading

    def open(self, url: str) -> FsspecReader:
        """Stream object `url` from its start."""
        calls = _BoundedCalls(self.timeout)
        try:
            file = self._call(url, "opening", self.fs.open, self._path(url), "rb")
        except BaseException:
            calls.close()
            raise
        return FsspecReader(url, file, calls)

    def read_range(self, url: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes of `url` from `offset` (e.g. one line of an index)."""
        if length == 0:
            return b""
        data = self._call(url, f"reading bytes {offset}..{offset + length - 1}",
                          self.fs.cat_file, self._path(url), offset, offset + length)
        if len(data) != length:
            raise UnavailableStoreError(url, f"{url}: bytes {offset}..{offset + length - 1} "
                                             f"asked, {len(data)} exist")
        return data

    def fetch(self, url: str) -> bytes:
        """The whole object `url` (an `index.jsonl`; use `open` for shards)."""
        return self._call(url, "reading", self.fs.cat_file, self._path(url))


def _segments_match(path: str, pattern: str) -> bool:
    """`glob`'s rule: wildcards match within one `/`-separated segment."""
    names, parts = path.strip("/").split("/"), pattern.strip("/").split("/")
    return len(names) == len(parts) and all(
        fnmatch.fnmatchcase(name, part) for name, part in zip(names, parts, strict=True))
