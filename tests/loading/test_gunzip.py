"""Gzip-compressed WeNet shards (`shards_000000000.tar.gz`) stream with decompression:
every utterance once per epoch, from a pattern or a data.list, exact resume (re-reading
the compressed shard from its start, counted), damaged data reported as corrupt."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
from zlib_ng import zlib_ng

import cat
from cat.audio.codec import decode, to_float32, to_int16
from cat.features.fbank import compute_fbank
from cat.formats.shard_index import index_folder
from cat.loading.gunzip import (
    EXPANSION_ALLOWANCE,
    MAX_EXPANSION,
    GunzipReader,
    is_gzip_shard,
)
from cat.loading.progress import StreamProgress
from cat.loading.samples import AudioConfig, StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.loading.tar import CorruptShardError, iter_tar_members
from cat.testing.epochs import features_by_key, run_epoch
from cat.testing.uio import make_uio_corpus, synth_wav
from cat.text import tokenizer as tk

TEXTS = {"BAC009S0002W0122": "而对楼市成交抑制作用最大的", "A/B/utt.1": "今天天气很好",
         "spk-2/x.y.z": "我们一起去", "IC0001W0001": "北京", "IC0001W0002": "上海市",
         "sp/0.9/IC0001W0003": "天气很好", "IC0001W0004": "一起", "IC0001W0005": "成交"}
FEAT_DIM = 80
REPO_ROOT = Path(cat.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """WeNet-style shards written by an independent tarfile writer, gzip-compressed,
    with the folder indexed (`prep_wds index`)."""
    corpus = make_uio_corpus(tmp_path_factory.mktemp("uio"), TEXTS, utts_per_shard=2,
                             gzip=True)
    assert all(shard.name.endswith(".tar.gz") for shard in corpus.shards)
    index_folder(corpus.shards[0].parent)
    return corpus


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    text = folder / "text"
    text.write_text("".join(f"u{i} {v}\n" for i, v in enumerate(TEXTS.values())),
                    encoding="utf-8")
    tk.save(tk.train_sentencepiece([text], "char", 0), folder / "tokenizer.tknz")
    return str(folder / "tokenizer.tknz")


def _stream(patterns, tokenizer, workers=0, **options) -> ShardStream:
    config = {"batch_size": 2, "max_frames": 0, "shuffle_buffer": 3, "sort_buffer": 2,
              "retry_seconds": 0.05, "audio": AudioConfig(), **options}
    return ShardStream(load_shard_list(patterns), tokenizer,
                       StreamConfig.with_defaults(**config), None, FEAT_DIM, 0, 1, workers)


def _run_epoch(stream, epoch, workers=0, **options):
    """`run_epoch` with each batch's features."""
    return run_epoch(stream, epoch, workers, features=True, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_gzip_shards_train_every_utterance_once_per_epoch(corpus, tokenizer, workers):
    folder = corpus.shards[0].parent
    for patterns in (f"{folder}/shards_*.tar.gz", str(corpus.shard_list)):
        stream = _stream(patterns, tokenizer, workers)
        assert [is_gzip_shard(url) for url in stream.shards.urls] == [True] * 4
        assert not stream.shards.estimated.any()  # exact counts from the index
        for epoch in (1, 2):
            batches, progress = _run_epoch(stream, epoch, workers)
            found = features_by_key(batches)
            assert sorted(found) == sorted(TEXTS)
            summary = progress.summary()
            assert summary["trained"] == len(TEXTS) and summary["not_trained"] == 0
            assert not summary["corrupt_shards"] and not summary["dropped"]
    key = "A/B/utt.1"
    waveform, _ = decode((corpus.raw_list.parent / "wav" / f"{key}.wav").read_bytes(), key)
    expected = compute_fbank(to_float32(to_int16(waveform)), 16000, AudioConfig().fbank)
    np.testing.assert_allclose(found[key], expected, rtol=0, atol=1e-4)


def test_resume_rereads_the_compressed_shard_from_its_start_and_counts_it(corpus, tokenizer):
    def stream():
        return _stream(str(corpus.shard_list), tokenizer, batch_size=1, shuffle_buffer=2)

    full, _ = _run_epoch(stream(), 3)
    first, progress = _run_epoch(stream(), 3, limit=3)
    state = progress.state()
    assert state["resume_reread_shards"] == 0
    resumed_stream = stream()
    resumed = StreamProgress(resumed_stream.shards,
                             [resumed_stream.worker_shards(3, 0, 1)])
    resumed.restore(state)
    rest, resumed = _run_epoch(resumed_stream, 3, progress=resumed)
    assert [k for keys, _ in first + rest for k in keys] == [k for keys, _ in full for k in keys]
    summary = resumed.summary()
    assert summary["trained"] == len(TEXTS) and summary["not_trained"] == 0
    # The shard being read and those of the buffered samples are decompressed again.
    assert 1 <= summary["resume_reread_shards"] <= 3
    assert resumed.state()["resume_reread_shards"] == summary["resume_reread_shards"]


def test_gzip_shards_on_a_store_stream_through_the_read_ahead_thread(corpus, tokenizer):
    fs = fsspec.filesystem("memory")
    folder = f"/gzip-{uuid.uuid4().hex[:8]}/shards"
    for path in [*corpus.shards, corpus.shards[0].parent / "index.jsonl"]:
        fs.pipe_file(f"{folder}/{path.name}", path.read_bytes())
    try:
        stream = _stream(f"memory://{folder}/shards_*.tar.gz", tokenizer, read_ahead_mb=1)
        assert not stream.shards.estimated.any()
        batches, progress = _run_epoch(stream, 1)
        assert sorted(features_by_key(batches)) == sorted(TEXTS)
        summary = progress.summary()
        assert summary["not_trained"] == 0 and not summary["corrupt_shards"]
    finally:
        fs.rm(folder.rsplit("/", 1)[0], recursive=True)


def test_a_truncated_gzip_shard_is_corrupt_and_the_others_train(corpus, tokenizer, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for shard in corpus.shards:
        (folder / shard.name).write_bytes(shard.read_bytes())
    (folder / "index.jsonl").write_bytes((corpus.shards[0].parent / "index.jsonl").read_bytes())
    damaged = folder / corpus.shards[1].name
    damaged.write_bytes(damaged.read_bytes()[:damaged.stat().st_size // 2])
    stream = _stream(f"{folder}/*.tar.gz", tokenizer, bad_shard_limit=0.5)
    _, progress = _run_epoch(stream, 1)
    summary = progress.summary()
    assert summary["corrupt_shards"] == [str(damaged)]
    assert "truncated" in progress.corrupt[0][1]
    # A cut utterance is lost with its shard, or dropped as incomplete when a member of it
    # came before the cut.
    assert summary["trained"] + summary["corrupt_missing"] \
        + sum(summary["dropped"].values()) == len(TEXTS) and summary["trained"] >= 6
    assert summary["unavailable_shards"] == []


def _tar(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_gunzip_reader_reads_concatenated_members_and_refuses_damage():
    members = {f"u{i}.wav": os.urandom(50_000) + bytes(200_000) for i in range(4)}
    plain = _tar(members)
    # Two gzip members (as `cat a.gz b.gz` makes), then zero padding.
    data = gzip.compress(plain[:123_457]) + gzip.compress(plain[123_457:]) + bytes(512)
    read = dict(iter_tar_members(GunzipReader(io.BytesIO(data), "x.tar.gz"), "x.tar.gz"))
    assert read == members
    whole = GunzipReader(io.BytesIO(data), "x")
    assert whole.read(10) + whole.read() == plain
    with pytest.raises(CorruptShardError, match=r"x\.tar\.gz: compressed data truncated"):
        GunzipReader(io.BytesIO(data[:len(data) // 3]), "x.tar.gz").read()
    with pytest.raises(CorruptShardError, match=r"x\.tar\.gz: damaged gzip data"):
        GunzipReader(io.BytesIO(data[:10] + b"\xff" * 64 + data[74:]), "x.tar.gz").read()
    assert [is_gzip_shard(u) for u in ("a/b.tar.gz", "s3://b/c.TGZ", "https://h/x.tar.gz?t=1",
                                       "pipe:ssh host cat /d/x.tar.gz", "a.tar")] \
        == [True, True, True, True, False]


def test_a_gzip_bomb_is_corrupt_once_it_inflates_past_the_bound():
    """256 MiB of zeros in 261 KB: refused once `EXPANSION_ALLOWANCE` came out, not
    inflated to its end; ordinary data of any size passes."""
    bomb = io.BytesIO()
    _write_gzip_tar(bomb, [("zeros.wav", b"", 256 << 20)])
    reader = GunzipReader(io.BytesIO(bomb.getvalue()), "bomb.tar.gz")
    with pytest.raises(CorruptShardError, match=rf"^bomb\.tar\.gz: inflates to more than "
                                                rf"{MAX_EXPANSION} times its compressed size "
                                                r"\(\d+ bytes from \d+\): a gzip bomb, not a "
                                                r"shard of speech$"):
        while reader.read(1 << 20):
            pass
    assert reader._produced <= EXPANSION_ALLOWANCE + (4 << 20)
    speech = os.urandom(1 << 20) * 70  # 70 MiB that barely compresses
    compressed = zlib_ng.compress(speech, 1, wbits=31)
    assert GunzipReader(io.BytesIO(compressed), "x").read() == speech


def _wav_header(num_bytes: int) -> bytes:
    """A 16 kHz mono 16-bit WAV header for `num_bytes` of samples."""
    return (b"RIFF" + (36 + num_bytes).to_bytes(4, "little") + b"WAVEfmt "
            + (16).to_bytes(4, "little") + (1).to_bytes(2, "little") + (1).to_bytes(2, "little")
            + (16000).to_bytes(4, "little") + (32000).to_bytes(4, "little")
            + (2).to_bytes(2, "little") + (16).to_bytes(2, "little") + b"data"
            + num_bytes.to_bytes(4, "little"))


def _write_gzip_tar(target, members) -> None:
    """A gzip-compressed tar of `(name, data, zeros)` members (`data`, then `zeros` zero
    bytes), compressed as it is written: a bomb costs no memory to make."""
    compress = zlib_ng.compressobj(6, zlib_ng.DEFLATED, 31)
    with contextlib.ExitStack() as stack:
        out = target if hasattr(target, "write") else stack.enter_context(open(target, "wb"))
        for name, data, zeros in members:
            info = tarfile.TarInfo(name)
            info.size = len(data) + zeros
            out.write(compress.compress(info.tobuf(tarfile.USTAR_FORMAT) + data))
            for start in range(0, zeros, 1 << 20):
                out.write(compress.compress(bytes(min(1 << 20, zeros - start))))
            out.write(compress.compress(bytes(-info.size % 512)))
        out.write(compress.compress(bytes(1024)) + compress.flush())


_STREAM_AND_MEASURE = """
import json, sys
import numpy as np
from cat.formats.tables import FrameRange
from cat.loading.batch import LengthFilter
from cat.loading.samples import AudioConfig, StreamConfig
from cat.loading.shardlist import load_shard_list
from cat.loading.stream import ShardStream
from cat.testing.epochs import run_epoch
tokenizer, *patterns = sys.argv[1:]
length_filter = LengthFilter(FrameRange(10, 2000), np.arange(4001), 1, False)
config = StreamConfig.with_defaults(batch_size=2, max_frames=0, shuffle_buffer=3,
                                    sort_buffer=2, bad_shard_limit=1.0, audio=AudioConfig())
for pattern in patterns:
    stream = ShardStream(load_shard_list(pattern, 3), tokenizer, config, length_filter, 80)
    batches, progress = run_epoch(stream, 1)
    # The peak of this program's memory so far (ru_maxrss would include the parent's).
    with open("/proc/self/status") as status:
        peak = next(line for line in status if line.startswith("VmHWM:")).split()[1]
    print(json.dumps({"trained": sorted(k for b in batches for k in b), "peak_kib": int(peak),
                      "summary": progress.summary(), "drops": progress.drop_lines}))
"""


def test_a_gzip_bomb_shard_streams_in_bounded_memory(tokenizer, tmp_path):
    """A 48 MiB WAV of zeros (25 minutes, far over the length filter) and a 256 MiB one
    (inflating 1000 times) in 0.3 MB of `.tar.gz`: the first dropped unread as `too_long`,
    the second's shard corrupt once it inflated 64 MiB; the loader's peak memory is that of
    streaming the same shards without them (measured before these bounds: 1.9 GB more)."""
    keys = sorted(TEXTS)
    good = {key: synth_wav(0.8, seed=i) for i, key in enumerate(keys)}

    def utterance(key, audio=None, zeros=0):
        return [(f"{key}.txt", TEXTS[key].encode(), 0),
                (f"{key}.wav", audio if audio is not None else good[key], zeros)]

    for folder, bombs in (("clean", False), ("bomb", True)):
        (tmp_path / folder).mkdir()
        for number, (size, first, bomb, last) in enumerate([(48 << 20, *keys[0:3]),
                                                            (256 << 20, *keys[3:6])]):
            members = utterance(first) + (utterance(bomb, _wav_header(size), size) if bombs
                                          else []) + utterance(last)
            _write_gzip_tar(tmp_path / folder / f"shards_{number:09d}.tar.gz", members)
    # One process streams the shards without the bombs, then with them: its peak may only
    # grow by what the bombs cost.
    run = subprocess.run([sys.executable, "-c", _STREAM_AND_MEASURE, tokenizer,
                          f"{tmp_path}/clean/*.tar.gz", f"{tmp_path}/bomb/*.tar.gz"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    clean, bomb = (json.loads(line) for line in run.stdout.splitlines()[-2:])
    assert clean["trained"] == sorted([keys[0], keys[2], keys[3], keys[5]])
    assert bomb["trained"] == sorted([keys[0], keys[2], keys[3]])
    summary = bomb["summary"]
    assert summary["dropped"] == {"too_long": 1, "incomplete_sample": 1}
    assert summary["corrupt_shards"] == [f"{tmp_path}/bomb/shards_000000001.tar.gz"]
    first = f"{tmp_path}/bomb/shards_000000000.tar.gz"
    assert f"{keys[1]} too_long member {first}:{keys[1]}.wav of {(48 << 20) + 44} bytes, " \
           "more than the " in "\n".join(bomb["drops"])
    assert bomb["peak_kib"] - clean["peak_kib"] < 32 << 10, (bomb["peak_kib"],
                                                             clean["peak_kib"])
