"""Streaming shard pipeline: shard lists, tar reading, stages, epochs, drops, resume, URLs."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from cat.data import prep_wds
from cat.data.pack import FrameRange
from cat.shared import pipeline
from cat.shared.data import LengthFilter
from cat.shared.pipeline import (
    CorruptShardError,
    ShardStream,
    StreamConfig,
    StreamProgress,
    assign_shards,
    decode_npy,
    expand_shard_patterns,
    iter_tar_members,
    load_shard_list,
)
from cat.testing.shards import serve_directory, truncate_file, write_raw_shard
from cat.testing.training import write_tiny_experiment

INFEASIBLE = {"BAC009S0009W9001": (14, "的一是在不了有和人这"),  # 2 encoder frames
              "BAC009S0009W9002": (6, "的"),  # no encoder frame
              "sp0.9-BAC009S0009W9003": (140, "的一")}  # outside the frame range below


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    return write_tiny_experiment(tmp_path_factory.mktemp("recipe"), num_train=30,
                                 utts_per_shard=4, extra_train=INFEASIBLE)


@pytest.fixture(scope="module")
def shard_dir(experiment):
    return experiment.root / "data/wds/train"


def _length_filter():
    frames = np.arange(301)
    return LengthFilter(FrameRange(0, 120), np.maximum(((frames - 1) // 2 - 1) // 2, 0), 4,
                        ctc=True)


def _stream(experiment, patterns=None, rank=0, world_size=1, workers=0, estimate=0,
            feat_dim=8, **config) -> ShardStream:
    shards = load_shard_list(patterns or str(experiment.root / "data/wds/train/data-*.tar"),
                             estimate)
    options = {"batch_size": 3, "max_frames": 200, "shuffle_buffer": 6, "sort_buffer": 5,
               **config}
    return ShardStream(shards, str(experiment.exp_dir / "tokenizer.tknz"),
                       StreamConfig(**options), _length_filter(), feat_dim, rank, world_size,
                       workers)


def _run_epoch(stream: ShardStream, epoch: int, workers: int = 0, skip=(), limit=None,
               persistent_loader=None):
    """(trained keys in order, progress) of one epoch, optionally stopping after `limit`."""
    stream.set_epoch(epoch, skip)
    progress = StreamProgress(stream.shards, stream.rank_shards(epoch))
    loader = persistent_loader
    if loader is None:
        loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)
    keys = []
    for batch in loader:
        if limit is not None and len(keys) >= limit:
            break
        progress.update(batch, trained=True)
        keys += batch.keys
    return keys, progress


def test_patterns_are_brace_expanded_globbed_and_sorted(shard_dir):
    root = str(shard_dir)
    everything = expand_shard_patterns(f"{root}/data-*.tar")
    assert everything == sorted(everything) and len(everything) == 9
    assert expand_shard_patterns(f"{root}/data-0000{{0..2}}.tar") == everything[:3]
    assert expand_shard_patterns([f"{root}/data-0000{{3,1}}.tar", f"{root}/data-00008.tar"]) \
        == [everything[3], everything[1], everything[8]]
    assert expand_shard_patterns("pipe:cat x-{0..1}.tar") == ["pipe:cat x-0.tar",
                                                             "pipe:cat x-1.tar"]
    with pytest.raises(FileNotFoundError, match=r"trset pattern '.*/nothing-\*.tar' matches "
                                                r"no shard"):
        expand_shard_patterns(f"{root}/nothing-*.tar")
    with pytest.raises(FileNotFoundError, match=r"\(expanded: '.*/data-00009.tar'\)"):
        expand_shard_patterns(f"{root}/data-0000{{8..9}}.tar")
    with pytest.raises(ValueError, match="listed twice"):
        expand_shard_patterns([f"{root}/data-*.tar", f"{root}/data-00001.tar"])


def test_shard_list_takes_counts_from_the_index(shard_dir):
    shards = load_shard_list(f"{shard_dir}/data-*.tar")
    index = prep_wds.read_index(shard_dir)
    assert [Path(u).name for u in shards.urls] == [r["shard"] for r in index.shards]
    assert shards.num_utts.tolist() == [r["num_utts"] for r in index.shards]
    assert shards.num_frames.tolist() == [r["num_frames"] for r in index.shards]
    assert shards.feat_dim == 8 and shards.longest == max(max(r["frames"]) for r in index.shards)
    assert not shards.estimated.any()
    local = str(shard_dir / "data-00000.tar")
    assert pipeline.index_location(local) == str(shard_dir / "index.jsonl")
    assert pipeline.index_location("https://host/a/b/data-1.tar") == "https://host/a/b/index.jsonl"
    assert pipeline.index_location(f"pipe:cat {local}") == str(shard_dir / "index.jsonl")
    assert pipeline.index_location("pipe:curl -s http://h/x/d-1.tar") == "http://h/x/index.jsonl"
    assert pipeline.index_location("pipe:aws s3 cp s3://b/d-1.tar -") is None


def test_tar_reader_agrees_with_tarfile_and_checks_headers(shard_dir, tmp_path):
    shard = shard_dir / "data-00000.tar"
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


def test_decode_npy_fast_path_and_fallback():
    rng = np.random.default_rng(0)
    for array in (rng.normal(size=(7, 3)).astype(np.float32),
                  rng.normal(size=(2, 5)).astype(np.float16), np.zeros((0, 4), np.float32),
                  np.asfortranarray(rng.normal(size=(3, 4)))):
        buffer = io.BytesIO()
        np.save(buffer, array)
        decoded = decode_npy(buffer.getvalue())
        assert decoded.dtype == array.dtype and np.array_equal(decoded, array)
    buffer = io.BytesIO()
    np.save(buffer, np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="truncated"):
        decode_npy(buffer.getvalue()[:-4])
    with pytest.raises(ValueError, match=r"not \.npy"):
        decode_npy(b"hello")


def test_shards_are_reshuffled_and_rebalanced_every_epoch():
    weights = np.array([5, 5, 5, 5, 1, 9, 2, 8, 5, 5, 5], np.float64)
    plans = {epoch: assign_shards(weights, seed=3, epoch=epoch, world_size=3)
             for epoch in range(1, 6)}
    for plan in plans.values():
        assert sorted(np.concatenate(plan).tolist()) == list(range(11))
        loads = [weights[p].sum() for p in plan]
        assert max(loads) - min(loads) <= weights.max()
    assert len({tuple(map(tuple, plan)) for plan in plans.values()}) == 5
    assert len({tuple(plan[0]) for plan in plans.values()}) > 1  # no static rank slice
    again = assign_shards(weights, seed=3, epoch=2, world_size=3)
    assert all(np.array_equal(a, b) for a, b in zip(again, plans[2], strict=True))
    in_order = assign_shards(weights, 0, 1, 2, shuffle=False)
    assert [p.tolist() for p in in_order] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9]]


@pytest.mark.parametrize("workers", [0, 2])
def test_every_utterance_once_per_epoch_with_drops_accounted(experiment, workers):
    stream = _stream(experiment, workers=workers)
    all_keys = set(experiment.train.keys)
    orders = []
    for epoch in (1, 2):
        keys, progress = _run_epoch(stream, epoch, workers)
        summary = progress.summary()
        dropped = [line.split()[0] for line in progress.drop_lines]
        assert len(keys) == len(set(keys)) and not set(keys) & set(dropped)
        assert set(keys) | set(dropped) == all_keys
        assert summary["dropped"] == {"label_too_long": 1, "no_encoder_frames": 1,
                                      "out_of_range": 1}
        assert summary["trained"] == len(keys) == len(all_keys) - 3
        assert summary["not_trained"] == 0 and summary["unconsumed_shards"] == 0
        orders.append(keys)
    assert orders[0] != orders[1]
    assert _run_epoch(_stream(experiment, workers=workers), 2, workers)[0] == orders[1]
    assert _run_epoch(_stream(experiment, workers=workers, seed=5), 2, workers)[0] != orders[1]


def test_persistent_workers_follow_set_epoch(experiment):
    stream = _stream(experiment, workers=2)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2,
                                         persistent_workers=True)
    first, _ = _run_epoch(stream, 1, persistent_loader=loader)
    second, _ = _run_epoch(stream, 2, persistent_loader=loader)
    first_again, _ = _run_epoch(stream, 1, persistent_loader=loader)
    assert first == first_again and first != second
    assert sorted(first) == sorted(second)


def test_http_and_pipe_shards_give_the_same_stream(experiment, shard_dir):
    local, _ = _run_epoch(_stream(experiment), 1)
    names = "data-0000{0..8}.tar"
    with serve_directory(shard_dir) as url:
        for read_ahead in (0, 1):
            stream = _stream(experiment, f"{url}/{names}", read_ahead_mb=read_ahead)
            assert stream.shards.num_utts.tolist() == _stream(experiment).shards.num_utts.tolist()
            assert _run_epoch(stream, 1)[0] == local
    for read_ahead in (0, 1):
        stream = _stream(experiment, f"pipe:cat {shard_dir}/{names}", read_ahead_mb=read_ahead)
        assert not stream.shards.estimated.any()
        assert _run_epoch(stream, 1)[0] == local
    failing = _stream(experiment, f"pipe:cat {shard_dir}/{names} && exit 3")
    _, progress = _run_epoch(failing, 1)
    assert len(progress.corrupt) == 9 and "status 3" in progress.corrupt[0][1]


def test_index_missing_needs_an_estimate(experiment, shard_dir, tmp_path):
    for name in ("data-00000.tar", "data-00001.tar"):
        shutil.copy(shard_dir / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"data-00000.tar: no utterance count \(no index "
                                                r"found at .*index.jsonl\).*utts_per_shard_"
                                                r"estimate"):
        load_shard_list(f"{tmp_path}/data-*.tar")
    stream = _stream(experiment, f"{tmp_path}/data-*.tar", estimate=100)
    assert stream.shards.estimated.all() and stream.shards.num_utts.tolist() == [100, 100]
    keys, progress = _run_epoch(stream, 1)
    summary = progress.summary()
    assert len(keys) + sum(summary["dropped"].values()) == 8 and len(keys) >= 6
    assert summary["expected"] is None and summary["not_trained"] is None


def test_corrupt_shard_is_skipped_and_counted_or_raises(experiment, shard_dir, tmp_path):
    copy = tmp_path / "wds"
    shutil.copytree(shard_dir, copy)
    truncate_file(copy / "data-00002.tar", 0.6)
    with open(copy / "data-00005.tar", "r+b") as f:
        f.seek(100)
        f.write(b"garbage!")  # breaks the first header's checksum
    expected_lost = 4 + 4  # two shards of 4 utterances
    # Local files (read in this thread) and a pipe (read by the read-ahead thread).
    for pattern, read_ahead in ((f"{copy}/data-*.tar", 0), (f"{copy}/data-*.tar", 1),
                                (f"pipe:cat {copy}/data-0000{{0..8}}.tar", 1)):
        _, progress = _run_epoch(_stream(experiment, pattern, read_ahead_mb=read_ahead), 1)
        summary = progress.summary()
        assert sorted(u[-14:] for u in summary["corrupt_shards"]) == \
            ["data-00002.tar", "data-00005.tar"]
        lost = summary["corrupt_missing"] + summary["dropped"].get("incomplete_sample", 0)
        assert 0 < lost <= expected_lost
        assert summary["trained"] + sum(summary["dropped"].values()) \
            + summary["corrupt_missing"] == summary["expected"]
        assert summary["not_trained"] == 0
    with pytest.raises(CorruptShardError, match=r"data-0000[25].tar: .*strict_shards"):
        _run_epoch(_stream(experiment, f"{copy}/data-*.tar", strict_shards=True), 1)


def test_bad_inputs_are_errors_naming_file_and_key(experiment, tmp_path):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(60, 8)).astype(np.float32)
    empty = write_raw_shard(tmp_path / "empty/data-0.tar",
                            [("sp0.9-utt1", features, "的一"), ("utt2", features, "  ")])
    with pytest.raises(ValueError, match=r"data-0.tar: utterance 'utt2' has an empty transcript"):
        _run_epoch(_stream(experiment, str(empty), estimate=2), 1)
    dotted = write_raw_shard(tmp_path / "dotted/data-0.tar", [("sp0.9-utt1", features, "的一")])
    with pytest.raises(ValueError, match=r"dotted/data-0.tar: utterance 'sp0.9-utt1' has 8-dim "
                                         r"features, but config.json encoder.kwargs.idim is 80"):
        _run_epoch(_stream(experiment, str(dotted), estimate=1, feat_dim=80), 1)
    assert _run_epoch(_stream(experiment, str(dotted), estimate=1), 1)[0] == ["sp0.9-utt1"]
    with pytest.raises(ValueError, match=r"trset has 9 shards, fewer than ranks x workers = "
                                         r"5 x 2"):
        _stream(experiment, rank=0, world_size=5, workers=2)
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*missing\.tknz does not exist"):
        stream = _stream(experiment)
        stream.tokenizer_path = str(tmp_path / "missing.tknz")
        _run_epoch(stream, 1)


def test_resume_starts_at_the_next_unconsumed_shard(experiment):
    stream = _stream(experiment, world_size=2, rank=1)
    first_keys, progress = _run_epoch(stream, 3, limit=9)
    state = progress.state()
    consumed = set(state["consumed"])
    assert consumed and set(stream.rank_shards(3)) - consumed
    index = prep_wds.read_index(experiment.root / "data/wds/train")
    shard_keys = {i: set(r["keys"]) for i, r in enumerate(index.shards)}
    resumed_progress = StreamProgress(stream.shards, stream.rank_shards(3))
    resumed_progress.restore(state)
    stream.set_epoch(3, resumed_progress.consumed)
    rest = []
    for batch in stream:
        resumed_progress.update(batch, trained=True)
        rest += batch.keys
    remaining = set().union(*(shard_keys[s] for s in stream.rank_shards(3) if s not in consumed))
    assert not set(rest) & set().union(*(shard_keys[s] for s in consumed))
    dropped = {line.split()[0] for line in resumed_progress.drop_lines}
    assert set(rest) | dropped == remaining
    summary = resumed_progress.summary()
    assert summary["reread_shards"] == len(state["partial"])
    assert summary["retrained"] == sum(n for _, n in state["partial"])
    rank_total = sum(len(shard_keys[s]) for s in stream.rank_shards(3))
    assert summary["trained"] + sum(summary["dropped"].values()) == rank_total
    assert summary["unconsumed_shards"] == 0
    assert set(first_keys) - set(rest) <= set().union(*(shard_keys[s] for s in consumed))


def test_plain_webdataset_reads_what_the_pipeline_reads(experiment, shard_dir):
    keys, _ = _run_epoch(_stream(experiment, shuffle_buffer=0), 1)
    plain = {prep_wds.decode_key(s["__key__"])
             for s in wds.WebDataset(sorted(map(str, shard_dir.glob("*.tar"))),
                                     shardshuffle=False)}
    assert set(keys) | set(INFEASIBLE) == plain
    assert os.path.exists(shard_dir / "index.jsonl")
