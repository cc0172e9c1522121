"""Tar reading: the streaming member reader against tarfile, header checks, skipping."""

from __future__ import annotations

import io
import tarfile

import pytest

from cat.loading.readahead import iter_shard_items
from cat.loading.tar import CorruptShardError, iter_tar_members
from cat.testing.training import write_tiny_experiment


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    write_tiny_experiment(root, num_train=8, utts_per_shard=4)
    return root / "data/wds/train/data-00000.tar"


class _Unseekable:
    """A stream that can only be read (like a pipe or an HTTP response)."""

    def __init__(self, data: bytes) -> None:
        self.stream = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self.stream.read(size)


def test_tar_reader_agrees_with_tarfile_and_checks_headers(shard):
    with tarfile.open(shard) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    with open(shard, "rb") as f:
        assert list(iter_tar_members(f, str(shard))) == expected
    long_name = "x" * 150 + ".txt"
    for tar_format in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as tar:
            for name, data in ((long_name, b"long"), ("dir/a.npy", b"\0" * 700)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        buffer.seek(0)
        assert list(iter_tar_members(buffer, "mem")) == [(long_name, b"long"),
                                                         ("dir/a.npy", b"\0" * 700)]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    with pytest.raises(CorruptShardError, match="checksum mismatch"):
        list(iter_tar_members(io.BytesIO(bytes(data)), "broken.tar"))
    with pytest.raises(CorruptShardError, match=r"broken.tar: member .* truncated"):
        list(iter_tar_members(io.BytesIO(shard.read_bytes()[:1500]), "broken.tar"))


def test_members_can_be_passed_over_unread_on_files_and_streams(shard):
    with tarfile.open(shard) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    wanted = {name for name, _ in expected[2:5]}
    asked = []

    def keep(name):
        asked.append(name)
        return name in wanted

    with open(shard, "rb") as f:
        seeked = list(iter_tar_members(f, str(shard), keep=keep))
    streamed = list(iter_tar_members(_Unseekable(shard.read_bytes()), "s", keep=keep))
    want = [(name, data if name in wanted else None) for name, data in expected]
    assert seeked == streamed == want
    assert asked == [name for name, _ in expected] * 2
    with pytest.raises(CorruptShardError, match="truncated"):
        list(iter_tar_members(_Unseekable(shard.read_bytes()[:3000]), "s", keep=lambda n: False))


def test_shard_items_pass_the_filter_of_each_shard(shard):
    items = list(iter_shard_items([(0, str(shard)), (1, str(shard))], 0,
                                  keep={1: lambda name: name.endswith(".txt")}))
    read = {(i[1], i[2]): i[3] is not None for i in items if i[0] == "member"}
    assert len(read) == 16
    assert all(read[shard_index, name] == (shard_index == 0 or name.endswith(".txt"))
               for shard_index, name in read)
    assert [i[:2] for i in items if i[0] == "end"] == [("end", 0), ("end", 1)]
