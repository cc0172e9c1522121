"""Tar reading: the streaming member reader against tarfile, header checks, skipping."""

from __future__ import annotations

import gzip
import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import cat
from cat.loading.readahead import iter_shard_items
from cat.loading.tar import CorruptShardError, iter_tar_members
from cat.testing.shards import claim_member_size
from cat.testing.training import write_tiny_experiment

REPO_ROOT = Path(cat.__file__).resolve().parent.parent


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


_READ_UNDER_A_MEMORY_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from cat.loading.gunzip import tar_stream
from cat.loading.tar import BufferPool, CorruptShardError, iter_tar_members
path, limit = sys.argv[1], int(sys.argv[2])


class Pipe:  # a stream that cannot say how much it holds
    def __init__(self, stream):
        self.read = stream.read


with open(path, "rb") as f:
    stream = Pipe(f) if len(sys.argv) > 3 else tar_stream(f, path)
    try:
        for _ in iter_tar_members(stream, path, BufferPool(), limit=limit) if limit else \\
                iter_tar_members(stream, path, BufferPool()):
            pass
    except CorruptShardError as error:
        print(f"corrupt: {error}")
# The peak of this program's memory (ru_maxrss would include the forking parent's).
with open("/proc/self/status") as status:
    print(next(line for line in status if line.startswith("VmHWM:")))
"""


@pytest.mark.parametrize(("claim", "limit"), [(1 << 40, 0), (700 << 20, -1)])
def test_a_header_claiming_a_huge_member_is_corrupt_and_allocates_nothing(shard, tmp_path,
                                                                           claim, limit):
    """1 TiB in a shard without an index (the sanity bound), 700 MiB in an indexed one
    (bounded by its size): the shard is corrupt, named, and nothing is allocated for the
    claim (the reader runs under a 1 GiB address-space limit)."""
    damaged = tmp_path / "data-00000.tar"
    damaged.write_bytes(shard.read_bytes())
    name = claim_member_size(damaged, claim, member=2)
    limit = damaged.stat().st_size if limit < 0 else limit
    run = subprocess.run([sys.executable, "-c", _READ_UNDER_A_MEMORY_LIMIT, str(damaged),
                          str(limit)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"corrupt: {damaged}: member {name!r}: its tar header claims {claim} bytes" \
        in run.stdout, run.stdout
    assert int(run.stdout.split("VmHWM:")[1].split()[0]) < 200 << 10  # KiB: under 200 MiB


@pytest.mark.parametrize("kind", ["plain", "gzip", "pipe"])
def test_a_claim_the_shard_cannot_hold_allocates_nothing(shard, tmp_path, kind):
    """900 MB claimed in a small shard without an index (under the 1 GiB sanity bound):
    checked against what the file, or at most 1032 times what the gzip stream, still
    holds, before anything is allocated; a stream that cannot say is read in pieces, so
    memory follows what arrives (before: a 0.9 GB buffer, then the error)."""
    damaged = tmp_path / "data-00000.tar"
    damaged.write_bytes(shard.read_bytes())
    name = claim_member_size(damaged, 900_000_000, member=2)
    if kind == "gzip":
        damaged = damaged.with_name("data-00000.tar.gz")
        damaged.write_bytes(gzip.compress((tmp_path / "data-00000.tar").read_bytes()))
    run = subprocess.run([sys.executable, "-c", _READ_UNDER_A_MEMORY_LIMIT, str(damaged), "0",
                          *(["pipe"] if kind == "pipe" else [])], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    message = (rf"corrupt: {damaged}: member {name!r} truncated \(\d+ of 900000000 bytes\)"
               if kind == "pipe" else
               rf"corrupt: {damaged}: member {name!r} truncated: its tar header claims "
               rf"900000000 bytes, the shard holds at most \d+ more \(or the header is "
               rf"damaged\)")
    assert re.search(message, run.stdout), run.stdout
    assert int(run.stdout.split("VmHWM:")[1].split()[0]) < 200 << 10  # KiB: under 200 MiB
