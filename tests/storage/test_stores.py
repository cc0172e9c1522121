"""One interface to the stores: fsspec's in-memory and local filesystems (and test
filesystems that hang or fail) listed and read with this toolkit's semantics: brace and
glob patterns, bounded waits, retries, transient against unavailable, clear errors for
schemes nobody supports and backends not installed; store clients imported only when a
URL needs them."""

from __future__ import annotations

import errno
import importlib.util
import json
import pickle
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations

from cat.loading.sources import TRANSIENT, UNAVAILABLE, classify, read_shard
from cat.storage.fsspec_store import FsspecStore, backend_package
from cat.storage.stores import (
    TransientStoreError,
    UnavailableStoreError,
    index_url,
    is_store_url,
    store_for,
    store_place,
)
from cat.testing.uio import make_uio_corpus


@pytest.fixture
def bucket():
    """A fresh `memory://<name>/wds/train` with three WeNet shards and an index."""
    name = f"speech-{uuid.uuid4().hex[:8]}"
    fs = fsspec.filesystem("memory")
    yield name, fs
    fs.rm(f"/{name}", recursive=True)


def _upload(fs, tmp_path, prefix: str) -> dict[str, bytes]:
    corpus = make_uio_corpus(tmp_path, {f"A/B/utt.{i}": f"第{i}句" for i in range(6)},
                             utts_per_shard=2)
    objects = {}
    for number, shard in enumerate(corpus.shards):
        objects[f"{prefix}/data-{number:05d}.tar"] = shard.read_bytes()
    objects[f"{prefix}/{index_url(prefix + '/x').rpartition('/')[2]}"] = b'{"format": 1}\n'
    for url, data in objects.items():
        fs.pipe_file(url, data)
    return objects


def test_memory_store_expands_patterns_and_reads_objects(bucket, tmp_path):
    name, fs = bucket
    prefix = f"memory://{name}/wds/train"
    objects = _upload(fs, tmp_path, prefix)
    store = store_for(prefix + "/data-00000.tar", timeout=10)
    assert isinstance(store, FsspecStore) and is_store_url(prefix)
    shards = [f"memory:///{name}/wds/train/data-{n:05d}.tar" for n in range(3)]
    assert store.expand(prefix + "/data-{00000..00002}.tar") == shards
    assert store.expand(prefix + "/data-*.tar") == shards
    assert store.expand([prefix + "/data-0000[02].tar"]) == [shards[0], shards[2]]
    with pytest.raises(UnavailableStoreError, match=r"data-00003\.tar: no such object "
                                                    r"\(expanded from") as missing:
        store.expand(prefix + "/data-{00000..00007}.tar")
    assert missing.value.errno == errno.ENOENT and classify(missing.value) == UNAVAILABLE
    with pytest.raises(UnavailableStoreError, match="matches no object"):
        store.expand(prefix + "/*/data-*.tar")  # wildcards stay within one segment
    with store.open(shards[1]) as stream:
        assert stream.read() == objects[prefix + "/data-00001.tar"]
    assert store.read_range(shards[2], 100, 412) == objects[prefix + "/data-00002.tar"][100:512]
    assert json.loads(store.fetch(index_url(shards[0]))) == {"format": 1}
    assert [n for n, _ in read_shard(shards[0])][:2] == ["A/B/utt.0.txt", "A/B/utt.0.wav"]
    with pytest.raises(UnavailableStoreError, match="no such object") as gone:
        store.open(prefix + "/data-00009.tar")
    assert str(gone.value).startswith(prefix + "/data-00009.tar")
    assert store_place(shards[0]) == f"memory://{name}"
    copy = pickle.loads(pickle.dumps(store))
    assert copy.protocol == "memory" and copy._fs is None


def test_local_files_through_file_urls(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data-00000.tar").write_bytes(b"x" * 1000)
    url = f"file://{tmp_path}/a/data-00000.tar"
    store = store_for(url)
    assert store.expand(f"file://{tmp_path}/a/data-*.tar") == [url]
    assert store.read_range(url, 10, 5) == b"xxxxx"
    assert index_url(url) == f"file://{tmp_path}/a/index.jsonl"


class _MemoryAlias(MemoryFileSystem):
    """fsspec's memory store under another scheme (its objects are shared)."""

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace(f"{cls.protocol}://", "memory://", 1))


