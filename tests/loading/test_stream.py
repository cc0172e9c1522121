"""Streaming shard pipeline: epochs, drops and verdicts, URLs, corrupt data, exact resume."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import re
import shutil

import kaldiio
import numpy as np
import pytest
import torch
import webdataset as wds

from cat.core.config import TrainOptions, train_option_defaults
from cat.formats import prep_wds, shard_format
from cat.formats.mappack import write_map_pack
from cat.formats.tables import FrameRange
from cat.loading.batch import LengthFilter
from cat.loading.progress import repeated_keys
from cat.loading.reader import DataUnavailableError, SeenKeys
from cat.loading.samples import StreamConfig, decode_npy, split_ids
from cat.loading.shardlist import load_shard_list
from cat.loading.stages import SortBatcher
from cat.loading.stream import ShardStream
from cat.loading.tar import CorruptShardError
from cat.testing.epochs import epoch_progress, run_epoch
from cat.testing.shards import serve_directory, truncate_file, write_raw_shard
from cat.testing.training import write_tiny_experiment
from cat.training.checkpoint import load_checkpoint, save_checkpoint

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
            feat_dim=8, tokenizer=None, **config) -> ShardStream:
    shards = load_shard_list(patterns or str(experiment.root / "data/wds/train/data-*.tar"),
                             estimate)
    options = {"batch_size": 3, "max_frames": 200, "shuffle_buffer": 6, "sort_buffer": 5,
               **config}
    return ShardStream(shards, str(tokenizer or experiment.exp_dir / "tokenizer.tknz"),
                       StreamConfig.with_defaults(**options), _length_filter(), feat_dim, rank,
                       world_size, workers)


def _keys(batches):
    return [key for batch in batches for key in batch]


def _dropped(progress):
    return [line.split()[0] for line in progress.drop_lines]


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


@pytest.mark.parametrize("workers", [0, 2])
def test_float16_shards_batch_the_float32_values_of_their_halves(experiment, tmp_path,
                                                                 workers):
    corpus = experiment.root / "data/fbank/train"
    prep_wds.pack_data(corpus / "feats.scp", corpus / "text", tmp_path / "half",
                       utts_per_file=4, dtype="float16")
    stream = _stream(experiment, patterns=str(tmp_path / "half/data-*.tar"), workers=workers)
    stream.set_epoch(1)
    features = dict(kaldiio.load_scp(str(corpus / "feats.scp")))
    seen = []
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers):
        for row, key in enumerate(batch.keys):
            length = int(batch.feat_lens[row])
            expected = features[key].astype(np.float16).astype(np.float32)
            assert batch.feats[row, :length].numpy().tobytes() == expected.tobytes()
            assert not batch.feats[row, length:].any()
            seen.append(key)
    assert len(seen) == len(set(seen)) == len(experiment.train.keys) - len(INFEASIBLE)


@pytest.mark.parametrize("workers", [0, 2])
def test_every_utterance_once_per_epoch_with_drops_accounted(experiment, workers):
    stream = _stream(experiment, workers=workers)
    all_keys = set(experiment.train.keys)
    orders = []
    for epoch in (1, 2):
        batches, progress = run_epoch(stream, epoch, workers)
        keys = _keys(batches)
        summary = progress.summary()
        assert len(keys) == len(set(keys)) and not set(keys) & set(_dropped(progress))
        assert set(keys) | set(_dropped(progress)) == all_keys
        assert summary["dropped"] == {"label_too_long": 1, "no_encoder_frames": 1,
                                      "out_of_range": 1}
        assert summary["trained"] == len(keys) == len(all_keys) - 3
        assert summary["not_trained"] == 0 and summary["retrained"] == 0
        assert len(progress.cut_ids()) == 0
        orders.append(keys)
    assert orders[0] != orders[1]
    assert _keys(run_epoch(_stream(experiment, workers=workers), 2, workers)[0]) == orders[1]
    assert _keys(run_epoch(_stream(experiment, workers=workers, seed=5), 2, workers)[0]) \
        != orders[1]


def test_persistent_workers_follow_set_epoch(experiment):
    stream = _stream(experiment, workers=2)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2,
                                         persistent_workers=True)
    first = _keys(run_epoch(stream, 1, 2, loader=loader)[0])
    second = _keys(run_epoch(stream, 2, 2, loader=loader)[0])
    first_again = _keys(run_epoch(stream, 1, 2, loader=loader)[0])
    assert first == first_again and first != second
    assert sorted(first) == sorted(second)


def test_http_and_pipe_shards_give_the_same_stream(experiment, shard_dir):
    local = run_epoch(_stream(experiment), 1)[0]
    names = "data-0000{0..8}.tar"
    with serve_directory(shard_dir) as url:
        for read_ahead in (0, 1):
            stream = _stream(experiment, f"{url}/{names}?token=1", read_ahead_mb=read_ahead)
            assert stream.shards.num_utts.tolist() == _stream(experiment).shards.num_utts.tolist()
            assert run_epoch(stream, 1)[0] == local
    for read_ahead in (0, 1):
        stream = _stream(experiment, f"pipe:cat {shard_dir}/{names}", read_ahead_mb=read_ahead)
        assert not stream.shards.estimated.any()
        assert run_epoch(stream, 1)[0] == local
    failing = f"pipe:cat {shard_dir}/{names} && exit 3"
    _, progress = run_epoch(_stream(experiment, failing, read_retries=1, retry_seconds=0.01,
                                     bad_shard_limit=1.0), 1)
    assert len(progress.unavailable) == 9 and not progress.corrupt
    assert "unavailable after 2 attempts: the command exited with status 3" in \
        progress.unavailable[0][1]
    with pytest.raises(DataUnavailableError, match=r"1 of the rank's 9 shards this epoch "
                                                   r"failed, more than bad_shard_limit=0.1; "
                                                   r"storage: pipe: cat"):
        run_epoch(_stream(experiment, failing, read_retries=0), 1)


def test_transient_storage_errors_are_retried_where_the_read_stopped(experiment, shard_dir,
                                                                     caplog):
    local = run_epoch(_stream(experiment), 1)[0]
    faults = {"data-00000.tar": ["503", "503"], "data-00004.tar": ["cut"],
              "data-00007.tar": ["503", "cut", "503"]}
    for read_ahead in (0, 1):
        with serve_directory(shard_dir, faults) as url:
            stream = _stream(experiment, f"{url}/data-0000{{0..8}}.tar",
                             read_ahead_mb=read_ahead, retry_seconds=0.01)
            batches, progress = run_epoch(stream, 1)
        assert batches == local and not progress.unavailable and not progress.corrupt
    assert "HTTP Error 503" in caplog.text and "connection closed" in caplog.text
    with serve_directory(shard_dir, {"data-00003.tar": ["503"] * 4}) as url:
        stream = _stream(experiment, f"{url}/data-0000{{0..8}}.tar", retry_seconds=0.01,
                         bad_shard_limit=0.2)
        _, progress = run_epoch(stream, 1)
    assert [m for _, m in progress.unavailable] == [
        "unavailable after 4 attempts: cannot fetch it: HTTPError: HTTP Error 503: "
        "try again later"]
    assert progress.summary()["unavailable_missing"] == 4


def test_estimated_counts_train_everything_but_cannot_tell_the_cut(experiment, shard_dir,
                                                                   tmp_path):
    for name in ("data-00000.tar", "data-00001.tar"):
        shutil.copy(shard_dir / name, tmp_path / name)
    stream = _stream(experiment, f"{tmp_path}/data-*.tar", estimate=100)
    batches, progress = run_epoch(stream, 1)
    summary = progress.summary()
    assert len(_keys(batches)) + sum(summary["dropped"].values()) == 8
    assert summary["expected"] is None and summary["not_trained"] is None
    assert progress.cut_ids() is None


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
        _, progress = run_epoch(_stream(experiment, pattern, read_ahead_mb=read_ahead,
                                         bad_shard_limit=0.5), 1)
        summary = progress.summary()
        assert sorted(u[-14:] for u in summary["corrupt_shards"]) == \
            ["data-00002.tar", "data-00005.tar"]
        lost = summary["corrupt_missing"] + summary["dropped"].get("incomplete_sample", 0)
        assert 0 < lost <= expected_lost
        assert summary["trained"] + sum(summary["dropped"].values()) \
            + summary["corrupt_missing"] == summary["expected"]
        assert summary["not_trained"] == 0 and len(progress.cut_ids()) == 0
    with pytest.raises(CorruptShardError, match=r"data-0000[25].tar: .*strict_shards"):
        run_epoch(_stream(experiment, f"{copy}/data-*.tar", strict_shards=True), 1)


def test_shards_that_do_not_match_their_index_are_corrupt(experiment, shard_dir, tmp_path):
    swapped = tmp_path / "swapped"
    shutil.copytree(shard_dir, swapped)
    os.rename(swapped / "data-00001.tar", swapped / "tmp.tar")
    os.rename(swapped / "data-00003.tar", swapped / "data-00001.tar")
    os.rename(swapped / "tmp.tar", swapped / "data-00003.tar")
    flipped = tmp_path / "flipped"
    shutil.copytree(shard_dir, flipped)
    data = bytearray((flipped / "data-00006.tar").read_bytes())
    data[1536 + 200] ^= 0x01  # inside the first member's feature values
    (flipped / "data-00006.tar").write_bytes(bytes(data))
    cases = {swapped: (["data-00001.tar", "data-00003.tar"], "does not match its index"),
             flipped: (["data-00006.tar"], r"its bytes differ from its index \(crc32")}
    for folder, (bad, message) in cases.items():
        for read_ahead in (0, 1):
            stream = _stream(experiment, f"{folder}/data-*.tar", bad_shard_limit=0.5,
                             read_ahead_mb=read_ahead)
            _, progress = run_epoch(stream, 1)
            summary = progress.summary()
            assert sorted(u[-14:] for u in summary["corrupt_shards"]) == bad
            assert re.search(message, progress.corrupt[0][1])
            assert summary["trained"] + sum(summary["dropped"].values()) + \
                summary["corrupt_missing"] == summary["expected"]
        if folder == swapped:  # caught at their first utterance: nothing of them trained
            assert summary["corrupt_missing"] == 8
        with pytest.raises(CorruptShardError, match=rf"{message}.*strict_shards is set"):
            run_epoch(_stream(experiment, f"{folder}/data-*.tar", strict_shards=True), 1)


def test_undecodable_members_are_counted_or_with_strict_shards_an_error(experiment, tmp_path):
    features = np.random.default_rng(0).normal(size=(60, 8)).astype(np.float32)
    good = [("utt1", features, "的一"), ("utt2", features, "是在")]
    cases = {
        "bad_text": write_raw_shard(tmp_path / "text/data-0.tar", good,
                                    text_bytes={"utt2": "是在".encode("gbk")}),
        "corrupt_features": write_raw_shard(tmp_path / "npy/data-0.tar", good,
                                            npy_bytes={"utt2": b"\x93NUMPY garbage"}),
        "incomplete_sample": write_raw_shard(tmp_path / "half/data-0.tar", good,
                                             skip={"utt2": "txt"}),
    }
    for reason, shard in cases.items():
        batches, progress = run_epoch(_stream(experiment, str(shard), estimate=2), 1)
        assert _keys(batches) == ["utt1"] and list(progress.summary()["dropped"]) == [reason]
        with pytest.raises((ValueError, CorruptShardError),
                           match=rf"{shard}: .*'utt2'.*{reason}.*strict_shards is set"):
            run_epoch(_stream(experiment, str(shard), estimate=2, strict_shards=True), 1)


def test_bad_inputs_are_errors_naming_file_and_key(experiment, tmp_path):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(60, 8)).astype(np.float32)
    dotted = write_raw_shard(tmp_path / "dotted/data-0.tar", [("sp0.9-utt1", features, "的一")])
    with pytest.raises(ValueError, match=r"dotted/data-0.tar: utterance 'sp0.9-utt1' has 8-dim "
                                         r"features, but config.json encoder.kwargs.idim is 80"):
        run_epoch(_stream(experiment, str(dotted), estimate=1, feat_dim=80), 1)
    assert _keys(run_epoch(_stream(experiment, str(dotted), estimate=1), 1)[0]) == ["sp0.9-utt1"]
    with pytest.raises(ValueError, match=r"trset has 9 shards, fewer than ranks x workers = "
                                         r"5 x 2"):
        _stream(experiment, rank=0, world_size=5, workers=2)
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*missing\.tknz does not exist"):
        stream = _stream(experiment)
        stream.tokenizer_path = str(tmp_path / "missing.tknz")
        run_epoch(stream, 1)


def test_stream_and_map_packer_train_and_drop_the_same_utterances(experiment, tmp_path):
    """One verdict for both paths: empty and all-<unk> transcripts are dropped alike."""
    corpus = experiment.train
    texts = dict(corpus.transcripts)
    keys = corpus.keys
    texts[keys[0]] = "  "
    texts[keys[1]] = "ＱＱ"  # characters the tokenizer does not know
    text = tmp_path / "text"
    text.write_text("".join(f"{k} {texts[k]}\n" for k in keys), encoding="utf-8")
    tokenizer = experiment.exp_dir / "tokenizer.tknz"
    counts = write_map_pack(corpus.feats_scp, text, tokenizer, tmp_path / "train.npz")
    map_drops = {k[len("dropped_"):]: n for k, n in counts.items() if k.startswith("dropped_")}
    samples = [(k, corpus.features[k], texts[k]) for k in keys]
    shard = write_raw_shard(tmp_path / "wds/data-0.tar", samples)
    stream = _stream(experiment, str(shard), estimate=len(keys), tokenizer=tokenizer)
    stream.length_filter = None
    _, progress = run_epoch(stream, 1)
    assert map_drops == progress.summary()["dropped"] == {"empty_label": 1, "all_unk": 1}
    assert progress.summary()["trained"] == counts["num_utts"]


def test_every_sort_buffer_leaves_whole():
    rng = random.Random(0)
    lengths = np.random.default_rng(0).integers(1, 1000, 400)
    samples = [{"id": i, "features": np.zeros((n, 1))} for i, n in enumerate(lengths)]
    batcher = SortBatcher(sort_buffer=20, batch_size=8, max_frames=3000, rng=rng)
    emitted = [[s["id"] for s in batch] for batch in batcher(iter(samples))]
    assert sorted(i for batch in emitted for i in batch) == list(range(400))
    # No batch mixes buffers (nothing waits for the next one), and buffers leave in order.
    owners = [{i // 20 for i in batch} for batch in emitted]
    assert all(len(owner) == 1 for owner in owners)
    order = [owner.pop() for owner in owners]
    assert order == sorted(order)
    for batch in emitted:
        frames = lengths[batch]
        assert len(batch) <= 8 and (len(batch) == 1 or frames.max() * len(batch) <= 3000)


@pytest.mark.parametrize(("workers", "stops", "buckets"), [
    (0, (1, 4, 7), 0), (1, (2, 5), 0), (2, (3, 6), 0), (0, (1, 4, 6), 4), (2, (2, 5), 3)])
def test_resume_continues_exactly_where_the_epoch_stopped(experiment, workers, stops, buckets,
                                                          tmp_path):
    """With the sort buffer, and with length buckets (`buckets`)."""
    epoch = 3

    def stream():
        return _stream(experiment, workers=workers, shuffle_buffer=3, sort_buffer=3,
                       buckets=buckets)

    assert (stream().bucket_bounds is not None) == bool(buckets)
    full, full_progress = run_epoch(stream(), epoch, workers)
    assert len(full) > max(stops)
    mid_shard = 0
    for stop in stops:
        first, progress = run_epoch(stream(), epoch, workers, limit=stop)
        mid_shard += sum(p.ordinal > 0 for p in progress.positions.values())
        path = tmp_path / f"state-{workers}-{stop}-{buckets}.pt"
        save_checkpoint(path, {"format": "cat-checkpoint", "version": 1, "data": progress.state()})
        # A new process: a new stream and progress, restored from the checkpoint.
        resumed_stream = stream()
        resumed = epoch_progress(resumed_stream, epoch, workers)
        resumed.restore(load_checkpoint(path)["data"])
        rest, resumed = run_epoch(resumed_stream, epoch, workers, progress=resumed)
        if workers <= 1:
            assert first + rest == full
        assert sorted(_keys(first + rest)) == sorted(_keys(full))
        summary = resumed.summary()
        assert summary == full_progress.summary() and summary["retrained"] == 0
        assert sorted(_dropped(progress) + _dropped(resumed)) == sorted(_dropped(full_progress))
    assert mid_shard  # some worker stopped inside a shard


def test_resume_reads_only_the_buffered_members_again(experiment, monkeypatch):
    from cat.loading import stream as pipeline

    stream = _stream(experiment, shuffle_buffer=8)
    _, progress = run_epoch(stream, 1, limit=3)
    position = progress.positions[0]
    fetched = []
    original = pipeline.fetch_samples

    def spy(urls, ids, *args):
        fetched.append(np.sort(ids))
        return original(urls, ids, *args)

    monkeypatch.setattr(pipeline, "fetch_samples", spy)
    resumed = epoch_progress(stream, 1, 0)
    resumed.restore(progress.state())
    run_epoch(_stream(experiment, shuffle_buffer=8), 1, progress=resumed)
    # Exactly the buffered samples are read again, from the shards read so far.
    assert len(fetched) == 1 and np.array_equal(fetched[0], np.sort(position.buffered()))
    shards_read = set(epoch_progress(stream, 1, 0).worker_shards[0][:position.shard + 1])
    assert set(split_ids(fetched[0])[0].tolist()) <= shards_read


def test_plain_webdataset_reads_what_the_pipeline_reads(experiment, shard_dir):
    keys = _keys(run_epoch(_stream(experiment, shuffle_buffer=0), 1)[0])
    plain = {shard_format.decode_key(s["__key__"])
             for s in wds.WebDataset(sorted(map(str, shard_dir.glob("*.tar"))),
                                     shardshuffle=False)}
    assert set(keys) | set(INFEASIBLE) == plain
    assert os.path.exists(shard_dir / "index.jsonl")


def _shards_sharing_a_key(folder, count=4):
    """`count` shards without an index of 3 utterances, each also holding `dup`."""
    rng = np.random.default_rng(5)
    features = {f"u{i}": rng.normal(size=(40 + i, 8)).astype(np.float32) for i in range(12)}
    shared = ("dup", rng.normal(size=(50, 8)).astype(np.float32), "的一")
    for number in range(count):
        own = [(key, features[key], "是在") for key in list(features)[3 * number:3 * number + 3]]
        write_raw_shard(folder / f"data-{number}.tar", [*own[:1], shared, *own[1:]])
    return f"{folder}/data-*.tar"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_key_in_shards_of_several_workers_is_trained_once(experiment, tmp_path, workers):
    """Shards without an index share a key: whichever of the rank's workers reads a copy
    after the first, it is dropped and counted, every epoch (the table is per epoch)."""
    stream = _stream(experiment, _shards_sharing_a_key(tmp_path), estimate=3,
                     workers=workers)
    for epoch in (1, 2):
        batches, progress = run_epoch(stream, epoch, workers)
        keys = _keys(batches)
        assert sorted(keys) == sorted(["dup", *(f"u{i}" for i in range(12))])
        assert progress.summary()["dropped"] == {"duplicate_key": 3}
        assert progress.summary()["repeated_keys"] == 0
        lines = sorted(progress.drop_lines)
        urls = stream.shards.urls
        firsts = {re.match(r"dup duplicate_key also in shard (\S+) \(read first; this copy: "
                           r"shard (\S+)\)$", line).groups() for line in lines}
        assert len({first for first, _ in firsts}) == 1 and len(lines) == 3
        assert {first for first, _ in firsts} | {copy for _, copy in firsts} == set(urls)


def test_keys_trained_by_two_ranks_or_across_a_resume_are_counted(experiment, tmp_path):
    """What the per-rank table cannot see: each rank trains its copy; the ranks'
    `trained_key_hashes` tell, and they survive a checkpoint."""
    pattern = _shards_sharing_a_key(tmp_path)
    progresses = [run_epoch(_stream(experiment, pattern, rank, 2, estimate=3), 1)[1]
                  for rank in (0, 1)]
    assert [p.summary()["dropped"] for p in progresses] == [{"duplicate_key": 1}] * 2
    hashes = [p.trained_key_hashes() for p in progresses]
    assert [len(h) for h in hashes] == [7, 7]
    assert repeated_keys(hashes) == 1 and repeated_keys(hashes[:1]) == 0
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"format": "cat-checkpoint", "version": 1,
                           "data": progresses[0].state()})
    resumed = epoch_progress(_stream(experiment, pattern, 0, 2, estimate=3), 1, 0)
    resumed.restore(load_checkpoint(path)["data"])
    np.testing.assert_array_equal(resumed.trained_key_hashes(), hashes[0])


def test_the_seen_key_table_stops_taking_keys_when_full_and_still_finds_them():
    seen = SeenKeys(1)  # 4096 slots, 3072 keys
    assert [seen.claim(f"k{i}", i % 7, 1) for i in range(3072)] == [i % 7 for i in range(3072)]
    assert seen.claim("new", 3, 1) is None
    assert seen.claim("k10", 5, 1) == 3  # still found: k10 came first from shard 3
    assert seen.claim("k10", 5, 2) == 5  # a new epoch starts empty
    assert seen.claim("k11", 6, 1) == 6  # a worker of the cut epoch: not recorded


def test_stream_config_is_the_train_options_with_no_defaults_of_its_own():
    fields = dataclasses.fields(StreamConfig)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in fields)
    options = [f.name for f in fields if f.name not in ("train", "audio", "retry_seconds")]
    defaults = train_option_defaults()
    config = StreamConfig.with_defaults()
    assert {name: getattr(config, name) for name in options} == \
        {name: defaults[name] for name in options}
    changed = TrainOptions(shuffle_buffer=7, read_timeout=2.5,
                           audio={"speed_perturb": [0.9, 1.1]})
    evaluation = StreamConfig.from_options(changed, train=False)
    assert (evaluation.shuffle_buffer, evaluation.read_timeout) == (0, 2.5)
    assert evaluation.audio.speed_perturb == () and evaluation.audio.sample_rate == 16000
    assert StreamConfig.from_options(changed).audio.speed_perturb == (0.9, 1.1)
