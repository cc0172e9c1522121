"""The shard writer's bytes against the standard library's tarfile writing the same members
(the writer before it wrote tars itself), and its tars read back by tarfile."""

from __future__ import annotations

import io
import itertools
import os
import tarfile
import zlib

import numpy as np
import pytest

from cat.core.io import iter_table
from cat.formats.shard_format import encode_key
from cat.formats.shard_writer import (
    ShardJob,
    TarStream,
    member_header,
    member_info,
    write_shard,
)
from cat.testing.features import write_feature_corpus

KEYS = ["sp0.9-BAC009S0002W0122", "说话人-甲-001", "k" * 96, "x" * 97, "y" * 150, "empty",
        "a/b%c"]


def reference_tar(members: list[tuple[str, bytes]]) -> bytes:
    """The tar tarfile writes (PAX format) with the writer's fixed metadata."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            tar.addfile(member_info(name, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_shards_are_the_bytes_tarfile_writes(tmp_path, dtype):
    frames = [7, 1, 3, 12, 5, 0, 2]
    texts = {key: text for key, text in zip(KEYS, ["你好 世界", "", "a", "b" * 700, "é",
                                                   "空", "x y"], strict=True)}
    corpus = write_feature_corpus(tmp_path / "corpus", keys=KEYS, num_frames=frames, dim=5,
                                  num_arks=2, transcripts=texts)
    locations = dict(iter_table(corpus.feats_scp))
    order = [KEYS[i] for i in (3, 0, 6, 1, 5, 2, 4)]
    entries = [(key, locations[key], texts[key], len(corpus.features[key])) for key in order]
    result = write_shard(ShardJob(str(tmp_path / "data-00000.tar"), entries, dtype))

    expected = reference_tar([
        member for key in order for member in (
            (f"{encode_key(key)}.npy", npy_bytes(corpus.features[key].astype(dtype))),
            (f"{encode_key(key)}.txt", texts[key].encode("utf-8")))])
    written = (tmp_path / "data-00000.tar").read_bytes()
    assert written == expected
    assert result == {"num_bytes": len(expected), "crc32": f"{zlib.crc32(expected):08x}",
                      "feat_dim": 5, "dropped": []}
    with tarfile.open(tmp_path / "data-00000.tar") as tar:
        names = tar.getnames()
        assert names[0] == f"{encode_key(order[0])}.npy" and len(names) == 2 * len(order)
        array = np.load(io.BytesIO(tar.extractfile(names[0]).read()))
    assert np.array_equal(array, corpus.features[order[0]].astype(dtype))


@pytest.mark.parametrize("name", ["a.npy", "x" * 99 + ".", "x" * 101, "键.txt", "a b\tc",
                                  "%2E.npy"])
@pytest.mark.parametrize("size", [0, 1, 511, 512, 8 ** 11 - 1, 8 ** 11])
def test_member_headers_match_tarfile(name, size):
    assert member_header(name, size) == member_info(name, size).tobuf(
        tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def test_short_writes_are_completed(tmp_path, monkeypatch):
    corpus = write_feature_corpus(tmp_path / "corpus", keys=["a", "b"], num_frames=[9, 4],
                                  dim=3)
    locations = dict(iter_table(corpus.feats_scp))
    entries = [(key, locations[key], "t", len(corpus.features[key])) for key in ("a", "b")]
    write_shard(ShardJob(str(tmp_path / "whole.tar"), entries))
    writev = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, buffers: writev(fd, [
        bytes(memoryview(buffers[0])[:100])]))
    write_shard(ShardJob(str(tmp_path / "short.tar"), entries))
    assert (tmp_path / "short.tar").read_bytes() == (tmp_path / "whole.tar").read_bytes()


def test_tar_streams_end_as_tarfile_ends_them(tmp_path):
    # Every remainder of the last 10 KiB record: the end blocks and the record's padding.
    rng = np.random.default_rng(0)
    for case in range(60):
        members = [(f"m{i}.npy", bytes(rng.integers(0, 256, int(size), dtype=np.uint8)))
                   for i, size in enumerate(rng.integers(0, 3000, case % 7))]
        members.append(("last.txt", b"x" * (case * 512 % tarfile.RECORDSIZE)))
        path = tmp_path / f"{case}.tar"
        with open(path, "wb") as f:
            stream = TarStream(f.fileno())
            for name, data in members:
                stream.add(name, data)
            stream.close()
        assert path.read_bytes() == reference_tar(members), case
        assert stream.size == path.stat().st_size


def test_tar_stream_hands_its_bytes_to_writeback_as_it_goes(tmp_path, monkeypatch):
    # Every `writeback_bytes` written, the range written since the last call goes to the
    # kernel's writeback (so the shard's fsync has little left to wait for); the ranges
    # are contiguous from 0, and the bytes are still tarfile's.
    import cat.formats.shard_writer as shard_writer

    calls = []
    monkeypatch.setattr(shard_writer, "start_writeback",
                        lambda fd, offset, length: calls.append((offset, length)))
    rng = np.random.default_rng(1)
    members = [(f"m{i}.npy", bytes(rng.integers(0, 256, 5000, dtype=np.uint8)))
               for i in range(20)]
    path = tmp_path / "a.tar"
    with open(path, "wb") as f:
        stream = TarStream(f.fileno(), writeback_bytes=16384)
        for name, data in members:
            stream.add(name, data)
        stream.close()
    assert path.read_bytes() == reference_tar(members)
    assert len(calls) >= 5
    assert calls[0][0] == 0 and all(length >= 16384 for _, length in calls)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(calls))
    assert calls[-1][0] + calls[-1][1] <= stream.size


def test_start_writeback_accepts_a_real_file(tmp_path):
    from cat.core.io import start_writeback

    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x" * 100000)
        f.flush()
        start_writeback(f.fileno(), 0, 100000)
        start_writeback(f.fileno(), 0, 0)
    assert path.read_bytes() == b"x" * 100000
