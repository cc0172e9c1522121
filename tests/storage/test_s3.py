"""Shards on a real S3-compatible store: SeaweedFS started on 127.0.0.1 by the tests.

One server serves the read-only tests of the module; the tests that freeze or kill a
server mid-read start their own. Every wait is bounded: reads that could hang run in a
thread whose result is awaited with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from cat.storage.s3 import (
    INDEX_NAME,
    S3Options,
    S3Store,
    S3TransientError,
    S3UnavailableError,
    index_url,
    split_s3_url,
)
from cat.testing.imports import disallowed_imports
from cat.testing.seaweedfs import SeaweedS3, seaweedfs_s3
from cat.testing.uio import make_uio_corpus

BUCKET = "corpus"
PREFIX = f"s3://{BUCKET}/wds/train"
# Longer than the socket buffers of both ends, so that a read is really cut mid-object.
BIG_OBJECT_BYTES = 48 << 20
# The most a test waits for a read that should fail; far above the read timeout below.
BOUND_SECONDS = 60


def _write_shards(folder: Path) -> dict[str, bytes]:
    """Three WeNet-style shards plus an index.jsonl; returns relative path -> bytes."""
    texts = {f"A/B/utt.{i}": f"第{i}句" for i in range(6)}
    corpus = make_uio_corpus(folder / "uio", texts, utts_per_shard=2)
    train = folder / "upload" / "wds" / "train"
    train.mkdir(parents=True)
    lines = [json.dumps({"format": "test-index", "num_shards": len(corpus.shards)})]
    for number, shard in enumerate(corpus.shards):
        name = f"data-{number:05d}.tar"
        (train / name).write_bytes(shard.read_bytes())
        lines.append(json.dumps({"shard": name, "num_utts": 2, "keys": ["k"] * number}))
    (train / INDEX_NAME).write_text("\n".join(lines) + "\n")
    (folder / "upload" / "wds" / "dev").mkdir()
    (folder / "upload" / "wds" / "dev" / "data-00000.tar").write_bytes(b"dev shard")
    return {str(p.relative_to(folder / "upload")): p.read_bytes()
            for p in (folder / "upload").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[SeaweedS3, dict[str, bytes]]:
    folder = tmp_path_factory.mktemp("s3")
    files = _write_shards(folder)
    with seaweedfs_s3(folder / "server") as server:
        server.create_bucket(BUCKET)
        server.upload_folder(folder / "upload", BUCKET)
        yield server, files


@pytest.fixture
def store(served, monkeypatch) -> S3Store:
    """A store configured the usual way: keys and endpoint from the environment."""
    server, _ = served
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return S3Store(S3Options(read_timeout=10, max_attempts=2))


def test_brace_pattern_expands_against_the_bucket(store):
    urls = store.expand(f"{PREFIX}/data-{{00000..00002}}.tar")
    assert urls == [f"{PREFIX}/data-0000{i}.tar" for i in range(3)]


def test_globs_match_within_one_path_segment(store):
    assert store.expand(f"s3://{BUCKET}/wds/*/data-00000.tar") == [
        f"s3://{BUCKET}/wds/dev/data-00000.tar", f"{PREFIX}/data-00000.tar"]
    assert store.expand(f"{PREFIX}/data-0000[12].tar") == [
        f"{PREFIX}/data-00001.tar", f"{PREFIX}/data-00002.tar"]
    with pytest.raises(S3UnavailableError, match="matches no object"):
        store.expand(f"s3://{BUCKET}/*/data-00000.tar")


def test_missing_objects_of_a_pattern_are_named(store):
    with pytest.raises(S3UnavailableError, match=r"data-00003\.tar.*no such object") as error:
        store.expand(f"{PREFIX}/data-{{00000..00003}}.tar")
    assert error.value.url == f"{PREFIX}/data-00003.tar"
    assert error.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="listed twice"):
        store.expand([f"{PREFIX}/data-00000.tar", f"{PREFIX}/data-0000[0].tar"])


def test_objects_stream_as_files_a_tar_reader_can_read(store, served):
    _, files = served
    url = f"{PREFIX}/data-00001.tar"
    with store.open(url) as reader:
        assert reader.size == len(files["wds/train/data-00001.tar"])
        assert reader.etag
        with tarfile.open(fileobj=io.BufferedReader(reader), mode="r|") as tar:
            names = [member.name for member in tar]
    assert names == ["A/B/utt.2.txt", "A/B/utt.2.wav", "A/B/utt.3.txt", "A/B/utt.3.wav"]


def test_reads_start_at_any_byte_offset(store, served):
    _, files = served
    url = f"{PREFIX}/data-00002.tar"
    data = files["wds/train/data-00002.tar"]
    with store.open(url, offset=1000) as reader:
        assert reader.position == 1000 and reader.size == len(data)
        first = reader.read(700)
        assert reader.position == 1700
        rest = reader.read()
    assert first + rest == data[1000:]
    with store.open(url, offset=len(data) - 10, etag=reader.etag) as tail:
        assert tail.read() == data[-10:]
    with store.open(url, offset=len(data)) as end:
        assert end.read() == b""
    with pytest.raises(S3UnavailableError, match="past the end"):
        store.open(url, offset=len(data) + 1)


def test_index_is_fetched_from_the_shards_prefix(store, served):
    _, files = served
    url = index_url(f"{PREFIX}/data-00001.tar")
    assert url == f"{PREFIX}/{INDEX_NAME}"
    assert index_url(f"{PREFIX}/") == url
    index = files[f"wds/train/{INDEX_NAME}"]
    assert store.fetch(url) == index
    with io.BufferedReader(store.open(url)) as lines:
        records = [json.loads(line) for line in lines]
    assert [r.get("shard") for r in records[1:]] == [f"data-0000{i}.tar" for i in range(3)]
    start = index.index(b'{"shard": "data-00001.tar"')
    length = index.index(b"\n", start) + 1 - start
    assert json.loads(store.read_range(url, start, length))["shard"] == "data-00001.tar"
    with pytest.raises(S3UnavailableError, match="asked"):
        store.read_range(url, len(index) - 5, 50)


def test_missing_keys_and_buckets_are_unavailable_and_named(store):
    for url in (f"{PREFIX}/data-09999.tar", "s3://no-such-bucket/data.tar"):
        with pytest.raises(S3UnavailableError) as error:
            store.open(url)
        assert str(error.value).startswith(url) and error.value.errno == errno.ENOENT
        assert not error.value.transient


def test_bad_credentials_and_anonymous_requests_are_denied(store, monkeypatch):
    url = f"{PREFIX}/data-00000.tar"
    with pytest.raises(S3UnavailableError, match=r"endpoint http://127\.0\.0\.1") as error:
        S3Store(S3Options(anonymous=True, max_attempts=1)).open(url)
    assert error.value.errno == errno.EACCES
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(S3UnavailableError, match="SignatureDoesNotMatch") as error:
        S3Store(S3Options(max_attempts=1)).open(url)
    assert error.value.errno == errno.EACCES


def test_a_replaced_object_is_not_continued(store):
    with pytest.raises(S3UnavailableError, match="changed since the read began"):
        store.open(f"{PREFIX}/data-00000.tar", offset=10, etag='"0123456789abcdef"')


def test_endpoint_comes_from_the_argument_then_the_environment(store, served, monkeypatch):
    server, _ = served
    assert S3Options().endpoint() == server.endpoint_url
    assert S3Options(endpoint_url="http://127.0.0.1:1").endpoint() == "http://127.0.0.1:1"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    assert S3Store().fetch(f"s3://{BUCKET}/wds/dev/data-00000.tar") == b"dev shard"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert S3Options().endpoint() is None


def test_urls_split_into_bucket_and_key():
    assert split_s3_url("s3://b/p/q.tar") == ("b", "p/q.tar")
    assert split_s3_url("s3://b") == ("b", "")
    for bad in ("http://b/k", "s3:///k"):
        with pytest.raises(ValueError):
            split_s3_url(bad)


# ------------------------------------------------------------ a server that fails mid-read


@pytest.fixture
def fragile(tmp_path, monkeypatch) -> tuple[SeaweedS3, bytes, str]:
    """A server of its own holding one large object, for tests that freeze or kill it."""
    data = np.random.default_rng(0).bytes(BIG_OBJECT_BYTES)
    (tmp_path / "upload").mkdir()
    (tmp_path / "upload" / "big.tar").write_bytes(data)
    with seaweedfs_s3(tmp_path / "server") as server:
        server.create_bucket(BUCKET)
        [url] = server.upload_folder(tmp_path / "upload", BUCKET, "wds")
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)
        yield server, data, url


def _read_until_error(reader, chunk: int = 1 << 20) -> tuple[bytes, BaseException | None]:
    parts = []
    try:
        while part := reader.read(chunk):
            parts.append(part)
    except Exception as error:
        return b"".join(parts), error
    return b"".join(parts), None


def _bounded(function, *args):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(function, *args).result(timeout=BOUND_SECONDS)


@pytest.mark.slow
def test_a_hung_server_times_out_and_the_read_continues_where_it_stopped(fragile):
    server, data, url = fragile
    store = S3Store(S3Options(read_timeout=2, max_attempts=1))
    reader = store.open(url)
    head = reader.read(1 << 20)
    server.pause()
    try:
        more, error = _bounded(_read_until_error, reader)
    finally:
        server.resume()
    reader.close()
    assert isinstance(error, S3TransientError), error
    assert str(error).startswith(url) and "read timed out" in str(error)
    received = head + more
    assert 0 < len(received) < len(data) and reader.position == len(received)
    with store.open(url, offset=reader.position, etag=reader.etag) as rest:
        assert received + rest.read() == data


@pytest.mark.slow
def test_a_stopped_server_gives_a_transient_error_naming_the_url(fragile):
    server, data, url = fragile
    store = S3Store(S3Options(read_timeout=5, connect_timeout=2, max_attempts=2))
    reader = store.open(url)
    reader.read(1 << 20)
    server.stop()
    received, error = _bounded(_read_until_error, reader)
    reader.close()
    assert isinstance(error, S3TransientError), error
    assert error.transient and error.url == url and str(error).startswith(url)
    assert len(received) < len(data)
    with pytest.raises(S3TransientError) as reopen:
        _bounded(store.open, url, reader.position)
    assert str(reopen.value).startswith(url) and reopen.value.errno == errno.EIO


def test_the_storage_package_imports_only_what_it_may():
    allowed = {"numpy", "boto3", "botocore", "fsspec", "braceexpand", "cat.core.io"}
    assert disallowed_imports("cat.storage", allowed) == {}


def test_a_store_pickles_without_its_client():
    store = S3Store(S3Options(endpoint_url="http://127.0.0.1:1", read_timeout=7))
    copy = pickle.loads(pickle.dumps(store))
    assert copy.options == store.options and copy._client is None