class HangingFileSystem(_MemoryAlias):
    """Memory objects whose reads never answer (a hung store)."""

    protocol = "hangmem"
    release = threading.Event()

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.release.wait(30)
        return super().cat_file(path, start, end, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        file = super()._open(path, mode, **kwargs)
        real = file.read

        def read(*arguments):
            self.release.wait(30)
            return real(*arguments)

        file.read = read
        return file


class FlakyFileSystem(_MemoryAlias):
    """Memory objects whose listing fails `failures` times (a connection error), and
    whose `denied` paths refuse access."""

    protocol = "flakymem"
    failures = 0
    calls = 0
    denied: tuple[str, ...] = ()

    def ls(self, path, detail=True, **kwargs):
        type(self).calls += 1
        if any(path.startswith(d) for d in self.denied):
            raise PermissionError(errno.EACCES, "access denied", path)
        if type(self).failures > 0:
            type(self).failures -= 1
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return super().ls(path, detail, **kwargs)


@pytest.fixture
def test_filesystems(monkeypatch):
    for cls in (HangingFileSystem, FlakyFileSystem):
        fsspec.register_implementation(cls.protocol, cls, clobber=True)
    yield
    HangingFileSystem.release.set()
    HangingFileSystem.release = threading.Event()


def test_a_hung_store_gives_a_transient_error_within_the_timeout(test_filesystems, bucket):
    name, fs = bucket
    fs.pipe_file(f"/{name}/data-00000.tar", b"y" * 4096)
    store = FsspecStore("hangmem", timeout=0.5, max_attempts=2, retry_seconds=0.05)
    url = f"hangmem://{name}/data-00000.tar"
    began = time.monotonic()
    reader = store.open(url)
    with pytest.raises(TransientStoreError, match=r"timed out") as hung:
        reader.read(100)
    assert time.monotonic() - began < 5
    assert hung.value.errno == errno.EIO and classify(hung.value) == TRANSIENT
    assert str(hung.value).startswith(url)
    began = time.monotonic()
    with pytest.raises(TransientStoreError, match="timed out"):
        store.read_range(url, 0, 10)  # two attempts of 0.5 s
    assert 1.0 <= time.monotonic() - began < 5
    reader.close()


def test_transient_listing_errors_are_retried_and_denial_is_not(test_filesystems, bucket):
    name, fs = bucket
    fs.pipe_file(f"/{name}/a/data-00000.tar", b"z")
    store = FsspecStore("flakymem", timeout=5, max_attempts=3, retry_seconds=0.01)
    FlakyFileSystem.failures, FlakyFileSystem.calls = 2, 0
    assert store.expand(f"flakymem://{name}/a/data-00000.tar") == \
        [f"flakymem:///{name}/a/data-00000.tar"]
    assert FlakyFileSystem.calls == 3
    FlakyFileSystem.failures = 5
    with pytest.raises(TransientStoreError, match="ConnectionResetError") as flaky:
        store.expand(f"flakymem://{name}/a/data-00000.tar")
    assert classify(flaky.value) == TRANSIENT
    FlakyFileSystem.failures, FlakyFileSystem.calls = 0, 0
    FlakyFileSystem.denied = (f"/{name}/a",)
    try:
        with pytest.raises(UnavailableStoreError, match="access denied") as denied:
            store.expand(f"flakymem://{name}/a/data-00000.tar")
    finally:
        FlakyFileSystem.denied = ()
    assert denied.value.errno == errno.EACCES and FlakyFileSystem.calls == 1


def test_unknown_schemes_and_missing_backends_are_named(monkeypatch):
    with pytest.raises(ValueError, match=r"no store supports nosuchstore:// URLs.*"
                                         r"supported: .*\bgs\b.*\bs3\b"):
        store_for("nosuchstore://bucket/data-00000.tar")
    monkeypatch.setitem(known_implementations, "fakestore", {
        "class": "cat_fake_backend_package.FakeFileSystem",
        "err": "Install cat_fake_backend_package to access the fake store"})
    assert backend_package("fakestore") == "cat_fake_backend_package"
    with pytest.raises(ImportError, match=r"fakestore:// URLs need the package "
                                          r"cat_fake_backend_package, which is not installed: "
                                          r"pip install cat_fake_backend_package"):
        store_for("fakestore://bucket/data-00000.tar")
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(ImportError, match=r"gs:// URLs need the package gcsfs, which is "
                                              r"not installed: pip install gcsfs"):
            store_for("gs://bucket/wds/data-00000.tar")
    assert backend_package("gs") == "gcsfs" and backend_package("hf") == "huggingface_hub"
    assert backend_package("memory") is None


def test_loading_local_shards_imports_no_store_client():
    code = ("import sys, cat.loading.stream, cat.formats.prep_wds, cat.training.train_data; "
            "print(sorted(m for m in ('boto3', 'botocore', 'fsspec', 's3fs') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert run.stdout.split() == ["[]"]
